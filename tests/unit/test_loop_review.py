"""Adversarial checks of the one governance loop: permits, deadlines, the stall budget, fairness.

Each test drives time with ``FakeClock`` (never a real sleep) and checks what
a caller relies on afterwards: no permit held, nobody left in the scope's
waiting room, and the reason the call ended with.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Sequence
from typing import Any

import pytest
from _chat_clients import chat_on_clock
from _closing import closing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polygateway.backends.base import (
    AcquireResult,
    AttemptOutcome,
    Lease,
    ScopeSnapshot,
    SourceSpec,
)
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.embedding import EmbeddingClient
from polygateway.errors import AllSourcesExhausted
from polygateway.middleware.lifecycle import GovernedClient
from polygateway.middleware.waiting import Waiter, WaitingRoom, room_for
from polygateway.testing import (
    CountingBackend,
    Delay,
    FakeClock,
    FakeTimers,
    FakeTransport,
    Gate,
    Hang,
    Recorder,
    StreamScript,
    TransientError,
    chat_chunk_events,
    chat_completion,
    embedding_body,
    gateway_settings,
    settle,
)
from polygateway.transport.http import HttpRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def make_chat(
    clock: FakeClock,
    script: Any,
    *,
    backend: MemoryBackend,
    emitter: Any = None,
    sources: tuple[Any, ...] = ("primary",),
    **gateway: Any,
) -> tuple[ChatClient, FakeTransport]:
    """A chat client on a fake clock, a scripted transport and the given memory backend."""
    transport = FakeTransport(script, clock=clock)
    chat = chat_on_clock(
        gateway_settings(*sources, **gateway),
        backend,
        transport,
        clock,
        max_sleeps=2000,
        seed=5,
        emitter=emitter,
    )
    return chat, transport


class SlowAcquire(MemoryBackend):
    """A memory backend whose ``acquire`` takes ``delay_s`` of fake time (a slow shared store)."""

    __slots__ = ("clock", "delay_s")

    def __init__(self, clock: FakeClock, delay_s: float) -> None:
        super().__init__(now=clock)
        self.clock = clock
        self.delay_s = delay_s

    async def acquire(
        self,
        scope: str,
        candidates: Sequence[SourceSpec],
        *,
        cost_tokens: int = 0,
        ttl_s: float,
        priority_class: str = "",
    ) -> AcquireResult:
        await self.clock.sleep(self.delay_s)
        return await super().acquire(
            scope, candidates, cost_tokens=cost_tokens, ttl_s=ttl_s, priority_class=priority_class
        )


class TestDeadlineAroundAcquire:
    """``deadline_s`` is read again once a permit is granted: no attempt starts without time."""

    async def test_deadline_passed_during_acquire_sends_nothing_and_ends_deadline(self) -> None:
        """An acquire slower than the time left: no request, "deadline", the permit back."""
        clock = FakeClock()
        backend = SlowAcquire(clock, delay_s=2.0)
        sent: list[HttpRequest] = []

        def answer(request: HttpRequest) -> dict[str, Any]:
            sent.append(request)
            return chat_completion("late")

        chat, _ = make_chat(clock, [answer], backend=backend)
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES, deadline_s=1.0)
        assert caught.value.reason == "deadline"
        assert [r.timeout_s for r in sent] == []  # none sent, with no time left
        assert caught.value.attempts == ()
        assert (await backend.snapshot("chat")).in_flight == 0
        assert room_for(backend, "chat").empty

    async def test_stream_whose_deadline_passed_during_acquire_opens_nothing(self) -> None:
        """The same for a stream: "deadline" as it opens, no request, the permit back."""
        clock = FakeClock()
        backend = SlowAcquire(clock, delay_s=2.0)
        chat, transport = make_chat(
            clock, [StreamScript(chat_chunk_events(["late"]))], backend=backend
        )
        with pytest.raises(AllSourcesExhausted) as caught:
            async with chat.stream(MESSAGES, deadline_s=1.0) as stream:
                _ = [chunk async for chunk in stream]
        assert caught.value.reason == "deadline"
        assert transport.requests == []
        assert (await backend.snapshot("chat")).in_flight == 0
        assert room_for(backend, "chat").empty


# --- no leak whatever happens: a randomised storm of calls, failures and cancellations ------

_OUTCOMES = st.sampled_from(
    [
        "ok",
        "503",
        "429",
        "429-hinted",
        "slow-ok",
        "slow-503",
        "hang",
        "bug",
        "401",
    ]
)


def _bug(request: HttpRequest) -> Any:
    raise ValueError("a bug in the attempt, not a failure of the upstream")


def _play_stream(kind: str) -> Any:
    """One scripted answer to a stream request, by name."""
    events = chat_chunk_events(["a", "b", "c"])
    if kind in ("ok", "429-hinted"):
        return StreamScript(events, gap_s=1.0)
    if kind == "slow-ok":
        return StreamScript(events, gap_s=3.0)
    if kind == "slow-503":
        return StreamScript(events, fail_after=2)
    if kind == "hang":
        return StreamScript(events, hang_before_first=True)
    return _play(kind)


def _play(kind: str) -> Any:
    """One scripted upstream answer, by name."""
    if kind == "ok":
        return chat_completion("ok")
    if kind == "503":
        return TransientError(status_code=503)
    if kind == "429":
        return TransientError(status_code=429)
    if kind == "429-hinted":
        return TransientError(status_code=429, retry_after_s=2.0)
    if kind == "slow-ok":
        return Delay(3.0, chat_completion("ok"), cut_at_timeout=True)
    if kind == "slow-503":
        return Delay(3.0, TransientError(status_code=503), cut_at_timeout=True)
    if kind == "hang":
        return Hang()
    if kind == "401":
        return TransientError(status_code=401)
    return _bug


class FlakyEmitter(Recorder):
    """An emitter that keeps every record, then raises on every other one it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def _fail_now(self) -> None:
        self.count += 1
        if self.count % 2:
            raise RuntimeError("emitter down")

    def emit_attempt(self, record: Any) -> None:
        super().emit_attempt(record)
        self._fail_now()

    def emit_call(self, record: Any) -> None:
        super().emit_call(record)
        self._fail_now()


