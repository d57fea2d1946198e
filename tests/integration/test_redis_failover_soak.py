"""Soak: chat traffic that never stops while Sentinel fails the Redis primary over, again and again.

Runs under ``make soak`` only (``-m soak``). A primary, its replica and one
Sentinel (``SentinelSetup`` of ``_redis_topologies.py``, loopback ports, a
temporary directory) govern one chat scope of two sources on the simulator.
Two ``RedisBackend`` objects, each under its own ``ChatClient``, stand for two
processes of a fleet; their callers call without pause while the test plays
six failovers in turn: the primary killed (SIGKILL, connections reset) or
frozen (SIGSTOP, nothing answers), Sentinel promotes the replica, and the old
primary comes back as the new one's replica (restarted, or thawed and demoted
by Sentinel).

The backends run with ``redis_replica_acks = 1``: a grant counts only once
the replica holds it, so a promotion loses no lease and the upstream bound
below is exact by design, not by luck of a short replication lag
(research-wiki/guides/redis-fleet.md, "Replica lag"). Its price shows in the
figures: a promoted primary grants nothing until the old one has rejoined it
as a replica, so service comes back after the rejoin, not at the promotion.

What must hold, with bounds meant for a loaded two-core machine: no source
ever sees more than its ``max_concurrency`` at once; every call is served or
fails with a ``GatewayUnavailableError`` (fail closed during the gap), and no
call that failed reached the upstream; after each promotion calls are served
again within a bound; and once traffic stops the scope holds no permit,
although leases would hold theirs for ten minutes: the releases that failed
in the gaps were written again on the new primaries.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import redis
from _leases import LEASES_ONLY
from _redis_topologies import Process, SentinelSetup
from _traffic import Traffic

from polygateway.backends.redis import RedisBackend, codec
from polygateway.chat import ChatClient
from polygateway.errors import (
    AllSourcesExhausted,
    GatewayUnavailableError,
    GovernanceBackendError,
)
from polygateway.simulator import FaultProfile, SimulatedUpstream
from polygateway.testing import gateway_settings

SCOPE = "chat"
PERMITS = {"a": 3, "b": 2}
LATENCY_S = 0.05
PROCESSES = 2
CALLERS_PER_PROCESS = 6
SOCKET_TIMEOUT_S = 1.0
TIMEOUT_S = 5.0
LEASE_GRACE_S = 600.0
"""A lease would hold its permit for ten minutes: only a written release frees it in time."""
CLIENT_NAME = "pgw-soak-"
"""The backends' connections are named, so the servers' CLIENT LIST shows where they are."""
REQUEUE_S = 0.05
"""A caller that failed closed requeues its work this much later, as callers should."""
CYCLES = ("kill", "freeze", "kill", "kill", "freeze", "kill")
STEADY_S = 10.0
"""Traffic on a settled topology before each fault and after the last one."""

DEADLINE_S = 20.0
"""Each call's ``deadline_s``: a call waiting in a gap may wait as long as the stall rule
allows otherwise (research-wiki/ARCHITECTURE.md §5); past it, it ends with
``AllSourcesExhausted("deadline")``."""
CALL_BOUND_S = DEADLINE_S + 3 * SOCKET_TIMEOUT_S
"""No call may outlast its deadline by more (a hung call fails the soak, it does not stall it)."""
FAILOVER_BOUND_S = 45.0
"""Fault to Sentinel naming the new primary: down-after 2 s plus an election, on a loaded box."""
SERVED_BOUND_S = 45.0
"""Promotion to the first call served. It includes the old primary's rejoin as a replica:
Sentinel notices a thawed primary within its 10 s INFO period, and a full sync waits Redis's
default ``repl-diskless-sync-delay`` of 5 s."""
STEADY_SERVED = 0.9
"""Share of the calls of a steady phase that must be served (fail-closed ones are typed)."""
DRAIN_BOUND_S = 15.0
"""Traffic stopped to no permit held: retried releases back off to one socket timeout."""
SOAK_BOUND_S = 420.0
"""The whole soak, setup excepted; about two minutes when nothing goes wrong."""


@dataclass
class Cycle:
    """One failover as measured: seconds from the fault, and the calls that ended meanwhile."""

    fault: str
    promoted_s: float
    rejoined_s: float
    served_s: float
    ended: Counter[str]
    fault_wall: float = 0.0
    """``time.time()`` at the fault: the servers' clock, which lease expiries are scored in."""
    stray: int = 0
    """Backend connections found on the old primary 1.5 s after its thaw (frozen cycles)."""
    failovers: int = 1
    """Failovers Sentinel made for this fault (its config epoch's steps): one, or state was lost."""
    steady: Counter[str] = field(default_factory=Counter)


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedUpstream]:
    profile = FaultProfile(latency_s=LATENCY_S)
    async with SimulatedUpstream(dict.fromkeys(PERMITS, profile)) as upstream:
        yield upstream


