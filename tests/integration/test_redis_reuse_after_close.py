"""A ``RedisBackend`` used again after its own ``aclose`` works as a new one does.

Its wire reconnects on the next command (a closed backend is reopened by
use, as it is when shared across ``asyncio.run`` calls); its fleet wake-up
subscription and, in a Cluster, its slot map must come back with it rather
than leave the backend polling or routing by ``MOVED`` alone.
"""

from __future__ import annotations

import redis.asyncio as aioredis
from _wakeups import listening, woken_by

from polygateway.backends.base import AttemptOutcome, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.middleware.waiting import room_for

SCOPE = "reuse"
SOURCE = SourceSpec(name="a", max_concurrency=1)


async def test_a_backend_used_again_after_aclose_is_woken_by_a_release_elsewhere(
    redis_url: str, admin: aioredis.Redis
) -> None:
    """Closed, then used again: A's release wakes B's head at once, not at its 30 s poll."""
    a, b = RedisBackend(redis_url), RedisBackend(redis_url)
    try:
        room = room_for(b, SCOPE)  # subscribes B
        await listening(admin, 1)
        await b.aclose()
        room_for(a, SCOPE)
        lease = (await a.acquire(SCOPE, [SOURCE], ttl_s=1000.0)).lease
        assert lease is not None
        head = room.enter()
        refused = await b.acquire(SCOPE, [SOURCE], ttl_s=60.0)  # registers B, listening again
        assert refused.lease is None
        await listening(admin, 2)  # before: only A's channel, B's listener never restarted
        await woken_by(room, head, a.release(lease, AttemptOutcome("success")), within_s=1.0)
        room.leave(head)
    finally:
        await a.aclose()
        await b.aclose()