_CHARGED = frozenset({"transient", "source_misconfigured"})
"""Attempt outcomes a chat call charges to ``max_attempts`` (its 429s are free)."""


def check_call_ends(emitter: FlakyEmitter, *, window_s: float, max_attempts: int) -> None:
    """Each call ended for a reason the stall budget and the retry budget allow."""
    for call in emitter.calls:
        attempts = [r for r in emitter.records if r.call_id == call.call_id]
        if call.outcome == "stalled":
            assert call.stalled_s > window_s, call
        if call.outcome == "retry_exhausted":
            charged = [r for r in attempts if r.outcome in _CHARGED]
            refused = {r.source for r in attempts if r.outcome == "source_misconfigured"}
            assert len(charged) >= max_attempts or refused == {"a", "b"}, (call, attempts)


class SuspendingBackend(MemoryBackend):
    """A memory backend whose every operation takes ``delay_s`` of fake time, as Redis would.

    Cancellation-safe as the protocol requires: a cancelled caller leaves the
    operation to finish in a task of its own, and a grant nobody will use is given back.
    """

    __slots__ = ("_kept", "delay_s", "sleep")

    def __init__(self, clock: FakeClock, sleep: Any, delay_s: float) -> None:
        super().__init__(now=clock)
        self.sleep = sleep
        self.delay_s = delay_s
        self._kept: set[asyncio.Future[Any]] = set()

    async def _slowly(self, operation: Any, give_back: bool = False) -> Any:
        async def run() -> Any:
            await self.sleep(self.delay_s)
            return await operation

        task = asyncio.ensure_future(run())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._kept.add(task)
            if give_back:
                task.add_done_callback(self._give_back)
            raise

    def _give_back(self, task: asyncio.Future[Any]) -> None:
        lease = task.result().lease
        if lease is not None:
            self._kept.add(
                asyncio.ensure_future(super().release(lease, AttemptOutcome("cancelled")))
            )

    async def acquire(
        self,
        scope: str,
        candidates: Sequence[SourceSpec],
        *,
        cost_tokens: int = 0,
        ttl_s: float,
        priority_class: str = "",
    ) -> AcquireResult:
        inner = super().acquire(
            scope, candidates, cost_tokens=cost_tokens, ttl_s=ttl_s, priority_class=priority_class
        )
        result: AcquireResult = await self._slowly(inner, give_back=True)
        return result

    async def release(self, lease: Lease, outcome: AttemptOutcome) -> None:
        await self._slowly(super().release(lease, outcome))

    async def progress_age_s(self, scope: str) -> float:
        age: float = await self._slowly(super().progress_age_s(scope))
        return age

    async def snapshot(self, scope: str) -> ScopeSnapshot:
        snap: ScopeSnapshot = await self._slowly(super().snapshot(scope))
        return snap


