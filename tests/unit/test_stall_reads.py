"""The stall rule's reads of a scope's progress age, as a crowd of waiting calls costs them.

Every call waiting past its own stall window asks whether the scope still
makes progress (``Backend.progress_age_s``: a round trip on Redis). The
answers are the same for every call of the scope, so the scope's waiting room
shares them: a crowd costs the backend what one call costs, and each call's
decision is still the one a fresh read would give
(research-wiki/designs/stall-budget.md, "Reading the progress age").
"""

from __future__ import annotations

import asyncio
import gc
import math
import random
from typing import Any, cast

import pytest
from _closing import closing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import AllSourcesExhausted, GovernanceBackendError
from polygateway.middleware.waiting import WaitingRoom, room_for
from polygateway.testing import (
    CountingBackend,
    FakeClock,
    FakeTimers,
    FakeTransport,
    chat_completion,
    gateway_settings,
    settle,
)

MESSAGES = [{"role": "user", "content": "hi"}]
WINDOW_S = 10.0
POLL_S = 0.5


def crowd_client(clock: FakeClock, timers: FakeTimers, backend: Any) -> ChatClient:
    """A chat client of one source, stall window ``WINDOW_S``, polling every ``POLL_S``."""
    return closing(
        ChatClient(
            gateway_settings(
                {"name": "primary", "max_concurrency": 1},
                stall_window_s=WINDOW_S,
                poll_interval_s=POLL_S,
            ),
            backend=backend,
            transport=FakeTransport(clock=clock, sleep=timers.sleep, default=chat_completion("ok")),
            now=clock,
            sleep=timers.sleep,
            rng=random.Random(4),
        )
    )


async def hold_the_permit(inner: MemoryBackend) -> Lease:
    """Another process of the fleet holds the source's one permit."""
    held = await inner.acquire("chat", [SourceSpec("primary", max_concurrency=1)], ttl_s=1e6)
    assert held.lease is not None
    return held.lease


async def stop(calls: list[asyncio.Future[Any]]) -> None:
    """Cancel the calls still running, so a failed test does not wait on them at teardown."""
    for call in calls:
        call.cancel()
    await asyncio.gather(*calls, return_exceptions=True)


async def mark_progress(inner: MemoryBackend) -> None:
    """Another process of the fleet serves a call of the scope, on a source of its own."""
    served = await inner.acquire("chat", [SourceSpec("elsewhere", max_concurrency=1)], ttl_s=60)
    assert served.lease is not None
    await inner.release(served.lease, AttemptOutcome("success"))


