"""The Redis backend's own wire (``wire.py``), its timeouts (``bounded.py``).

The backend pipelines its scripts on one connection of its own, read by a
protocol of its own, rather than through ``redis.asyncio.Redis``; these
tests pin what that wire promises: one connection however many operations
run at once, every operation served, a connection the server dropped while
idle reconnected rather than failing an operation, a script error leaving
the connection in step, a silent server's connection closed after
``_LATE_REPLY_S``, and releases written behind: a release returns once
written, runs before anything this process sends after it, and is logged
(without the password) when it fails unseen. And of its timeouts: each
operation fails at its own deadline, although one timer serves them all.
And of its connection, made by the wire itself: a password, a user of the
server's ACL, a database other than 0, a unix socket and TLS are honoured,
from the URL or from an injected client's settings, and a refusal fails
closed with redis-py's words and without the password.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from _redis_tls import TLSRedis

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend, limiter, wire
from polygateway.backends.redis.bounded import TIMED_OUT, Deadlines
from polygateway.errors import GovernanceBackendError
from polygateway.middleware.waiting import room_for

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


async def test_operations_at_once_share_one_pipelined_connection(redis_url: str) -> None:
    """40 calls at once: all served, over one connection (an injected pool's size aside)."""
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
        assert set(opened) == {1}
        assert (await backend.snapshot(SCOPE)).in_flight == 0
    finally:
        await backend.aclose()
        await client.aclose()
        await pool.disconnect()


async def test_callers_cancelled_mid_operation_leave_the_others_served(redis_url: str) -> None:
    """Callers cancelled while their replies are due: theirs are read, the others get theirs."""
    backend = RedisBackend(redis_url)
    try:
        await backend.progress_age_s(SCOPE)  # the connection is open
        tasks = [asyncio.ensure_future(backend.progress_age_s(SCOPE)) for _ in range(6)]
        await asyncio.sleep(0)
        for task in tasks[1:5]:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert [isinstance(r, asyncio.CancelledError) for r in results] == [False] + [True] * 4 + [
            False
        ]
        assert results[0] == results[5] == float("inf")
        # The replies of the cancelled callers were read in their turn: the wire is in step.
        await backend.release(await _grant(backend), SUCCESS)
        assert await backend.progress_age_s(SCOPE) < 1.0
        assert backend._wire.pending == 0
    finally:
        await backend.aclose()


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


async def test_a_script_error_leaves_the_connection_in_step(redis_url: str) -> None:
    """A script failing on the server fails closed; the next operations run normally."""
    backend = RedisBackend(redis_url)
    try:
        with redis.Redis.from_url(redis_url) as admin:
            admin.set("pgw:{chat}:leases:a", "not a zset")
            with pytest.raises(GovernanceBackendError, match="WRONGTYPE"):
                await backend.acquire(SCOPE, [MANY], ttl_s=60)
            admin.delete("pgw:{chat}:leases:a")
        await backend.release(await _grant(backend), SUCCESS)
        assert await backend.progress_age_s(SCOPE) < 1.0
        assert _clients(redis_url) == 1
    finally:
        await backend.aclose()


async def test_a_connection_silent_past_the_late_reply_bound_is_closed(
    make_redis_server: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Silent past _LATE_REPLY_S with a reply due, the connection is given up; a new one serves."""
    monkeypatch.setattr(limiter, "_LATE_REPLY_S", 0.4)
    server = make_redis_server()
    backend = RedisBackend(server.url, socket_timeout_s=0.2)
    try:
        await backend.progress_age_s(SCOPE)  # connection open, script loaded
        server.pause()
        try:
            with pytest.raises(GovernanceBackendError, match=r"no reply within 0\.2 s"):
                await backend.progress_age_s(SCOPE)
            assert backend._wire.pending == 1  # its reply is still awaited
            deadline = time.monotonic() + 2.0
            while backend._wire.pending and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert backend._wire.pending == 0
            assert not backend._wire.writable
        finally:
            server.resume()
        # Its connection was closed with it; a new one serves.
        assert await backend.progress_age_s(SCOPE) == float("inf")
    finally:
        await backend.aclose()


class _Transport(asyncio.Transport):
    """Just enough of a transport for a ``Link``: writes are kept, close is remembered."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def close(self) -> None:
        self.closed = True


async def test_a_connection_busy_past_the_late_reply_bound_is_kept() -> None:
    """Replies due all the time but coming: the server is not silent, the connection stays.

    A reply every 0.1 s against a 0.5 s bound: only a stall of this process
    longer than 0.4 s could pass for the server's silence.
    """
    link = wire.Link(late_reply_s=0.5)
    transport = _Transport()
    link.connection_made(transport)
    replies: list[Any] = []
    link.send(b"PING", replies.append)
    for _ in range(10):  # 1 s, over two bounds: always one reply due, one answered
        await asyncio.sleep(0.1)
        link.send(b"PING", replies.append)
        link.data_received(b"+PONG\r\n")
    assert not transport.closed
    assert len(replies) == 10
    # Then silence with a reply due: given up within a bound and a half (the watchdog
    # looks every half bound, and its timer is due before this sleep's).
    await asyncio.sleep(0.8)
    assert transport.closed
    link.connection_lost(None)
    assert isinstance(replies[-1], redis.exceptions.ConnectionError)


# --- releases written behind ----------------------------------------------------------------


async def test_a_release_returns_once_written_and_frees_its_permit_when_the_server_runs_it(
    make_redis_server: Callable[..., Any],
) -> None:
    """On a frozen server a release returns at once; the server frees the permit on waking."""
    server = make_redis_server()
    # A long socket timeout: a release that waited for its reply would take all of it.
    backend = RedisBackend(server.url, socket_timeout_s=2.0)
    try:
        lease = await _grant(backend)
        server.pause()
        try:
            started = time.monotonic()
            await backend.release(lease, SUCCESS)
            assert time.monotonic() - started < 1.0
            assert backend._wire.pending == 1
        finally:
            server.resume()
        # Behind the release on the one connection: the snapshot sees the permit free.
        assert (await backend.snapshot(SCOPE)).in_flight == 0
    finally:
        await backend.aclose()


async def test_what_follows_a_release_in_this_process_sees_its_permit_free(redis_url: str) -> None:
    """One permit, released and acquired again at once, 50 times: never refused."""
    backend = RedisBackend(redis_url)
    one = SourceSpec(name="one", max_concurrency=1)
    try:
        lease = await _grant(backend, one)
        for _ in range(50):
            await backend.release(lease, SUCCESS)
            lease = await _grant(backend, one)
        await backend.release(lease, SUCCESS)
        assert (await backend.snapshot(SCOPE)).in_flight == 0
    finally:
        await backend.aclose()


async def test_a_release_written_behind_wakes_the_waiting_room_when_its_reply_comes(
    redis_url: str,
) -> None:
    """The permit freed, as its reply says, wakes the head of this process's waiting room."""
    backend = RedisBackend(redis_url)
    room = room_for(backend, SCOPE)
    try:
        lease = await _grant(backend)
        head = room.enter()
        await backend.release(lease, SUCCESS)
        assert room.wakeups == 0  # written, its reply not read yet
        deadline = time.monotonic() + 2.0
        while not room.wakeups and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert room.wakeups == 1
        room.leave(head)
    finally:
        await backend.aclose()


async def test_a_late_grant_given_back_before_a_connection_is_up_still_wakes_the_room(
    redis_url: str,
) -> None:
    """The give-back of a late grant is waited for by nobody, even queued for a connection."""
    granting = RedisBackend(redis_url)
    try:
        lease = await _grant(granting)
    finally:
        await granting.aclose()
    backend = RedisBackend(redis_url)  # no connection up yet: the release is queued
    room = room_for(backend, SCOPE)
    head = room.enter()
    try:
        assert backend._release(lease, AttemptOutcome("cancelled"), waited=False) is None
        deadline = time.monotonic() + 2.0
        while not room.wakeups and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert room.wakeups == 1
        assert (await backend.snapshot(SCOPE)).in_flight == 0
        room.leave(head)
    finally:
        await backend.aclose()


async def test_a_release_that_fails_unseen_is_logged_without_the_password(
    make_redis_server: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Written, then its connection lost before the reply: a warning names it, not the password."""
    password = "wire-pw-FAKE-5c1d"
    server = make_redis_server(password=password)
    backend = RedisBackend(server.url, socket_timeout_s=0.5)
    try:
        lease = await _grant(backend)
        server.pause()
        await backend.release(lease, SUCCESS)  # written; the frozen server has not run it
        with caplog.at_level(logging.WARNING, logger="polygateway.backends.redis"):
            # Killed while frozen, so it never runs the release: the connection drops, reply due.
            os.kill(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=5)
            deadline = time.monotonic() + 2.0
            while backend._wire.pending and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        assert backend._wire.pending == 0
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("redis release failed" in w and "scope='chat'" in w for w in warnings), warnings
        assert password not in caplog.text
    finally:
        await backend.aclose()


async def test_a_release_with_no_connection_up_waits_and_fails_closed(
    make_redis_server: Callable[..., Any],
) -> None:
    """Nothing to write on (the server is down): the release waits for the connection and fails."""
    server = make_redis_server()
    backend = RedisBackend(server.url, socket_timeout_s=0.5)
    try:
        lease = await _grant(backend)
        server.stop()
        await asyncio.sleep(0.1)  # the end of file reaches the event loop: no connection up
        assert not backend._wire.writable
        with pytest.raises(GovernanceBackendError) as caught:
            await backend.release(lease, SUCCESS)
        assert (caught.value.operation, caught.value.scope) == ("release", SCOPE)
    finally:
        await backend.aclose()


# --- timeouts: one deadline queue for every operation -------------------------------------


async def test_each_operation_times_out_at_its_own_deadline(
    make_redis_server: Callable[..., Any],
) -> None:
    """On a frozen server, an operation started later fails later: each waits its own timeout."""
    server = make_redis_server()
    backend = RedisBackend(server.url, socket_timeout_s=0.3)
    began: dict[str, float] = {}
    took: dict[str, float] = {}

    async def timed(name: str) -> None:
        began[name] = time.monotonic()
        with pytest.raises(GovernanceBackendError):
            await backend.progress_age_s(SCOPE)
        took[name] = time.monotonic() - began[name]

    try:
        await backend.progress_age_s(SCOPE)  # connections open, script loaded
        server.pause()
        try:
            first = asyncio.ensure_future(timed("first"))
            await asyncio.sleep(0.2)
            await asyncio.gather(first, timed("second"))
        finally:
            server.resume()
        assert began["second"] - began["first"] >= 0.2
        # Each waited its own 0.3 s: the second did not end at the first's deadline
        # (0.1 s after it began). The upper bound only says "no hang": a loaded machine
        # may fire a timer late, never early.
        for name in ("first", "second"):
            assert 0.25 <= took[name] < 0.3 + 1.5, (name, took)
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


# --- connecting: the wire's own socket, TLS and login -------------------------------------

PASSWORD = "conn-pw-FAKE-77e1"


def _keys_in(server: Any, db: int) -> list[bytes]:
    """The backend's keys in database ``db`` of ``server``."""
    with redis.Redis(port=server.port, password=server.password, db=db) as admin:
        return sorted(admin.keys("pgw:*"))


async def _serves(url: str, **kwargs: Any) -> None:
    """A backend on ``url`` serves a call and a snapshot, then closes."""
    backend = RedisBackend(url, **kwargs)
    try:
        await backend.release(await _grant(backend), SUCCESS)
        assert (await backend.snapshot(SCOPE)).in_flight == 0
    finally:
        await backend.aclose()


async def test_a_password_and_a_database_other_than_0_are_honoured(
    make_redis_server: Callable[..., Any],
) -> None:
    """``redis://:password@host:port/3``: the state lands in database 3, none in 0."""
    server = make_redis_server(password=PASSWORD)
    await _serves(f"redis://:{PASSWORD}@127.0.0.1:{server.port}/3")
    assert b"pgw:{chat}:sources" in _keys_in(server, 3)
    assert _keys_in(server, 0) == []


async def test_an_acl_user_from_the_url_or_its_query_is_logged_in(
    make_redis_server: Callable[..., Any],
) -> None:
    """``user:password@`` and ``?username=&password=&db=`` log in a user of the server's ACL."""
    server = make_redis_server(password=PASSWORD)
    with server.client() as admin:
        admin.acl_setuser(
            "gw", enabled=True, passwords=["+gw-pw"], keys=["pgw:*"], commands=["+@all"]
        )
    await _serves(f"redis://gw:gw-pw@127.0.0.1:{server.port}/1")
    await _serves(f"redis://127.0.0.1:{server.port}/0?username=gw&password=gw-pw&db=2")
    assert _keys_in(server, 1) == _keys_in(server, 2) != []


async def test_a_unix_socket_with_a_password_and_a_database_is_honoured(
    make_redis_server: Callable[..., Any], tmp_path: Path
) -> None:
    """``unix://:password@/path?db=2``: served over the socket, the state in database 2."""
    path = tmp_path / "redis.sock"
    server = make_redis_server(
        "--unixsocket", str(path), "--unixsocketperm", "700", password=PASSWORD
    )
    await _serves(f"unix://:{PASSWORD}@{path}?db=2")
    assert _keys_in(server, 2) != []
    assert _keys_in(server, 0) == []


async def test_an_injected_clients_password_and_database_are_honoured(
    make_redis_server: Callable[..., Any],
) -> None:
    """The wire connects with the client's settings; the URL only names it in messages."""
    server = make_redis_server(password=PASSWORD)
    client = aioredis.Redis(port=server.port, password=PASSWORD, db=6)
    try:
        await _serves("redis://named-only-in-messages/0", client=client)
    finally:
        await client.aclose()
    assert _keys_in(server, 6) != []


async def test_the_connection_is_named_and_its_login_is_not_repeated(
    make_redis_server: Callable[..., Any],
) -> None:
    """``?client_name=`` names the connection; HELLO and SELECT are sent once, when it is made."""
    server = make_redis_server(password=PASSWORD)
    backend = RedisBackend(f"redis://:{PASSWORD}@127.0.0.1:{server.port}/3?client_name=pgw-test")
    try:
        with server.client() as admin:
            admin.config_resetstat()  # after the inspecting client's own HELLO
            for _ in range(3):
                await backend.release(await _grant(backend), SUCCESS)
            assert "pgw-test" in [c["name"] for c in admin.client_list()]
            stats = admin.info("commandstats")
        assert (stats["cmdstat_hello"]["calls"], stats["cmdstat_select"]["calls"]) == (1, 1)
    finally:
        await backend.aclose()


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("redis://:wrong-FAKE-pw@127.0.0.1:{port}/0", "AuthenticationError: invalid username"),
        ("redis://127.0.0.1:{port}/0", "AuthenticationError: HELLO must be called"),
        ("redis://:{password}@127.0.0.1:{port}/99", "ResponseError: DB index is out of range"),
    ],
)
async def test_a_refused_login_fails_closed_in_redis_pys_words(
    make_redis_server: Callable[..., Any], url: str, error: str
) -> None:
    """A wrong or missing password, a database out of range: the operation fails closed."""
    server = make_redis_server(password=PASSWORD)
    backend = RedisBackend(url.format(port=server.port, password=PASSWORD))
    try:
        with pytest.raises(GovernanceBackendError, match=error) as caught:
            await backend.progress_age_s(SCOPE)
        assert PASSWORD not in str(caught.value)
        assert "wrong-FAKE-pw" not in str(caught.value)
        assert not backend._wire.writable
    finally:
        await backend.aclose()


async def test_tls_verifies_the_servers_certificate(tls_redis: TLSRedis) -> None:
    """``rediss://`` with the CA served (password, db 1); without the CA, fails closed."""
    await _serves(tls_redis.url(1))
    assert _keys_in(tls_redis.server, 1) != []
    backend = RedisBackend(f"rediss://:{tls_redis.password}@127.0.0.1:{tls_redis.tls_port}/1")
    try:
        with pytest.raises(GovernanceBackendError, match="CERTIFICATE_VERIFY_FAILED") as caught:
            await backend.progress_age_s(SCOPE)
        assert tls_redis.password not in str(caught.value)
    finally:
        await backend.aclose()


async def test_a_tls_connection_is_closed_when_aclose_returns(tls_redis: TLSRedis) -> None:
    """TLS says goodbye before its socket closes: ``aclose`` waits for that (briefly), so an
    event loop closed right after leaks no socket (it would warn when collected)."""
    backend = RedisBackend(tls_redis.url(1))
    await backend.release(await _grant(backend), SUCCESS)
    link = backend._wire._link
    assert link is not None
    assert link._transport is not None
    sock = link._transport.get_extra_info("socket")
    assert sock.fileno() >= 0
    await backend.aclose()
    assert sock.fileno() == -1, "the socket is still open"


async def test_a_connection_abandoned_while_being_made_is_made_again_where_locate_says(
    redis_url: str, make_redis_server: Callable[..., Any]
) -> None:
    """``abandon`` during the connect (a failover announced then): the new link is discarded.

    Behind Sentinel, a connection being made to a frozen primary when the new
    one is announced would otherwise be kept once the old server thaws (its
    ROLE still master for a moment): writes there are lost at its demotion.
    """
    old = wire.Endpoint.from_url(redis_url, connect_timeout_s=5.0)
    new_server = make_redis_server()
    new = wire.Endpoint.from_url(new_server.url, connect_timeout_s=5.0)
    located: list[wire.Endpoint] = []
    link: wire.Wire

    async def locate() -> wire.Endpoint:
        where = old if not located else new
        located.append(where)
        if where is old:
            asyncio.get_running_loop().call_soon(link.abandon)  # announced while connecting
        return where

    link = wire.Wire(old, late_reply_s=5.0, locate=locate)
    reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    link.send(wire.command("SET", "abandon-test", "written"), reply.set_result)
    try:
        async with asyncio.timeout(10):
            assert await reply == b"OK"
    finally:
        await link.aclose()
    assert located == [old, new, new]  # the last: asked again once connected
    assert link.endpoint == new
    with redis.Redis.from_url(new_server.url) as on_new, redis.Redis.from_url(redis_url) as on_old:
        assert on_new.get("abandon-test") == b"written"
        assert on_old.get("abandon-test") is None


async def test_a_connection_made_where_locate_no_longer_points_is_made_again(
    make_redis_server: Callable[..., Any],
) -> None:
    """A connection that comes up on a server ``locate`` no longer names is never written to.

    Behind Sentinel: a connection being made to a frozen primary completes once
    it thaws, its ROLE still master. Sentinel names the promoted replica from
    its reconfiguration step on but announces ``+switch-master`` only at the
    failover's end, so a thaw in between leaves nothing to abandon the
    connection: the commands queued for it (in the failover soak, the releases
    of the gap written again) ran on the old primary and were lost at its
    demotion, their leases held on the new one until they expired. So the wire
    asks again once connected, and goes where the answer is now.
    """
    old_server, new_server = make_redis_server(), make_redis_server()
    old = replace(wire.Endpoint.from_url(old_server.url, connect_timeout_s=5.0), primary_only=True)
    new = replace(wire.Endpoint.from_url(new_server.url, connect_timeout_s=5.0), primary_only=True)
    named = [old]  # what the Sentinels name now
    asked = asyncio.Event()

    async def locate() -> wire.Endpoint:
        asked.set()
        return named[0]

    link = wire.Wire(old, late_reply_s=5.0, locate=locate)
    reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    old_server.pause()
    try:
        link.send(wire.command("SET", "moved-test", "written"), reply.set_result)
        await asked.wait()  # located: connecting to the frozen primary
        named[0] = new  # the replica is promoted; no announcement yet
        old_server.resume()  # the old primary answers, still a master
        async with asyncio.timeout(10):
            assert await reply == b"OK"
    finally:
        old_server.resume()
        await link.aclose()
    assert link.endpoint == new
    with (
        redis.Redis.from_url(new_server.url) as on_new,
        redis.Redis.from_url(old_server.url) as on_old,
    ):
        assert on_old.get("moved-test") is None
        assert on_new.get("moved-test") == b"written"