async def drive(
    tasks: Sequence[asyncio.Future[Any]], cancel_at: Sequence[float | None], timers: FakeTimers
) -> list[float]:
    """Move fake time on until every call has ended, cancelling each at its time, if any.

    Returns how long each call ran. Fails the test if one is still running 500 s in.
    """
    clock = timers.clock
    started = clock()
    cancels = sorted((at, i) for i, at in enumerate(cancel_at) if at is not None)
    ended: dict[int, float] = {}
    for i, task in enumerate(tasks):
        task.add_done_callback(lambda _, i=i: ended.setdefault(i, clock() - started))
    await settle(5)  # every call begins before time moves
    for _ in range(2000):
        if all(t.done() for t in tasks):
            break
        while cancels and clock() - started >= cancels[0][0]:
            tasks[cancels.pop(0)[1]].cancel()
        await timers.advance(0.25, turns=20)
    assert all(t.done() for t in tasks), "a call never ended"
    return [ended[i] for i in range(len(tasks))]


async def assert_nothing_left(backend: MemoryBackend, scope: str, timers: FakeTimers) -> None:
    """Once the operations cancelled callers left behind have run: no permit, no waiter."""
    await timers.advance(5.0, turns=20)
    assert backend.snapshot_now(scope).in_flight == 0
    room = room_for(backend, scope)
    assert room.empty
    assert room.asking == 0
    assert all(in_use == 0 for _, in_use in room.by_class().values())


async def close_on_fake_time(client: GovernedClient, timers: FakeTimers) -> None:
    """Close ``client`` while fake time moves (its grace is a fake sleep)."""
    closing_ = asyncio.ensure_future(client.aclose())
    while not closing_.done():
        await timers.advance(10.0, turns=5)
    await closing_


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    answers=st.lists(_OUTCOMES, min_size=1, max_size=12),
    calls=st.lists(
        st.tuples(
            st.one_of(st.none(), st.floats(0.0, 40.0)),  # deadline_s
            st.one_of(st.none(), st.floats(0.0, 60.0)),  # cancelled at
            st.booleans(),  # fail_fast
        ),
        min_size=1,
        max_size=6,
    ),
    concurrency=st.integers(1, 2),
    backend_delay_s=st.sampled_from([0.0, 0.1, 0.7]),
    modes=st.lists(st.sampled_from(["complete", "stream", "bare-stream"]), min_size=1),
)
def test_no_permit_or_waiter_is_left_whatever_happens(
    answers: list[str],
    calls: list[tuple[float | None, float | None, bool]],
    concurrency: int,
    backend_delay_s: float,
    modes: list[str],
) -> None:
    """Failures, bugs, hangs, deadlines and cancellations at any time: nothing stays held."""

    async def scenario() -> None:
        clock = FakeClock()
        timers = FakeTimers(clock)
        backend = SuspendingBackend(clock, timers.sleep, backend_delay_s)
        answers_left = iter(itertools.cycle(answers))

        def upstream(request: HttpRequest) -> Any:
            if isinstance(request.json, dict) and request.json.get("stream") is True:
                return _play_stream(next(answers_left))
            return _play(next(answers_left))

        async def read(mode: str, deadline_s: float | None, fail_fast: bool) -> Any:
            if mode == "complete":
                return await chat.complete(MESSAGES, deadline_s=deadline_s, fail_fast=fail_fast)
            stream = chat.stream(MESSAGES, deadline_s=deadline_s, fail_fast=fail_fast)
            if mode == "stream":
                async with stream as chunks:
                    return [chunk async for chunk in chunks]
            async for _ in stream:  # a bare loop that stops at the first chunk
                break
            return None

        transport = FakeTransport(clock=clock, sleep=timers.sleep, default=upstream)
        emitter = FlakyEmitter()
        chat = ChatClient(
            gateway_settings(
                {"name": "a", "max_concurrency": concurrency, "timeout_s": 5},
                {"name": "b", "max_concurrency": 1, "timeout_s": 5},
                stall_window_s=30.0,
                poll_interval_s=0.5,
                breaker_failures=2,
                breaker_cooldown_s=4.0,
                breaker_cooldown_max_s=8.0,
            ),
            backend=backend,
            transport=transport,
            now=clock,
            sleep=timers.sleep,
            rng=random.Random(9),
            emitter=emitter,
        )
        try:
            tasks = [
                asyncio.ensure_future(read(mode, deadline_s, fail_fast))
                for (deadline_s, _, fail_fast), mode in zip(calls, itertools.cycle(modes))
            ]
            ended = await drive(tasks, [at for _, at, _ in calls], timers)
            for i, (task, (deadline_s, _, fail_fast)) in enumerate(zip(tasks, calls, strict=True)):
                if task.cancelled():
                    continue
                error = task.exception()
                if isinstance(error, AllSourcesExhausted):
                    assert error.reason != "no_runnable" or fail_fast
                    assert error.reason != "deadline" or deadline_s is not None
                if deadline_s is not None:
                    # A hard bound: past it, at most an acquire in flight, a release and
                    # the final error's snapshot.
                    assert ended[i] <= deadline_s + 3 * backend_delay_s + 1e-6, (i, ended[i], error)
            check_call_ends(emitter, window_s=30.0, max_attempts=3)
            await assert_nothing_left(backend, "chat", timers)
        finally:
            await close_on_fake_time(chat, timers)

    asyncio.run(scenario())


