"""Cancellation storm: half of 2,000 in-flight calls cancelled at random moments, on both backends.

Calls are plain completions and streams, over real sockets to the simulator
in its own process, through one scope of fifty permits. A seeded plan dooms
half of them, each to be cancelled at a random moment of one phase: while
it waits for a permit, while its request is on the wire, or between two
chunks of its stream (the real transport is wrapped only to learn when a
request starts, when a chunk arrives and how many requests are in flight).
The moments are counted in requests sent, not in seconds, so the storm hits
the same phases however fast the machine serves. Afterwards no permit is
held (in memory or in Redis, long before any lease could expire), nobody is
left in the waiting room, every call that was not cancelled completed, and
no more than fifty requests were ever in flight at once.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

import pytest
from sim_process import SimProcess

from polygateway.backends.base import Backend
from polygateway.backends.memory import MemoryBackend
from polygateway.backends.redis import RedisBackend
from polygateway.chat import ChatClient
from polygateway.middleware.waiting import room_for
from polygateway.models import ChatResponse
from polygateway.testing import (
    CountingBackend,
    FakeTransport,
    Recorder,
    chat_completion,
    gateway_settings,
    settle,
)
from polygateway.transport.factory import make_transport
from polygateway.transport.http import HttpRequest, Transport

CALLS = 2_000
PERMITS = 50
CANCEL_SHARE = 0.5
LATENCY_S = 0.01
# Long leases: a permit freed by expiry rather than by the cancelled call would be seen as held.
LEASE_GRACE_S = 60.0
RUN_BOUND_S = 90.0
SETTLE_BOUND_S = 5.0
STREAM_CHUNKS = 8
PROFILE = {
    "latency_s": LATENCY_S,
    "latency_jitter_s": LATENCY_S / 2,
    "ttft_s": 0.005,
    "stream_chunks": STREAM_CHUNKS,
    "chunk_interval_s": 0.005,
}

Phase = Literal["waiting", "attempt", "stream"]


class Saboteur:
    """The real transport, plus the doomed calls' cancellations at their planned moments.

    An attempt runs in its caller's task, so the task seen here is the call
    to cancel: a request starting arms an ``attempt`` cancellation a random
    fraction of the upstream latency later; the k-th chunk of a stream
    triggers a ``stream`` cancellation before the next one is read. A
    ``waiting`` call is cancelled when request number ``k`` starts, a ``k``
    chosen well before its turn in the queue could come. Requests in flight
    are counted from the start of ``send`` (or the opening of a stream) to
    its end: the concurrency the scope's permits bound.
    """

    def __init__(self, inner: Transport, rng: random.Random) -> None:
        self.inner = inner
        self.rng = rng
        self.plan: dict[asyncio.Task[Any], Phase] = {}
        self.waiting: dict[int, list[asyncio.Task[Any]]] = {}
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0

    def _start(self) -> None:
        """Count a request going out and fire the ``waiting`` cancellations due at it."""
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        for task in self.waiting.pop(self.requests, ()):
            asyncio.get_running_loop().call_soon(task.cancel)

    def _doomed(self, phase: Phase) -> asyncio.Task[Any] | None:
        task = asyncio.current_task()
        if task is None or self.plan.get(task) != phase:
            return None
        del self.plan[task]  # one cancellation per call
        return task

    async def send(self, request: HttpRequest) -> Any:
        self._start()
        try:
            task = self._doomed("attempt")
            if task is not None:
                delay = self.rng.uniform(0.0, LATENCY_S)
                asyncio.get_running_loop().call_later(delay, task.cancel)
            return await self.inner.send(request)
        finally:
            self.in_flight -= 1

    @asynccontextmanager
    async def stream(self, request: HttpRequest) -> AsyncIterator[AsyncIterator[Any]]:
        self._start()
        try:
            task = self._doomed("stream")
            after = self.rng.randint(3, STREAM_CHUNKS) if task is not None else None
            async with self.inner.stream(request) as events:
                yield _Chunks(events, task, after)
        finally:
            self.in_flight -= 1

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Chunks:
    """A stream's events; cancels its doomed caller right after event number ``after``."""

    def __init__(
        self, events: AsyncIterator[Any], task: asyncio.Task[Any] | None, after: int | None
    ) -> None:
        self.events = aiter(events)
        self.task = task
        self.after = after
        self.seen = 0

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> Any:
        event = await anext(self.events)
        self.seen += 1
        if self.task is not None and self.seen == self.after:
            # Lands at the caller's next await: between this chunk and the next.
            asyncio.get_running_loop().call_soon(self.task.cancel)
        return event


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """Each backend on its real clock (Redis: the server's TIME)."""
    built: Backend
    if request.param == "redis":
        built = RedisBackend(request.getfixturevalue("redis_url"), socket_timeout_s=5.0)
    else:
        built = MemoryBackend()
    try:
        yield built
    finally:
        await built.aclose()


@pytest.fixture
async def upstream() -> AsyncIterator[SimProcess]:
    """A healthy simulated source ``a`` with some latency, in its own process."""
    async with SimProcess({"a": PROFILE}, seed=11) as sim:
        yield sim


