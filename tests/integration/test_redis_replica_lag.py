"""Replica lag and ``redis_replica_acks``: what a failover can over-admit, with and without WAIT.

A primary and a replica that replicates through a delay line (``DelayLine``
in ``_redis_topologies.py``, a relay that holds the primary's stream for a
chosen time), so the replica really is that far behind; a failover kills the
primary, drops the stream still held (it dies with its primary) and promotes
the replica by hand (``REPLICAOF NO ONE``), as Sentinel would. One more
test runs the opt-in behind a real Sentinel through a failover. The bound
under test is research-wiki/guides/redis-fleet.md's ("Replica lag").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
from _leases import LEASES_ONLY
from _redis_topologies import LaggingReplica, Process, SentinelSetup, running

from polygateway.backends.base import AcquireResult, AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend, codec
from polygateway.errors import ConfigError, GovernanceBackendError

SCOPE = "chat"
MAX = 4
SPEC = SourceSpec(name="a", max_concurrency=MAX)
SUCCESS = AttemptOutcome("success")
TIMEOUT_S = 1.0
ACK_TIMEOUT_S = 0.25
LAG_S = 2.0
"""How far behind the replica is during the burst (issue #18's scenario)."""
BEFORE = 2
"""Leases granted, and still in flight, while the replica keeps up."""
TTL_S = 600.0
"""Long enough that no lease expires during a test: every one counts as in flight."""


@pytest.fixture
def lagging(tmp_path: Path) -> Iterator[LaggingReplica]:
    """A primary and a replica behind a delay line, stopped after the test."""
    yield from running(LaggingReplica(tmp_path))


def url(process: Process) -> str:
    return f"redis://{process.address}/0"


@pytest.fixture
async def acked(lagging: LaggingReplica) -> AsyncIterator[RedisBackend]:
    """A backend on the primary whose grants one replica must acknowledge."""
    backend = RedisBackend(
        url(lagging.primary),
        socket_timeout_s=TIMEOUT_S,
        replica_acks=1,
        replica_ack_timeout_s=ACK_TIMEOUT_S,
    )
    try:
        yield backend
    finally:
        await backend.aclose()


def leases(result: list[AcquireResult | BaseException]) -> list[Lease]:
    return [r.lease for r in result if isinstance(r, AcquireResult) and r.lease is not None]


def lease_ids_on(client: redis.Redis) -> set[str]:
    members = client.zrangebyscore(codec.key(SCOPE, "leases", SPEC.name), *LEASES_ONLY)
    return {m.decode() for m in members}


async def burst(backend: RedisBackend, n: int = MAX) -> list[AcquireResult | BaseException]:
    return await asyncio.gather(
        *(backend.acquire(SCOPE, [SPEC], ttl_s=TTL_S) for _ in range(n)), return_exceptions=True
    )


@pytest.mark.parametrize("acks", [1, 0], ids=["with-acks", "without-acks"])
async def test_a_failover_with_lag_over_admits_at_most_the_unreplicated_grants(
    lagging: LaggingReplica, acks: int
) -> None:
    """Replica 2 s behind, a burst in the gap, failover: with WAIT the upstream never sees more
    than max_concurrency; without, the excess is > 0 and at most the grants not replicated."""
    old = RedisBackend(
        url(lagging.primary),
        socket_timeout_s=TIMEOUT_S,
        replica_acks=acks,
        replica_ack_timeout_s=ACK_TIMEOUT_S,
    )
    try:
        held = leases(await burst(old, BEFORE))
        assert len(held) == BEFORE
        if not acks:
            lagging.caught_up()  # with acks, each grant's WAIT has proved it already
        lagging.line.lag(LAG_S)  # type: ignore[union-attr]
        in_gap = await burst(old)
        lagging.fail_over()  # well inside the 2 s: the stream held is lost with the primary
    finally:
        await old.aclose()
    granted_in_gap = leases(in_gap)
    with lagging.replica.client() as client:
        known = lease_ids_on(client)
    held += granted_in_gap
    unreplicated = [lease for lease in held if lease.lease_id not in known]

    # The promoted primary has no replica of its own here: with acks its grants would fail
    # closed until one attaches, so it admits without them, the worst case.
    new = RedisBackend(url(lagging.replica), socket_timeout_s=TIMEOUT_S)
    try:
        after = leases(await burst(new))
    finally:
        await new.aclose()
    in_flight = len(held) + len(after)
    excess = in_flight - MAX
    if acks:
        # Each grant, unacknowledged within the timeout, was given back and failed closed;
        # the acquires behind them found the source full meanwhile.
        assert granted_in_gap == []
        assert any(isinstance(r, GovernanceBackendError) for r in in_gap), in_gap
        assert unreplicated == []
        assert in_flight == MAX
    else:
        assert len(granted_in_gap) == MAX - BEFORE
        assert [lease.lease_id for lease in unreplicated] == [
            lease.lease_id for lease in granted_in_gap
        ]
        # The documented bound: the grants of the unreplicated window still in flight, so at
        # most max_concurrency more (2 x max_concurrency in all).
        assert 0 < excess <= len(unreplicated) <= MAX


async def test_acknowledged_grants_cost_one_wait_each_in_the_same_round_trip(
    lagging: LaggingReplica, acked: RedisBackend
) -> None:
    """With a replica keeping up, every grant is acknowledged: one WAIT per ACQUIRE run (the
    burst's first call alone, the two that arrived meanwhile in one run), none per release
    (the first written at once, the two behind it in one run), and the promoted replica
    would know each lease."""
    with lagging.primary.client() as client:
        client.config_resetstat()
    result = await burst(acked, 3)
    granted = leases(result)
    assert len(granted) == 3
    for lease in granted:
        await acked.release(lease, SUCCESS)
    await acked.acquire(SCOPE, [SPEC], ttl_s=TTL_S)
    with lagging.primary.client() as client:
        stats = client.info("commandstats")
    assert stats["cmdstat_wait"]["calls"] == 3
    assert stats["cmdstat_evalsha"]["calls"] == 5


async def test_without_acks_no_wait_is_ever_sent(lagging: LaggingReplica) -> None:
    """The default sends exactly what it sent before the opt-in existed: no WAIT."""
    backend = RedisBackend(url(lagging.primary), socket_timeout_s=TIMEOUT_S)
    try:
        with lagging.primary.client() as client:
            client.config_resetstat()
        for lease in leases(await burst(backend, 2)):
            await backend.release(lease, SUCCESS)
        await backend.snapshot(SCOPE)
    finally:
        await backend.aclose()
    with lagging.primary.client() as client:
        stats = client.info("commandstats")
    assert "cmdstat_wait" not in stats


async def test_a_flushed_script_is_acknowledged_after_it_runs(
    lagging: LaggingReplica, acked: RedisBackend
) -> None:
    """After SCRIPT FLUSH the acquire runs again behind its WAIT: a second WAIT covers it."""
    lease = (await acked.acquire(SCOPE, [SPEC], ttl_s=TTL_S)).lease
    assert lease is not None
    with lagging.primary.client() as client:
        client.script_flush()
        client.config_resetstat()
    got = await acked.acquire(SCOPE, [SPEC], ttl_s=TTL_S)
    assert got.lease is not None
    with lagging.primary.client() as client:
        assert client.info("commandstats")["cmdstat_wait"]["calls"] == 2
    lagging.caught_up()
    with lagging.replica.client() as client:
        assert got.lease.lease_id in lease_ids_on(client)


async def test_a_grant_no_replica_acknowledges_is_given_back(redis_url: str) -> None:
    """A server without replicas: the grant is released and the acquire fails closed."""
    backend = RedisBackend(
        redis_url, socket_timeout_s=TIMEOUT_S, replica_acks=1, replica_ack_timeout_s=0.05
    )
    try:
        with pytest.raises(GovernanceBackendError, match="acknowledged by 0 of 1 replicas"):
            await backend.acquire(SCOPE, [SPEC], ttl_s=TTL_S)
        snap = await backend.snapshot(SCOPE)
        assert snap.sources[0].in_flight == 0
    finally:
        await backend.aclose()


async def test_a_refusal_ignores_its_wait(redis_url: str) -> None:
    """A full source refuses as usual with acks on: the WAIT's answer does not matter."""
    plain = RedisBackend(redis_url, socket_timeout_s=TIMEOUT_S)
    backend = RedisBackend(
        redis_url, socket_timeout_s=TIMEOUT_S, replica_acks=1, replica_ack_timeout_s=0.05
    )
    try:
        one = SourceSpec(name="a", max_concurrency=1)
        assert (await plain.acquire(SCOPE, [one], ttl_s=TTL_S)).lease is not None
        refused = await backend.acquire(SCOPE, [one], ttl_s=TTL_S)
        assert refused.lease is None
        assert [r.reason for r in refused.rejections] == ["concurrency"]
    finally:
        await backend.aclose()
        await plain.aclose()


async def test_a_cancelled_acknowledged_acquire_gives_its_grant_back(redis_url: str) -> None:
    """Cancelled while its WAIT is pending: the grant, when it comes, is released."""
    backend = RedisBackend(
        redis_url, socket_timeout_s=TIMEOUT_S, replica_acks=1, replica_ack_timeout_s=0.3
    )
    try:
        task = asyncio.create_task(backend.acquire(SCOPE, [SPEC], ttl_s=TTL_S))
        await asyncio.sleep(0.05)  # edge: the script ran, the WAIT holds the reply
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.5)  # edge: the WAIT times out on the server; the grant comes back
        snap = await backend.snapshot(SCOPE)
        assert snap.sources[0].in_flight == 0
    finally:
        await backend.aclose()


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"replica_acks": -1}, "redis_replica_acks"),
        ({"replica_acks": 1, "mode": "cluster"}, "redis_replica_acks"),
        ({"replica_acks": 1, "replica_ack_timeout_s": 1.0}, "redis_replica_ack_timeout_s"),
    ],
)
def test_an_unusable_opt_in_is_refused_by_the_backend(
    values: dict[str, object], field: str
) -> None:
    """The same rule as the settings': a ConfigError naming the key."""
    with pytest.raises(ConfigError) as info:
        RedisBackend("redis://127.0.0.1:1/0", socket_timeout_s=1.0, **values)  # type: ignore[arg-type]
    assert info.value.field == field