async def test_a_crowd_past_its_window_reads_the_progress_age_once_per_scope() -> None:
    """Sixty calls wait 100 s past their window on a scope served elsewhere: the progress
    age costs what one polling head costs, not a read per call; none of them ends stalled."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    inner = MemoryBackend(now=clock)
    backend = CountingBackend(inner)
    held = await hold_the_permit(inner)
    await mark_progress(inner)
    chat = crowd_client(clock, timers, backend)
    crowd = [asyncio.ensure_future(chat.complete(MESSAGES)) for _ in range(60)]
    try:
        await settle()
        reads_before = 0
        for second in range(1, 112):
            if second % 9 == 0:
                await mark_progress(inner)  # the fleet serves every 9 s: the scope is alive
            if second == 11:
                reads_before = backend.calls.get("progress_age_s", 0)  # all past the window
            await timers.advance(1.0)
        reads = backend.calls.get("progress_age_s", 0) - reads_before
        # The head alone, reading once per poll, would read up to 1 + 100 / (POLL_S / 2) times.
        assert reads <= 1 + 100 / (POLL_S / 2), reads
        assert not any(call.done() for call in crowd)
        await inner.release(held, AttemptOutcome("cancelled"))
        for _ in range(80):
            await timers.advance(1.0)
        assert [a.text for a in await asyncio.gather(*crowd)] == ["ok"] * 60
        assert (await inner.snapshot("chat")).in_flight == 0
        assert room_for(backend, "chat").empty
    finally:
        await stop(crowd)


async def test_a_progress_mark_is_seen_by_the_next_decision_of_every_waiting_call() -> None:
    """A mark just before the scope's age passes the window keeps every call waiting; once the
    marks stop, they all end stalled a window after the last one, not earlier."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    inner = MemoryBackend(now=clock)
    backend = CountingBackend(inner)
    held = await hold_the_permit(inner)
    await mark_progress(inner)
    started = clock()
    chat = crowd_client(clock, timers, backend)
    crowd = [asyncio.ensure_future(chat.complete(MESSAGES)) for _ in range(12)]
    ended: dict[int, float] = {}
    for i, call in enumerate(crowd):
        call.add_done_callback(lambda _, i=i: ended.setdefault(i, clock() - started))
    try:
        await settle()
        await timers.advance(WINDOW_S - 0.1)
        await mark_progress(inner)  # 0.1 s before the age would pass the window
        last_mark = clock() - started
        for _ in range(int(2 * WINDOW_S / 0.05)):
            await timers.advance(0.05)
        assert len(ended) == len(crowd)
        for call in crowd:
            error = call.exception()
            assert isinstance(error, AllSourcesExhausted)
            assert error.reason == "stalled"
        # Stalled only once the age passed the window after the last mark, and soon after.
        assert min(ended.values()) > last_mark + WINDOW_S
        assert max(ended.values()) <= last_mark + WINDOW_S + POLL_S + 0.1
        assert room_for(backend, "chat").empty
    finally:
        await stop(crowd)
        await inner.release(held, AttemptOutcome("cancelled"))


# --- the room's shared read, on its own ----------------------------------------------------


class AgeBackend:
    """A backend double of ``progress_age_s`` alone: each read takes ``delay_s`` of fake time.

    ``progress_at`` is the scope's last progress mark (``None``: never served);
    ``failing`` makes the next reads fail as a shared backend's would.
    """

    def __init__(self, clock: FakeClock, timers: FakeTimers, delay_s: float = 0.1) -> None:
        self.clock = clock
        self.timers = timers
        self.delay_s = delay_s
        self.progress_at: float | None = clock()
        self.failing = False
        self.reads = 0

    async def progress_age_s(self, scope: str) -> float:
        self.reads += 1
        await self.timers.sleep(self.delay_s)
        if self.failing:
            raise GovernanceBackendError("progress key unreadable", operation="progress_age_s")
        if self.progress_at is None:
            return math.inf
        return self.clock() - self.progress_at


def ask(room: WaitingRoom, backend: AgeBackend, below: float = WINDOW_S) -> asyncio.Task[float]:
    """One call asking the room for the scope's progress age, as the stall rule does."""
    return asyncio.ensure_future(
        room.progress_age(cast(Any, backend), "chat", backend.clock, known_below=below)
    )


async def room_with_a_read_of_4s() -> tuple[FakeClock, FakeTimers, AgeBackend, WaitingRoom]:
    """A room whose one read so far found the scope 4 s past its last progress."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    backend = AgeBackend(clock, timers, delay_s=0.0)
    room = WaitingRoom()
    await timers.advance(4.0)
    first = ask(room, backend)
    await settle()
    await timers.advance(0.0)
    assert await first == 4.0
    return clock, timers, backend, room


async def test_calls_asking_while_a_read_is_in_flight_share_it() -> None:
    """Forty calls ask at once: one backend read, the same answer for all."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    backend = AgeBackend(clock, timers)
    room = WaitingRoom()
    await timers.advance(4.0)
    asking = [ask(room, backend) for _ in range(40)]
    await settle()
    await timers.advance(0.1)
    assert [await a for a in asking] == [pytest.approx(4.1)] * 40
    assert backend.reads == 1


