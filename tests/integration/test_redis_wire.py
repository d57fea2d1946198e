"""The Redis backend's own connection pool (``wire.py``), its timeouts (``bounded.py``).

The backend sends its scripts over a small pool of redis-py connections of
its own rather than through ``redis.asyncio.Redis``; these tests pin what
that pool promises: never more connections than its size, every operation
served however many wait, a connection the server dropped while idle
reconnected rather than failing an operation, a failed exchange never
reused, and work whose caller left cut off after ``_LATE_REPLY_S``. And of
its timeouts: each operation fails at its own deadline, although one timer
serves them all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend, limiter
from polygateway.backends.redis.bounded import TIMED_OUT, Deadlines
from polygateway.errors import GovernanceBackendError

SCOPE = "chat"
MANY = SourceSpec(name="a", max_concurrency=1000)
SUCCESS = AttemptOutcome("success")


async def _grant(backend: RedisBackend, spec: SourceSpec = MANY) -> Lease:
    result = await backend.acquire(SCOPE, [spec], ttl_s=60)
    assert result.lease is not None, result.rejections
    return result.lease


def _clients(url: str) -> int:
    """Connections the server holds open, the inspecting one left out."""
    with redis.Redis.from_url(url) as admin:
        return len(admin.client_list()) - 1


async def test_operations_beyond_the_pool_size_wait_for_a_connection_and_are_served(
    redis_url: str,
) -> None:
    """40 calls at once through a pool of 3: all served, never more than 3 connections open."""
    pool = aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=3)
    client = aioredis.Redis(connection_pool=pool)
    backend = RedisBackend(redis_url, client=client)
    opened: list[int] = []

    async def call() -> None:
        lease = await _grant(backend)
        opened.append(_clients(redis_url))
        await backend.release(lease, SUCCESS)

    try:
        await asyncio.gather(*(call() for _ in range(40)))
        assert len(opened) == 40
        assert max(opened) <= 3
        assert (await backend.snapshot(SCOPE)).in_flight == 0
    finally:
        await backend.aclose()
        await client.aclose()
        await pool.disconnect()


async def test_a_cancelled_wait_for_a_connection_passes_it_on(redis_url: str) -> None:
    """Callers cancelled while queued for the one connection leave it to the callers behind them."""
    pool = aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=1)
    client = aioredis.Redis(connection_pool=pool)
    backend = RedisBackend(redis_url, client=client)
    try:
        await backend.progress_age_s(SCOPE)  # the one connection is open
        tasks = [asyncio.ensure_future(backend.progress_age_s(SCOPE)) for _ in range(6)]
        await asyncio.sleep(0)
        for task in tasks[1:5]:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert [isinstance(r, asyncio.CancelledError) for r in results] == [False] + [True] * 4 + [
            False
        ]
        assert results[0] == results[5] == float("inf")
        # The work of the cancelled callers was left behind and finishes; the pool serves on.
        await backend.release(await _grant(backend), SUCCESS)
        assert await backend.progress_age_s(SCOPE) < 1.0
    finally:
        await backend.aclose()
        await client.aclose()
        await pool.disconnect()


async def test_connections_dropped_by_a_restarted_server_reconnect_without_a_failed_call(
    make_redis_server: Callable[..., Any],
) -> None:
    """After a restart between two calls, idle connections reconnect: no call fails for them."""
    server = make_redis_server()
    backend = RedisBackend(server.url)
    try:
        leases = await asyncio.gather(*(_grant(backend) for _ in range(5)))  # five connections
        await asyncio.gather(*(backend.release(lease, SUCCESS) for lease in leases))
        server.stop()
        server.start()
        await asyncio.sleep(0.1)  # the closed sockets' end of file reaches the event loop
        for _ in range(5):
            await backend.release(await _grant(backend), SUCCESS)
        assert await backend.progress_age_s(SCOPE) < 1.0
    finally:
        await backend.aclose()


async def test_a_script_error_does_not_leave_its_connection_in_use(
    redis_url: str,
) -> None:
    """A script failing on the server fails closed; the next operations run normally."""
    pool = aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=1)
    client = aioredis.Redis(connection_pool=pool)
    backend = RedisBackend(redis_url, client=client)
    try:
        with redis.Redis.from_url(redis_url) as admin:
            admin.set("pgw:{chat}:leases:a", "not a zset")
            with pytest.raises(GovernanceBackendError):
                await backend.acquire(SCOPE, [MANY], ttl_s=60)
            admin.delete("pgw:{chat}:leases:a")
        await backend.release(await _grant(backend), SUCCESS)
        assert await backend.progress_age_s(SCOPE) < 1.0
    finally:
        await backend.aclose()
        await client.aclose()
        await pool.disconnect()


async def test_work_left_behind_is_cut_off_after_the_late_reply_bound(
    make_redis_server: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Silent past _LATE_REPLY_S, the server no longer holds the operation left behind."""
    monkeypatch.setattr(limiter, "_LATE_REPLY_S", 0.4)
    server = make_redis_server()
    backend = RedisBackend(server.url, socket_timeout_s=0.2)
    try:
        await backend.progress_age_s(SCOPE)  # connection open, script loaded
        server.pause()
        try:
            with pytest.raises(GovernanceBackendError, match=r"no reply within 0\.2 s"):
                await backend.progress_age_s(SCOPE)
            assert len(backend._left) == 1
            deadline = time.monotonic() + 2.0
            while backend._left and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not backend._left
        finally:
            server.resume()
        # Its connection was closed with it; a new one serves.
        assert await backend.progress_age_s(SCOPE) == float("inf")
    finally:
        await backend.aclose()