async def test_behind_sentinel_acks_fail_closed_until_the_new_primary_has_a_replica(
    tmp_path: Path,
) -> None:
    """Sentinel mode: grants acknowledged on the primary; after a failover the new primary has
    no replica, so acquires fail closed, until the old primary comes back as its replica."""
    setup = SentinelSetup(tmp_path)
    backend = RedisBackend(
        "redis:///0",
        mode="sentinel",
        sentinels=setup.sentinels,
        sentinel_master=SentinelSetup.MASTER,
        socket_timeout_s=TIMEOUT_S,
        replica_acks=1,
        replica_ack_timeout_s=ACK_TIMEOUT_S,
    )
    try:
        setup.start()
        with setup.replica.client() as client:  # the rejoining node syncs at once
            client.config_set("repl-diskless-sync-delay", 0)
        lease = await acquire_within(backend, 10.0)
        await backend.release(lease, SUCCESS)
        old_port = setup.primary.port
        setup.primary.kill()
        new_primary = await asyncio.to_thread(setup.wait_for_failover, old_port)
        await unacknowledged_within(backend, 10.0)  # the new primary grants; nobody acknowledges
        # Back as the new primary's replica (what Sentinel does too, at its own slower pace).
        setup.primary.args = ("--replicaof", "127.0.0.1", str(new_primary.port))
        setup.primary.start()
        lease = await acquire_within(backend, 10.0)
        await backend.release(lease, SUCCESS)
    finally:
        await backend.aclose()
        setup.stop()


async def acquire_within(backend: RedisBackend, bound_s: float) -> Lease:
    """Acquire, retrying while the backend fails closed, within ``bound_s``."""
    deadline = asyncio.get_running_loop().time() + bound_s
    while True:
        try:
            got = await backend.acquire(SCOPE, [SPEC], ttl_s=TTL_S)
        except GovernanceBackendError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)  # edge: a real failover's pace
            continue
        assert got.lease is not None, got.rejections
        return got.lease


async def unacknowledged_within(backend: RedisBackend, bound_s: float) -> None:
    """Acquire until a grant fails for want of an acknowledgement (failover errors retried)."""
    deadline = asyncio.get_running_loop().time() + bound_s
    while True:
        try:
            got = await backend.acquire(SCOPE, [SPEC], ttl_s=TTL_S)
        except GovernanceBackendError as exc:
            if "acknowledged by 0 of 1" in str(exc):
                return
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)  # edge: a real failover's pace
            continue
        raise AssertionError(f"granted with no replica to acknowledge it: {got}")