def _play_embed(kind: str) -> Any:
    """One scripted answer to a one-text embedding batch, by name."""
    if kind in ("ok", "slow-ok"):
        body = embedding_body([[0.5, 0.25]])
        return body if kind == "ok" else Delay(3.0, body, cut_at_timeout=True)
    return _play(kind)


def _progress_that_raises(progress: Any) -> None:
    raise RuntimeError("the progress display has a bug")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    answers=st.lists(_OUTCOMES, min_size=1, max_size=12),
    calls=st.lists(
        st.tuples(
            st.one_of(st.none(), st.floats(0.0, 40.0)),  # deadline_s
            st.one_of(st.none(), st.floats(0.0, 60.0)),  # cancelled at
            st.booleans(),  # partial
        ),
        min_size=1,
        max_size=4,
    ),
    backend_delay_s=st.sampled_from([0.0, 0.1, 0.7]),
)
def test_embedding_batches_leave_no_permit_or_waiter_whatever_happens(
    answers: list[str],
    calls: list[tuple[float | None, float | None, bool]],
    backend_delay_s: float,
) -> None:
    """Batches of one call failing, hanging, cut or cancelled at any time: nothing stays held."""

    async def scenario() -> None:
        clock = FakeClock()
        timers = FakeTimers(clock)
        backend = SuspendingBackend(clock, timers.sleep, backend_delay_s)
        answers_left = iter(itertools.cycle(answers))
        transport = FakeTransport(
            clock=clock, sleep=timers.sleep, default=lambda _: _play_embed(next(answers_left))
        )
        emb = EmbeddingClient(
            gateway_settings(
                {"name": "a", "max_concurrency": 2, "timeout_s": 5, "max_batch_size": 1},
                {"name": "b", "max_concurrency": 1, "timeout_s": 5, "max_batch_size": 1},
                scope="embed",
                kind="embed",
                stall_window_s=30.0,
                breaker_failures=2,
                breaker_cooldown_s=4.0,
                breaker_cooldown_max_s=8.0,
            ),
            "embed",
            backend=backend,
            transport=transport,
            now=clock,
            sleep=timers.sleep,
            rng=random.Random(9),
            emitter=FlakyEmitter(),
        )
        try:
            tasks = [
                asyncio.ensure_future(
                    emb.embed(
                        ["a", "b", "c"],
                        partial=partial,
                        deadline_s=deadline_s,
                        on_progress=_progress_that_raises,
                    )
                )
                for deadline_s, _, partial in calls
            ]
            await drive(tasks, [at for _, at, _ in calls], timers)
            await asyncio.gather(*tasks, return_exceptions=True)
            await assert_nothing_left(backend, "embed", timers)
        finally:
            await close_on_fake_time(emb, timers)

    asyncio.run(scenario())


# --- the waiting room's order: FIFO per tenant, stride between classes ----------------------

