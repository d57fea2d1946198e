"""A fleet of OS processes sharing one governance budget through a real Redis.

Each fleet member is ``bench/fleet_worker.py`` in its own process, with its own
``ChatClient`` built from settings naming ``backend = "redis"``; the
simulated upstream runs in the test's event loop on 127.0.0.1 and records
every request it sees. What one process does to the shared state (a 429, a
tripped breaker, a permit it dies holding) must show in every other process;
what the simulator sees must stay inside the limits whatever the number of
processes; and a Redis that goes away must fail calls closed, never let one
through ungoverned.

Times are compared across processes on ``time.monotonic()``, one system-wide
clock on Linux (CLOCK_MONOTONIC): the simulator's arrival times, the
workers' call records and the test's own marks are on it.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from polygateway.backends.base import ScopeSnapshot
from polygateway.backends.redis import RedisBackend
from polygateway.simulator import FaultProfile, SimulatedUpstream

# The fleet member lives with the fleet benchmark (bench/ is not an installed package).
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.fleet_worker import ANSWER_TIMEOUT_S, Json, Worker

SCOPE = "fleet"
API_KEY = "sk-fleet-Secret-0123456789"
PASSWORD = "fleet-redis-Pa55word"
FAST = FaultProfile(latency_s=0.02, latency_jitter_s=0.005)


Spawn = Callable[..., Awaitable[list[Worker]]]


@pytest.fixture
async def spawn(tmp_path: Path) -> AsyncIterator[Spawn]:
    """Start ``n`` workers on one settings dict, all stopped (or killed) after the test."""
    started: list[Worker] = []

    async def spawn_(n: int, settings: Json) -> list[Worker]:
        config = {"settings": settings, "scope": SCOPE}
        workers = await asyncio.gather(*(Worker.start(config, tmp_path) for _ in range(n)))
        started.extend(workers)
        return list(workers)

    yield spawn_
    await asyncio.gather(*(w.stop() for w in started))
    for worker in started:
        # Nothing any worker printed may carry the API key or the Redis password.
        assert API_KEY not in worker.output
        assert PASSWORD not in worker.output


@pytest.fixture
def fleet_redis(make_redis_server: Callable[..., Any]) -> Any:
    """A dedicated password-protected redis-server the test may stop, freeze and restart."""
    return make_redis_server(password=PASSWORD)


def source(sim: SimulatedUpstream, name: str, **fields: Any) -> Json:
    """A chat source on the simulator, as settings take it (the key given in code)."""
    return {
        "name": name,
        "protocol": "openai",
        "base_url": sim.base_url(name),
        "model": "sim",
        "api_key": API_KEY,
        **fields,
    }


def fleet_settings(url: str, sources: Sequence[Json], **gateway: Any) -> Json:
    """Settings of one chat scope on Redis at ``url``, as every worker builds them."""
    return {
        "backend": "redis",
        "redis_url": url,
        "poll_interval_s": 0.2,
        "backoff_base_s": 0.05,
        "backoff_cap_s": 0.2,
        **gateway,
        "scopes": {SCOPE: {"kind": "chat", "sources": list(sources)}},
    }


async def snapshot(url: str) -> ScopeSnapshot:
    """The scope's shared state as the test process itself reads it from Redis."""
    backend = RedisBackend(url)
    try:
        return await backend.snapshot(SCOPE)
    finally:
        await backend.aclose()


def arrivals_between(sim: SimulatedUpstream, name: str, start: float, end: float) -> int:
    """Requests the simulator saw at ``name`` in ``[start, end]`` (monotonic seconds)."""
    return sum(start <= t <= end for t in sim.stats(name).arrivals)


def served_by(records: Sequence[Json]) -> set[str]:
    """The sources that served these calls; every call must have been served."""
    assert all(r["ok"] for r in records), [r for r in records if not r["ok"]]
    return {r["source"] for r in records}


# --- one budget for the whole fleet ---------------------------------------------------------

RPM = 1200
BURST = RPM / 60  # rpm_burst's default: one second's worth
CONCURRENCY = 8
PROCESSES = 4
CALLERS_PER_PROCESS = 8