# --- timeouts: one deadline queue for every operation -------------------------------------


async def test_each_operation_times_out_at_its_own_deadline(
    make_redis_server: Callable[..., Any],
) -> None:
    """On a frozen server, an operation started later fails later: each waits its own timeout."""
    server = make_redis_server()
    backend = RedisBackend(server.url, socket_timeout_s=0.3)
    ended: dict[str, float] = {}

    async def timed(name: str) -> None:
        with pytest.raises(GovernanceBackendError):
            await backend.progress_age_s(SCOPE)
        ended[name] = time.monotonic()

    try:
        await backend.progress_age_s(SCOPE)  # connections open, script loaded
        server.pause()
        try:
            started = time.monotonic()
            first = asyncio.ensure_future(timed("first"))
            await asyncio.sleep(0.2)
            await asyncio.gather(first, timed("second"))
        finally:
            server.resume()
        assert 0.25 <= ended["first"] - started < 0.45
        assert 0.45 <= ended["second"] - started < 0.7
    finally:
        await backend.aclose()


async def test_deadlines_wake_only_the_futures_still_waiting_then_disarm() -> None:
    """Futures done in time keep their result; the others get TIMED_OUT; no timer is left."""
    deadlines = Deadlines(0.05)
    loop = asyncio.get_running_loop()
    futures = [loop.create_future() for _ in range(4)]
    for future in futures:
        deadlines.add(loop, future)
    futures[0].set_result("early")
    futures[2].cancel()
    await asyncio.sleep(0.12)
    assert futures[0].result() == "early"
    assert futures[1].result() is TIMED_OUT
    assert futures[2].cancelled()
    assert futures[3].result() is TIMED_OUT
    assert (deadlines._timer, len(deadlines._entries)) == (None, 0)


def test_deadlines_keep_working_in_a_new_event_loop() -> None:
    """A backend's deadline queue used from a second event loop still times its futures out."""
    deadlines = Deadlines(0.05)

    async def one_timeout() -> object:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[object] = loop.create_future()
        deadlines.add(loop, future)
        # A second future, left pending when the loop ends: the next loop must not wait on it.
        deadlines.add(loop, loop.create_future())
        return await future

    assert asyncio.run(one_timeout()) is TIMED_OUT
    assert asyncio.run(asyncio.wait_for(one_timeout(), 1.0)) is TIMED_OUT