_SHARES = {"hi": 3.0, "lo": 1.0}
_ROOM_STEP = st.one_of(
    st.tuples(
        st.just("enter"), st.sampled_from(sorted(_SHARES)), st.sampled_from(["", "t1", "t2"])
    ),
    st.tuples(st.just("grant"), st.just(""), st.just("")),
    st.tuples(st.just("cancel"), st.integers(0, 50).map(str), st.just("")),
)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(_ROOM_STEP, max_size=80))
def test_room_keeps_arrival_order_per_tenant_and_starves_no_class(
    steps: list[tuple[str, str, str]],
) -> None:
    """Random arrivals, grants and cancellations: each tenant's calls in ticket order; no class
    that waits goes longer between two grants than the others' shares allow."""
    room = WaitingRoom(_SHARES)
    waiting: list[Waiter] = []
    served_since: dict[str, int] = dict.fromkeys(_SHARES, 0)  # others' grants since its last
    grants = 0
    last_grant: dict[tuple[str, str], int] = {}  # (class, tenant): the number of its last grant
    waits_since: dict[tuple[str, str], int] = {}  # (class, tenant): grants when it began to wait

    def flow_of(w: Waiter) -> tuple[str, str]:
        return (w.priority_class, w.tenant)

    def forget_idle_flows() -> None:
        for flow in list(waits_since):
            if not any(flow_of(w) == flow for w in waiting):
                del waits_since[flow]

    for op, arg, tenant in steps:
        if op == "enter":
            was_waiting = any(w.priority_class == arg for w in waiting)
            waiting.append(room.enter(priority_class=arg, tenant=tenant))
            waits_since.setdefault((arg, tenant), grants)
            if not was_waiting:
                served_since[arg] = 0  # a class back from idle starts afresh
        elif op == "cancel" and waiting:
            room.leave(waiting.pop(int(arg) % len(waiting)))
            forget_idle_flows()
        elif op == "grant" and waiting:
            head = room.head()
            assert head is not None
            same_flow = [
                w.ticket
                for w in waiting
                if w.priority_class == head.priority_class and w.tenant == head.tenant
            ]
            assert head.ticket == min(same_flow)  # arrival order within a tenant of a class
            waiting.remove(head)
            room.leave(head, granted=True)
            grants += 1
            mine = flow_of(head)
            previous = last_grant.get(mine)
            if previous is not None:
                # Round robin inside a class: a tenant of the class that has waited since
                # before this tenant's previous grant had its own turn since.
                for (klass, other), since in waits_since.items():
                    if klass == head.priority_class and other != head.tenant and since < previous:
                        assert last_grant.get((klass, other), -1) > previous, (mine, other)
            last_grant[mine] = grants
            forget_idle_flows()
            served_since[head.priority_class] = 0
            for name, share in _SHARES.items():
                if name != head.priority_class and any(w.priority_class == name for w in waiting):
                    served_since[name] += 1
                    bound = sum(_SHARES.values()) / share + 1
                    assert served_since[name] <= bound, (name, served_since)
        assert len(room) == len(waiting)


# --- the breaker's half-open probe, as waiting calls see it ----------------------------------


async def test_half_open_breaker_lets_exactly_one_probe_through_a_crowd() -> None:
    """Cool-down over with five calls waiting: one request reaches the source until it answers."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    backend = MemoryBackend(now=clock)
    probe = Gate(chat_completion("probe"))
    transport = FakeTransport(
        [TransientError(status_code=503), probe],
        clock=clock,
        sleep=timers.sleep,
        default=chat_completion("after"),
    )
    chat = closing(
        ChatClient(
            gateway_settings(
                {"name": "primary", "max_concurrency": 8},
                breaker_failures=1,
                breaker_cooldown_s=4.0,
                breaker_cooldown_max_s=4.0,
                max_attempts=5,
            ),
            backend=backend,
            transport=transport,
            now=clock,
            sleep=timers.sleep,
            rng=random.Random(2),
        )
    )
    first = asyncio.ensure_future(chat.complete(MESSAGES))
    await settle()
    crowd = [asyncio.ensure_future(chat.complete(MESSAGES)) for _ in range(5)]
    await settle()
    assert len(transport.requests) == 1  # the failure that tripped the breaker
    await timers.advance(10.0)  # the cool-down passes while every call waits
    await probe.wait_entered()
    for _ in range(8):
        await timers.advance(1.0)
    assert probe.entered == 1
    assert len(transport.requests) == 2  # the probe alone, however long it takes
    probe.open()
    for _ in range(20):
        await timers.advance(1.0)
    answers = await asyncio.gather(first, *crowd)
    assert sorted(a.text for a in answers).count("probe") == 1
    assert (await backend.snapshot("chat")).in_flight == 0
    assert room_for(backend, "chat").empty


async def test_a_429s_retry_after_pauses_only_its_own_source() -> None:
    """A 429 asking for 30 s pauses that source alone: calls go on at once to the other one."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    chat, transport = make_chat(
        clock,
        {
            "first": [TransientError(status_code=429, retry_after_s=30.0)],
            "second": [chat_completion("second")] * 3,
        },
        backend=backend,
        sources=({"name": "first", "priority": 0}, {"name": "second", "priority": 1}),
    )
    started = clock()
    answers = [await chat.complete(MESSAGES) for _ in range(3)]
    assert [a.text for a in answers] == ["second"] * 3
    assert transport.sources_called() == ["first", "second", "second", "second"]
    assert clock() == started  # nobody waited for the paused source
    snapshot = await backend.snapshot("chat")
    paused = {s.name: s.paced_for_s for s in snapshot.sources}
    assert paused["first"] == pytest.approx(30.0)
    assert paused["second"] is None


