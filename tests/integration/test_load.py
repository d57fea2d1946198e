"""Load: ten thousand chat calls at once against one scope of fifty permits, over real sockets.

The upstream is the simulator in a child process (``sim_process``), so the
gateway has this process's core to itself and the server counts what really
reached it. The faults are 5% of all requests: 5xx, 429 (a short
Retry-After), resets in the middle of the body, malformed JSON and 200s whose
body is an error. Hangs are left to ``test_faults_e2e``: a hung request the
client has given up on is still "in service" at the server until the server
notices the closed socket, which a server-side concurrency count would
charge to the permit that was already, correctly, handed on.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import pytest
from sim_process import SimProcess

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings
from polygateway.errors import AllSourcesExhausted, GatewayError
from polygateway.middleware.waiting import room_for
from polygateway.models import ChatResponse
from polygateway.simulator import FaultProfile, SimulatedUpstream
from polygateway.testing import gateway_settings

CALLS = 10_000
PERMITS = 50
# Mean upstream latency: long enough that fifty requests really overlap at the server.
LATENCY_S = 0.01
LOAD_PROFILE = {
    "latency_s": LATENCY_S,
    "latency_jitter_s": LATENCY_S / 2,
    "rate_5xx": 0.02,
    "rate_429": 0.01,
    "retry_after_s": 0.02,
    "rate_reset": 0.01,
    "rate_malformed": 0.005,
    "rate_error_body": 0.005,
}
# Hard bound of one load run; it takes ~26 s with httpx and ~9 s with aiohttp on two cores.
RUN_BOUND_S = 150.0
SETTLE_BOUND_S = 5.0


def open_sockets() -> int:
    """Sockets this process holds, counted from /proc/self/fd (psutil is not a dependency)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                count += 1
        except OSError:
            continue  # the fd closed between listing and reading (e.g. listdir's own)
    return count


def other_tasks() -> int:
    """Tasks alive in the loop besides the test's own."""
    return len(asyncio.all_tasks() - {asyncio.current_task()})


async def eventually(check: Callable[[], bool], within_s: float = SETTLE_BOUND_S) -> bool:
    """Wait (really) for a condition that needs a few loop turns or a peer's reaction."""
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


@pytest.fixture
async def upstream() -> AsyncIterator[SimProcess]:
    """The simulator with one source ``a`` playing 5% faults, in its own process."""
    async with SimProcess({"a": LOAD_PROFILE}, seed=7) as sim:
        yield sim


def load_settings(base_url: str, transport: str) -> GatewaySettings:
    """One chat scope, one source of fifty permits; back-off short so retries do not dominate."""
    return gateway_settings(
        {"name": "a", "base_url": base_url, "max_concurrency": PERMITS, "timeout_s": 10},
        transport=transport,
        max_attempts=3,
        backoff_base_s=0.005,
        backoff_cap_s=0.05,
        poll_interval_s=0.02,
        breaker_cooldown_s=1.0,
    )