@pytest.fixture
async def backends(sentinel_setup: SentinelSetup) -> AsyncIterator[list[RedisBackend]]:
    """One backend per process of the fleet, each following the Sentinel on its own."""
    made = [
        RedisBackend(
            f"redis:///0?client_name={CLIENT_NAME}{n}",
            mode="sentinel",
            sentinels=sentinel_setup.sentinels,
            sentinel_master=SentinelSetup.MASTER,
            socket_timeout_s=SOCKET_TIMEOUT_S,
            replica_acks=1,
        )
        for n in range(PROCESSES)
    ]
    try:
        yield made
    finally:
        for backend in made:
            await backend.aclose()


@pytest.fixture
async def clients(
    sim: SimulatedUpstream, backends: list[RedisBackend]
) -> AsyncIterator[list[ChatClient]]:
    settings = gateway_settings(
        *(
            {
                "name": name,
                "base_url": sim.base_url(name),
                "max_concurrency": n,
                "timeout_s": TIMEOUT_S,
            }
            for name, n in PERMITS.items()
        ),
        scope=SCOPE,
        redis_socket_timeout_s=SOCKET_TIMEOUT_S,
        redis_replica_acks=1,
        poll_interval_s=0.05,
        lease_grace_s=LEASE_GRACE_S,
    )
    made = [ChatClient(settings, SCOPE, backend=backend) for backend in backends]
    try:
        yield made
    finally:
        for chat in made:
            await chat.aclose()


def node_at(setup: SentinelSetup, port: int) -> Process:
    return setup.primary if setup.primary.port == port else setup.replica


def backend_connections(node: Process) -> int:
    """How many command connections of the soak's backends ``node`` holds now.

    Wake-up subscriptions are left out: on a replica they still hear the
    primary's ``PUBLISH`` (replicated), so staying there is harmless.
    """
    with node.client() as client:
        return sum(
            str(c.get("name", "")).startswith(CLIENT_NAME) and str(c.get("sub", "0")) == "0"
            for c in client.client_list()
        )


def held_leases(setup: SentinelSetup) -> list[tuple[str, float]]:
    """Leases the primary still holds: (source, ``time.time()`` of the grant)."""
    ttl_s = LEASE_GRACE_S + TIMEOUT_S
    with node_at(setup, setup.primary_port()).client() as client:
        return [
            (name, expiry - ttl_s)
            for name in PERMITS
            for _, expiry in client.zrangebyscore(
                codec.key(SCOPE, "leases", name), *LEASES_ONLY, withscores=True
            )
        ]


def acknowledging(primary: Process) -> bool:
    """Whether a replica acknowledges the primary's writes (what a grant waits for)."""
    with primary.client() as client:
        client.set("soak-check", 1)
        acknowledged = client.execute_command("WAIT", 1, 100) == 1
        client.delete("soak-check")
        return bool(acknowledged)


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float) -> bool:
    """Wait (really) for a condition, polling."""
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def wait_until_acknowledging(primary: Process, within_s: float) -> None:
    """Wait until the old primary, back as a replica, acknowledges: grants need it (acks = 1)."""

    async def check() -> bool:
        try:
            return await asyncio.to_thread(acknowledging, primary)
        except redis.RedisError:
            return False

    assert await eventually(check, within_s), f"no replica acknowledges {primary.address}"


