"""What the fleet wake-up tests share (wake-ups, hand-off, classes, tenants, floors)."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from polygateway.backends.base import Lease, SourceSpec
from polygateway.backends.redis import RedisBackend

BOUND_S = 10.0
"""Bound on anything a test awaits, far below the poll intervals the tests set."""

FLEET_SOCKET_TIMEOUT_S = 0.5
"""The ``fleet`` fixture's backends' socket timeout, and so their hand-off TTL (capped by it)."""


async def listening(admin: aioredis.Redis, n: int) -> None:
    """Wait until ``n`` processes are subscribed to their wake-up channels."""
    async with asyncio.timeout(BOUND_S):
        while len(await admin.pubsub_channels("pgw:wake:*")) < n:
            await asyncio.sleep(0.01)


async def hold(
    backend: RedisBackend, scope: str, source: SourceSpec, n: int, **acquire: Any
) -> list[Lease]:
    """``n`` leases of ``source`` (1000 s unless ``ttl_s`` says): the source held full."""
    acquire.setdefault("ttl_s", 1000.0)
    leases = []
    for _ in range(n):
        lease = (await backend.acquire(scope, [source], **acquire)).lease
        assert lease is not None
        leases.append(lease)
    return leases


async def refused(backend: RedisBackend, scope: str, source: SourceSpec, **acquire: Any) -> None:
    """Refused for concurrency (the source held full), which registers the process."""
    result = await backend.acquire(scope, [source], ttl_s=60.0, **acquire)
    assert result.lease is None
    assert [r.reason for r in result.rejections] == ["concurrency"]