@pytest.mark.parametrize(
    "duration_s",
    [
        pytest.param(20.0, id="20s"),
        pytest.param(120.0, id="2min", marks=[pytest.mark.soak, pytest.mark.timeout(400)]),
    ],
)
async def test_four_processes_share_one_concurrency_and_rpm_budget(
    duration_s: float, fleet_redis: Any, spawn: Spawn
) -> None:
    """Four processes, one scope: never over 8 in flight, never over the rpm bucket, >= 90% used."""
    # No server-side limit: the only limits are ours; 20-50 ms lets 8 permits carry 20 req/s.
    profile = FaultProfile(latency_s=0.035, latency_jitter_s=0.015)
    async with SimulatedUpstream({"a": profile}) as sim:
        spec = source(sim, "a", max_concurrency=CONCURRENCY, rpm=RPM)
        workers = await spawn(PROCESSES, fleet_settings(fleet_redis.url, [spec]))
        # One call each first (connections open, lazy paths taken), then a second for the
        # bucket to refill: whatever came before, it holds at most BURST tokens at start_at.
        for warm in await asyncio.gather(
            *(w.records("calls", n=1, concurrency=1) for w in workers)
        ):
            assert served_by(warm) == {"a"}
        await asyncio.sleep(1.0)
        sim.reset_stats()
        # A common start a little ahead, so the four processes begin together; no call
        # (hence no admission) of the run starts before it.
        start_at = time.monotonic() + 0.5
        runs = await asyncio.gather(
            *(
                w.records(
                    "run",
                    start_at=start_at,
                    duration_s=duration_s,
                    concurrency=CALLERS_PER_PROCESS,
                )
                for w in workers
            )
        )
        stats = sim.stats("a")

    records = [r for run in runs for r in run]
    assert served_by(records) == {"a"}
    assert all(len(r["attempts"]) == 1 for r in records)
    assert stats.requests == len(records), "every request the server saw is a governed call"
    assert stats.max_concurrent <= CONCURRENCY
    # Token bucket: by any moment t, at most rpm/60 * (t - start_at) + burst admissions,
    # and a request reaches the server only after its admission.
    arrivals = sorted(stats.arrivals)
    assert arrivals[0] >= start_at
    over = [
        (i + 1, round(t - start_at, 3))
        for i, t in enumerate(arrivals)
        if i + 1 > RPM / 60 * (t - start_at) + BURST
    ]
    assert not over, f"arrivals over the rpm bucket (count, seconds after start): {over[:10]}"
    admitted = sum(t <= start_at + duration_s for t in arrivals)
    floor = 0.9 * RPM / 60 * duration_s
    assert admitted >= floor, f"only {admitted} admissions in {duration_s} s (want >= {floor})"
    # Every process took part in the shared budget.
    assert all(sum(r["ok"] for r in run) > 0 for run in runs)


# --- state one process writes, every process reads ------------------------------------------


async def test_a_429_seen_by_one_process_paces_the_source_for_all(
    fleet_redis: Any, spawn: Spawn
) -> None:
    """Process A's 429 with Retry-After paces the source fleet-wide: B goes elsewhere, then back."""
    retry_after_s = 4.0
    throttled = FaultProfile(latency_s=0.02, rate_429=1.0, retry_after_s=retry_after_s)
    async with SimulatedUpstream({"a": throttled, "b": FAST}) as sim:
        sources = [source(sim, "a", priority=0), source(sim, "b", priority=1)]
        a, b = await spawn(2, fleet_settings(fleet_redis.url, sources))

        first = await a.records("calls", n=1, concurrency=1)
        paced_at = time.monotonic()
        assert served_by(first) == {"b"}
        assert first[0]["attempts"] == [["a", "rate_limited"], ["b", "success"]]
        # From now on "a" would serve: only the pacer keeps anyone away from it.
        sim.set_profile("a", FAST)

        snap = (await snapshot(fleet_redis.url)).source("a")
        assert snap is not None
        assert snap.paced_for_s is not None
        assert 0 < snap.paced_for_s <= retry_after_s
        seen_by_b = await b.ask("acquire", source="a")
        assert seen_by_b["reason"] == "paced"
        assert 0 < seen_by_b["reopen_in_s"] <= retry_after_s
        during = await b.records("calls", n=6, concurrency=2)
        assert time.monotonic() < paced_at + retry_after_s, "the pace must outlast B's calls"
        assert served_by(during) == {"b"}
        assert all(r["attempts"] == [["b", "success"]] for r in during)
        assert sim.stats("a").requests == 1

        await asyncio.sleep(max(0.0, paced_at + retry_after_s + 0.2 - time.monotonic()))
        after = await b.records("calls", n=2, concurrency=1)
        assert served_by(after) == {"a"}


