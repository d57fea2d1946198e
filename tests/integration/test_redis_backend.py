"""What only the Redis backend has: the server clock, the key layout, round trips, failures.

The contract suite and the differential test run the Redis backend on a fake
clock; the few tests here that prove the server-clock path (``TIME`` inside
the scripts) use short real sleeps. Fault tests stop, freeze or flush a
dedicated real ``redis-server``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from _behind import released
from _leases import LEASES_ONLY
from redis.crc import key_slot

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend, wire
from polygateway.errors import ConfigError, GovernanceBackendError
from polygateway.middleware.waiting import room_for

SCOPE = "chat"
ONE = SourceSpec(name="a", max_concurrency=1)
SUCCESS = AttemptOutcome("success")
PASSWORD = "secretpw"


async def _grant(backend: RedisBackend, spec: SourceSpec = ONE, ttl: float = 60.0) -> Lease:
    result = await backend.acquire(SCOPE, [spec], ttl_s=ttl)
    assert result.lease is not None, result.rejections
    return result.lease


def _sync(url: str) -> redis.Redis:
    return redis.Redis.from_url(url)


@pytest.fixture
async def backend(redis_url: str) -> Any:
    """A RedisBackend on the session server's clock (no injected ``now``)."""
    b = RedisBackend(redis_url)
    yield b
    await b.aclose()


# --- the server clock ---------------------------------------------------------------------


async def test_short_lease_expires_by_itself_on_the_server_clock(backend: RedisBackend) -> None:
    """A holder that never releases loses its permit once the TTL passes on the server's TIME."""
    await _grant(backend, ttl=1.0)
    refused = await backend.acquire(SCOPE, [ONE], ttl_s=60)  # well inside the TTL, even loaded
    assert refused.lease is None
    assert refused.rejections[0].reason == "concurrency"
    await asyncio.sleep(1.1)  # a sleep never ends early: the TTL has passed
    snap = await backend.snapshot(SCOPE)
    assert snap.in_flight == 0
    await _grant(backend)


async def test_renew_extends_a_lease_on_the_server_clock(backend: RedisBackend) -> None:
    """A lease renewed before its TTL outlives the TTL it was granted with.

    TTL 1 s, renewed half-way, looked at 0.6 s after the renewal: past the
    granted TTL, inside the renewed one, with 0.4 s to spare on either side.
    """
    lease = await _grant(backend, ttl=1.0)
    granted = time.monotonic()  # the server granted it before this
    await asyncio.sleep(0.5)
    assert await backend.renew(lease) is True
    renewed = time.monotonic()  # the server renewed it before this
    await asyncio.sleep(max(0.0, granted + 1.1 - time.monotonic()))
    assert (await backend.snapshot(SCOPE)).in_flight == 1
    await asyncio.sleep(max(0.0, renewed + 1.1 - time.monotonic()))
    assert (await backend.snapshot(SCOPE)).in_flight == 0
    assert await backend.renew(lease) is False


async def test_progress_age_grows_in_real_time(backend: RedisBackend) -> None:
    """Progress age is inf before any success, about 0 after one, then grows with server time.

    Each age read lies between the time waited and the time since just
    before the success, as this process measures them: bounds that hold
    however slowly a loaded machine runs the round trips.
    """
    assert await backend.progress_age_s(SCOPE) == float("inf")
    lease = await _grant(backend)
    before = time.monotonic()
    await backend.release(lease, SUCCESS)
    first = await backend.progress_age_s(SCOPE)
    assert 0.0 <= first <= time.monotonic() - before + 0.01
    await asyncio.sleep(0.25)
    later = await backend.progress_age_s(SCOPE)
    assert first + 0.25 - 0.01 <= later <= time.monotonic() - before + 0.01
    assert (await backend.snapshot(SCOPE)).progress_age_s >= later


def _after_evalsha(admin: redis.Redis, calls: int) -> dict[str, Any]:
    """``INFO commandstats`` once the server has run ``calls`` EVALSHA: the release is written
    behind, and a round trip to wait for it would add one (bounded: 5 s)."""
    deadline = time.monotonic() + 5.0
    while True:
        stats: dict[str, Any] = admin.info("commandstats")
        done = stats.get("cmdstat_evalsha", {}).get("calls", 0)
        if done >= calls or time.monotonic() > deadline:
            return stats
        time.sleep(0.005)


async def test_progress_key_carries_the_documented_ttl(
    backend: RedisBackend, redis_url: str
) -> None:
    """The progress mark disappears after _PROGRESS_TTL_S (3600 s): older is as good as never."""
    await released(backend, await _grant(backend), SUCCESS)
    with _sync(redis_url) as client:
        ttl = client.ttl("pgw:{chat}:progress")
    assert 3590 <= ttl <= 3600


