"""An ACQUIRE that ran but whose reply was lost with its connection gives its lease back.

A grant can run and be replicated while its reply is lost with the
connection: the failover soak (``test_redis_failover_soak.py``) showed one,
granted on the primary at the moment it was frozen (SIGSTOP) and kept by the
replica's promotion (``redis_replica_acks = 1``), which would otherwise hold
its permit for its whole lease. Its id
is the backend's own (``acquire`` makes it before writing the script), and
releasing an id that holds nothing is harmless (RELEASE returns 0), so an
ACQUIRE whose connection was lost after it was written (``wire.Unanswered``)
can be given back on each of its candidates, as the releases of a gap are
written again (research-wiki/guides/redis-fleet.md, "Leases and crashes").

Here a relay in front of a dedicated redis-server lets the ACQUIRE through,
holds its reply, and resets the connection: the server granted, the backend
never heard. Whether its caller still waited (it gets a typed failure) or had
left (its socket timeout passed first), the lease must be gone from the server
soon after the backend reconnects, not at its expiry.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import pytest
import redis
from _leases import LEASES_ONLY

from polygateway.backends.base import AttemptOutcome, SourceSpec
from polygateway.backends.redis import RedisBackend, codec
from polygateway.errors import GovernanceBackendError

SCOPE = "chat"
SPECS = [SourceSpec(name="a", max_concurrency=1), SourceSpec(name="b", max_concurrency=1)]
TTL_S = 600.0
"""The lease would hold its permit ten minutes: only a written release frees it in time."""
SOCKET_TIMEOUT_S = 2.0
GIVEN_BACK_WITHIN_S = 5.0


class _End(asyncio.Protocol):
    """One end of a relayed connection: what it receives is written to the other end."""

    def __init__(self, relay: Relay, *, replies: bool, other: _End | None = None) -> None:
        self.relay = relay
        self.replies = replies  # the server's end: what it receives can be held
        self.other = other
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.relay.closed or (self.other is not None and self.other.lost.done()):
            transport.abort()  # made as the relay closed, or its client left meanwhile

    def data_received(self, data: bytes) -> None:
        if self.replies and self.relay.holding:
            if self.relay.passing <= 0:
                return  # held: lost with the connection at the reset
            self.relay.passing -= 1
        if self.other is not None and self.other.transport is not None:
            self.other.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.set_result(None)
        if self.other is not None:
            self.other.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class Relay:
    """A TCP relay to one server: replies can be held, and connections reset (new ones go on).

    It accepts on its own listening socket, in one task that is woken to stop
    rather than cancelled, and it never cancels a connection being made; so
    every socket it accepted or opened is known when it closes, and it aborts
    and awaits them all. (asyncio's server, on Python 3.11, can accept a
    connection as it closes and never hand it to the protocol made for it.)
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.holding = False
        self.passing = 0  # while holding, the server's writes still let through first
        self.closed = False
        self._ends: list[_End] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._accepting: asyncio.Task[None] | None = None

    async def start(self) -> int:
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self._listener.setblocking(False)
        self._accepting = asyncio.get_running_loop().create_task(self._accept())
        port: int = self._listener.getsockname()[1]
        return port

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            if self.closed:  # the wake-up of aclose, or a connection racing it
                conn.close()
                return
            self._track(loop.create_task(self._serve(conn)))

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _end(self, other: _End | None = None) -> _End:
        end = _End(self, replies=other is not None, other=other)
        if other is not None:  # joined before either is handed on, so each aborts the other
            other.other = end
        self._ends.append(end)
        return end

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        _, client = await loop.connect_accepted_socket(self._end, conn)
        if client.transport is None or client.lost.done() or self.closed:
            client.abort()
            return
        client.transport.pause_reading()  # its bytes wait until its server end is made
        try:
            await loop.create_connection(lambda: self._end(client), "127.0.0.1", self.target_port)
        except OSError:
            client.abort()
            return
        client.transport.resume_reading()

    def reset(self) -> None:
        """Drop what is held and reset every connection; replies flow again on new ones."""
        for end in self._ends:
            end.abort()
        self._ends = [end for end in self._ends if not end.lost.done()]
        self.holding = False

    async def aclose(self) -> None:
        self.closed = True
        loop = asyncio.get_running_loop()
        if self._accepting is not None:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as waker:
                waker.setblocking(False)
                await loop.sock_connect(waker, self._listener.getsockname())
                await self._accepting
        self._listener.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.reset()
        await asyncio.gather(*(end.lost for end in self._ends))


