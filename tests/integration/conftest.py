"""Integration fixtures: ``backend_env`` for the backend contract suite, ``tls_redis``,
``admin``, ``sentinel_setup``.

``backend_env``: each parameter builds a fresh backend that reads ``clock``
(a ``FakeClock`` the tests advance). A new backend is added here as a new
parameter, never by copying a test.

``tls_redis``: a dedicated ``redis-server`` that also answers TLS, with a CA
of its own, for the tests of ``rediss://`` (the wire's, the wake-ups').

``admin``: a plain redis-py client of the suite's server, for a test to read
the keys the scripts wrote.

``sentinel_setup``: a primary, its replica and one Sentinel of their own
(``_redis_topologies.SentinelSetup``), for the Sentinel and failover tests.

``cluster``: a 3-master Redis Cluster (``_redis_topologies.Cluster``) for the
requesting module, stopped at its end; ``cluster_backend``: a cluster-mode
``RedisBackend`` seeded with its first node, on the cluster emptied first.

``transport``: each HTTP transport in turn (``"httpx"``, ``"aiohttp"``), for
the end-to-end tests against the simulator that both must pass alike.

``fleet``: ``RedisBackend`` objects on the suite's Redis, each a process of a
fleet, whose scripts read ``clock`` (a ``FakeClock``) and whose socket
timeout (and so hand-off TTL) is ``FLEET_SOCKET_TIMEOUT_S``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from _redis_tls import TLSRedis, start_tls_redis
from _redis_topologies import Cluster, SentinelSetup, running
from _wakeups import FLEET_SOCKET_TIMEOUT_S

from polygateway.backends.base import Backend
from polygateway.backends.memory import MemoryBackend
from polygateway.backends.redis import RedisBackend
from polygateway.testing import FakeClock


@dataclass
class BackendEnv:
    """A backend and the fake clock it reads."""

    name: str
    backend: Backend
    clock: FakeClock


@pytest.fixture(params=["memory", "redis"])
async def backend_env(request: pytest.FixtureRequest) -> AsyncIterator[BackendEnv]:
    """A fresh backend of each kind, on a fake clock, closed after the test."""
    clock = FakeClock()
    name: str = request.param
    backend: Backend
    if name == "redis":
        backend = RedisBackend(request.getfixturevalue("redis_url"), now=clock)
    else:
        backend = MemoryBackend(now=clock)
    try:
        yield BackendEnv(name=name, backend=backend, clock=clock)
    finally:
        await backend.aclose()


@pytest.fixture
def tls_redis(make_redis_server: Callable[..., Any], tmp_path: Path) -> TLSRedis:
    """A dedicated TLS redis-server with a password, stopped after the test."""
    return start_tls_redis(make_redis_server, tmp_path)


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A client of the suite's Redis that decodes replies, closed after the test."""
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


LOCKED_USER = "pgw-locked"
LOCKED_PASSWORD = "locked-pw-SECRET-31ad"


@pytest.fixture
async def locked_url(redis_url: str, admin: aioredis.Redis) -> AsyncIterator[str]:
    """The suite's Redis as a user allowed only the gateway's keys and channels (``~pgw:*``,
    ``&pgw:*``), as a deployment may lock its gateway user down; removed after the test."""
    await admin.acl_setuser(
        LOCKED_USER,
        enabled=True,
        passwords=[f"+{LOCKED_PASSWORD}"],
        categories=["+@all"],
        keys=["pgw:*"],
        channels=["pgw:*"],
    )
    try:
        yield redis_url.replace("redis://", f"redis://{LOCKED_USER}:{LOCKED_PASSWORD}@", 1)
    finally:
        await admin.acl_deluser(LOCKED_USER)


@pytest.fixture
def sentinel_setup(tmp_path: Path) -> Iterator[SentinelSetup]:
    """A primary, a replica and a Sentinel, stopped (thawed first) after the test."""
    yield from running(SentinelSetup(tmp_path))


@pytest.fixture(params=["httpx", "aiohttp"])
def transport(request: pytest.FixtureRequest) -> str:
    """Each HTTP transport in turn: the tests taking it hold for both alike."""
    name: str = request.param
    return name


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A 3-master cluster for the module, stopped at its end."""
    yield from running(Cluster(tmp_path_factory.mktemp("cluster")))


@pytest.fixture
async def cluster_backend(cluster: Cluster) -> AsyncIterator[RedisBackend]:
    """A cluster-mode backend seeded with the first node, on an emptied cluster."""
    cluster.flush()
    made = RedisBackend(cluster.seed_url, mode="cluster", socket_timeout_s=5.0)
    try:
        yield made
    finally:
        await made.aclose()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def _backends_on(url: str, clock: FakeClock) -> AsyncIterator[Callable[[], RedisBackend]]:
    """Make backends on ``url`` and one fake clock, each a process of the fleet; close them."""
    made: list[RedisBackend] = []

    def make() -> RedisBackend:
        backend = RedisBackend(url, now=clock, socket_timeout_s=FLEET_SOCKET_TIMEOUT_S)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.aclose()


@pytest.fixture
async def fleet(redis_url: str, clock: FakeClock) -> AsyncIterator[Callable[[], RedisBackend]]:
    """Backends on one Redis and one fake clock, each a process of the fleet."""
    async for make in _backends_on(redis_url, clock):
        yield make


@pytest.fixture
async def locked_fleet(
    locked_url: str, clock: FakeClock
) -> AsyncIterator[Callable[[], RedisBackend]]:
    """``fleet``, as the user ``locked_url`` allows only the gateway's keys and channels."""
    async for make in _backends_on(locked_url, clock):
        yield make