async def fail_over(setup: SentinelSetup, traffic: Traffic, fault: str) -> Cycle:
    """Kill or freeze the primary, wait for the promotion and the old one's rejoin, and service."""
    old_port = setup.primary_port()
    old = node_at(setup, old_port)
    epoch = await asyncio.to_thread(setup.config_epoch)
    fault_at, fault_wall = time.monotonic(), time.time()
    if fault == "kill":
        await asyncio.to_thread(old.kill)
    else:
        old.pause()
    try:
        new = await asyncio.to_thread(setup.wait_for_failover, old_port, FAILOVER_BOUND_S)
        promoted_at = time.monotonic()
    finally:
        old.resume()  # thawed, it is demoted by Sentinel; killed, this does nothing
    stray = 0
    if fault == "kill":
        old.args = ("--replicaof", "127.0.0.1", str(new.port))
        await asyncio.to_thread(old.start)
    else:
        await asyncio.sleep(1.5)
        stray = await asyncio.to_thread(backend_connections, old)
    await wait_until_acknowledging(new, SERVED_BOUND_S - (time.monotonic() - promoted_at))
    rejoined_at = time.monotonic()
    # One failover per fault. A second one would have promoted the old primary (a killed
    # one restarted with the data of its previous life, or a thawed one) over the state
    # the fleet wrote meanwhile: failovers = config epoch steps (_redis_topologies.py,
    # SentinelSetup.DOWN_AFTER_MS, for why Sentinel once did so a second after the first).
    failovers = await asyncio.to_thread(setup.config_epoch) - epoch
    assert failovers == 1, f"{fault}: Sentinel made {failovers} failovers"
    assert await asyncio.to_thread(setup.primary_port) == new.port

    async def served() -> bool:
        return traffic.first_ok(started_after=fault_at) is not None

    within_s = SERVED_BOUND_S - (time.monotonic() - promoted_at)
    if not await eventually(served, within_s):
        held = [
            (name, round(granted - fault_wall, 2))
            for name, granted in await asyncio.to_thread(held_leases, setup)
        ]
        raise AssertionError(
            f"{fault}: no call served {SERVED_BOUND_S:g} s after the promotion;"
            f" leases held on the primary (source, granted s after the fault): {held}"
        )
    first = traffic.first_ok(started_after=fault_at)
    assert first is not None
    return Cycle(
        fault=fault,
        promoted_s=promoted_at - fault_at,
        rejoined_s=rejoined_at - fault_at,
        served_s=first.ended - fault_at,
        ended=traffic.between(fault_at, first.ended),
        fault_wall=fault_wall,
        stray=stray,
        failovers=failovers,
    )


def report(
    cycles: list[Cycle],
    before: Counter[str],
    traffic: Traffic,
    sim: SimulatedUpstream,
    rewritten: int,
    drain_s: float | None,
) -> str:
    """The figures of the run, for a reader to check against the assertions."""
    lines = [
        "",
        "failover soak: seconds from the fault to promoted / rejoined / served; calls meanwhile",
        f"  steady {STEADY_S:g} s before the first fault: {dict(before)}",
    ]
    for n, c in enumerate(cycles, 1):
        failed = sum(c.ended.values()) - c.ended["ok"]
        lines.append(
            f"  {n} {c.fault:<6} {c.promoted_s:6.2f} / {c.rejoined_s:6.2f} / {c.served_s:6.2f}"
            f"   ok {c.ended['ok']:3d}  failed {failed:4d}"
            f"   then steady {STEADY_S:g} s: {dict(c.steady)}"
            + (
                f"   backend connections on the thawed primary: {c.stray}"
                if c.fault == "freeze"
                else ""
            )
        )
    lines.append(f"  calls: {dict(Counter(o.kind for o in traffic.outcomes))}")
    for name, permits in PERMITS.items():
        stats = sim.stats(name)
        lines.append(
            f"  source {name}: {stats.requests} requests, max concurrent "
            f"{stats.max_concurrent} of {permits}"
        )
    lines.append(f"  releases that failed in a gap and were written again: {rewritten}")
    drained = "not reached" if drain_s is None else f"{drain_s:.2f} s after the last call ended"
    lines.append(f"  in_flight 0: {drained}")
    return "\n".join(lines)


