"""The Redis backend over TLS behind Sentinel and in a Cluster (``rediss://``).

Each topology serves TLS only (``tls-port``, ``port 0``; its processes talk
TLS to each other with ``tls-replication yes`` and ``tls-cluster yes``), on
free loopback ports in the test's temporary directory, with a CA of the
test's own (``_redis_tls.tls_files``). A plain-TCP connection would find no
listener: that the backend is served at all shows it spoke TLS everywhere.

- Sentinel: the ``rediss://`` URL's TLS settings reach the Sentinels as well
  as the primary (a Sentinel talking TLS to TLS servers listens on its own
  ``tls-port``, redis.io's TLS page); a governed acquire and release work,
  and a killed primary is followed to the promoted replica over TLS.
- Cluster: the slot map is read over TLS and names each node's ``tls-port``
  (``CLUSTER SHARDS``); a scope on each of the three masters is served.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import _redis_topologies as topologies
import pytest
from _redis_tls import tls_files
from _redis_topologies import Cluster, SentinelSetup, TLSFiles, running

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend

SCOPE = "chat"
SPEC = SourceSpec(name="a", max_concurrency=4)
SUCCESS = AttemptOutcome("success")
TIMEOUT_S = 1.0
FAILOVER_BOUND_S = 45.0
"""Sentinel's own failover (down-after 2 s, then an election) plus ours, on a loaded machine."""


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    """A CA and a certificate for 127.0.0.1, shared by every server of the module."""
    return tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def tls_sentinel(tmp_path: Path, certificates: TLSFiles) -> Iterator[SentinelSetup]:
    """A TLS-only primary, replica and Sentinel, stopped after the test."""
    yield from running(SentinelSetup(tmp_path, tls=certificates))


@pytest.fixture
async def sentinel_backend(
    tls_sentinel: SentinelSetup, certificates: TLSFiles
) -> AsyncIterator[RedisBackend]:
    made = RedisBackend(
        f"rediss:///0?ssl_ca_certs={certificates[0]}",
        mode="sentinel",
        sentinels=tls_sentinel.sentinels,
        sentinel_master=SentinelSetup.MASTER,
        socket_timeout_s=TIMEOUT_S,
    )
    try:
        yield made
    finally:
        await made.aclose()


async def acquire_until_served(backend: RedisBackend, scope: str = SCOPE) -> Lease:
    return await topologies.acquire_until_served(backend, scope, SPEC, 30.0, FAILOVER_BOUND_S)


async def test_a_tls_sentinel_setup_serves_and_follows_a_killed_primary(
    tls_sentinel: SentinelSetup, sentinel_backend: RedisBackend
) -> None:
    """Over TLS: acquire and release on the primary the Sentinel names, then, the primary
    killed, on the promoted replica (the ``+switch-master`` listener subscribed over TLS)."""
    backend = sentinel_backend
    lease = await backend.acquire(SCOPE, [SPEC], ttl_s=30.0)  # served at once, no retry
    assert lease.lease is not None, lease.rejections
    await backend.release(lease.lease, SUCCESS)
    wire = backend._wire.route(SCOPE)
    assert wire.endpoint.port == tls_sentinel.primary.port
    assert wire.endpoint.tls is not None
    async with asyncio.timeout(FAILOVER_BOUND_S):  # the +switch-master listener, over TLS
        while await asyncio.to_thread(topologies.sentinel_subscribers, tls_sentinel) < 1:
            await asyncio.sleep(0.05)
    with tls_sentinel.primary.client() as client:
        assert client.execute_command("WAIT", 1, 5000) == 1
    old_port = tls_sentinel.primary.port
    tls_sentinel.primary.kill()
    new_primary = await asyncio.to_thread(tls_sentinel.wait_for_failover, old_port)
    lease2 = await acquire_until_served(backend)
    await backend.release(lease2, SUCCESS)
    assert backend._wire.route(SCOPE).endpoint.port == new_primary.port
    snap = await backend.snapshot(SCOPE)
    assert snap.sources[0].in_flight == 0


@pytest.fixture(scope="module")
def tls_cluster(
    tmp_path_factory: pytest.TempPathFactory, certificates: TLSFiles
) -> Iterator[Cluster]:
    """A TLS-only 3-master cluster for the module (``tls-cluster yes``), stopped at its end."""
    yield from running(Cluster(tmp_path_factory.mktemp("tls-cluster"), tls=certificates))


async def test_a_tls_cluster_serves_a_scope_on_each_master(tls_cluster: Cluster) -> None:
    """A ``rediss://`` seed: the map names the nodes' TLS ports, and a scope on each of the
    three masters is served there, its keys on its own node."""
    tls_cluster.flush()
    backend = RedisBackend(tls_cluster.seed_url, mode="cluster", socket_timeout_s=5.0)
    try:
        for index, (scope,) in tls_cluster.scopes_per_node().items():
            got = await backend.acquire(scope, [SPEC], ttl_s=30)
            assert got.lease is not None, got.rejections
            await backend.release(got.lease, SUCCESS)
            wire = backend._wire.route(scope)
            assert wire.endpoint.port == tls_cluster.nodes[index].port
            assert wire.endpoint.tls is not None
            with tls_cluster.nodes[index].client() as client:
                assert client.dbsize() > 0
        assert sorted(backend._wire.nodes()) == sorted(n.address for n in tls_cluster.nodes)
    finally:
        await backend.aclose()