async def run_load(upstream: SimProcess, transport: str, calls: int, bound_s: float) -> None:
    """Drive ``calls`` concurrent calls and check every promise of the load issue."""
    tasks_before, sockets_before = other_tasks(), open_sockets()
    backend = MemoryBackend()
    settings = load_settings(upstream.base_url("a"), transport)
    chat = ChatClient.from_settings(settings, "chat", backend=backend)

    async def one(i: int) -> ChatResponse:
        return await chat.complete([{"role": "user", "content": f"call {i}"}], max_tokens=4)

    try:
        started = time.monotonic()
        async with asyncio.timeout(bound_s):
            results = await asyncio.gather(*(one(i) for i in range(calls)), return_exceptions=True)
        elapsed = time.monotonic() - started

        # Every call ended, served or with a typed error, and nothing else.
        kinds = Counter(type(r).__name__ for r in results)
        served = [r for r in results if isinstance(r, ChatResponse)]
        failed = [r for r in results if isinstance(r, BaseException)]
        assert len(served) + len(failed) == calls, kinds
        assert all(isinstance(e, GatewayError) for e in failed), kinds
        # Three attempts against 5% faults: a failed call is one in thousands, and says why.
        assert len(served) >= calls * 0.99, kinds
        assert all(isinstance(e, AllSourcesExhausted) for e in failed), kinds
        assert {e.reason for e in failed if isinstance(e, AllSourcesExhausted)} <= {
            "retry_exhausted"
        }

        # The server never saw more than the scope's permits at once. It did see real overlap:
        # the first calls of the burst ask the backend together (up to the loop's bound of
        # concurrent acquires, MAX_ASKING) and hold permits while their
        # requests are in flight; 16 is well below either bound and far above no overlap.
        stats = await upstream.stats("a")
        assert stats["max_concurrent"] <= PERMITS, stats
        assert stats["max_concurrent"] >= 16, stats
        assert stats["requests"] >= calls, stats
        faults = sum(v for k, v in stats["by_outcome"].items() if k != "ok")
        assert faults >= stats["requests"] * 0.03, stats  # the faults were really played

        # Afterwards the backend holds no permit and nobody is left in the waiting room.
        snapshot = await backend.snapshot("chat")
        assert snapshot.in_flight == 0, snapshot
        assert len(room_for(backend, "chat")) == 0
    finally:
        # Closed even when an assertion failed: an open client would leak its pool.
        await chat.aclose()
    # Closing the client left no task and no socket behind.
    assert await eventually(lambda: other_tasks() <= tasks_before), asyncio.all_tasks()
    assert await eventually(lambda: open_sockets() <= sockets_before), (
        open_sockets(),
        sockets_before,
    )
    assert elapsed < bound_s


@pytest.mark.timeout(RUN_BOUND_S + 30)
@pytest.mark.parametrize("transport", ["httpx", "aiohttp"])
async def test_ten_thousand_calls_all_end_within_fifty_permits_and_leak_nothing(
    upstream: SimProcess, transport: str
) -> None:
    """10,000 concurrent calls, 5% faults: each ends typed, <= 50 at the server, no leak after."""
    await run_load(upstream, transport, CALLS, RUN_BOUND_S)


@pytest.mark.soak
@pytest.mark.timeout(1800)
async def test_hundred_thousand_calls_all_end_within_fifty_permits(upstream: SimProcess) -> None:
    """Soak: 100,000 calls through the default transport keep every promise of the load test."""
    await run_load(upstream, "httpx", 10 * CALLS, 1500.0)


async def test_waiters_reach_the_upstream_in_submission_order() -> None:
    """With one permit, calls submitted while it is held reach the upstream in submission order."""
    waiters = 25
    profile = FaultProfile(latency_s=0.02)
    async with SimulatedUpstream({"a": profile}) as sim:
        settings = gateway_settings(
            {"name": "a", "base_url": sim.base_url("a"), "max_concurrency": 1, "timeout_s": 10},
            poll_interval_s=5.0,  # no poll can promote anyone: only the FIFO hands the permit on
        )
        async with ChatClient.from_settings(settings, "chat", backend=MemoryBackend()) as chat:
            first = asyncio.create_task(chat.complete([{"role": "user", "content": "first"}]))
            assert await eventually(lambda: sim.stats("a").current_concurrent == 1)
            tasks = []
            for i in range(waiters):
                tasks.append(
                    asyncio.create_task(chat.complete([{"role": "user", "content": f"{i}"}]))
                )
                # Let call i reach the waiting room before call i + 1 is even created.
                for _ in range(5):
                    await asyncio.sleep(0)
            assert len(room_for(chat.backend, "chat")) == waiters
            async with asyncio.timeout(30):
                served = await asyncio.gather(first, *tasks)
    # The simulator numbers requests in arrival order: the id of answer i carries its rank.
    ranks = [int(r.raw["id"].rsplit("-", 1)[1]) for r in served]
    assert ranks == list(range(1, waiters + 2))
    assert sim.stats("a").max_concurrent == 1