def rewritten_releases(caplog: pytest.LogCaptureFixture) -> int:
    """Releases the backends said they would write again (each is said once)."""
    return sum("written again" in r.getMessage() for r in caplog.records)


@pytest.mark.soak
@pytest.mark.timeout(SOAK_BOUND_S + 120)
async def test_failovers_under_traffic_fail_closed_serve_again_and_lose_no_permit(
    sentinel_setup: SentinelSetup,
    sim: SimulatedUpstream,
    backends: list[RedisBackend],
    clients: list[ChatClient],
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Six failovers (four kills, two freezes) under nonstop traffic from two processes:
    limits hold, failures are typed, service returns in bounds, no permit is lost."""
    caplog.set_level(logging.WARNING, logger="polygateway.backends.redis")
    traffic = Traffic(
        clients,
        CALLERS_PER_PROCESS,
        REQUEUE_S,
        fails_closed=(GatewayUnavailableError,),  # any other error fails the soak
        call_bound_s=CALL_BOUND_S,
        options={"deadline_s": DEADLINE_S},
    )
    cycles: list[Cycle] = []
    before: Counter[str] = Counter()
    drain_s: float | None = None
    try:
        async with asyncio.timeout(SOAK_BOUND_S):
            running = asyncio.create_task(traffic.run())
            try:
                # The replica counts from its first acknowledgement (one a second): until
                # then every grant is given back and calls fail closed.
                started = time.monotonic()

                async def serving() -> bool:
                    return traffic.first_ok(started_after=started) is not None

                assert await eventually(serving, SERVED_BOUND_S), "the fleet never served"
                steady_from = time.monotonic()
                await asyncio.sleep(STEADY_S)
                before = traffic.between(steady_from, time.monotonic())
                for fault in CYCLES:
                    cycle = await fail_over(sentinel_setup, traffic, fault)
                    steady_from = time.monotonic()
                    await asyncio.sleep(STEADY_S)
                    cycle.steady = traffic.between(steady_from, time.monotonic())
                    cycles.append(cycle)
            finally:
                traffic.stop.set()
                await running
            ended_at = max(o.ended for o in traffic.outcomes)

            async def drained() -> bool:
                try:
                    return (await backends[0].snapshot(SCOPE)).in_flight == 0
                except GatewayUnavailableError:
                    return False

            if await eventually(drained, DRAIN_BOUND_S):
                drain_s = time.monotonic() - ended_at
    finally:
        with capsys.disabled():
            print(report(cycles, before, traffic, sim, rewritten_releases(caplog), drain_s))

    # No permit lost: every lease would hold its permit ten minutes, yet none is held.
    snapshot = await backends[1].snapshot(SCOPE)
    held = [
        (name, [round(granted - c.fault_wall, 2) for c in cycles])
        for name, granted in await asyncio.to_thread(held_leases, sentinel_setup)
    ]
    assert drain_s is not None, ("held: (source, granted s after each fault)", held, snapshot)
    assert snapshot.in_flight == 0, snapshot
    # Every call is served or fails closed with a typed error: nothing else escapes a call.
    kinds = Counter(o.kind for o in traffic.outcomes)
    assert set(kinds) - {"ok"} <= {GovernanceBackendError.__name__, AllSourcesExhausted.__name__}
    # Never more at a source than its permits, across every failover.
    for name, permits in PERMITS.items():
        assert sim.stats(name).max_concurrent <= permits, sim.stats(name)
    # The upstream saw the served calls and nothing else: no call that failed went upstream.
    assert sum(sim.stats(name).requests for name in PERMITS) == kinds["ok"], kinds
    # Each gap was a real one: calls failed closed in it, and releases were written again.
    for cycle in cycles:
        assert sum(cycle.ended.values()) > cycle.ended["ok"], cycle
    assert rewritten_releases(caplog) > 0
    # Between the faults the fleet served (a loaded machine may fail a few calls closed).
    for steady in (before, *(cycle.steady for cycle in cycles)):
        assert steady["ok"] >= STEADY_SERVED * sum(steady.values()) > 0, steady
    # No command connection stays on a thawed primary Sentinel replaced (a connection still
    # being made at +switch-master is discarded, not kept once the server answers).
    assert all(cycle.stray == 0 for cycle in cycles), [c.stray for c in cycles]
