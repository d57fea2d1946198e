"""Both transports, one suite, over real sockets to a scripted HTTP/1.1 upstream on 127.0.0.1.

The upstream is a raw asyncio server so each test can play exactly what a
failing provider does on the wire: any status, a reset (RST) before or in the
middle of an answer, silence, an event stream cut short, an echo of the
request's headers. Every test runs once per transport (httpx, aiohttp), built
through ``make_transport`` as the clients build them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import pytest

from polygateway.config import SourceConfig
from polygateway.middleware.classify import verdict_for
from polygateway.transport.factory import TransportKind, make_transport
from polygateway.transport.http import HttpRequest, TransientError, Transport

KEY = "sk-test-SECRET-123"
# Bounds the waits of the tests themselves, never a timing under test.
WAIT_S = 5.0


@dataclass
class Seen:
    """One request as the upstream received it."""

    method: str
    target: str
    headers: dict[str, str]
    body: bytes


Behaviour = Callable[[Seen, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _head(status: int, headers: dict[str, str]) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    lines = [f"HTTP/1.1 {status} {phrase}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def reply(
    writer: asyncio.StreamWriter,
    status: int,
    body: bytes | str | Any = b"",
    headers: dict[str, str] | None = None,
) -> None:
    """A complete answer with Content-Length; JSON-encodes anything but bytes and str."""
    if not isinstance(body, bytes | str):
        body = json.dumps(body)
        headers = {"Content-Type": "application/json", **(headers or {})}
    data = body.encode() if isinstance(body, str) else body
    all_headers = {"Content-Length": str(len(data)), "Connection": "close", **(headers or {})}
    writer.write(_head(status, all_headers) + data)
    await writer.drain()


async def start_events(writer: asyncio.StreamWriter) -> None:
    """The head of a chunked event stream."""
    writer.write(
        _head(
            200,
            {
                "Content-Type": "text/event-stream",
                "Transfer-Encoding": "chunked",
                "Connection": "close",
            },
        )
    )
    await writer.drain()


async def send_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    """One HTTP chunk (an empty one ends the body)."""
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    await writer.drain()


def event(payload: Any) -> bytes:
    """One SSE event whose data is ``payload`` (JSON unless a str)."""
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


def reset(writer: asyncio.StreamWriter) -> None:
    """Abort the connection with a TCP RST, as a crashed or overloaded proxy does."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def until_client_closes(reader: asyncio.StreamReader) -> None:
    """Wait until the client closes its side (EOF or reset)."""
    with contextlib.suppress(ConnectionError):
        while await reader.read(1024):
            pass


