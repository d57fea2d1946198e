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
from collections.abc import Callable
from typing import Any

import pytest
import redis

from polygateway.backends.base import AttemptOutcome, SourceSpec
from polygateway.backends.redis import RedisBackend, codec
from polygateway.errors import GovernanceBackendError

SCOPE = "chat"
SPECS = [SourceSpec(name="a", max_concurrency=1), SourceSpec(name="b", max_concurrency=1)]
TTL_S = 600.0
"""The lease would hold its permit ten minutes: only a written release frees it in time."""
SOCKET_TIMEOUT_S = 2.0
GIVEN_BACK_WITHIN_S = 5.0


class Relay:
    """A TCP relay to one server: replies can be held, and connections reset (new ones go on)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.holding = False
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Tracked, so that closing the relay also ends a connection it is still making.
        handler = asyncio.current_task()
        if handler is not None:
            self._tasks.add(handler)
            handler.add_done_callback(self._tasks.discard)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except asyncio.CancelledError:
            writer.transport.abort()
            raise
        if self._closed:  # accepted as the relay closed: nothing may outlive it
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self._writers += (writer, up_writer)
        for task in (
            asyncio.create_task(self._pump(reader, up_writer, held=False)),
            asyncio.create_task(self._pump(up_reader, writer, held=True)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, held: bool
    ) -> None:
        try:
            while data := await reader.read(65536):
                if not (held and self.holding):
                    writer.write(data)
        except OSError:
            pass
        writer.transport.abort()

    def reset(self) -> None:
        """Drop what is held and reset every connection; replies flow again on new ones."""
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()
        self.holding = False

    async def aclose(self) -> None:
        self._closed = True
        self.reset()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def leases(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        return sum(int(client.zcard(codec.key(SCOPE, "leases", spec.name))) for spec in SPECS)


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