_FLOOR_STEP = st.one_of(
    st.tuples(st.just("enter"), st.sampled_from(sorted(_SHARES))),
    st.tuples(st.just("grant"), st.just("")),
    st.tuples(st.just("release"), st.sampled_from(sorted(_SHARES))),
    st.tuples(st.just("cancel"), st.integers(0, 50).map(str)),
)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(_FLOOR_STEP, max_size=80))
def test_room_serves_a_class_below_its_floor_first_and_counts_permits(
    steps: list[tuple[str, str]],
) -> None:
    """A waiting class holding fewer permits than it reserves is always the one that asks next."""
    floors = {"lo": 1}
    room = WaitingRoom(_SHARES, floors)
    waiting: list[Waiter] = []
    held = dict.fromkeys(_SHARES, 0)
    for op, arg in steps:
        if op == "enter":
            waiting.append(room.enter(priority_class=arg))
        elif op == "cancel" and waiting:
            room.leave(waiting.pop(int(arg) % len(waiting)))
        elif op == "release" and held[arg]:
            held[arg] -= 1
            room.unhold(room.slot(arg))
        elif op == "grant" and waiting:
            head = room.head()
            assert head is not None
            below = {
                w.priority_class
                for w in waiting
                if held[w.priority_class] < floors.get(w.priority_class, 0)
            }
            assert not below or head.priority_class in below, (head.priority_class, held)
            waiting.remove(head)
            room.leave(head, granted=True)
            room.hold(room.slot(head.priority_class))
            held[head.priority_class] += 1
        assert {name: in_use for name, (_, in_use) in room.by_class().items()} == held


async def test_a_crowd_waiting_costs_one_poll_per_interval_not_one_per_call() -> None:
    """Ten calls wait 100 s for a permit held elsewhere: only the head polls, every [p/2, p]."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    inner = MemoryBackend(now=clock)
    backend = CountingBackend(inner)
    held = await inner.acquire("chat", [SourceSpec("primary", max_concurrency=1)], ttl_s=1e6)
    assert held.lease is not None
    transport = FakeTransport(clock=clock, sleep=timers.sleep, default=chat_completion("ok"))
    chat = closing(
        ChatClient(
            gateway_settings(
                {"name": "primary", "max_concurrency": 1},
                stall_window_s=3600.0,
                poll_interval_s=0.5,
            ),
            backend=backend,
            transport=transport,
            now=clock,
            sleep=timers.sleep,
            rng=random.Random(4),
        )
    )
    crowd = [asyncio.ensure_future(chat.complete(MESSAGES)) for _ in range(10)]
    await settle()
    for _ in range(100):
        await timers.advance(1.0)
    polls = backend.calls.get("acquire", 0)
    assert 100 / 0.5 <= polls <= 1 + 100 / 0.25  # the head's jittered polls, and nobody else's
    assert backend.calls.get("progress_age_s", 0) == 0
    await inner.release(held.lease, AttemptOutcome("cancelled"))
    for _ in range(10):
        await timers.advance(1.0)
    assert [a.text for a in await asyncio.gather(*crowd)] == ["ok"] * 10
    assert (await inner.snapshot("chat")).in_flight == 0