async def test_a_permanent_429_sees_one_probe_per_hint_across_the_fleet(
    fleet_redis: Any, spawn: Spawn
) -> None:
    """Four processes, 10 calls each, 10 s against a 429-forever source: at most 6 requests."""
    limited = FaultProfile(latency_s=0.01, rate_429=1.0, retry_after_s=2.0)
    async with SimulatedUpstream({"a": limited}) as sim:
        settings = fleet_settings(fleet_redis.url, [source(sim, "a")], poll_interval_s=0.5)
        workers = await spawn(PROCESSES, settings)
        # The first 429 teaches the fleet the hint.
        taught = await workers[0].records("calls", n=1, concurrency=1, deadline_s=0.3)
        assert taught[0]["reason"] == "deadline"
        runs = await asyncio.gather(
            *(w.records("calls", n=10, concurrency=10, deadline_s=10.0) for w in workers)
        )
        stats = sim.stats("a")
    records = [r for run in runs for r in run]
    assert all(r["reason"] == "deadline" for r in records)
    # The teaching 429, then one probe per 2 s pause, fleet-wide: 6 at the very most.
    assert stats.requests <= 6
    assert stats.max_in_window(1.9) == 1


async def test_a_breaker_tripped_by_one_process_is_open_for_all(
    fleet_redis: Any, spawn: Spawn
) -> None:
    """Process A's failures open the breaker of a source; B is refused it and served elsewhere."""
    failing = FaultProfile(latency_s=0.01, rate_5xx=1.0, statuses_5xx=(503,))
    async with SimulatedUpstream({"bad": failing, "good": FAST}) as sim:
        sources = [source(sim, "bad", priority=0), source(sim, "good", priority=1)]
        settings = fleet_settings(
            fleet_redis.url, sources, breaker_failures=3, breaker_cooldown_s=30.0
        )
        a, b = await spawn(2, settings)

        tripping = await a.records("calls", n=3, concurrency=1)
        assert served_by(tripping) == {"good"}
        assert all(r["attempts"][0] == ["bad", "transient"] for r in tripping)

        snap = (await snapshot(fleet_redis.url)).source("bad")
        assert snap is not None
        assert (snap.breaker, snap.trips) == ("open", 1)
        assert snap.reopen_in_s is not None
        assert 25.0 < snap.reopen_in_s <= 30.0
        seen_by_b = await b.ask("acquire", source="bad")
        assert seen_by_b["reason"] == "breaker_open"
        assert 25.0 < seen_by_b["reopen_in_s"] <= 30.0
        after = await b.records("calls", n=6, concurrency=2)
        assert all(r["attempts"] == [["good", "success"]] for r in after)
        assert sim.stats("bad").requests == 3


# --- a member dies holding permits -----------------------------------------------------------


async def test_permits_of_a_killed_process_return_within_the_lease_time(
    fleet_redis: Any, spawn: Spawn
) -> None:
    """``kill -9`` of a process holding every permit: they return at lease expiry, B carries on."""
    timeout_s, grace_s = 1.0, 1.0
    lease_s = timeout_s + grace_s
    slow = FaultProfile(latency_s=0.8)  # answers inside timeout_s: only the kill ends A's calls
    async with SimulatedUpstream({"a": slow}) as sim:
        spec = source(sim, "a", max_concurrency=4, timeout_s=timeout_s)
        settings = fleet_settings(fleet_redis.url, [spec], lease_grace_s=grace_s)
        a, b = await spawn(2, settings)

        asked = time.monotonic()
        a.send("calls", n=4, concurrency=4)
        async with asyncio.timeout(10.0):
            while sim.stats("a").current_concurrent < 4:
                await asyncio.sleep(0.005)
        a.kill()
        killed = time.monotonic()
        await a.process.wait()
        held = (await snapshot(fleet_redis.url)).source("a")
        assert held is not None
        assert held.in_flight == 4, "the dead process's leases still hold the permits"

        sim.set_profile("a", FAST)
        survivor = await b.records("calls", n=8, concurrency=4)
        assert served_by(survivor) == {"a"}
        b_arrivals = sorted(t for t in sim.stats("a").arrivals if t > killed)
        assert len(b_arrivals) == 8
        # Not before the leases, granted after `asked`, expired; soon after they did.
        assert b_arrivals[0] >= asked + lease_s
        # + one poll, + scheduling: 1 s, since beside a full suite on two cores B's first
        # call was seen 0.8 s past the leases' expiry (0.02-0.2 s on a quiet machine); a
        # lease kept past its TTL (2 s here) would be seen later still.
        assert b_arrivals[0] <= killed + lease_s + 0.2 + 1.0
        assert sim.stats("a").max_concurrent <= 4
        final = (await snapshot(fleet_redis.url)).source("a")
        assert final is not None
        assert final.in_flight == 0


