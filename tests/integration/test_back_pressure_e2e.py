"""The upstream's back-pressure, end to end: real sockets to the simulator, both transports.

What real providers send when they push back (a 429 or 503 naming its
back-off, a window announced spent) must reach the governance: the source
paused for exactly the hinted time, fleet-wide, then reopened by one probe,
so that however many calls wait, a permanently limited source sees one
request per hinted interval, and a healthy source serves everybody
meanwhile. Arrival times are the simulator's, on ``time.monotonic()``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from polygateway.backends.memory import MemoryBackend
from polygateway.backends.redis import RedisBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings, ScopeConfig, SourceConfig
from polygateway.errors import AllSourcesExhausted
from polygateway.simulator import FaultProfile, SimulatedUpstream

HI = [{"role": "user", "content": "hello"}]
HEALTHY = FaultProfile()
LIMITED_FOREVER = FaultProfile(rate_429=1.0, retry_after_s=2.0)
"""A source at its quota for good: every answer a 429 with ``Retry-After: 2``."""
BOUND_S = 30.0
"""Bounds the tests' own waits, never a timing under test."""


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedUpstream]:
    """A simulator with no sources yet; each test adds its own."""
    async with SimulatedUpstream({}) as upstream:
        yield upstream


def _settings(
    sim: SimulatedUpstream, transport: str, *names: str, **gateway: Any
) -> GatewaySettings:
    """One chat scope over the named simulator sources, in that order of priority."""
    sources = [
        SourceConfig(
            name=name,
            protocol="openai",
            base_url=sim.base_url(name),
            model="sim",
            max_concurrency=16,
            timeout_s=5.0,
            ttft_timeout_s=1.0,
            priority=i,
        )
        for i, name in enumerate(names)
    ]
    fields: dict[str, Any] = {"transport": transport, "poll_interval_s": 0.5, **gateway}
    return GatewaySettings(
        _env_file=None,
        **fields,
        scopes={"chat": ScopeConfig(kind="chat", sources=sources)},
    )


def _client(settings: GatewaySettings, backend: MemoryBackend) -> ChatClient:
    return ChatClient.from_settings(settings, "chat", backend=backend)


async def _teach_the_hint(chat: ChatClient) -> None:
    """One call meets the first 429 (and learns ``Retry-After: 2``), then gives up quickly."""
    with pytest.raises(AllSourcesExhausted):
        await chat.complete(HI, max_tokens=4, deadline_s=0.3)


async def test_permanent_429_sees_one_request_per_hinted_interval(
    sim: SimulatedUpstream, transport: str
) -> None:
    """10 callers, 10 s, a source answering 429 with Retry-After 2 forever: at most 6 requests."""
    sim.set_profile("limited", LIMITED_FOREVER)
    backend = MemoryBackend()
    async with _client(_settings(sim, transport, "limited"), backend) as chat:
        await _teach_the_hint(chat)
        results = await asyncio.wait_for(
            asyncio.gather(
                *(chat.complete(HI, max_tokens=4, deadline_s=10.0) for _ in range(10)),
                return_exceptions=True,
            ),
            BOUND_S,
        )
    assert all(isinstance(r, AllSourcesExhausted) and r.reason == "deadline" for r in results)
    # The first call's 429, then one probe per 2 s pause over the 10 s: 6 at the very most.
    assert sim.stats("limited").requests <= 6
    assert sim.stats("limited").max_in_window(1.9) == 1


async def test_healthy_source_serves_every_call_while_the_other_is_paused(
    sim: SimulatedUpstream, transport: str
) -> None:
    """With a healthy second source, every call is served by it while the first is paused."""
    sim.set_profile("limited", LIMITED_FOREVER)
    sim.set_profile("healthy", FaultProfile(latency_s=0.05))
    backend = MemoryBackend()
    async with _client(_settings(sim, transport, "limited", "healthy"), backend) as chat:
        await chat.complete(HI, max_tokens=4)  # the first 429 teaches the hint
        started = time.monotonic()
        served = []
        while time.monotonic() - started < 6.0:
            batch = await asyncio.wait_for(
                asyncio.gather(*(chat.complete(HI, max_tokens=4) for _ in range(10))), BOUND_S
            )
            served.extend(r.source for r in batch)
    assert set(served) == {"healthy"}
    # One probe per 2 s pause reached the limited source, never the 10 callers each.
    assert sim.stats("limited").requests <= 1 + 6.0 / 2.0 + 1