@dataclass
class Upstream:
    """A scripted HTTP/1.1 server on 127.0.0.1; one request per connection."""

    behaviour: Behaviour | None = None
    seen: list[Seen] = field(default_factory=list)
    active: int = 0
    max_active: int = 0
    client_closed: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0
    server: asyncio.Server | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _read_body(self, reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                body += await reader.readexactly(size)
                await reader.readexactly(2)
                if size == 0:
                    return body
        return await reader.readexactly(int(headers.get("content-length", "0")))

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            request_line, *header_lines = head.split("\r\n")
            method, target, _ = request_line.split(" ", 2)
            headers = {}
            for line in header_lines:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
            seen = Seen(method, target, headers, await self._read_body(reader, headers))
            self.seen.append(seen)
            assert self.behaviour is not None
            await self.behaviour(seen, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.active -= 1
            with contextlib.suppress(ConnectionError, OSError):
                writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    """A fresh scripted upstream on a free loopback port."""
    up = Upstream()
    up.server = await asyncio.start_server(up._handle, "127.0.0.1", 0)
    up.port = up.server.sockets[0].getsockname()[1]
    try:
        yield up
    finally:
        await up.close()


@pytest.fixture(params=["httpx", "aiohttp"])
def kind(request: pytest.FixtureRequest) -> TransportKind:
    """Each transport in turn."""
    value: TransportKind = request.param
    return value


@pytest.fixture
async def transport(kind: TransportKind, upstream: Upstream) -> AsyncIterator[Transport]:
    """The transport under test for one source pointing at the upstream."""
    source = SourceConfig(name="primary", protocol="openai", base_url=upstream.base_url)
    built = make_transport(kind, [source], max_connections=4)
    try:
        yield built
    finally:
        await built.aclose()


def chat(upstream: Upstream, **overrides: Any) -> HttpRequest:
    """A chat request with a key, to the upstream."""
    base: dict[str, Any] = {
        "source": "primary",
        "url": f"{upstream.base_url}/chat/completions",
        "timeout_s": WAIT_S,
        "idle_timeout_s": WAIT_S,
        "connect_timeout_s": WAIT_S,
        "headers": {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        "json": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    base.update(overrides)
    return HttpRequest(**base)


async def failure(transport: Transport, request: HttpRequest) -> TransientError:
    """The TransientError a send raises."""
    with pytest.raises(TransientError) as info:
        await transport.send(request)
    return info.value


async def drain(transport: Transport, request: HttpRequest, got: list[Any]) -> None:
    """Read a stream into ``got`` until it ends or fails."""
    async with transport.stream(request) as events:
        async for item in events:
            got.append(item)


def assert_no_key(err: BaseException) -> None:
    """Nothing an error shows holds the key."""
    for text in (str(err), repr(err)):
        assert KEY not in text
        assert "SECRET" not in text


# --- The classification table of research-wiki/ARCHITECTURE.md §2b, one row each ---


@pytest.mark.parametrize(
    ("status", "failure_class", "aimd"),
    [
        (429, "rate_limited", True),
        (408, "transient", False),
        (500, "transient", False),
        (502, "transient", False),
        (503, "transient", True),
        (504, "transient", False),
        (529, "transient", True),
        (401, "source_misconfigured", False),
        (403, "source_misconfigured", False),
        (404, "source_misconfigured", False),
        (400, "request_rejected", False),
        (413, "request_rejected", False),
        (422, "request_rejected", False),
    ],
)
async def test_status_row(
    transport: Transport, upstream: Upstream, status: int, failure_class: str, aimd: bool
) -> None:
    """Each status of the table: its class, its code, AIMD decrease only on overload."""

    async def answer(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await reply(w, status, {"error": {"message": "upstream says no"}})

    upstream.behaviour = answer
    err = await failure(transport, chat(upstream))
    decrease = verdict_for(err, exempt_429=True).outcome.aimd_decrease
    assert (err.status_code, err.failure, decrease) == (status, failure_class, aimd)
    assert "upstream says no" in str(err)


async def test_429_with_retry_after_sets_retry_after_s(
    transport: Transport, upstream: Upstream
) -> None:
    """429 + Retry-After: rate_limited, retry_after_s from the header."""

    async def answer(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await reply(w, 429, {"error": "slow down"}, {"Retry-After": "12"})

    upstream.behaviour = answer
    err = await failure(transport, chat(upstream))
    assert (err.failure, err.status_code) == ("rate_limited", 429)
    assert err.retry_after_s == pytest.approx(12.0)
    assert verdict_for(err, exempt_429=True).outcome.aimd_decrease


async def test_connect_error_on_closed_port(kind: TransportKind) -> None:
    """Nobody listening on a loopback port: transient, no status, no AIMD decrease."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # The port is closed again: connecting to it is refused.
    source = SourceConfig(name="primary", protocol="openai", base_url=f"http://127.0.0.1:{port}")
    transport = make_transport(kind, [source], max_connections=1)
    try:
        err = await failure(
            transport,
            HttpRequest(
                source="primary",
                url=f"http://127.0.0.1:{port}/v1/chat/completions",
                timeout_s=WAIT_S,
                headers={"Authorization": f"Bearer {KEY}"},
                json={},
            ),
        )
    finally:
        await transport.aclose()
    assert (err.failure, err.status_code, err.timeout) == ("transient", None, False)
    assert "connect error" in str(err)
    assert_no_key(err)


async def test_reset_before_answer(transport: Transport, upstream: Upstream) -> None:
    """A reset instead of an answer: transient, no status."""

    async def rst(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        reset(w)

    upstream.behaviour = rst
    err = await failure(transport, chat(upstream))
    decrease = verdict_for(err, exempt_429=True).outcome.aimd_decrease
    assert (err.failure, err.status_code, decrease) == ("transient", None, False)


async def test_reset_in_the_middle_of_the_body(transport: Transport, upstream: Upstream) -> None:
    """Half a body then a reset: transient, no status."""

    async def half(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(_head(200, {"Content-Length": "1000", "Content-Type": "application/json"}))
        w.write(b'{"choices": [')
        await w.drain()
        await asyncio.sleep(0.05)
        reset(w)

    upstream.behaviour = half
    err = await failure(transport, chat(upstream))
    assert (err.failure, err.status_code) == ("transient", None)


async def test_read_timeout(transport: Transport, upstream: Upstream) -> None:
    """An upstream that never answers is cut at timeout_s: transient, timeout, AIMD decrease."""

    async def silent(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await until_client_closes(reader)

    upstream.behaviour = silent
    err = await failure(transport, chat(upstream, timeout_s=0.2))
    decrease = verdict_for(err, exempt_429=True).outcome.aimd_decrease
    assert (err.failure, err.status_code, err.timeout, decrease) == (
        "transient",
        None,
        True,
        True,
    )


async def test_malformed_json_body(transport: Transport, upstream: Upstream) -> None:
    """A 200 whose body is not JSON: transient, no status, 'malformed body'."""

    async def junk(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await reply(w, 200, "<html>gateway hiccup</html>", {"Content-Type": "text/html"})

    upstream.behaviour = junk
    err = await failure(transport, chat(upstream))
    assert (err.failure, err.status_code) == ("transient", None)
    assert "malformed body" in str(err)


# --- Successful exchanges ---


async def test_success_returns_json_and_request_arrives_as_built(
    transport: Transport, upstream: Upstream
) -> None:
    """A 200's JSON comes back; the upstream saw method, path, key and JSON body."""

    async def ok(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await reply(w, 200, {"id": "x", "choices": []})

    upstream.behaviour = ok
    assert await transport.send(chat(upstream)) == {"id": "x", "choices": []}
    (seen,) = upstream.seen
    assert (seen.method, seen.target) == ("POST", "/v1/chat/completions")
    assert seen.headers["authorization"] == f"Bearer {KEY}"
    assert json.loads(seen.body) == {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_multipart_upload_arrives_with_file_name_and_query(
    transport: Transport, upstream: Upstream
) -> None:
    """files= arrives as multipart part 'file' with its name and bytes; params= as the query."""

    async def ok(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await reply(w, 200, {"success": True, "content": "text"})

    upstream.behaviour = ok
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256))
    request = HttpRequest(
        source="primary",
        url=f"http://127.0.0.1:{upstream.port}/parse",
        timeout_s=WAIT_S,
        files={"file": ("image.png", png, "image/png")},
        params={"return_type": "content_list_json"},
    )
    assert await transport.send(request) == {"success": True, "content": "text"}
    (seen,) = upstream.seen
    assert seen.target == "/parse?return_type=content_list_json"
    assert seen.headers["content-type"].startswith("multipart/form-data")
    assert b'name="file"' in seen.body
    assert b'filename="image.png"' in seen.body
    assert png in seen.body


async def test_pool_never_exceeds_max_connections(kind: TransportKind, upstream: Upstream) -> None:
    """Eight concurrent calls through a pool of two: the upstream never sees more than two."""

    async def slow(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.05)
        await reply(w, 200, {"ok": True})

    upstream.behaviour = slow
    source = SourceConfig(name="primary", protocol="openai", base_url=upstream.base_url)
    transport = make_transport(kind, [source], max_connections=2)
    try:
        results = await asyncio.gather(*(transport.send(chat(upstream)) for _ in range(8)))
    finally:
        await transport.aclose()
    assert results == [{"ok": True}] * 8
    assert upstream.max_active <= 2
    assert len(upstream.seen) == 8


# --- Secrets ---


@pytest.mark.parametrize("status", [401, 500, 400])
async def test_echoed_authorization_never_in_error(
    transport: Transport, upstream: Upstream, status: int
) -> None:
    """An upstream echoing the Authorization header (and the bare key) is scrubbed everywhere."""

    async def echo(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        auth = seen.headers["authorization"]
        await reply(w, status, {"error": f"rejected {auth} (key {KEY})", "headers": seen.headers})

    upstream.behaviour = echo
    err = await failure(transport, chat(upstream))
    assert_no_key(err)
    assert err.status_code == status


# --- Streams ---


async def test_stream_events_end_cleanly_at_done(transport: Transport, upstream: Upstream) -> None:
    """Events arrive parsed in order; keep-alive comments are skipped; [DONE] ends the stream."""

    async def events(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await start_events(w)
        await send_chunk(w, b": keep-alive\r\n\r\n")
        await send_chunk(w, event({"n": 1}) + event({"n": 2}))
        # One event split across two chunks, mid-line.
        await send_chunk(w, b'data: {"n"')
        await asyncio.sleep(0.01)
        await send_chunk(w, b": 3}\n\n" + event("[DONE]"))
        await send_chunk(w, b"")

    upstream.behaviour = events
    got: list[Any] = []
    await drain(transport, chat(upstream), got)
    assert got == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert upstream.seen[0].headers["accept"] == "text/event-stream"


async def test_stream_without_done_is_truncated(transport: Transport, upstream: Upstream) -> None:
    """A stream that ends cleanly but without [DONE] raises TransientError(truncated=True)."""

    async def cut(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await start_events(w)
        await send_chunk(w, event({"n": 1}))
        await send_chunk(w, b"")

    upstream.behaviour = cut
    got: list[Any] = []
    with pytest.raises(TransientError, match=r"stream ended without \[DONE\]") as info:
        await drain(transport, chat(upstream), got)
    assert got == [{"n": 1}]
    assert info.value.truncated


async def test_stream_reset_mid_stream_is_transient(
    transport: Transport, upstream: Upstream
) -> None:
    """A reset after some events is a transient failure after those events."""

    async def rst(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await start_events(w)
        await send_chunk(w, event({"n": 1}))
        await asyncio.sleep(0.05)
        reset(w)

    upstream.behaviour = rst
    got: list[Any] = []
    with pytest.raises(TransientError) as info:
        await drain(transport, chat(upstream), got)
    assert got == [{"n": 1}]
    assert (info.value.failure, info.value.status_code) == ("transient", None)


async def test_stream_ttft_timeout(transport: Transport, upstream: Upstream) -> None:
    """Headers but no first event within the TTFT: transient timeout."""

    async def mute(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await start_events(w)
        await until_client_closes(reader)

    upstream.behaviour = mute
    with pytest.raises(TransientError) as info:
        await drain(transport, chat(upstream, timeout_s=0.2), [])
    assert info.value.timeout
    assert verdict_for(info.value, exempt_429=True).outcome.aimd_decrease


async def test_stream_ttft_timeout_when_headers_never_come(
    transport: Transport, upstream: Upstream
) -> None:
    """No answer at all within the TTFT: transient timeout at open."""

    async def silent(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await until_client_closes(reader)

    upstream.behaviour = silent
    with pytest.raises(TransientError) as info:
        async with transport.stream(chat(upstream, timeout_s=0.2)):
            raise AssertionError("the context must not open")
    assert info.value.timeout


async def test_stream_idle_timeout(transport: Transport, upstream: Upstream) -> None:
    """A first event then silence longer than the idle timeout: transient timeout."""

    async def stall(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await start_events(w)
        await send_chunk(w, event({"n": 1}))
        await until_client_closes(reader)

    upstream.behaviour = stall
    got: list[Any] = []
    with pytest.raises(TransientError) as info:
        await drain(transport, chat(upstream, idle_timeout_s=0.2), got)
    assert got == [{"n": 1}]
    assert info.value.timeout
    assert "stream idle" in str(info.value)


async def test_stream_flowing_past_its_end_is_cut_as_the_calls_deadline(
    transport: Transport, upstream: Upstream
) -> None:
    """An event every 50 ms forever, deadline_in_s=0.3: cut as the call's deadline, well in time."""

    async def trickle(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await start_events(w)
        n = 0
        try:
            while True:  # until the client goes: a write then fails
                await send_chunk(w, event({"n": n}))
                n += 1
                await asyncio.sleep(0.05)
        finally:
            upstream.client_closed.set()

    upstream.behaviour = trickle
    got: list[Any] = []
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(TransientError) as info:
        async with asyncio.timeout(WAIT_S):
            await drain(transport, chat(upstream, deadline_in_s=0.3), got)
    elapsed = loop.time() - started
    assert info.value.timeout
    assert (info.value.failure, info.value.status_code) == ("transient", None)
    assert "call deadline reached" in str(info.value)
    assert_no_key(info.value)
    assert got  # events flowed before the end: neither idle nor TTFT cut it
    assert got == [{"n": i} for i in range(len(got))]
    # The trickle never stops: only the end (0.3 s) ends it, well before WAIT_S.
    assert elapsed < 0.3 + 1.5
    await asyncio.wait_for(upstream.client_closed.wait(), WAIT_S)


@pytest.mark.parametrize(
    ("status", "failure_class"),
    [
        (429, "rate_limited"),
        (503, "transient"),
        (404, "source_misconfigured"),
        (422, "request_rejected"),
    ],
)
async def test_stream_non_2xx_is_classified_before_any_event(
    transport: Transport, upstream: Upstream, status: int, failure_class: str
) -> None:
    """An error status on a stream raises its class at open, before any event."""

    async def refuse(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await reply(
            w, status, {"error": f"echo {seen.headers['authorization']}"}, {"Retry-After": "2"}
        )

    upstream.behaviour = refuse
    with pytest.raises(TransientError) as info:
        async with transport.stream(chat(upstream)):
            raise AssertionError("the context must not open")
    assert (info.value.status_code, info.value.failure) == (status, failure_class)
    assert info.value.retry_after_s == pytest.approx(2.0)
    assert_no_key(info.value)


async def test_stream_non_json_event_is_malformed(transport: Transport, upstream: Upstream) -> None:
    """An event whose data is not JSON: transient malformed body."""

    async def junk(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await start_events(w)
        await send_chunk(w, event("{not json"))
        await send_chunk(w, b"")

    upstream.behaviour = junk
    with pytest.raises(TransientError, match="malformed body") as info:
        await drain(transport, chat(upstream), [])
    assert info.value.status_code is None


async def test_leaving_stream_early_closes_the_connection(
    transport: Transport, upstream: Upstream
) -> None:
    """Breaking out after one event and leaving the context closes the connection upstream."""

    async def endless(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await start_events(w)
        await send_chunk(w, event({"n": 1}))
        await until_client_closes(reader)
        upstream.client_closed.set()

    upstream.behaviour = endless
    async with transport.stream(chat(upstream)) as events:
        async for item in events:
            assert item == {"n": 1}
            break
    await asyncio.wait_for(upstream.client_closed.wait(), WAIT_S)


async def test_cancelling_a_stream_closes_the_connection(
    transport: Transport, upstream: Upstream
) -> None:
    """Cancelling the reading task closes the connection upstream; CancelledError passes."""
    first = asyncio.Event()

    async def endless(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await start_events(w)
        await send_chunk(w, event({"n": 1}))
        await until_client_closes(reader)
        upstream.client_closed.set()

    async def read() -> None:
        async with transport.stream(chat(upstream, idle_timeout_s=60.0)) as events:
            async for _ in events:
                first.set()

    upstream.behaviour = endless
    task = asyncio.create_task(read())
    await asyncio.wait_for(first.wait(), WAIT_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(upstream.client_closed.wait(), WAIT_S)


async def test_cancelling_a_send_closes_the_connection(
    transport: Transport, upstream: Upstream
) -> None:
    """A caller's own timeout around send cancels it and frees the connection."""

    async def silent(seen: Seen, reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await until_client_closes(reader)
        upstream.client_closed.set()

    upstream.behaviour = silent
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.2):
            await transport.send(chat(upstream))
    await asyncio.wait_for(upstream.client_closed.wait(), WAIT_S)