# --- Redis goes away --------------------------------------------------------------------------


async def test_calls_fail_closed_while_redis_is_down_and_serve_again_after(
    fleet_redis: Any, spawn: Spawn
) -> None:
    """Redis stopped, then frozen: calls fail with GovernanceBackendError in time, none goes out.

    Leases are long here (20 s), as in production, so a permit left held by the
    outage (an acquire the frozen server ran after its caller gave up) would
    show: the calls after the outage would wait for it, and the final snapshot
    would count it.
    """
    socket_timeout_s = 0.3
    poll_s = 0.2  # fleet_settings' poll_interval_s
    slack_s = 0.3
    phase_s = 1.5
    async with SimulatedUpstream({"a": FAST}) as sim:
        spec = source(sim, "a", max_concurrency=2, timeout_s=10.0)
        settings = fleet_settings(
            fleet_redis.url, [spec], redis_socket_timeout_s=socket_timeout_s, lease_grace_s=10.0
        )
        (worker,) = await spawn(1, settings)

        running = worker.send("run", duration_s=6 * phase_s, concurrency=4)
        marks: dict[str, float] = {"end": math.inf}
        await asyncio.sleep(phase_s)
        marks["stopping"] = time.monotonic()
        await asyncio.to_thread(fleet_redis.stop)
        marks["stopped"] = time.monotonic()
        await asyncio.sleep(phase_s)
        marks["starting"] = time.monotonic()
        await asyncio.to_thread(fleet_redis.start)
        marks["started"] = time.monotonic()
        await asyncio.sleep(phase_s)
        marks["pausing"] = time.monotonic()
        fleet_redis.pause()
        await asyncio.sleep(phase_s)
        marks["resuming"] = time.monotonic()
        fleet_redis.resume()
        async with asyncio.timeout(ANSWER_TIMEOUT_S):
            answer = await running
        records: list[Json] = answer["records"]
        final = (await snapshot(fleet_redis.url)).source("a")

    def inside(start: float, end: float) -> list[Json]:
        return [r for r in records if start <= r["started"] and r["ended"] <= end]

    for down, up in (("stopped", "starting"), ("pausing", "resuming")):
        failed = inside(marks[down], marks[up])
        assert len(failed) >= 2, (down, records)
        assert all(r["error"] == "GovernanceBackendError" for r in failed), failed
        # Nothing reached the upstream while nothing governed it.
        assert arrivals_between(sim, "a", marks[down] + 0.1, marks[up]) == 0
    # No hang. Each ask of Redis fails within the socket timeout. Only the head of the
    # process's waiting room asks (at once when promoted, or at its next poll while the
    # permits are held); when its ask fails, every call queued behind it fails closed
    # with it, so no failure comes later than a poll plus one socket timeout after the
    # call started or after the failure before it, whichever is later.
    failures = sorted((r for r in records if not r["ok"]), key=lambda r: r["ended"])
    for previous, r in itertools.pairwise([{"ended": -math.inf}, *failures]):
        waited = r["ended"] - max(r["started"], previous["ended"])
        assert waited <= poll_s + socket_timeout_s + slack_s, (r, previous)
    # A call that waited through an outage instead is served as soon as Redis is back.
    for down, up in (("stopping", "started"), ("pausing", "resuming")):
        served = [r for r in records if r["ok"] and marks[down] <= r["started"] <= marks[up]]
        assert all(r["ended"] <= marks[up] + slack_s for r in served), served
    # The same client serves again once Redis is back, at once, without a restart.
    for back, until in (("started", "pausing"), ("resuming", "end")):
        later = inside(marks[back] + 0.05, marks[until])
        assert len(later) >= 4, (back, records)
        assert all(r["ok"] for r in later), [r for r in later if not r["ok"]]
        assert all(r["ended"] - r["started"] < slack_s for r in later), later
    # Nothing the outage left behind holds a permit.
    assert final is not None
    assert final.in_flight == 0