async def eventually(
    check: Callable[[], Awaitable[bool]], within_s: float = SETTLE_BOUND_S
) -> bool:
    """Wait (really) for background work a cancelled call left behind to finish."""
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest.mark.timeout(RUN_BOUND_S + 30)
async def test_cancelling_half_of_two_thousand_calls_leaks_no_permit(
    backend: Backend, upstream: SimProcess
) -> None:
    """1,000 of 2,000 calls cancelled at random moments: zero permits after, the rest complete."""
    settings = gateway_settings(
        {
            "name": "a",
            "base_url": upstream.base_url("a"),
            "max_concurrency": PERMITS,
            "timeout_s": 10,
        },
        lease_grace_s=LEASE_GRACE_S,
        poll_interval_s=0.05,
    )
    rng = random.Random(2024)
    scope = settings.scope("chat")
    saboteur = Saboteur(make_transport("httpx", scope.sources, max_connections=PERMITS), rng)
    recorder = Recorder()
    chat = ChatClient(settings, "chat", backend=backend, transport=saboteur, emitter=recorder)
    chunks_seen: dict[int, int] = {}

    async def complete(i: int) -> Any:
        return await chat.complete([{"role": "user", "content": f"call {i}"}], max_tokens=8)

    async def stream(i: int) -> Any:
        chunks_seen[i] = 0
        finishes = []
        async with chat.stream([{"role": "user", "content": f"call {i}"}], max_tokens=8) as s:
            async for chunk in s:
                chunks_seen[i] += 1
                if chunk.finish_reason:
                    finishes.append(chunk.finish_reason)
        return finishes

    async def no_permit_held() -> bool:
        return (await backend.snapshot("chat")).in_flight == 0

    async def upstream_idle() -> bool:
        return int((await upstream.stats("a"))["current_concurrent"]) == 0

    try:
        tasks = [
            asyncio.create_task(stream(i) if i % 2 else complete(i), name=f"call-{i}")
            for i in range(CALLS)
        ]
        doomed = rng.sample(range(CALLS), int(CALLS * CANCEL_SHARE))
        phases: dict[int, Phase] = {}
        for i in doomed:
            phase: Phase = rng.choice(
                ["waiting", "attempt", "stream"] if i % 2 else ["waiting", "attempt"]
            )
            phases[i] = phase
            if phase == "waiting":
                # Call i's turn needs about i admissions less the cancelled calls queued ahead
                # of it (a fifth of i at most), and each admission sends one request.
                at = rng.randint(1, max(1, i // 2))
                saboteur.waiting.setdefault(at, []).append(tasks[i])
            else:
                saboteur.plan[tasks[i]] = phase

        async with asyncio.timeout(RUN_BOUND_S):
            await asyncio.wait(tasks)

        cancelled = [i for i, t in enumerate(tasks) if t.cancelled()]
        # A cancellation passes through as CancelledError: none was swallowed or converted.
        assert set(cancelled) <= set(doomed)
        assert len(cancelled) >= len(doomed) * 0.8, "the storm should hit calls still in flight"
        # Every call that was not cancelled completed: a whole answer, plain or streamed.
        for i, task in enumerate(tasks):
            if task.cancelled():
                continue
            result = task.result()
            if i % 2:
                assert result == ["stop"], (i, result)
            else:
                assert isinstance(result, ChatResponse)
                assert result.finish_reason == "stop"

        # The storm hit every phase: waiting, on the wire, between two chunks of a stream.
        by_phase = {p: sum(1 for i in cancelled if phases[i] == p) for p in ("waiting", "attempt")}
        mid_stream = [i for i in cancelled if phases[i] == "stream"]
        assert not saboteur.waiting, "every planned waiting cancellation fired"
        waiting_planned = sum(1 for p in phases.values() if p == "waiting")
        assert by_phase["waiting"] == waiting_planned >= 200, by_phase
        assert by_phase["attempt"] >= 100, by_phase
        assert len(mid_stream) >= 100
        # Each was cut after some chunks had reached its caller (the first event only announces).
        assert all(chunks_seen[i] >= 1 for i in mid_stream), [chunks_seen[i] for i in mid_stream]
        # Telemetry saw every attempt, whatever instant its call was cancelled at (even while
        # the attempt's permit was being released): one record per request sent.
        assert len(recorder.records) == saboteur.requests
        in_attempt = sum(1 for r in recorder.records if r.outcome == "cancelled")
        assert in_attempt >= 200

        # No permit is held: released by the cancelled calls themselves, not by lease expiry.
        assert await eventually(no_permit_held), await backend.snapshot("chat")
        assert len(room_for(backend, "chat")) == 0

        assert await eventually(upstream_idle)
        # The permits bounded the requests in flight, and the storm kept the scope (nearly) full.
        # (Not the upstream's own count: it goes on with an abandoned request until its handler
        # ends, while the permit is rightly back in use as soon as the socket is closed.)
        assert PERMITS * 0.8 <= saboteur.max_in_flight <= PERMITS, saboteur.max_in_flight

        # The scope still serves after the storm.
        answer = await chat.complete([{"role": "user", "content": "after the storm"}])
        assert answer.finish_reason == "stop"
    finally:
        # Even when an assertion failed: a client left open leaks its pooled connections.
        await chat.aclose()
    assert await eventually(no_permit_held)


async def test_a_call_cancelled_while_its_permit_is_released_still_emits_its_record() -> None:
    """Cancelled during the release of its served attempt: the attempt's record is not lost."""
    backend = CountingBackend(MemoryBackend())
    backend.hold_release = asyncio.Event()
    recorder = Recorder()
    transport = FakeTransport(default=chat_completion("hi"))
    chat = ChatClient(
        gateway_settings("a"), "chat", backend=backend, transport=transport, emitter=recorder
    )
    async with chat:
        call = asyncio.create_task(chat.complete([{"role": "user", "content": "hi"}]))
        await settle()
        assert len(transport.requests) == 1  # served, now held in its release
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        backend.hold_release.set()
        await settle()
    assert [(r.source, r.outcome) for r in recorder.records] == [("a", "success")]
    assert (await backend.snapshot("chat")).in_flight == 0
