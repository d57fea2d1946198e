"""A call's flow (priority class, tenant) and the loop's bookkeeping of its waits, pinned exactly.

Each test pins a behaviour that a mutation of ``middleware/retry.py`` changed
without a test noticing (research-wiki/MUTATION.md): the exact words and
fields of the errors ``check_flow`` raises, the flow a call is filed under,
a call's defaults, and ``waited_s`` adding up a back-off and a queue wait.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from _closing import closing

from polygateway.backends.base import AttemptOutcome, Lease
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings
from polygateway.errors import AllSourcesExhausted, RequestRejected
from polygateway.middleware.waiting import room_for
from polygateway.testing import (
    BoundedSleep,
    Delay,
    FakeClock,
    FakeTimers,
    FakeTransport,
    Recorder,
    StreamScript,
    TransientError,
    chat_chunk_events,
    chat_completion,
    gateway_settings,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def _classes(*names: str, max_concurrency: int = 4) -> GatewaySettings:
    """A chat scope of ``names`` (primary and backup) declaring interactive (3) and batch (1)."""
    return GatewaySettings.model_validate(
        {
            "scopes": {
                "chat": {
                    "kind": "chat",
                    "priority_classes": {"interactive": {"share": 3}, "batch": {"share": 1}},
                    "default_priority_class": "batch",
                    "sources": [
                        {
                            "name": n,
                            "protocol": "openai",
                            "base_url": f"http://127.0.0.1:9/{n}",
                            "max_concurrency": max_concurrency,
                        }
                        for n in names or ("primary", "backup")
                    ],
                }
            }
        }
    )


def _client(settings: GatewaySettings, clock: FakeClock, **parts: Any) -> ChatClient:
    return closing(
        ChatClient(
            settings,
            backend=MemoryBackend(now=clock),
            transport=FakeTransport([], clock=clock, default=chat_completion()),
            now=clock,
            rng=random.Random(5),
            **parts,
        )
    )


class _OnePermit:
    """A chat client on one permit whose upstream answers each call after 1 s (fake timers).

    Calls started with ``start`` queue behind whoever holds the permit; ``run``
    advances the timers until the given tasks end; ``order`` is the labels the
    upstream saw, in the order it saw them.
    """

    def __init__(self, settings: GatewaySettings) -> None:
        clock = FakeClock()
        self.timers = FakeTimers(clock)
        self.transport = FakeTransport(
            [], clock=clock, sleep=self.timers.sleep, default=Delay(1.0, chat_completion("ok"))
        )
        self.backend = MemoryBackend(now=clock)
        self.chat = closing(
            ChatClient(
                settings,
                backend=self.backend,
                transport=self.transport,
                now=clock,
                sleep=self.timers.sleep,
                rng=random.Random(5),
            )
        )

    async def hold(self) -> Lease:
        """Take the one permit from outside the client, as a call elsewhere would."""
        held = await self.backend.acquire("chat", [self.chat._mw._order.sources[0][1]], ttl_s=600.0)
        assert held.lease is not None
        return held.lease

    async def start(self, label: str, **options: Any) -> asyncio.Task[Any]:
        """A call in a task, given ten loop turns to reach its queue."""
        task = asyncio.create_task(
            self.chat.complete([{"role": "user", "content": label}], **options)
        )
        for _ in range(10):
            await asyncio.sleep(0)
        return task

    async def run(self, *tasks: asyncio.Task[Any]) -> None:
        """Advance the timers until every task ended (200 s of fake time at most)."""
        for _ in range(400):
            await self.timers.advance(0.5)
            if all(t.done() for t in tasks):
                break
        await asyncio.gather(*tasks)

    def order(self) -> list[str]:
        return [str(r.json["messages"][0]["content"]) for r in self.transport.requests]


class TestCheckFlowErrors:
    """The refusals of a call's class or tenant say exactly what is wrong, with the scope."""

    def test_a_tenant_that_is_not_a_string(self) -> None:
        chat = _client(gateway_settings("primary", "backup"), FakeClock())
        with pytest.raises(RequestRejected) as caught:
            chat._mw.begin(op_name="chat.complete", tenant=42)  # type: ignore[typeddict-item]
        assert str(caught.value).startswith(
            "chat.complete: tenant must be a string naming the call's flow, not 42"
        )
        assert caught.value.scope == "chat"
        assert caught.value.sources == ("primary", "backup")

    def test_a_class_on_a_scope_that_declares_none(self) -> None:
        chat = _client(gateway_settings("primary", "backup"), FakeClock())
        with pytest.raises(RequestRejected) as caught:
            chat._mw.begin(op_name="embed", priority_class="urgent")
        assert str(caught.value).startswith(
            "embed: priority_class 'urgent' is not a class of scope 'chat': "
            "it declares no priority classes"
        )
        assert caught.value.scope == "chat"
        assert caught.value.sources == ("primary", "backup")

    def test_an_undeclared_class_names_the_declared_ones(self) -> None:
        chat = _client(_classes(), FakeClock())
        with pytest.raises(RequestRejected) as caught:
            chat._mw.begin(op_name="chat.complete", priority_class="urgent")
        assert str(caught.value).startswith(
            "chat.complete: priority_class 'urgent' is not a class of scope 'chat': "
            "its classes are batch, interactive"
        )
        assert caught.value.scope == "chat"


