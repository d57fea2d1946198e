"""The sharded httpx pool over real sockets: connection bound, full concurrency, keep-alive.

The upstream is a raw asyncio HTTP/1.1 server on 127.0.0.1 that keeps
connections alive and counts them by peer port, so the test sees how many
TCP connections the transport really opened. It can hold every answer until
a given number of requests are in flight at once (a barrier), which proves
the shards together carry that many without one waiting for another.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from polygateway.config import SourceConfig
from polygateway.transport.factory import make_transport
from polygateway.transport.http import HttpRequest, Transport
from polygateway.transport.httpx_client import SHARD_SIZE
from polygateway.transport.pool import shard_plan

# Bounds the waits of the tests themselves, never a timing under test.
WAIT_S = 10.0


class KeepAliveUpstream:
    """Answers every request with a small JSON body on a kept-alive connection.

    ``hold_until``: when set, each answer waits until that many requests are
    in flight at once (or ``WAIT_S`` passes, so a failing test ends).
    """

    def __init__(self, hold_until: int | None = None) -> None:
        self.hold_until = hold_until
        self.peers: set[int] = set()
        self.in_flight = 0
        self.max_in_flight = 0
        self.answered = 0
        self._barrier = asyncio.Event()
        self.server: asyncio.Server | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        length = 0
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        await reader.readexactly(length)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.hold_until is not None:
                if self.in_flight >= self.hold_until:
                    self._barrier.set()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(WAIT_S):
                        await self._barrier.wait()
        finally:
            self.in_flight -= 1
        body = json.dumps({"ok": True}).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        self.answered += 1

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.peers.add(writer.get_extra_info("peername")[1])
        try:
            while not reader.at_eof():
                await self._serve_one(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(ConnectionError, OSError):
                writer.close()


@contextlib.asynccontextmanager
async def serving(hold_until: int | None = None) -> AsyncIterator[KeepAliveUpstream]:
    """A fresh upstream on a free loopback port for the block's duration."""
    up = KeepAliveUpstream(hold_until)
    up.server = await asyncio.start_server(up.handle, "127.0.0.1", 0)
    up.port = up.server.sockets[0].getsockname()[1]
    try:
        yield up
    finally:
        up.server.close()
        await up.server.wait_closed()


@contextlib.asynccontextmanager
async def httpx_transport(up: KeepAliveUpstream, max_connections: int) -> AsyncIterator[Transport]:
    """The httpx transport as the clients build it, for one source at ``up``."""
    source = SourceConfig(name="primary", protocol="openai", base_url=up.base_url)
    built = make_transport("httpx", [source], max_connections=max_connections)
    try:
        yield built
    finally:
        await built.aclose()


def chat(up: KeepAliveUpstream) -> HttpRequest:
    """A chat request to the upstream."""
    base: dict[str, Any] = {
        "source": "primary",
        "url": f"{up.base_url}/chat/completions",
        "timeout_s": WAIT_S,
        "connect_timeout_s": WAIT_S,
        "headers": {"Content-Type": "application/json"},
        "json": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    return HttpRequest(**base)


async def test_64_concurrent_requests_never_open_more_than_max_connections() -> None:
    """64 at once over a pool of 60 (5 shards of 12): all succeed on exactly 60 connections."""
    assert shard_plan(60, SHARD_SIZE) == (5, 12)
    async with serving(hold_until=60) as up, httpx_transport(up, 60) as transport:
        answers = await asyncio.gather(*(transport.send(chat(up)) for _ in range(64)))
    assert answers == [{"ok": True}] * 64
    # 60 held at once needs 60 connections; the 4 others must reuse them.
    assert up.max_in_flight == 60
    assert len(up.peers) == 60


async def test_a_full_pool_carries_max_connections_requests_at_once() -> None:
    """At max_connections in flight no request waits on a busy shard while another has room."""
    shards, per_shard = shard_plan(64, SHARD_SIZE)
    async with serving(hold_until=64) as up, httpx_transport(up, 64) as transport:
        answers = await asyncio.gather(*(transport.send(chat(up)) for _ in range(64)))
    assert answers == [{"ok": True}] * 64
    assert up.max_in_flight == 64
    assert 64 == len(up.peers) <= shards * per_shard


async def test_sequential_requests_reuse_one_kept_alive_connection() -> None:
    """A lone caller always lands on the first shard, so one TCP connection serves it all."""
    async with serving() as up, httpx_transport(up, 64) as transport:
        for _ in range(10):
            assert await transport.send(chat(up)) == {"ok": True}
    assert up.answered == 10
    assert len(up.peers) == 1


@pytest.mark.parametrize("concurrency", [2, 5])
async def test_steady_low_concurrency_opens_only_as_many_connections_as_callers(
    concurrency: int,
) -> None:
    """A few callers repeating requests keep to a few warm connections, not one per shard."""
    async with serving() as up, httpx_transport(up, 64) as transport:

        async def caller() -> None:
            for _ in range(20):
                assert await transport.send(chat(up)) == {"ok": True}

        await asyncio.gather(*(caller() for _ in range(concurrency)))
    assert up.answered == 20 * concurrency
    assert len(up.peers) <= concurrency