async def test_a_past_read_answers_while_it_proves_the_scope_fresh_then_one_reads_again() -> None:
    """A read of 4 s answers, aged, until the window; then a fresh read sees a new mark."""
    clock, timers, backend, room = await room_with_a_read_of_4s()
    await timers.advance(5.0)
    backend.progress_at = clock()  # a mark the aged figure does not know about
    assert await ask(room, backend) == 9.0  # an upper bound, still under the window
    assert backend.reads == 1
    await timers.advance(1.5)
    again = ask(room, backend)  # 10.5 s aged: past the window, so it reads
    await settle()
    await timers.advance(0.0)
    assert await again == 1.5
    assert backend.reads == 2


async def test_a_failed_read_fails_every_call_waiting_on_it_and_is_not_kept() -> None:
    """The backend fails: each call that shared the read fails closed; the next one reads again."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    backend = AgeBackend(clock, timers)
    backend.failing = True
    room = WaitingRoom()
    asking = [ask(room, backend) for _ in range(5)]
    await settle()
    await timers.advance(0.1)
    for a in asking:
        with pytest.raises(GovernanceBackendError) as caught:
            await a
        assert caught.value.operation == "progress_age_s"
    assert backend.reads == 1
    backend.failing = False
    later = ask(room, backend)
    await settle()
    await timers.advance(0.1)
    assert await later == pytest.approx(0.2)
    assert backend.reads == 2


async def test_the_reader_cancelled_mid_read_leaves_the_others_an_answer() -> None:
    """The call that began the read is cancelled: the others read again, once, and answer."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    backend = AgeBackend(clock, timers)
    room = WaitingRoom()
    reader, *others = [ask(room, backend) for _ in range(4)]
    await settle()
    reader.cancel()
    await settle()
    assert reader.cancelled()
    await timers.advance(0.2)
    assert [await a for a in others] == [pytest.approx(0.1)] * 3
    assert backend.reads == 2


async def test_a_call_cancelled_while_it_shares_a_read_leaves_the_read_to_the_others() -> None:
    """A call that joined a read is cancelled: the read goes on, the others get its answer."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    backend = AgeBackend(clock, timers)
    room = WaitingRoom()
    reader, joiner, other = [ask(room, backend) for _ in range(3)]
    await settle()
    joiner.cancel()
    await settle()
    await timers.advance(0.1)
    assert joiner.cancelled()
    assert await reader == await other == pytest.approx(0.1)
    assert backend.reads == 1


class CountingAgeBackend(AgeBackend):
    """``AgeBackend`` that keeps every read's (began, ended, answer) and how many overlap."""

    def __init__(self, clock: FakeClock, timers: FakeTimers, delay_s: float) -> None:
        super().__init__(clock, timers, delay_s)
        self.answers: list[tuple[float, float, float]] = []
        self.in_flight = 0
        self.most_in_flight = 0

    async def progress_age_s(self, scope: str) -> float:
        began = self.clock()
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            age = await super().progress_age_s(scope)
        finally:
            self.in_flight -= 1
        self.answers.append((began, self.clock(), age))
        return age


_READ_STEP = st.one_of(
    st.tuples(st.just("ask"), st.integers(1, 4)),
    st.tuples(st.just("cancel"), st.integers(0, 30)),
    st.tuples(st.just("mark"), st.just(0)),
    st.tuples(st.just("fail"), st.booleans().map(int)),
    st.tuples(st.just("advance"), st.sampled_from([0, 1, 5, 20, 40])),
)