class TestTheFlowACallIsFiledUnder:
    """The class and tenant a call carries: the default class, and ``""`` for no tenant."""

    def test_no_class_and_no_tenant(self) -> None:
        call = _client(_classes(), FakeClock())._mw.begin()
        assert (call.priority_class, call.tenant) == ("batch", "")

    def test_the_default_class_named_and_a_tenant(self) -> None:
        call = _client(_classes(), FakeClock())._mw.begin(priority_class="batch", tenant="team-a")
        assert (call.priority_class, call.tenant) == ("batch", "team-a")

    def test_a_declared_class_and_a_tenant(self) -> None:
        mw = _client(_classes(), FakeClock())._mw
        call = mw.begin(priority_class="interactive", tenant="user-7")
        assert (call.priority_class, call.tenant) == ("interactive", "user-7")
        assert mw.begin(priority_class="interactive").tenant == ""

    def test_a_scope_without_classes_files_every_call_under_one_flow(self) -> None:
        call = _client(gateway_settings("primary"), FakeClock())._mw.begin(tenant="t")
        assert (call.priority_class, call.tenant) == ("", "t")


def test_a_call_begun_without_options_has_the_documented_defaults() -> None:
    """``begin()``: operation "call", no token cost, not fail-fast, not a stream, 16 hex id."""
    call = _client(gateway_settings("primary"), FakeClock())._mw.begin()
    assert call.op_name == "call"
    assert call.cost_tokens == 0
    assert call.fail_fast is False
    assert call.streaming is False
    assert len(call.call_id) == 16
    int(call.call_id, 16)


async def test_a_back_off_and_a_queue_wait_after_it_both_count_as_waited() -> None:
    """A failure's back-off, then a wait in the queue for the only permit: ``waited_s`` is both.

    Nothing of the call is an attempt's latency here, so all of its time was
    waiting: ``waited_s`` equals its duration, and is more than the back-off.
    """
    clock = FakeClock()
    recorder = Recorder()
    backend = MemoryBackend(now=clock)
    bounded = BoundedSleep(clock, max_calls=200)
    held: list[Lease] = []
    sleeps: list[float] = []
    chat = closing(
        ChatClient(
            gateway_settings(
                {"name": "primary", "max_concurrency": 1},
                max_attempts=3,
                backoff_base_s=2.0,
                backoff_cap_s=2.0,
            ),
            backend=backend,
            transport=FakeTransport(
                [TransientError(status_code=500), chat_completion()], clock=clock
            ),
            now=clock,
            sleep=bounded,
            rng=random.Random(3),
            emitter=recorder,
        )
    )
    spec = chat._mw._order.sources[0][1]

    async def sleep(seconds: float) -> None:
        if not held:
            # The first sleep is the back-off: another call takes the only permit meanwhile.
            got = await backend.acquire("chat", [spec], ttl_s=600.0)
            assert got.lease is not None
            held.append(got.lease)
        sleeps.append(seconds)
        await bounded(seconds)

    chat._mw._sleep = sleep
    task = asyncio.create_task(chat.complete(MESSAGES))
    for _ in range(20):
        await asyncio.sleep(0)
    assert held, "the call never backed off"
    clock.advance(3.0)
    await backend.release(held[0], AttemptOutcome("success"))
    await task
    [call] = recorder.calls
    assert call.outcome == "served"
    assert call.waited_s == pytest.approx(call.duration_s)
    assert call.waited_s > sleeps[0] + 3.0 - 1e-9


async def test_queued_calls_of_two_classes_get_the_permit_in_proportion_to_their_shares() -> None:
    """Shares 3 and 1 on one permit, both queued: the grants go 3 to 1, through the loop.

    A grant moves its class's virtual time on (``Call.leave(granted=True)``):
    without it the class with the larger share would win every turn.
    """
    q = _OnePermit(_classes("primary", max_concurrency=1))
    first = await q.start("first", priority_class="batch")  # holds the permit; the rest queue
    tasks = [await q.start(f"i{n}", priority_class="interactive") for n in range(8)]
    tasks += [await q.start(f"b{n}", priority_class="batch") for n in range(8)]
    await q.run(first, *tasks)
    order = [label[0] for label in q.order()][1:9]
    assert order.count("i") == 6, order  # 3 to 1 over the first eight grants
    assert order.count("b") == 2, order


