"""The aiohttp transport without its per-request extras keeps every promise, over real sockets.

``send`` now relies on aiohttp's own ``total`` timeout instead of an
``asyncio.timeout`` of its own, builds each ``ClientTimeout`` once, and
looks for secrets only on failure paths; streams close their one timer when
their context exits. These tests pin what those changes must not lose: the
total bound covers reading the body, no secret reaches an error, and no
timer outlives a stream. The upstream is a raw asyncio server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from polygateway.config import SourceConfig
from polygateway.transport.aiohttp_client import AiohttpTransport, _client_timeout
from polygateway.transport.exchange import EventStream
from polygateway.transport.http import HttpRequest, TransientError

KEY = "sk-test-SECRET-123"
# Bounds the waits of the tests themselves, never a timing under test.
WAIT_S = 5.0

Behaviour = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _head(status: int, headers: dict[str, str]) -> bytes:
    # One request per connection, said so: the client must not reuse it.
    headers = {"Connection": "close", **headers}
    lines = [f"HTTP/1.1 {status} X", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """Read one request (head and Content-Length body); returns the head."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return head


async def _until_client_closes(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(ConnectionError):
        while await reader.read(1024):
            pass


class _Upstream:
    """A scripted HTTP/1.1 server: one behaviour for every connection."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.server: asyncio.Server | None = None
        self.port = 0
        self.client_closed = asyncio.Event()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _read_request(reader)
            await self.behaviour(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(ConnectionError, OSError):
                writer.close()


@contextlib.asynccontextmanager
async def _serving(behaviour: Behaviour) -> AsyncIterator[tuple[_Upstream, AiohttpTransport]]:
    up = _Upstream(behaviour)
    up.server = await asyncio.start_server(up._handle, "127.0.0.1", 0)
    up.port = up.server.sockets[0].getsockname()[1]
    source = SourceConfig(
        name="primary", protocol="openai", base_url=f"http://127.0.0.1:{up.port}/v1"
    )
    transport = AiohttpTransport([source], max_connections=4)
    try:
        yield up, transport
    finally:
        await transport.aclose()
        up.server.close()
        await up.server.wait_closed()


def _chat(up: _Upstream, **overrides: Any) -> HttpRequest:
    base: dict[str, Any] = {
        "source": "primary",
        "url": f"http://127.0.0.1:{up.port}/v1/chat/completions",
        "timeout_s": WAIT_S,
        "idle_timeout_s": WAIT_S,
        "connect_timeout_s": WAIT_S,
        "headers": {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        "json": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    base.update(overrides)
    return HttpRequest(**base)


def _assert_no_key(err: BaseException) -> None:
    for text in (str(err), repr(err)):
        assert KEY not in text
        assert "SECRET" not in text


def _stream_handles(loop: asyncio.AbstractEventLoop) -> list[asyncio.TimerHandle]:
    """Live timer handles on ``loop`` that belong to an event stream."""
    scheduled: list[asyncio.TimerHandle] = loop._scheduled  # type: ignore[attr-defined]  # the heap
    return [
        h
        for h in scheduled
        if not h.cancelled() and isinstance(getattr(h._callback, "__self__", None), EventStream)  # type: ignore[attr-defined]
    ]


async def test_trickling_body_is_cut_at_timeout_s() -> None:
    """A body sent a byte at a time, each gap short, is still cut at timeout_s (a timeout)."""

    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_head(200, {"Content-Type": "application/json", "Content-Length": "400"}))
        for _ in range(400):
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(0.02)

    async with _serving(trickle) as (up, transport):
        started = asyncio.get_running_loop().time()
        with pytest.raises(TransientError) as info:
            await asyncio.wait_for(transport.send(_chat(up, timeout_s=0.3)), WAIT_S)
        elapsed = asyncio.get_running_loop().time() - started
    assert (info.value.failure, info.value.timeout) == ("transient", True)
    assert "request timed out" in str(info.value)
    # The whole body would take 8 s: the bound held, whatever the machine's load.
    assert elapsed < 4.0


@pytest.mark.parametrize("timeout_s", [0.0, -0.5])
async def test_deadline_already_reached_expires_at_once(timeout_s: float) -> None:
    """A timeout_s clipped to zero or below times out at once (aiohttp reads it as no bound)."""

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _until_client_closes(reader)

    async with _serving(silent) as (up, transport):
        with pytest.raises(TransientError) as info:
            await asyncio.wait_for(transport.send(_chat(up, timeout_s=timeout_s)), WAIT_S)
    assert (info.value.failure, info.value.timeout) == ("transient", True)
    assert "request timed out" in str(info.value)


async def test_timeout_s_over_aiohttp_ceil_threshold_is_not_rounded() -> None:
    """The cached ClientTimeout carries the exact total and connect bounds, never rounded up."""
    timeout = _client_timeout(7.25, 2.0)
    assert (timeout.total, timeout.sock_connect, timeout.ceil_threshold) == (7.25, 2.0, math.inf)
    assert _client_timeout(7.25, 2.0) is timeout
    assert _client_timeout(None, 2.0).total is None


async def test_error_answer_echoing_the_key_is_scrubbed() -> None:
    """A 401 that echoes the Authorization header never shows the key (secrets found lazily)."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = json.dumps({"error": f"bad key Bearer {KEY} ({KEY})"}).encode()
        writer.write(_head(401, {"Content-Length": str(len(body))}) + body)
        await writer.drain()

    async with _serving(echo) as (up, transport):
        with pytest.raises(TransientError) as sent:
            await transport.send(_chat(up))
        with pytest.raises(TransientError) as streamed:
            async with transport.stream(_chat(up)):
                raise AssertionError("the stream must not open")
    for err in (sent.value, streamed.value):
        assert err.failure == "source_misconfigured"
        assert "***" in str(err)
        _assert_no_key(err)


async def test_stream_left_early_leaves_no_timer_scheduled() -> None:
    """Breaking out after the first event and leaving the context cancels the stream's timer."""

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(
            _head(200, {"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked"})
        )
        data = b'data: {"n": 1}\n\n'
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()
        await _until_client_closes(reader)

    loop = asyncio.get_running_loop()
    async with _serving(endless) as (up, transport):
        async with transport.stream(_chat(up, idle_timeout_s=60.0)) as events:
            async for item in events:
                assert item == {"n": 1}
                assert _stream_handles(loop) != []
                break
        assert _stream_handles(loop) == []


async def test_stream_read_to_done_leaves_no_timer_scheduled() -> None:
    """A stream read to [DONE] ends with no timer of its own on the loop."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
        writer.write(
            _head(200, {"Content-Type": "text/event-stream", "Content-Length": str(len(body))})
            + body
        )
        await writer.drain()

    loop = asyncio.get_running_loop()
    async with _serving(answer) as (up, transport):
        async with transport.stream(_chat(up)) as events:
            got = [item async for item in events]
        assert got == [{"n": 1}, {"n": 2}]
        assert _stream_handles(loop) == []


async def test_send_after_close_is_refused() -> None:
    """The per-source session cache does not outlive aclose(): a later send is an error."""

    async def ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = b'{"ok": true}'
        writer.write(_head(200, {"Content-Length": str(len(body))}) + body)
        await writer.drain()

    async with _serving(ok) as (up, transport):
        assert await transport.send(_chat(up)) == {"ok": True}
        await transport.aclose()
        with pytest.raises(RuntimeError, match="closed"):
            await transport.send(_chat(up))
