"""What the fleet wake-up tests share (wake-ups, hand-off, classes, tenants, floors)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import redis.asyncio as aioredis

from polygateway.backends.base import Lease, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings
from polygateway.middleware.waiting import Waiter, WaitingRoom

BOUND_S = 10.0
"""Bound on anything a test awaits, far below the poll intervals the tests set."""

FLEET_SOCKET_TIMEOUT_S = 0.5
"""The ``fleet`` fixture's backends' socket timeout, and so their hand-off TTL (capped by it)."""


async def listening(admin: aioredis.Redis, n: int) -> None:
    """Wait until ``n`` processes are subscribed to their wake-up channels."""
    async with asyncio.timeout(BOUND_S):
        while len(await admin.pubsub_channels("pgw:wake:*")) < n:
            await asyncio.sleep(0.01)


async def woken_by(
    room: WaitingRoom, head: Waiter, release: Awaitable[None], *, within_s: float
) -> None:
    """``head`` waits in ``room`` until ``release`` frees a permit: woken once, within
    ``within_s`` of it (a wake-up, never the 30 s wait's poll)."""
    waiting = asyncio.ensure_future(room.wait(head, 30.0, asyncio.sleep))
    began = time.monotonic()
    await release
    async with asyncio.timeout(BOUND_S):
        await waiting
    assert time.monotonic() - began < within_s
    assert room.wakeups == 1


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


@contextlib.asynccontextmanager
async def two_processes(
    redis_url: str, settings: GatewaySettings, scope: str
) -> AsyncIterator[tuple[tuple[RedisBackend, ChatClient], tuple[RedisBackend, ChatClient]]]:
    """Two processes of a fleet over real sockets: each its own backend and chat client."""
    first, second = RedisBackend(redis_url), RedisBackend(redis_url)
    try:
        async with (
            ChatClient(settings, scope, backend=first) as chat_1,
            ChatClient(settings, scope, backend=second) as chat_2,
        ):
            yield (first, chat_1), (second, chat_2)
    finally:
        await first.aclose()
        await second.aclose()


async def ask_in_class(chat: ChatClient, priority_class: str) -> None:
    """One chat call of ``priority_class``, its class's name as the message."""
    await chat.complete(
        [{"role": "user", "content": priority_class}], priority_class=priority_class
    )


async def served_window(
    served: list[str], tasks: list[asyncio.Task[None]], start: int, stop: int
) -> Counter[str]:
    """Who was served from the ``start``-th call to the ``stop``-th (once queues filled);
    then every task is cancelled and awaited."""
    while len(served) < stop:
        await asyncio.sleep(0.01)
    window = Counter(served[start:stop])
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return window