def _recorded_chat(clock: FakeClock, script: Any, recorder: Recorder) -> ChatClient:
    return closing(
        ChatClient(
            gateway_settings("primary"),
            backend=MemoryBackend(now=clock),
            transport=FakeTransport(script, clock=clock),
            now=clock,
            sleep=BoundedSleep(clock, max_calls=2000),
            rng=random.Random(3),
            emitter=recorder,
        )
    )


async def _read_raising(chat: ChatClient, error: BaseException | None, **options: Any) -> None:
    """Read a stream to its end, or raise ``error`` in the body at its first chunk."""
    async with chat.stream(MESSAGES, **options) as stream:
        async for _ in stream:
            if error is not None:
                raise error


async def test_a_stream_cut_at_its_deadline_is_recorded_as_deadline() -> None:
    """A stream flowing past ``deadline_s`` ends its call record with outcome ``deadline``."""
    clock = FakeClock()
    recorder = Recorder()
    flowing = StreamScript(
        chat_chunk_events([f"w{i}" for i in range(100)], role_first=False), gap_s=1.0
    )
    chat = _recorded_chat(clock, [flowing], recorder)
    with pytest.raises(AllSourcesExhausted) as caught:
        await _read_raising(chat, None, deadline_s=5.5)
    assert caught.value.reason == "deadline"
    assert recorder.call_outcomes() == ["deadline"]


async def test_a_stream_whose_reader_raises_is_recorded_by_what_it_raised() -> None:
    """The caller's own error inside the stream's body: ``error``; a cancellation: ``cancelled``."""
    clock = FakeClock()
    recorder = Recorder()
    script = [StreamScript(chat_chunk_events(["a", "b"])) for _ in range(2)]
    chat = _recorded_chat(clock, script, recorder)
    with pytest.raises(KeyError):
        await _read_raising(chat, KeyError("the caller's bug"))
    with pytest.raises(asyncio.CancelledError):
        await _read_raising(chat, asyncio.CancelledError())
    assert recorder.call_outcomes() == ["error", "cancelled"]


async def test_a_tenant_arriving_after_three_calls_of_another_is_served_second() -> None:
    """Tenants take turns through the loop: B's one call goes right after A's first.

    A's first call asks at once and queues on refusal; the others queue
    directly: both ways into the queue carry the call's tenant.
    """
    q = _OnePermit(gateway_settings({"name": "primary", "max_concurrency": 1}))
    held = await q.hold()
    tasks = [
        await q.start(label, tenant=tenant)
        for label, tenant in (("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"))
    ]
    await q.backend.release(held, AttemptOutcome("success"))
    await q.run(*tasks)
    order = q.order()
    assert order[:2] == ["a1", "b1"], order


async def test_a_cancelled_waiter_does_not_spend_its_classs_turn() -> None:
    """The head of class interactive cancelled while queued: its class's next call keeps the turn.

    Only a grant moves a class's virtual time; a call that leaves the queue
    without a permit leaves it where it was.
    """
    q = _OnePermit(_classes("primary", max_concurrency=1))
    held = await q.hold()
    tasks = {
        label: await q.start(label, priority_class=klass)
        for label, klass in (("i1", "interactive"), ("b1", "batch"), ("i2", "interactive"))
    }
    tasks["i1"].cancel()
    with pytest.raises(asyncio.CancelledError):
        await tasks["i1"]
    await q.backend.release(held, AttemptOutcome("success"))
    await q.run(tasks["b1"], tasks["i2"])
    order = q.order()
    assert order[0] == "i2", order


class _SlowRelease(MemoryBackend):
    """A memory backend whose releases wait for ``opened``: a release can be cancelled.

    Not cancellation-safe, unlike a real backend: the test looks only at the
    call's record, not at the permit.
    """

    def __init__(self, now: FakeClock) -> None:
        super().__init__(now=now)
        self.opened = asyncio.Event()
        self.releasing = asyncio.Event()

    async def release(self, lease: Lease, outcome: AttemptOutcome) -> bool:
        self.releasing.set()
        await self.opened.wait()
        return await super().release(lease, outcome)


async def test_a_stream_read_to_its_end_whose_release_is_cancelled_is_still_served() -> None:
    """Cancelled while giving its permit back, a stream read to its end is recorded ``served``."""
    clock = FakeClock()
    recorder = Recorder()
    backend = _SlowRelease(clock)
    chat = closing(
        ChatClient(
            gateway_settings("primary"),
            backend=backend,
            transport=FakeTransport([StreamScript(chat_chunk_events(["a"]))], clock=clock),
            now=clock,
            sleep=BoundedSleep(clock, max_calls=50),
            rng=random.Random(3),
            emitter=recorder,
        )
    )
    task = asyncio.create_task(_read_raising(chat, None))
    await backend.releasing.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert recorder.call_outcomes() == ["served"]


