"""The Redis backend on a real 3-master Cluster: commands sent again, and a backend reused.

A command that follows ``ASK`` to a node whose scripts were flushed is
loaded and sent again there, behind ``ASKING``; a backend used again after
its ``aclose`` reads the slot map again, as a new one does; a cluster none
of whose nodes answers fails every call with the backend's typed error.
"""

from __future__ import annotations

import asyncio

import pytest
from _redis_topologies import Cluster, Process, end_and_give_back, slot_of

from _ports import free_port
from polygateway.backends.base import AcquireResult, AttemptOutcome, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.backends.redis.cluster import Cluster as RedisCluster
from polygateway.errors import GovernanceBackendError

SUCCESS = AttemptOutcome("success")
SPEC = SourceSpec(name="a", max_concurrency=4)
BOUND_S = 10.0


def evalsha_stats(node: Process) -> tuple[int, int]:
    """EVALSHA commands ``node`` ran, and refused before running (``MOVED``, ``ASK``), so far
    (``INFO commandstats``)."""
    with node.client() as client:
        stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("rejected_calls", 0))


def noscripts(node: Process) -> int:
    """``NOSCRIPT`` errors ``node`` answered so far (``INFO errorstats``)."""
    with node.client() as client:
        return int(client.info("errorstats").get("errorstat_NOSCRIPT", {}).get("count", 0))


async def move_keys_to_flushed(
    cluster: Cluster, slot: int, source: Process, target: Process
) -> None:
    """Every key of the migrating ``slot`` moved to ``target``, whose scripts are then flushed."""
    while await asyncio.to_thread(cluster.move_keys, slot, source, target):
        pass
    with target.client() as client:
        client.script_flush()


async def test_a_script_after_ask_to_a_flushed_node_is_loaded_and_run_there(
    cluster: Cluster, cluster_backend: RedisBackend
) -> None:
    """The scope's keys moved, the importing node's scripts flushed: PROGRESS is sent on
    ``ASK``, answered NOSCRIPT, then loaded and run on that node behind ``ASKING``, never
    bounced back to the migrating node by a ``MOVED`` (which answers ``ASK`` again).

    PROGRESS names one key: the importing node runs it behind ``ASKING``. A script naming
    several keys, some not made yet, gets ``TRYAGAIN`` there instead, and ACQUIRE never
    follows ``ASK`` (``cluster.py``), so neither reaches a flushed importing node.
    """
    scopes = cluster.scopes_per_node()
    (scope,), (on_the_target,) = scopes[0], scopes[2]
    await cluster_backend.progress_age_s(on_the_target)  # connected there: its scripts loaded
    got = await cluster_backend.acquire(scope, [SPEC], ttl_s=30)
    assert got.lease is not None
    await cluster_backend.release(got.lease, SUCCESS)
    assert await cluster_backend.progress_age_s(scope) < 60
    slot, source, target = slot_of(scope), cluster.nodes[0], cluster.nodes[2]
    await asyncio.to_thread(cluster.begin_migration, slot, source, target)
    try:
        await move_keys_to_flushed(cluster, slot, source, target)
        on_source = await asyncio.to_thread(evalsha_stats, source)
        on_target = await asyncio.to_thread(evalsha_stats, target)
        flushed = await asyncio.to_thread(noscripts, target)
        async with asyncio.timeout(BOUND_S):
            assert await cluster_backend.progress_age_s(scope) < 60
        assert await asyncio.to_thread(noscripts, target) == flushed + 1
        ran, refused = await asyncio.to_thread(evalsha_stats, target)
        assert ran == on_target[0] + 2  # answered NOSCRIPT, then run
        assert refused == on_target[1]  # before: one MOVED, back to the migrating node
        assert (await asyncio.to_thread(evalsha_stats, source))[1] == on_source[1] + 1  # one ASK
    finally:
        await end_and_give_back(cluster, slot, source, target)


