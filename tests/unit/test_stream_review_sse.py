"""Both transports' event paths under any TCP read boundary: the same events, whatever the split.

The SSE parser alone is checked against httpx-sse in test_transport_sse.py;
here the whole read path of each transport (httpx over ``MockTransport``,
aiohttp's ``_AiohttpEvents`` over a scripted body) gets a stream of JSON
events cut at every byte, with CRLF, CR or LF line ends, comments
(``: ping``), ``event:``/``id:``/``retry:`` fields and ``data`` split over
several lines, and must hand back exactly the events sent, then end at
``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polygateway.config import SourceConfig
from polygateway.transport.aiohttp_client import _AiohttpEvents
from polygateway.transport.http import HttpRequest
from polygateway.transport.httpx_client import HttpxTransport

URL = "http://upstream.test/v1/chat/completions"

_scalar = st.one_of(
    st.integers(min_value=-(10**6), max_value=10**6),
    st.text(max_size=8),  # any character: CR, LF, ":" and non-ASCII are JSON-escaped or kept
    st.booleans(),
    st.none(),
)
_payload = st.dictionaries(st.sampled_from(["id", "text", "n", "ü", "a:b"]), _scalar, max_size=3)
_newline = st.sampled_from(["\n", "\r\n", "\r"])
_noise = st.sampled_from(
    [": ping", ":", "event: message", "event: completion", "id: 7", "id:", "retry: 100", "x: y"]
)


@st.composite
def _streams(draw: st.DrawFn) -> tuple[bytes, list[Any]]:
    """An event stream (bytes) of JSON events with noise around them, and the events it carries."""
    payloads = draw(st.lists(_payload, max_size=5))
    nl = draw(_newline)
    parts: list[str] = ["\ufeff"] if draw(st.booleans()) else []
    for payload in payloads:
        for noise in draw(st.lists(_noise, max_size=2)):
            parts.append(noise + nl)
        text = json.dumps(payload, indent=draw(st.sampled_from([None, 1])), ensure_ascii=False)
        # Multi-line JSON goes out as several data lines, joined back with "\n".
        for line in text.split("\n"):
            parts.append(f"data:{draw(st.sampled_from(['', ' ']))}{line}{nl}")
        parts.append(nl)
    parts.append(f"data: [DONE]{nl}{nl}")
    return "".join(parts).encode(), payloads


def _cuts(raw: bytes, size: int) -> list[bytes]:
    return [raw[i : i + size] for i in range(0, len(raw), size)] or [b""]


def _request(timeout_s: float = 30.0) -> HttpRequest:
    return HttpRequest(source="primary", url=URL, timeout_s=timeout_s, json={"stream": True})


class _Body(httpx.AsyncByteStream):
    """A response body read in the given pieces, each a read of its own."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self._pieces = pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self._pieces:
            await asyncio.sleep(0)
            yield piece


async def _through_httpx(
    pieces: Sequence[bytes], content_type: str = "text/event-stream"
) -> list[Any]:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": content_type}, stream=_Body(pieces))

    transport = HttpxTransport(
        [SourceConfig(name="primary", protocol="openai", base_url="http://upstream.test/v1")],
        max_connections=1,
        mock_transport=httpx.MockTransport(handler),
    )
    try:
        async with transport.stream(_request()) as events:
            return [event async for event in events]
    finally:
        await transport.aclose()


class _Content:
    """``aiohttp.StreamReader.readany`` over scripted pieces (b"" at the end)."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self._pieces = list(pieces)

    async def readany(self) -> bytes:
        await asyncio.sleep(0)
        return self._pieces.pop(0) if self._pieces else b""


class _Response:
    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.content = _Content(pieces)


async def _through_aiohttp(pieces: Sequence[bytes]) -> list[Any]:
    loop = asyncio.get_running_loop()
    request = _request()
    events = _AiohttpEvents(
        _Response(pieces),  # type: ignore[arg-type]
        request,
        (),
        loop,
        loop.time() + request.timeout_s,
        math.inf,
    )
    try:
        return [event async for event in events]
    finally:
        events.close()


_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.mark.parametrize("through", [_through_httpx, _through_aiohttp], ids=["httpx", "aiohttp"])
@_SETTINGS
@given(_streams())
def test_each_path_reads_the_same_events_at_every_byte_boundary(
    through: Callable[[Sequence[bytes]], Coroutine[Any, Any, list[Any]]],
    stream: tuple[bytes, list[Any]],
) -> None:
    """One byte per read, then the whole body in one read: the events sent, in order."""
    raw, payloads = stream
    assert asyncio.run(through(_cuts(raw, 1))) == payloads
    assert asyncio.run(through([raw])) == payloads


@_SETTINGS
@given(_streams(), st.lists(st.integers(min_value=0, max_value=2000), max_size=6))
def test_both_paths_agree_on_any_split(stream: tuple[bytes, list[Any]], cuts: list[int]) -> None:
    """Reads cut at arbitrary points (a CRLF or a UTF-8 character in two) change nothing."""
    raw, payloads = stream
    points = sorted({min(c, len(raw)) for c in cuts})
    pieces = [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True)]
    pieces = [p for p in pieces if p]
    assert asyncio.run(_through_httpx(pieces)) == payloads
    assert asyncio.run(_through_aiohttp(pieces)) == payloads


async def _httpx_events(raw: bytes, content_type: str) -> list[Any]:
    return await _through_httpx([raw], content_type)


async def test_httpx_path_drops_a_leading_bom_as_the_event_stream_format_says() -> None:
    """A BOM before the first field does not hide the first event (nor [DONE]) on httpx."""
    raw = b'\xef\xbb\xbfdata: {"n": 1}\n\ndata: [DONE]\n\n'
    assert await _httpx_events(raw, "text/event-stream") == [{"n": 1}]
    assert await _through_aiohttp([raw]) == [{"n": 1}]


async def test_httpx_path_reads_utf8_whatever_charset_the_header_names() -> None:
    """An event stream is UTF-8 whatever charset its header names, on both paths."""
    raw = 'data: {"t": "ü€"}\n\ndata: [DONE]\n\n'.encode()
    content_type = "text/event-stream; charset=iso-8859-1"
    assert await _httpx_events(raw, content_type) == [{"t": "ü€"}]
    assert await _through_aiohttp([raw]) == [{"t": "ü€"}]


async def test_httpx_path_reads_a_media_type_written_in_capitals() -> None:
    """Media types are case-insensitive: ``Text/Event-Stream`` is read on httpx as on aiohttp."""
    raw = b'data: {"n": 1}\n\ndata: [DONE]\n\n'
    assert await _httpx_events(raw, "Text/Event-Stream; charset=UTF-8") == [{"n": 1}]