# 40 examples: each ends with a full collection (an unretrieved failure would be logged
# then), which costs about 50 ms in a full suite's heap. About 2.5 s plain; under `make
# mutation`'s tracing, whose 10 s bound per test it outgrew on a busy 2-core machine (the
# clean run before any mutant failed on it), it has a bound of its own.
@pytest.mark.timeout(60)
@settings(max_examples=40, deadline=None)
@given(steps=st.lists(_READ_STEP, max_size=40), delay_ds=st.sampled_from([0, 1, 3]))
def test_shared_reads_answer_as_fresh_reads_would_whoever_is_cancelled(
    steps: list[tuple[str, int]], delay_ds: int
) -> None:
    """Calls asking, cancelled, the backend failing and the scope served at random: one read
    in flight at most; an answer under the window bounds the true age; one over it is a read
    made after the call asked; nothing is left in flight or unretrieved afterwards."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        unhandled: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _, context: unhandled.append(context))
        clock = FakeClock()
        timers = FakeTimers(clock)
        backend = CountingAgeBackend(clock, timers, delay_s=delay_ds / 10)
        backend.progress_at = None
        room = WaitingRoom()
        asked: list[tuple[asyncio.Task[float], float]] = []
        settled: dict[int, float] = {}  # per call answered: the scope's true age then

        def true_age() -> float:
            return math.inf if backend.progress_at is None else clock() - backend.progress_at

        def check(i: int) -> None:
            task, asked_at = asked[i]
            if task.cancelled() or task.exception() is not None:
                return
            answer = task.result()
            if answer <= WINDOW_S:
                assert settled[i] <= answer + 1e-9, (answer, settled[i])
            else:
                assert any(
                    ended >= asked_at and age == answer for _, ended, age in backend.answers
                ), (answer, asked_at, backend.answers)

        for op, arg in steps:
            if op == "ask":
                for _ in range(arg):
                    i = len(asked)
                    asked.append((ask(room, backend), clock()))
                    asked[i][0].add_done_callback(lambda _, i=i: settled.setdefault(i, true_age()))
            elif op == "cancel" and asked:
                asked[arg % len(asked)][0].cancel()
            elif op == "mark":
                backend.progress_at = clock()
            elif op == "fail":
                backend.failing = bool(arg)
            elif op == "advance":
                await settle()
                await timers.advance(arg / 10)
            await settle()
            for i in settled:
                check(i)
        backend.failing = False
        for _ in range(5):
            await timers.advance(1.0)
        assert all(task.done() for task, _ in asked)
        for i in settled:
            check(i)
        for task, _ in asked:
            if not task.cancelled():
                task.exception()  # each failure was its caller's to see
        assert backend.most_in_flight <= 1
        assert room._age_read is None
        asked.clear()
        gc.collect()
        await settle()
        assert unhandled == []

    asyncio.run(scenario())


async def test_a_read_timed_on_another_clock_is_never_aged_on_this_one() -> None:
    """Two clients of one scope on different clocks: a read timed on the one far ahead
    never answers the other's question, which would age it backwards into "fresh"."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    backend = AgeBackend(clock, timers, delay_s=0.0)
    room = WaitingRoom()
    await timers.advance(2.0)
    ahead = FakeClock(start=1e6)
    first = asyncio.ensure_future(
        room.progress_age(cast(Any, backend), "chat", ahead, known_below=10.0)
    )
    await settle()
    await timers.advance(0.0)
    assert await first == 2.0
    await timers.advance(20.0)  # the scope has now not served for 22 s
    behind = asyncio.ensure_future(
        room.progress_age(cast(Any, backend), "chat", clock, known_below=10.0)
    )
    await settle()
    await timers.advance(0.0)
    assert await behind == 22.0
    assert backend.reads == 2


class SlowAgeBackend(MemoryBackend):
    """A memory backend whose progress-age read takes ``delay_s`` of fake time (a round trip)."""

    def __init__(self, clock: FakeClock, timers: FakeTimers, delay_s: float) -> None:
        super().__init__(now=clock)
        self.timers = timers
        self.delay_s = delay_s
        self.reads = 0

    async def progress_age_s(self, scope: str) -> float:
        self.reads += 1
        await self.timers.sleep(self.delay_s)
        return await super().progress_age_s(scope)


_CROWD_STEP = st.one_of(
    st.tuples(st.just("call"), st.integers(0, 1)),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("mark"), st.just(0)),
    st.tuples(st.just("advance"), st.sampled_from([1, 3, 6, 12])),
)