async def test_an_acquire_during_a_migration_to_a_flushed_node_runs_there_once_moved(
    cluster: Cluster, cluster_backend: RedisBackend
) -> None:
    """The scope's keys moved to a node whose scripts were flushed, its slot still migrating:
    ACQUIRE, which makes keys, never follows ``ASK`` there; once the slot moved it follows
    ``MOVED``, is answered NOSCRIPT, loaded, and granted on the new owner."""
    scopes = cluster.scopes_per_node()
    (scope,), (on_the_target,) = scopes[0], scopes[2]
    await cluster_backend.progress_age_s(on_the_target)  # connected there: its scripts loaded
    held = await cluster_backend.acquire(scope, [SPEC], ttl_s=30)
    assert held.lease is not None
    slot, source, target = slot_of(scope), cluster.nodes[0], cluster.nodes[2]
    acquiring: asyncio.Future[AcquireResult] | None = None
    await asyncio.to_thread(cluster.begin_migration, slot, source, target)
    try:
        await move_keys_to_flushed(cluster, slot, source, target)
        flushed = await asyncio.to_thread(noscripts, target)
        ran = (await asyncio.to_thread(evalsha_stats, target))[0]
        asked = (await asyncio.to_thread(evalsha_stats, source))[1]
        acquiring = asyncio.ensure_future(cluster_backend.acquire(scope, [SPEC], ttl_s=30))
        async with asyncio.timeout(BOUND_S):
            while (await asyncio.to_thread(evalsha_stats, source))[1] < asked + 3:
                await asyncio.sleep(0.01)  # ASK, taken as TRYAGAIN: sent again to the source
        assert not acquiring.done()
        assert (await asyncio.to_thread(evalsha_stats, target))[0] == ran  # never behind ASKING
        await asyncio.to_thread(cluster.end_migration, slot, target)
        async with asyncio.timeout(BOUND_S):
            got = await acquiring
        assert got.lease is not None
        assert await asyncio.to_thread(noscripts, target) == flushed + 1
        assert (await cluster_backend.snapshot(scope)).sources[0].in_flight == 2
    finally:
        await end_and_give_back(cluster, slot, source, target, acquiring)


async def test_a_cluster_backend_used_again_after_aclose_reads_the_slot_map(
    cluster: Cluster, cluster_backend: RedisBackend
) -> None:
    """Closed before its first use, then used: the map of every node is read, not only the
    one slot a ``MOVED`` named."""
    await cluster_backend.aclose()
    for (scope,) in cluster.scopes_per_node().values():
        await cluster_backend.snapshot(scope)
    topology = cluster_backend._wire
    assert isinstance(topology, RedisCluster)
    async with asyncio.timeout(BOUND_S):
        while None in topology._owners:  # before: only the two slots MOVED named
            await asyncio.sleep(0.01)
    assert len(topology.nodes()) == len(cluster.nodes)


async def test_a_cluster_no_node_of_which_answers_fails_calls_typed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every node unreachable: each call fails closed with ``GovernanceBackendError``, and the
    map's reading, in the background, says so in the log without an exception escaping."""
    backend = RedisBackend(f"redis://127.0.0.1:{free_port()}", mode="cluster", socket_timeout_s=1.0)
    try:
        for _ in range(2):
            with pytest.raises(GovernanceBackendError, match="ConnectionError"):
                await backend.acquire("nowhere", [SPEC], ttl_s=30)
        async with asyncio.timeout(BOUND_S):
            while "cannot read the Redis Cluster's slot map" not in caplog.text:
                await asyncio.sleep(0.01)
    finally:
        await backend.aclose()


async def test_reading_the_map_passes_a_frozen_node_for_the_next(cluster: Cluster) -> None:
    """A node that owns slots stops answering: the map's reading waits one timeout for it,
    then reads the map from the next node, without an error escaping."""
    cluster.flush()
    backend = RedisBackend(cluster.seed_url, mode="cluster", socket_timeout_s=0.3)
    topology = backend._wire
    assert isinstance(topology, RedisCluster)
    frozen = cluster.nodes[1]
    try:
        for (scope,) in cluster.scopes_per_node().values():
            await backend.snapshot(scope)  # the map read, every node connected
        async with asyncio.timeout(BOUND_S):
            while len(topology.nodes()) < len(cluster.nodes):
                await asyncio.sleep(0.01)
        frozen.pause()
        reading = asyncio.ensure_future(topology._read_any())
        async with asyncio.timeout(1.5):  # below the cluster's node timeout (3 s)
            await reading
        frozen.resume()
        assert len(topology.nodes()) == len(cluster.nodes)
    finally:
        frozen.resume()
        await backend.aclose()