# --- keys and round trips -----------------------------------------------------------------


async def test_every_key_of_a_scope_uses_its_hash_tag(
    backend: RedisBackend, redis_url: str
) -> None:
    """All of a scope's keys are pgw:{scope}:... and so live in one Redis Cluster slot."""
    lease = await _grant(backend)
    await backend.release(lease, SUCCESS)
    await _grant(backend)
    other = await backend.acquire("embed", [ONE], ttl_s=60)
    assert other.lease is not None
    with _sync(redis_url) as client:
        keys = sorted(k.decode() for k in client.keys("*"))
    chat = [k for k in keys if k.startswith("pgw:{chat}:")]
    assert set(chat) == {
        "pgw:{chat}:sources",
        "pgw:{chat}:src:a",
        "pgw:{chat}:leases:a",
        "pgw:{chat}:progress",
    }
    assert all(k.startswith(("pgw:{chat}:", "pgw:{embed}:")) for k in keys)
    assert len({key_slot(k.encode()) for k in chat}) == 1
    assert key_slot(b"pgw:{chat}:x") != key_slot(b"pgw:{embed}:x")


async def test_a_call_that_does_not_wait_costs_exactly_two_round_trips(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One acquire and one release write two commands, both EVALSHA of a loaded script."""
    sent: list[str] = []
    send = wire.Link.send

    def counting(link: wire.Link, data: bytes, on_reply: wire.OnReply, *rest: Any) -> None:
        # RESP: *<n>\r\n$<len>\r\n<name>\r\n...
        sent.append(data.split(b"\r\n", 3)[2].decode())
        send(link, data, on_reply, *rest)

    monkeypatch.setattr(wire.Link, "send", counting)
    pool = aioredis.ConnectionPool.from_url(redis_url)
    client = aioredis.Redis(connection_pool=pool)
    backend = RedisBackend(redis_url, client=client)
    try:
        await backend.release(await _grant(backend), SUCCESS)  # warm: scripts loaded, pool open
        sent.clear()
        with _sync(redis_url) as admin:
            admin.config_resetstat()
            await backend.release(await _grant(backend), SUCCESS)
            stats = _after_evalsha(admin, 2)
        assert sent == ["EVALSHA", "EVALSHA"]
        evalsha = stats["cmdstat_evalsha"]
        assert (evalsha["calls"], evalsha["failed_calls"], evalsha["rejected_calls"]) == (2, 0, 0)
        assert not {"cmdstat_eval", "cmdstat_script|load"} & set(stats)
    finally:
        await backend.aclose()
        await client.aclose()
        await pool.disconnect()


async def test_a_backend_on_its_own_pool_sends_nothing_but_two_evalsha(
    backend: RedisBackend, redis_url: str
) -> None:
    """Built from a URL, a call that does not wait sends two EVALSHA: no probe, no reload."""
    await backend.release(await _grant(backend), SUCCESS)  # warm: scripts loaded, connection open
    with _sync(redis_url) as admin:
        admin.config_resetstat()
        await backend.release(await _grant(backend), SUCCESS)
        stats = _after_evalsha(admin, 2)
    # Commands the scripts run count here too; what a client could send besides is absent.
    assert stats["cmdstat_evalsha"]["calls"] == 2
    extra = {"eval", "script|load", "zrange", "ping", "hello", "client|setinfo", "select", "auth"}
    assert not {f"cmdstat_{name}" for name in extra} & set(stats)


async def test_script_flush_mid_run_is_survived(backend: RedisBackend, redis_url: str) -> None:
    """After SCRIPT FLUSH the next calls reload their scripts (NOSCRIPT) and keep working."""
    lease = await _grant(backend)
    with _sync(redis_url) as client:
        client.script_flush()
    await backend.release(lease, SUCCESS)
    assert (await backend.snapshot(SCOPE)).in_flight == 0
    with _sync(redis_url) as client:
        client.script_flush()
    assert await backend.renew(await _grant(backend)) is True
    assert await backend.progress_age_s(SCOPE) < 1.0


# --- fail closed ----------------------------------------------------------------------------


def _operations(backend: RedisBackend, lease: Lease) -> dict[str, Callable[[], Awaitable[Any]]]:
    return {
        "acquire": lambda: backend.acquire(SCOPE, [ONE], ttl_s=60),
        "release": lambda: backend.release(lease, SUCCESS),
        "renew": lambda: backend.renew(lease),
        "progress_age_s": lambda: backend.progress_age_s(SCOPE),
        "snapshot": lambda: backend.snapshot(SCOPE),
    }


async def _assert_fails_closed(
    backend: RedisBackend, lease: Lease, socket_timeout_s: float, *, written_behind: bool = False
) -> list[GovernanceBackendError]:
    """Every operation fails closed, fast; with ``written_behind``, the release returns at once.

    (A release written on an open connection does not wait for its reply; one
    with no connection up waits, and fails like the rest.) "Fast" is the
    socket timeout plus a second, for a loaded machine's late timers.
    """
    within_s = socket_timeout_s + 1.0
    errors = []
    for name, operation in _operations(backend, lease).items():
        started = time.monotonic()
        if name == "release" and written_behind:
            await operation()
            # Returned before the socket timeout could fire: it did not wait for a reply.
            assert time.monotonic() - started < socket_timeout_s
            continue
        with pytest.raises(GovernanceBackendError) as caught:
            await operation()
        assert time.monotonic() - started < within_s, name
        err = caught.value
        assert (err.operation, err.scope) == (name, SCOPE)
        assert f"operation={name}" in str(err)
        assert f"scope={SCOPE!r}" in str(err)
        errors.append(err)
    return errors


async def test_redis_down_fails_closed_without_leaking_the_password(
    make_redis_server: Callable[..., Any],
) -> None:
    """A stopped server: every operation raises GovernanceBackendError fast, naming op and scope.

    The URL's password appears in no message, repr or chained traceback; once
    the server is back the same backend instance works again.
    """
    server = make_redis_server(password=PASSWORD)
    backend = RedisBackend(server.url, socket_timeout_s=0.5)
    try:
        assert PASSWORD not in repr(backend)
        lease = await _grant(backend)
        server.stop()
        errors = await _assert_fails_closed(backend, lease, socket_timeout_s=0.5)
        for err in errors:
            assert err.__cause__ is not None
            text = "".join(traceback.format_exception(err)) + repr(err)
            assert PASSWORD not in text
            assert ":***@127.0.0.1" in str(err)
        server.start()
        await backend.release(await _grant(backend), SUCCESS)
        assert await backend.progress_age_s(SCOPE) < 1.0
    finally:
        await backend.aclose()


async def test_frozen_redis_fails_closed_within_the_socket_timeout(
    make_redis_server: Callable[..., Any],
) -> None:
    """A server that accepts but never answers (SIGSTOP) fails every operation by the timeout.

    But the release, written behind: it returns at once. What the server
    received meanwhile it runs on waking, and the backend still reads those
    replies: the release frees the permit, and the same backend serves again.
    """
    server = make_redis_server()
    backend = RedisBackend(server.url, socket_timeout_s=0.3)
    try:
        lease = await _grant(backend)
        server.pause()
        try:
            await _assert_fails_closed(backend, lease, socket_timeout_s=0.3, written_behind=True)
        finally:
            server.resume()
        assert await _until_free(backend) == 0
        assert await backend.renew(lease) is False
        await backend.release(await _grant(backend), SUCCESS)
        assert (await backend.snapshot(SCOPE)).in_flight == 0
    finally:
        await backend.aclose()


async def _until_free(backend: RedisBackend, within_s: float = 3.0) -> int:
    """Permits in use once they are all free, or after ``within_s`` (what was left behind runs)."""
    deadline = time.monotonic() + within_s
    while (in_flight := (await backend.snapshot(SCOPE)).in_flight) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return in_flight


async def test_acquire_timed_out_on_a_frozen_server_gives_its_late_grant_back(
    make_redis_server: Callable[..., Any],
) -> None:
    """A frozen server runs a timed-out acquire on waking: its grant is released, not held."""
    server = make_redis_server()
    backend = RedisBackend(server.url, socket_timeout_s=0.3)
    try:
        # Script loaded and connection open: the EVALSHA reaches the frozen server, which runs it.
        await backend.release(await _grant(backend), SUCCESS)
        server.pause()
        try:
            with pytest.raises(GovernanceBackendError) as caught:
                await backend.acquire(SCOPE, [ONE], ttl_s=600)
        finally:
            server.resume()
        assert await _until_free(backend) == 0
        assert "no reply within 0.3 s" in str(caught.value)
        with _sync(server.url) as client:
            # The script did run (it registered the source) and its lease is gone.
            assert client.zscore("pgw:{chat}:sources", "a") is not None
            assert client.zcount("pgw:{chat}:leases:a", *LEASES_ONLY) == 0
    finally:
        await backend.aclose()


async def test_a_script_error_fails_closed(backend: RedisBackend, redis_url: str) -> None:
    """A script failing on the server (here: a key of the wrong type) raises, never admits."""
    with _sync(redis_url) as client:
        client.set("pgw:{chat}:leases:a", "not a zset")
    with pytest.raises(GovernanceBackendError) as caught:
        await backend.acquire(SCOPE, [ONE], ttl_s=60)
    assert (caught.value.operation, caught.value.scope) == ("acquire", SCOPE)
    assert "ResponseError" in str(caught.value)


def test_a_bad_url_is_a_config_error_without_the_password() -> None:
    """An unusable URL fails at construction with ConfigError; its password stays masked."""
    with pytest.raises(ConfigError) as caught:
        RedisBackend(f"nosuch://:{PASSWORD}@127.0.0.1:1/0")
    assert PASSWORD not in str(caught.value)
    assert caught.value.field == "redis_url"


# --- cancellation ---------------------------------------------------------------------------


async def _in_flight_after_close(backend: RedisBackend, url: str) -> int:
    """Let the backend finish what cancelled callers left behind, then count permits afresh."""
    await backend.aclose()
    fresh = RedisBackend(url)
    try:
        return (await fresh.snapshot(SCOPE)).in_flight
    finally:
        await fresh.aclose()


async def _lease_from_elsewhere(url: str) -> Lease:
    """A lease granted by another backend (process): the one releasing it has no connection yet."""
    granting = RedisBackend(url)
    try:
        return await _grant(granting, ttl=600)
    finally:
        await granting.aclose()


async def test_cancelled_release_still_returns_the_permit(redis_url: str) -> None:
    """Cancelling a release waiting for the connection does not keep the permit until expiry."""
    lease = await _lease_from_elsewhere(redis_url)
    backend = RedisBackend(redis_url)
    task = asyncio.ensure_future(backend.release(lease, SUCCESS))
    await asyncio.sleep(0)
    assert not task.done()  # no connection up: it waits for its reply
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _in_flight_after_close(backend, redis_url) == 0


@pytest.mark.parametrize("turns", [0, 1, 2])
async def test_cancelled_acquire_leaves_no_permit_held(redis_url: str, turns: int) -> None:
    """A caller cancelled mid-acquire holds nothing afterwards, whenever the cancel lands."""
    backend = RedisBackend(redis_url)
    await backend.snapshot(SCOPE)  # connection open, so the acquire is one round trip
    task = asyncio.ensure_future(backend.acquire(SCOPE, [ONE], ttl_s=600))
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await _in_flight_after_close(backend, redis_url) == 0
    with _sync(redis_url) as client:
        # Cancelled before it started, the acquire never ran; after, it ran to the end (its
        # grant given back), as the registration of the candidate shows.
        assert (client.zscore("pgw:{chat}:sources", "a") is not None) == (turns > 0)


async def test_acquire_cancelled_while_its_reply_is_in_flight_gives_the_grant_back(
    make_redis_server: Callable[..., Any],
) -> None:
    """The script ran on the server but its caller is gone: the grant is released, not leaked."""
    server = make_redis_server()
    backend = RedisBackend(server.url)
    await backend.snapshot(SCOPE)  # connection open, so the acquire is one round trip
    server.pause()
    try:
        task = asyncio.ensure_future(backend.acquire(SCOPE, [ONE], ttl_s=600))
        await asyncio.sleep(0.05)  # the EVALSHA is sent; its reply cannot come yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        server.resume()
    assert await _in_flight_after_close(backend, server.url) == 0
    with _sync(server.url) as client:
        assert client.zscore("pgw:{chat}:sources", "a") is not None


async def test_cancelled_release_wakes_the_local_waiting_room(redis_url: str) -> None:
    """The release of a cancelled caller still wakes the head of the waiting room."""
    lease = await _lease_from_elsewhere(redis_url)
    backend = RedisBackend(redis_url)
    room = room_for(backend, SCOPE)
    head = room.enter()
    task = asyncio.ensure_future(backend.release(lease, SUCCESS))
    await asyncio.sleep(0)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await backend.aclose()
    assert room.wakeups == 1
    room.leave(head)


# --- packaging ------------------------------------------------------------------------------


def test_import_polygateway_does_not_import_redis() -> None:
    """The top-level package and the backends package leave redis unimported (it is an extra)."""
    code = (
        "import sys, polygateway, polygateway.backends, polygateway.backends.memory; "
        "assert 'redis' not in sys.modules, sorted(m for m in sys.modules if 'redis' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_missing_redis_says_which_extra_to_install() -> None:
    """Without the redis client, importing the Redis backend names the pip extra."""
    code = (
        "import sys; sys.modules['redis'] = None\n"
        "try:\n"
        "    import polygateway.backends.redis\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert "pip install 'polygateway[redis]'" in out.stdout