# About 2 s plain: a bound of its own under `make mutation`'s tracing, as the test above.
@pytest.mark.timeout(60)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_CROWD_STEP, max_size=30), delay_ds=st.sampled_from([0, 1, 4]))
def test_two_clients_sharing_reads_end_stalled_exactly_when_the_rule_holds(
    steps: list[tuple[str, int]], delay_ds: int
) -> None:
    """Two clients of one scope queue behind a permit held elsewhere while the fleet serves
    at random and calls are cancelled: a call ends stalled only when its own waiting and the
    scope's true age both exceed the window, and none waits on long after both do."""

    async def scenario() -> None:
        clock = FakeClock()
        timers = FakeTimers(clock)
        backend = SlowAgeBackend(clock, timers, delay_s=delay_ds / 10)
        held = await hold_the_permit(backend)
        await mark_progress(backend)
        last_mark = clock()
        clients = [crowd_client(clock, timers, backend) for _ in range(2)]
        calls: list[asyncio.Future[Any]] = []
        began: list[float] = []
        ended_with_age: dict[int, float] = {}

        def true_age() -> float:
            return clock() - last_mark

        def start(client: ChatClient) -> None:
            i = len(calls)
            calls.append(asyncio.ensure_future(client.complete(MESSAGES)))
            began.append(clock())
            calls[i].add_done_callback(lambda _, i=i: ended_with_age.setdefault(i, true_age()))

        def check_running() -> None:
            # Past its window and the scope stale by a poll, a read's round trip and the
            # timer's slack: every call still waiting must have ended stalled by now.
            late = WINDOW_S + POLL_S + 2 * delay_ds / 10 + 0.01
            if true_age() > late:
                for call, at in zip(calls, began, strict=True):
                    assert call.done() or clock() - at <= late, (clock() - at, true_age())

        try:
            for op, arg in steps:
                if op == "call":
                    start(clients[arg])
                elif op == "cancel" and calls:
                    calls[arg % len(calls)].cancel()
                elif op == "mark":
                    await mark_progress(backend)
                    last_mark = clock()
                elif op == "advance":
                    for _ in range(arg * 4):
                        await timers.advance(0.25)
                        check_running()
            for _ in range(int(4 * WINDOW_S / 0.25)):
                await timers.advance(0.25)
                check_running()
            assert all(call.done() for call in calls)
            for i, call in enumerate(calls):
                if call.cancelled():
                    continue
                error = call.exception()
                assert isinstance(error, AllSourcesExhausted)
                assert error.reason == "stalled"
                # The rule held when the call ended (the read it ended on took delay_s).
                assert ended_with_age[i] > WINDOW_S, (i, ended_with_age[i])
            room = room_for(backend, "chat")
            assert room.empty
            assert room._age_read is None
        finally:
            await stop(calls)
            await backend.release(held, AttemptOutcome("cancelled"))
            for client in clients:
                await client.aclose()

    asyncio.run(scenario())


async def test_a_past_read_aged_exactly_to_the_window_still_answers() -> None:
    """A past read answers while its aged bound is at most the window: at exactly the window
    it is still the answer (``age > window`` is false either way), and nothing is read."""
    clock, timers, backend, room = await room_with_a_read_of_4s()
    await timers.advance(6.0)
    backend.progress_at = clock()  # a fresh read would say 0
    aged = ask(room, backend)
    await settle()
    await timers.advance(0.0)
    assert await aged == WINDOW_S
    assert backend.reads == 1


async def test_a_read_on_a_clock_ahead_is_not_aged_on_this_one_once_this_one_passes_it() -> None:
    """A read timed on a clock 5 s ahead, asked 10 s later on this clock: aged on this one it
    would say 7 s (fresh), but the scope has not served for 12 s: this call reads again."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    backend = AgeBackend(clock, timers, delay_s=0.0)
    room = WaitingRoom()
    await timers.advance(2.0)
    ahead = FakeClock(start=clock() + 5.0)
    first = asyncio.ensure_future(
        room.progress_age(cast(Any, backend), "chat", ahead, known_below=WINDOW_S)
    )
    await settle()
    await timers.advance(0.0)
    assert await first == 2.0
    await timers.advance(10.0)
    later = asyncio.ensure_future(
        room.progress_age(cast(Any, backend), "chat", clock, known_below=WINDOW_S)
    )
    await settle()
    await timers.advance(0.0)
    assert await later == 12.0
    assert backend.reads == 2