class _Watching(MemoryBackend):
    """Notes, as each acquire begins, what the scope's room wants (``seen``)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(now=clock)
        self.seen: list[dict[str, int]] = []

    async def acquire(self, *args: Any, **kwargs: Any) -> Any:
        self.seen.append(dict(room_for(self, "chat").wanting()))
        return await super().acquire(*args, **kwargs)


async def test_a_call_asking_counts_in_what_its_class_wants() -> None:
    """While its acquire is in flight, the call counts in its class's calls wanting a permit.

    A fleet's backend registers the process under these classes when it
    refuses the acquire, so a call that asked at once is heard of too.
    """
    clock = FakeClock()
    backend = _Watching(clock)
    chat = _on(_classes("primary"), clock, backend)
    await chat.complete(MESSAGES, priority_class="interactive")
    assert backend.seen == [{"interactive": 1}]
    assert room_for(backend, "chat").wanting() == {}


async def test_a_head_asking_from_the_queue_counts_once_in_its_class() -> None:
    """Queued and asking, a call is one call wanting a permit, not two.

    A fleet's backend keeps the process registered where calls are left
    besides the one asking: counted twice, a process whose last call was
    granted would stay registered, woken for permits nobody here wants.
    """
    clock = FakeClock()
    backend = _Watching(clock)
    chat = _on(_classes("primary", max_concurrency=1), clock, backend)
    held = await backend.acquire("chat", [chat._mw._order.sources[0][1]], ttl_s=600.0)
    assert held.lease is not None
    backend.seen.clear()
    task = asyncio.create_task(chat.complete(MESSAGES, priority_class="interactive"))
    for _ in range(20):
        await asyncio.sleep(0)
    assert backend.seen == [{"interactive": 1}], "asked at once, refused"
    assert room_for(backend, "chat").wanting() == {"interactive": 1}, "queued"
    await backend.release(held.lease, AttemptOutcome("success"))  # its head asks again
    await task
    assert backend.seen == [{"interactive": 1}, {"interactive": 1}]


def _on(settings: GatewaySettings, clock: FakeClock, backend: MemoryBackend) -> ChatClient:
    return closing(
        ChatClient(
            settings,
            backend=backend,
            transport=FakeTransport([], clock=clock, default=chat_completion()),
            now=clock,
            rng=random.Random(5),
        )
    )


def _reserved() -> GatewaySettings:
    """The classes of ``_classes`` with one permit reserved for interactive."""
    settings = _classes("primary").model_dump()
    settings["scopes"]["chat"]["priority_classes"]["interactive"]["reserved"] = 1
    return GatewaySettings.model_validate(settings)


async def test_a_call_of_a_scope_with_classes_names_its_class_and_its_cost() -> None:
    """Such a call passes ``priority_class`` (a fleet's backend counts the permits of a class
    with a floor and keeps the process registered where calls are left), a call of a scope
    without classes does not; each reserves its tokens."""
    asked: list[dict[str, Any]] = []

    class Recording(MemoryBackend):
        async def acquire(self, *args: Any, **kwargs: Any) -> Any:
            asked.append(kwargs)
            return await super().acquire(*args, **kwargs)

    clock = FakeClock()
    chat = _on(_reserved(), clock, Recording(now=clock))
    await chat.complete(MESSAGES, priority_class="interactive")
    await chat.complete(MESSAGES, priority_class="batch")
    await _on(gateway_settings("primary"), clock, Recording(now=clock)).complete(MESSAGES)
    reserved, other, plain = asked
    assert reserved["priority_class"] == "interactive"
    assert other["priority_class"] == "batch"
    assert "priority_class" not in plain
    assert reserved["cost_tokens"] == other["cost_tokens"] == plain["cost_tokens"] > 0


async def test_two_calls_asking_at_once_count_twice_in_their_class() -> None:
    """Each acquire in flight counts in its class until it returns: the class stays one the
    process waits in while any of its calls still asks."""
    gate = asyncio.Event()
    counted: list[int] = []

    class Gated(MemoryBackend):
        async def acquire(self, *args: Any, **kwargs: Any) -> Any:
            counted.append(room_for(self, "chat").slot("interactive").asking)
            await gate.wait()
            return await super().acquire(*args, **kwargs)

    clock = FakeClock()
    chat = _on(_classes("primary"), clock, Gated(now=clock))
    calls = [
        asyncio.create_task(chat.complete(MESSAGES, priority_class="interactive")) for _ in range(2)
    ]
    while len(counted) < 2:
        await asyncio.sleep(0)
    assert counted == [1, 2]
    gate.set()
    await asyncio.gather(*calls)
    room = room_for(chat.backend, "chat")
    assert room.slot("interactive").asking == 0
    assert room.wanting() == {}
