"""The stall budget: only non-productive waiting counts (research-wiki/designs/stall-budget.md).

The stall rule ends a call with ``AllSourcesExhausted(reason="stalled")`` when
BOTH this call's non-productive waiting exceeds ``stall_window_s`` AND the
scope has made no progress fleet-wide for as long (``inf`` = never served =
exceeded). Time spent inside real attempts is governed by ``max_attempts``
and is never billed to the stall budget.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from _chat_clients import chat_on_clock
from _chat_clients import make_chat as chat_client

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import AllSourcesExhausted
from polygateway.middleware.waiting import room_for
from polygateway.models import AttemptRecord
from polygateway.testing import (
    BoundedSleep,
    Delay,
    FakeClock,
    FakeTimers,
    FakeTransport,
    Gate,
    Recorder,
    TransientError,
    chat_completion,
    gateway_settings,
    settle,
)

STALL = 300.0
MESSAGES = [{"role": "user", "content": "hi"}]


def make_chat(
    clock: FakeClock,
    script: Any,
    *,
    sources: tuple[str, ...] = ("primary",),
    source_fields: dict[str, Any] | None = None,
    **given: Any,
) -> tuple[ChatClient, FakeTransport, Any]:
    """A chat client on a fake clock, a scripted transport and a memory backend."""
    fields = source_fields or {}
    named = tuple({"name": name, **fields} for name in sources)
    return chat_client(
        clock, script, sources=named, stall_window_s=STALL, seed=7, max_sleeps=2000, **given
    )


class FixedProgress(MemoryBackend):
    """A memory backend whose fleet-wide progress age is whatever the test says."""

    __slots__ = ("age",)

    def __init__(self, *, now: Callable[[], float], age: float) -> None:
        super().__init__(now=now)
        self.age = age

    async def progress_age_s(self, scope: str) -> float:
        return self.age


class HookedSleep(BoundedSleep):
    """A bounded fake sleep that runs each action once the clock has passed its time."""

    __slots__ = ("actions",)

    def __init__(
        self, clock: FakeClock, actions: list[tuple[float, Callable[[], Awaitable[None]]]]
    ) -> None:
        super().__init__(clock, max_calls=5000)
        self.actions = sorted(actions, key=lambda a: a[0])

    async def __call__(self, seconds: float) -> None:
        await super().__call__(seconds)
        while self.actions and self.clock() >= self.actions[0][0]:
            _, action = self.actions.pop(0)
            await action()


async def hold_permit(backend: Any, source: str = "primary") -> Lease:
    """Take the only permit of a max_concurrency=1 source, as another holder would."""
    result = await backend.acquire("chat", [SourceSpec(source, max_concurrency=1)], ttl_s=1e6)
    assert result.lease is not None
    return result.lease


class TestStallBudget:
    """Productive time (real attempts) is excluded from the stall account."""

    async def test_single_timeout_does_not_exhaust_stall_budget(self) -> None:
        """One attempt that burns more than the window, then a success: the retry budget is usable.

        stall_window_s == timeout_s == 300; the first attempt takes 350 s of the
        fake clock and times out, the second succeeds. Billing the attempt to the
        stall clock (the old wall-clock measure) would end the call "stalled".
        """
        clock = FakeClock()
        timeout = TransientError("timed out", timeout=True)
        chat, transport, _ = make_chat(
            clock,
            [Delay(350.0, timeout), chat_completion("second")],
            source_fields={"timeout_s": STALL},
        )
        response = await chat.complete(MESSAGES)
        assert response.text == "second"
        assert [a.outcome for a in response.attempts] == ["transient", "success"]
        assert len(transport.requests) == 2

    async def test_productive_time_excluded_from_stall(self) -> None:
        """However long real attempts take, they alone never end a call "stalled"."""
        clock = FakeClock()
        timeout = TransientError("timed out", timeout=True)
        chat, _, _ = make_chat(
            clock,
            [Delay(STALL + 100, timeout), Delay(STALL + 100, timeout), chat_completion("third")],
            source_fields={"timeout_s": STALL},
        )
        started = clock()
        response = await chat.complete(MESSAGES)
        assert response.text == "third"
        assert clock() - started >= 2 * (STALL + 100)

    async def test_nonproductive_wait_still_triggers_stall(self) -> None:
        """After a long productive attempt, a full window of pure waiting still ends "stalled"."""
        clock = FakeClock()
        backend = MemoryBackend(now=clock)
        held: list[Lease] = []

        async def take_the_permit() -> None:
            held.append(await hold_permit(backend))

        started = clock()
        sleep = HookedSleep(clock, [(started + 350.0, take_the_permit)])
        chat, transport, _ = make_chat(
            clock,
            [Delay(350.0, TransientError("timed out", timeout=True))],
            backend=backend,
            sleep=sleep,
            source_fields={"timeout_s": STALL, "max_concurrency": 1},
        )
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES)
        assert caught.value.reason == "stalled"
        assert held, "the test never took the permit"
        assert len(transport.requests) == 1
        # 350 s productive, then more than a whole window of non-productive waiting.
        assert clock() - started > 350.0 + STALL

    async def test_saturation_429_still_stalls(self) -> None:
        """Endless 429s (free of the retry budget) end in "stalled", not an endless loop."""
        clock = FakeClock()
        chat, _, _ = make_chat(
            clock,
            [],
            sleep=BoundedSleep(clock, max_calls=500),
        )
        chat_transport = chat._transport
        assert isinstance(chat_transport, FakeTransport)
        chat_transport.default = TransientError(status_code=429)
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES)
        error = caught.value
        assert error.reason == "stalled"
        outcomes = {a.outcome for a in error.attempts}
        assert outcomes == {"rate_limited"}
        assert len(error.attempts) > 3  # more round trips than max_attempts: not charged

    async def test_cancel_inside_attempt_pierces(self) -> None:
        """Cancelling a call inside its attempt raises CancelledError and frees the permit."""
        clock = FakeClock()
        gate = Gate()
        recorder = Recorder()
        chat, _, backend = make_chat(clock, [gate], emitter=recorder)
        task = asyncio.create_task(chat.complete(MESSAGES))
        await gate.wait_entered()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await backend.snapshot("chat")).in_flight == 0
        assert recorder.outcomes() == ["cancelled"]

    async def test_concurrent_calls_do_not_share_clock(self) -> None:
        """One call's long productive attempt is not subtracted from another call's waiting."""
        clock = FakeClock()
        timers = FakeTimers(clock)
        backend = FixedProgress(now=clock, age=math.inf)
        settings = gateway_settings(
            {"name": "primary", "max_concurrency": 1, "timeout_s": STALL}, stall_window_s=STALL
        )
        transport = FakeTransport(
            [Delay(250.0, chat_completion("a"))],
            clock=clock,
            sleep=timers.sleep,
            default=TransientError(status_code=429),
        )
        chat = chat_on_clock(settings, backend, transport, clock, sleep=timers.sleep, seed=3)
        task_a = asyncio.create_task(chat.complete(MESSAGES))
        await settle()
        task_b = asyncio.create_task(chat.complete(MESSAGES))
        await settle()
        started = clock()
        for _ in range(2000):
            if task_b.done():
                break
            await timers.advance(1.0)
        assert (await task_a).text == "a"
        with pytest.raises(AllSourcesExhausted) as caught:
            await task_b
        assert caught.value.reason == "stalled"
        # B waited 250 s behind A, then 429s: stalled one window after it began,
        # not one window plus A's 250 productive seconds.
        assert clock() - started < STALL + 20.0

    async def test_telemetry_time_counts_as_productive(self) -> None:
        """A slow emitter (inside attempting()) cannot push a call over its stall window."""
        clock = FakeClock()

        class SlowEmitter:
            def emit_attempt(self, record: AttemptRecord) -> None:
                clock.advance(STALL + 100)

        chat, _, _ = make_chat(
            clock,
            [TransientError(status_code=503), chat_completion("after")],
            emitter=SlowEmitter(),
        )
        response = await chat.complete(MESSAGES)
        assert response.text == "after"


class TestStallQuadrants:
    """Local window exceeded x fleet-wide progress stale: only both end the call."""

    async def test_both_windows_exceeded_raises_stalled(self) -> None:
        """Waiting past the window in a scope that never served ends "stalled", with no attempt."""
        clock = FakeClock()
        backend = MemoryBackend(now=clock)
        chat, transport, _ = make_chat(
            clock, [], backend=backend, source_fields={"max_concurrency": 1}
        )
        await hold_permit(backend)
        started = clock()
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES)
        assert caught.value.reason == "stalled"
        assert caught.value.attempts == ()
        assert transport.requests == []
        assert STALL < clock() - started < STALL + 1.0

    async def test_local_exceeded_but_global_fresh_keeps_waiting(self) -> None:
        """Past its own window, a call keeps waiting while the scope serves others."""
        clock = FakeClock()
        backend = FixedProgress(now=clock, age=0.0)
        lease = await hold_permit(backend)
        started = clock()

        async def free() -> None:
            await backend.release(lease, AttemptOutcome("cancelled"))

        chat, _, _ = make_chat(
            clock,
            [chat_completion("served")],
            backend=backend,
            sleep=HookedSleep(clock, [(started + 2 * STALL, free)]),
            source_fields={"max_concurrency": 1},
        )
        response = await chat.complete(MESSAGES)
        assert response.text == "served"
        assert clock() - started >= 2 * STALL

    async def test_global_stale_but_local_fresh_keeps_waiting(self) -> None:
        """Global stale alone (never served, age=inf) keeps waiting.

        The local measure is the call's non-productive waiting, here still
        inside the window, so the stale scope alone does not end the call.
        """
        clock = FakeClock()
        backend = MemoryBackend(now=clock)
        lease = await hold_permit(backend)
        started = clock()

        async def free() -> None:
            await backend.release(lease, AttemptOutcome("cancelled"))

        assert await backend.progress_age_s("chat") == math.inf
        chat, _, _ = make_chat(
            clock,
            [chat_completion("served")],
            backend=backend,
            sleep=HookedSleep(clock, [(started + STALL - 50, free)]),
            source_fields={"max_concurrency": 1},
        )
        response = await chat.complete(MESSAGES)
        assert response.text == "served"
        assert clock() - started >= STALL - 50

    async def test_neither_exceeded_keeps_waiting(self) -> None:
        """Inside its window in a serving scope, a call simply waits its turn."""
        clock = FakeClock()
        backend = FixedProgress(now=clock, age=0.0)
        lease = await hold_permit(backend)
        started = clock()

        async def free() -> None:
            await backend.release(lease, AttemptOutcome("cancelled"))

        chat, _, _ = make_chat(
            clock,
            [chat_completion("served")],
            backend=backend,
            sleep=HookedSleep(clock, [(started + 100, free)]),
            source_fields={"max_concurrency": 1},
        )
        response = await chat.complete(MESSAGES)
        assert response.text == "served"
        assert response.attempts[0].permit_wait_s >= 100


async def test_cancellation_pierces_wait_loop() -> None:
    """A call waiting for a permit is cancelled at once and leaves the waiting room."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    backend = MemoryBackend(now=clock)
    await hold_permit(backend)
    chat, transport, _ = make_chat(
        clock, [], backend=backend, sleep=timers.sleep, source_fields={"max_concurrency": 1}
    )
    task = asyncio.create_task(chat.complete(MESSAGES))
    await settle()
    room = room_for(backend, "chat")
    assert len(room) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert room.empty
    assert (await backend.snapshot("chat")).in_flight == 1  # only the test's own permit
    assert transport.requests == []