def leases(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        return sum(
            int(client.zcount(codec.key(SCOPE, "leases", spec.name), *LEASES_ONLY))
            for spec in SPECS
        )


async def eventually(check: Callable[[], bool], within_s: float) -> bool:
    deadline = asyncio.get_running_loop().time() + within_s
    while not await asyncio.to_thread(check):
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)  # edge: polling a real server
    return True


@pytest.mark.parametrize("caller", ["waiting", "left"])
async def test_an_acquire_run_but_unanswered_gives_its_lease_back(
    make_redis_server: Callable[..., Any], caller: str
) -> None:
    """The server granted, the reply was lost with the connection: the lease is released."""
    server = make_redis_server()
    relay = Relay(server.port)
    port = await relay.start()
    backend = RedisBackend(f"redis://127.0.0.1:{port}/0", socket_timeout_s=SOCKET_TIMEOUT_S)
    try:
        warm = await backend.acquire(SCOPE, SPECS, ttl_s=TTL_S)  # connected, scripts loaded
        assert warm.lease is not None
        await backend.release(warm.lease, AttemptOutcome("success"))
        assert await eventually(lambda: leases(server.url) == 0, GIVEN_BACK_WITHIN_S)

        relay.holding = True
        acquiring = asyncio.create_task(backend.acquire(SCOPE, SPECS, ttl_s=TTL_S))
        assert await eventually(lambda: leases(server.url) == 1, GIVEN_BACK_WITHIN_S)  # granted
        if caller == "left":
            with pytest.raises(GovernanceBackendError, match="no reply within"):
                await acquiring  # its socket timeout passed: the caller is gone
        relay.reset()  # the reply is lost with the connection
        if caller == "waiting":
            with pytest.raises(GovernanceBackendError, match="connection"):
                await acquiring

        assert await eventually(lambda: leases(server.url) == 0, GIVEN_BACK_WITHIN_S), (
            "the lease granted unanswered is still held"
        )
    finally:
        await backend.aclose()
        await relay.aclose()


async def test_an_acquire_run_unanswered_gives_every_lease_back(
    make_redis_server: Callable[..., Any],
) -> None:
    """Calls that asked together went in one ACQUIRE run whose reply was lost: each of its
    grants is released, and the call that went alone before them keeps its lease."""
    server = make_redis_server()
    relay = Relay(server.port)
    port = await relay.start()
    backend = RedisBackend(f"redis://127.0.0.1:{port}/0", socket_timeout_s=SOCKET_TIMEOUT_S)
    wide = [*SPECS, SourceSpec(name="c", max_concurrency=2)]
    try:
        warm = await backend.acquire(SCOPE, wide, ttl_s=TTL_S)  # connected, scripts loaded
        assert warm.lease is not None
        await backend.release(warm.lease, AttemptOutcome("success"))

        # The first call's reply passes; the run of the three that arrived while it was in
        # flight is granted on the server, and its reply held.
        relay.holding, relay.passing = True, 1
        calls = [asyncio.create_task(backend.acquire(SCOPE, wide, ttl_s=TTL_S)) for _ in range(4)]
        first = await calls[0]
        assert first.lease is not None
        assert await eventually(lambda: all_leases(server.url, wide) == 4, GIVEN_BACK_WITHIN_S)
        relay.reset()  # the run's reply is lost with the connection
        for call in calls[1:]:
            with pytest.raises(GovernanceBackendError, match="connection"):
                await call

        assert await eventually(lambda: all_leases(server.url, wide) == 1, GIVEN_BACK_WITHIN_S), (
            "a lease the run granted unanswered is still held"
        )
        await backend.release(first.lease, AttemptOutcome("success"))
        assert await eventually(lambda: all_leases(server.url, wide) == 0, GIVEN_BACK_WITHIN_S)
    finally:
        await backend.aclose()
        await relay.aclose()


def all_leases(url: str, specs: list[SourceSpec]) -> int:
    with redis.Redis.from_url(url) as client:
        return sum(
            int(client.zcount(codec.key(SCOPE, "leases", spec.name), *LEASES_ONLY))
            for spec in specs
        )