async def _gap_after_a_hinted_429(sim: SimulatedUpstream, chat: ChatClient) -> float:
    """Seconds between a 429 with ``Retry-After: 2`` and the call's next request to that source.

    The source answers 429 once, then serves: the call's next attempt shows
    when the waiting call noticed the pause's end.
    """
    sim.set_profile("limited", FaultProfile(rate_429=1.0, retry_after_s=2.0))
    call = asyncio.create_task(chat.complete(HI, max_tokens=4, deadline_s=BOUND_S))
    async with asyncio.timeout(BOUND_S):
        while sim.stats("limited").requests < 1:
            await asyncio.sleep(0.01)
    sim.set_profile("limited", HEALTHY)
    response = await asyncio.wait_for(call, BOUND_S)
    assert response.source == "limited"
    first, second = sim.stats("limited").arrivals[:2]
    return second - first


@pytest.mark.parametrize("poll_interval_s", [0.05, 30.0])
async def test_wait_on_a_hinted_pause_resumes_when_it_ends(
    sim: SimulatedUpstream, transport: str, poll_interval_s: float
) -> None:
    """The next attempt goes out within 50 ms of the hint's end, whatever the poll interval."""
    sim.set_profile("limited", HEALTHY)
    settings = _settings(sim, transport, "limited", poll_interval_s=poll_interval_s)
    async with _client(settings, MemoryBackend()) as chat:
        gap = await _gap_after_a_hinted_429(sim, chat)
    assert 2.0 <= gap <= 2.05


async def test_wait_on_a_hinted_pause_resumes_within_a_poll_on_redis(
    sim: SimulatedUpstream, redis_url: str
) -> None:
    """On Redis, the fleet-wide pause's end is seen within one poll interval (here at once)."""
    sim.set_profile("limited", HEALTHY)
    backend = RedisBackend(redis_url)
    settings = _settings(sim, "httpx", "limited", poll_interval_s=0.2)
    try:
        async with ChatClient.from_settings(settings, "chat", backend=backend) as chat:
            gap = await _gap_after_a_hinted_429(sim, chat)
    finally:
        await backend.aclose()
    assert 2.0 <= gap <= 2.0 + 0.2


async def test_503_with_retry_after_pauses_the_source(
    sim: SimulatedUpstream, transport: str
) -> None:
    """A 503 naming its back-off pauses its source for that long, then one probe goes out."""
    sim.set_profile(
        "down",
        FaultProfile(rate_5xx=1.0, statuses_5xx=(503,), retry_after_s=5.0, retry_after_on_5xx=True),
    )
    sim.set_profile("healthy", HEALTHY)
    backend = MemoryBackend()
    settings = _settings(sim, transport, "down", "healthy")
    async with _client(settings, backend) as chat:
        started = time.monotonic()
        first = await chat.complete(HI, max_tokens=4)
        assert [a.source for a in first.attempts] == ["down", "healthy"]
        snap = (await backend.snapshot("chat")).source("down")
        elapsed = time.monotonic() - started
        assert snap is not None
        assert snap.paced_for_s is not None
        # Paused for the hint from the 503, less the time since (however loaded the machine).
        assert 5.0 - elapsed <= snap.paced_for_s <= 5.0
        for _ in range(5):
            assert (await chat.complete(HI, max_tokens=4)).attempts[0].source == "healthy"
    assert sim.stats("down").requests == 1


async def test_stalled_error_carries_the_latest_hint(
    sim: SimulatedUpstream, transport: str
) -> None:
    """After a 429 storm the stalled error says how long the upstream asked to wait."""
    sim.set_profile("limited", FaultProfile(rate_429=1.0, retry_after_s=1.0))
    backend = MemoryBackend()
    settings = _settings(sim, transport, "limited", stall_window_s=2.5)
    async with _client(settings, backend) as chat:
        with pytest.raises(AllSourcesExhausted) as caught:
            await asyncio.wait_for(chat.complete(HI, max_tokens=4), BOUND_S)
    assert caught.value.reason == "stalled"
    assert caught.value.retry_after_s is not None
    assert 0.0 < caught.value.retry_after_s <= 1.0


async def test_hint_longer_than_the_stall_window_is_clamped_and_logged(
    sim: SimulatedUpstream, transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A Retry-After of an hour pauses the source for the stall window only, and says so."""
    sim.set_profile("limited", FaultProfile(rate_429=1.0, retry_after_s=3600.0))
    sim.set_profile("healthy", HEALTHY)
    backend = MemoryBackend()
    settings = _settings(sim, transport, "limited", "healthy", stall_window_s=20.0)
    async with _client(settings, backend) as chat:
        with caplog.at_level("WARNING", logger="polygateway.retry"):
            await chat.complete(HI, max_tokens=4)
        snap = (await backend.snapshot("chat")).source("limited")
    assert snap is not None
    assert snap.paced_for_s is not None
    assert 19.0 < snap.paced_for_s <= 20.0
    assert any("3600" in r.getMessage() and "limited" in r.getMessage() for r in caplog.records)
