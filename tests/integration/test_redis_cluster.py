"""The Redis backend on a real 3-master Redis Cluster (``redis_mode = "cluster"``).

The cluster is started once for the module (three ``redis-server
--cluster-enabled yes`` on free loopback ports, ``redis-cli --cluster
create``) and stopped at its end; each test empties it first. A resharding
moves a scope's slot while calls run, as ``redis-cli --cluster reshard``
does (``CLUSTER SETSLOT`` IMPORTING / MIGRATING, ``MIGRATE``, ``SETSLOT NODE``).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from _redis_topologies import Cluster, Process, end_and_give_back, slot_of

from polygateway.backends.base import AcquireResult, AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.config import GatewaySettings
from polygateway.errors import ConfigError, GovernanceBackendError

SUCCESS = AttemptOutcome("success")
SPEC = SourceSpec(name="a", max_concurrency=4)
SIX = [SourceSpec(name=f"s{i}", max_concurrency=1) for i in range(6)]
"""A scope of six sources of one permit each, offered in this order."""


def evalsha_calls(cluster: Cluster) -> list[int]:
    """EVALSHA commands each node has run so far (``INFO commandstats``)."""
    counts = []
    for node in cluster.nodes:
        with node.client() as client:
            stats = client.info("commandstats").get("cmdstat_evalsha", {"calls": 0})
            counts.append(int(stats["calls"]))
    return counts


def evalsha_refusals(node: Process) -> tuple[int, int]:
    """EVALSHA commands ``node`` redirected (``ASK``, ``TRYAGAIN``, ...) without running
    them, and those whose script stopped with an error, so far (``INFO commandstats``)."""
    with node.client() as client:
        stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("rejected_calls", 0)), int(stats.get("failed_calls", 0))


def evalsha_bounces(node: Process) -> int:
    """EVALSHA commands ``node`` sent back so far, redirected or stopped by an error."""
    return sum(evalsha_refusals(node))


def keys_in_slot(node: Process, slot: int) -> set[str]:
    """The keys ``node`` stores in ``slot`` (``CLUSTER GETKEYSINSLOT``)."""
    with node.client() as client:
        keys = client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    return {key.decode() for key in keys}


async def bounced_while_pending(
    acquiring: asyncio.Future[AcquireResult], node: Process, times: int
) -> None:
    """Wait (3 s at most) until ``node`` has bounced ``times`` more EVALSHAs, or the call ended."""
    start = await asyncio.to_thread(evalsha_bounces, node)
    deadline = asyncio.get_running_loop().time() + 3.0
    while not acquiring.done():
        if await asyncio.to_thread(evalsha_bounces, node) >= start + times:
            return
        assert asyncio.get_running_loop().time() < deadline, "the call was never bounced"
        await asyncio.sleep(0.01)


async def hold_the_first_two(backend: RedisBackend, scope: str) -> list[Lease]:
    """s0 and s1 of ``SIX`` held: s0 is marked full in the scope's verdicts, s1 is not (its
    refusal is for the next call to find), s2 to s5 were never seen."""
    leases = []
    for expected in ("s0", "s1"):
        got = await backend.acquire(scope, SIX, ttl_s=30)
        assert got.lease is not None
        assert got.lease.source == expected
        leases.append(got.lease)
    return leases


async def test_each_scope_lives_on_the_node_owning_its_slot(
    cluster: Cluster, cluster_backend: RedisBackend
) -> None:
    """A scope per master: each is served, and its keys are on its own node, none elsewhere."""
    for index, (scope,) in cluster.scopes_per_node().items():
        got = await cluster_backend.acquire(scope, [SPEC], ttl_s=30)
        assert got.lease is not None
        await cluster_backend.release(got.lease, SUCCESS)
        assert (await cluster_backend.snapshot(scope)).progress_age_s < 60
        for other, node in enumerate(cluster.nodes):
            with node.client() as client:
                stored = client.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot_of(scope))
                assert (stored > 0) == (other == index)


async def test_a_call_costs_two_round_trips_on_its_own_node(
    cluster: Cluster, cluster_backend: RedisBackend
) -> None:
    """Once the slot map is known, acquire and release are two EVALSHAs on the owner only."""
    scopes = cluster.scopes_per_node()
    for (scope,) in scopes.values():  # the first use may be redirected: the map is learnt
        got = await cluster_backend.acquire(scope, [SPEC], ttl_s=30)
        assert got.lease is not None
        await cluster_backend.release(got.lease, SUCCESS)
    await cluster_backend._wire.drain()
    before = evalsha_calls(cluster)
    index, (scope,) = next(iter(scopes.items()))
    for _ in range(10):
        got = await cluster_backend.acquire(scope, [SPEC], ttl_s=30)
        assert got.lease is not None
        await cluster_backend.release(got.lease, SUCCESS)
    await cluster_backend._wire.drain()
    after = evalsha_calls(cluster)
    grown = [b - a for a, b in zip(before, after, strict=True)]
    assert grown == [20 if i == index else 0 for i in range(len(grown))]


async def test_the_permit_limit_holds_per_scope_on_every_node(
    cluster: Cluster, cluster_backend: RedisBackend
) -> None:
    """max_concurrency is enforced wherever the scope lives, and every permit comes back."""
    for (scope,) in cluster.scopes_per_node().values():
        grants = [await cluster_backend.acquire(scope, [SPEC], ttl_s=30) for _ in range(6)]
        leases = [g.lease for g in grants if g.lease is not None]
        assert len(leases) == SPEC.max_concurrency
        assert [r.reason for r in grants[-1].rejections] == ["concurrency"]
        for lease in leases:
            await cluster_backend.release(lease, SUCCESS)
        assert (await cluster_backend.snapshot(scope)).sources[0].in_flight == 0


async def test_a_moved_scope_is_followed_and_the_map_relearnt(
    cluster: Cluster, cluster_backend: RedisBackend
) -> None:
    """The slot moved between two calls: the next call follows MOVED and still holds its state."""
    (scope,) = cluster.scopes_per_node()[0]
    held = await cluster_backend.acquire(scope, [SPEC], ttl_s=30)
    assert held.lease is not None
    slot = slot_of(scope)
    target = cluster.nodes[1]
    await asyncio.to_thread(cluster.migrate, slot, target)
    try:
        assert cluster.owner(slot) is target
        snap = await cluster_backend.snapshot(scope)
        assert snap.sources[0].in_flight == 1  # the lease moved with the slot's keys
        await cluster_backend.release(held.lease, SUCCESS)
        assert (await cluster_backend.snapshot(scope)).sources[0].in_flight == 0
        assert cluster_backend._wire.route(scope).endpoint.port == target.port
    finally:
        await asyncio.to_thread(cluster.migrate, slot, cluster.nodes[0])


async def test_a_call_during_a_slot_migration_waits_for_its_end(
    cluster: Cluster, cluster_backend: RedisBackend
) -> None:
    """One of its keys moved: the script gets ASK, then TRYAGAIN, and runs once the slot moved."""
    (scope,) = cluster.scopes_per_node()[0]
    for source in ("a", "b"):
        got = await cluster_backend.acquire(
            scope, [SourceSpec(name=source, max_concurrency=4)], ttl_s=30
        )
        assert got.lease is not None
    slot, source_node, target = slot_of(scope), cluster.nodes[0], cluster.nodes[2]
    await asyncio.to_thread(cluster.begin_migration, slot, source_node, target)
    try:
        moved = [f"pgw:{{{scope}}}:src:a"]
        assert await asyncio.to_thread(cluster.move_keys, slot, source_node, target, moved) == 1
        acquiring = asyncio.ensure_future(cluster_backend.acquire(scope, [SPEC], ttl_s=30))
        await asyncio.sleep(0.2)
        assert not acquiring.done()  # bouncing: the slot's keys are split between two nodes
        while await asyncio.to_thread(cluster.move_keys, slot, source_node, target):
            pass
        await asyncio.to_thread(cluster.end_migration, slot, target)
        got = await acquiring
        assert got.lease is not None
        snap = await cluster_backend.snapshot(scope)
        assert {s.name: s.in_flight for s in snap.sources} == {"a": 2, "b": 1}
    finally:
        while await asyncio.to_thread(cluster.move_keys, slot, source_node, target):
            pass
        await asyncio.to_thread(cluster.end_migration, slot, target)
        await asyncio.to_thread(cluster.migrate, slot, source_node)


async def test_resharding_while_calls_run_loses_no_permit_and_admits_no_excess(
    cluster: Cluster, cluster_backend: RedisBackend
) -> None:
    """Workers acquire and release while the scope's slot moves away and back: never more than
    max_concurrency held at once, every failure fails closed, and all permits come back."""
    (scope,) = cluster.scopes_per_node()[0]
    slot = slot_of(scope)
    held = 0
    most = 0
    served = 0
    failed = 0
    stop = asyncio.Event()

    async def worker() -> None:
        nonlocal held, most, served, failed
        while not stop.is_set():
            try:
                got = await cluster_backend.acquire(scope, [SPEC], ttl_s=60)
            except GovernanceBackendError:
                failed += 1
                await asyncio.sleep(0.01)
                continue
            if got.lease is None:
                await asyncio.sleep(0.005)
                continue
            held += 1
            most = max(most, held)
            await asyncio.sleep(0.002)
            held -= 1
            await cluster_backend.release(got.lease, SUCCESS)
            served += 1

    workers = [asyncio.ensure_future(worker()) for _ in range(8)]
    try:
        await asyncio.sleep(0.2)
        for target in (cluster.nodes[1], cluster.nodes[2], cluster.nodes[0]):
            await asyncio.to_thread(cluster.migrate, slot, target)
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await asyncio.gather(*workers)
    await cluster_backend._wire.drain()
    assert served > 0
    assert most <= SPEC.max_concurrency
    assert failed <= served  # a reshard is a blip, not an outage
    snap = await cluster_backend.snapshot(scope)
    assert snap.sources[0].in_flight == 0
    assert cluster.owner(slot) is cluster.nodes[0]


async def granted_past_the_held(
    backend: RedisBackend, scope: str, acquiring: asyncio.Future[AcquireResult], held: list[Lease]
) -> None:
    """The call completes with the true state: s2 granted past full s0 and s1, no source
    above its one permit; every permit given back."""
    got = await acquiring
    assert got.lease is not None
    assert got.lease.source == "s2"
    assert [(r.source, r.reason) for r in got.rejections] == [
        ("s0", "concurrency"),
        ("s1", "concurrency"),
    ]
    snap = await backend.snapshot(scope)
    assert {s.name: s.in_flight for s in snap.sources} == {"s0": 1, "s1": 1, "s2": 1}
    for lease in [*held, got.lease]:
        await backend.release(lease, SUCCESS)
    assert all(s.in_flight == 0 for s in (await backend.snapshot(scope)).sources)


async def test_an_acquire_that_makes_keys_does_not_follow_ask_into_a_half_moved_scope(
    cluster: Cluster, cluster_backend: RedisBackend
) -> None:
    """ACQUIRE's declared keys moved, a later candidate's still on the migrating node: the call
    waits for the migration's end instead of running on the importing node, where that
    candidate's keys would read as absent (a full source granted anew, and its real keys then
    refused by MIGRATE with BUSYKEY); once the slot moved it decides on the true state.

    ACQUIRE names only the first candidate's keys in KEYS and makes the others' itself
    (research-wiki/designs/script-cost.md), so Redis's checks before ``ASK`` cannot see them.
    """
    (scope,) = cluster.scopes_per_node()[0]
    held = await hold_the_first_two(cluster_backend, scope)
    slot, source_node, target = slot_of(scope), cluster.nodes[0], cluster.nodes[2]
    stays = {f"pgw:{{{scope}}}:src:s1", f"pgw:{{{scope}}}:leases:s1"}
    declared = await asyncio.to_thread(keys_in_slot, source_node, slot) - stays
    assert {f"pgw:{{{scope}}}:{name}" for name in ("sources", "src:s0", "leases:s0")} < declared
    assert f"pgw:{{{scope}}}:verdicts" in declared
    assert any(key.startswith(f"pgw:{{{scope}}}:specs:") for key in declared)
    acquiring: asyncio.Future[AcquireResult] | None = None
    await asyncio.to_thread(cluster.begin_migration, slot, source_node, target)
    try:
        moved = sorted(declared)
        assert await asyncio.to_thread(cluster.move_keys, slot, source_node, target, moved) == 5
        ran_on_target = (await asyncio.to_thread(evalsha_calls, cluster))[2]
        acquiring = asyncio.ensure_future(cluster_backend.acquire(scope, SIX, ttl_s=30))
        await bounced_while_pending(acquiring, source_node, 3)
        assert not acquiring.done(), acquiring.result()  # not granted on the importing node
        assert (await asyncio.to_thread(evalsha_calls, cluster))[2] == ran_on_target
        assert await asyncio.to_thread(keys_in_slot, target, slot) == declared  # nothing made
        rest = sorted(stays)
        assert await asyncio.to_thread(cluster.move_keys, slot, source_node, target, rest) == 2
        await asyncio.to_thread(cluster.end_migration, slot, target)
        await granted_past_the_held(cluster_backend, scope, acquiring, held)
    finally:
        await end_and_give_back(cluster, slot, source_node, target, acquiring)


async def test_an_acquire_stopped_on_the_migrating_node_runs_again_after_the_migration(
    cluster: Cluster, cluster_backend: RedisBackend
) -> None:
    """A later candidate's keys moved first: on the migrating node the script stops at them
    (``Script attempted to access a non local key``); the call is sent again, as after
    ``TRYAGAIN``, and completes on the new owner once the slot moved, with the true state,
    instead of failing closed for a migration that lasts milliseconds."""
    (scope,) = cluster.scopes_per_node()[0]
    held = await hold_the_first_two(cluster_backend, scope)
    slot, source_node, target = slot_of(scope), cluster.nodes[0], cluster.nodes[2]
    acquiring: asyncio.Future[AcquireResult] | None = None
    await asyncio.to_thread(cluster.begin_migration, slot, source_node, target)
    try:
        later = [f"pgw:{{{scope}}}:src:s1", f"pgw:{{{scope}}}:leases:s1"]
        assert await asyncio.to_thread(cluster.move_keys, slot, source_node, target, later) == 2
        _, stopped = await asyncio.to_thread(evalsha_refusals, source_node)
        acquiring = asyncio.ensure_future(cluster_backend.acquire(scope, SIX, ttl_s=30))
        await bounced_while_pending(acquiring, source_node, 3)
        assert not acquiring.done(), acquiring.result()
        # Run there and stopped by the script's error each time, not refused before running.
        assert (await asyncio.to_thread(evalsha_refusals, source_node))[1] >= stopped + 3
        while await asyncio.to_thread(cluster.move_keys, slot, source_node, target):
            pass
        await asyncio.to_thread(cluster.end_migration, slot, target)
        await granted_past_the_held(cluster_backend, scope, acquiring, held)
    finally:
        await end_and_give_back(cluster, slot, source_node, target, acquiring)


def test_status_shows_every_scope_wherever_it_lives(cluster: Cluster, tmp_path: Path) -> None:
    """`polygateway status --json` reads a scope on each master through one seed node."""
    cluster.flush()
    scopes = [names[0] for names in cluster.scopes_per_node().values()]
    config = [
        f'[gateway]\nbackend = "redis"\nredis_mode = "cluster"\nredis_url = "{cluster.seed_url}"\n'
    ]
    for scope in scopes:
        config.append(
            f'[scopes.{scope}]\nkind = "embed"\n[[scopes.{scope}.sources]]\nname = "a"\n'
            'protocol = "openai"\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "m"\n'
        )
    (tmp_path / "polygateway.toml").write_text("\n".join(config))
    done = subprocess.run(
        [sys.executable, "-m", "polygateway", "status", "--json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [scope["scope"] for scope in report["scopes"]] == scopes


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("unix:///tmp/redis.sock", "discovered by TCP address"),
        ("redis://127.0.0.1:7000/3", "only database 0"),
    ],
)
def test_a_cluster_that_cannot_work_is_refused_at_load(url: str, problem: str) -> None:
    """A unix socket or a database other than 0 in cluster mode: ConfigError naming redis_url."""
    with pytest.raises(ConfigError, match=problem) as info:
        GatewaySettings(backend="redis", redis_mode="cluster", redis_url=url)
    assert info.value.field == "redis_url"
    with pytest.raises(ConfigError, match=problem):
        RedisBackend(url, mode="cluster")
