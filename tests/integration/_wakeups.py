"""What the fleet wake-up tests share (``test_redis_wakeups.py``, ``test_redis_handoff.py``)."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

BOUND_S = 10.0
"""Bound on anything a test awaits, far below the poll intervals the tests set."""

FLEET_SOCKET_TIMEOUT_S = 0.5
"""The ``fleet`` fixture's backends' socket timeout, and so their hand-off TTL (capped by it)."""


async def listening(admin: aioredis.Redis, n: int) -> None:
    """Wait until ``n`` processes are subscribed to their wake-up channels."""
    async with asyncio.timeout(BOUND_S):
        while len(await admin.pubsub_channels("pgw:wake:*")) < n:
            await asyncio.sleep(0.01)
