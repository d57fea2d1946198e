"""HttpxTransport over httpx.MockTransport: the classification table row by row, streams, secrets.

The real code path runs (client, timeouts, httpx-sse, exception translation);
only the socket is replaced. The same behaviours over real sockets, for both
transports, are pinned in tests/integration/test_transport_sockets.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import httpx
import pytest

from polygateway.config import SourceConfig
from polygateway.middleware.classify import verdict_for
from polygateway.transport.exchange import EventStream
from polygateway.transport.http import (
    STREAM_END,
    HttpRequest,
    TransientError,
    excerpt,
    parse_event_data,
    parse_json_body,
    scrub,
    secrets_in,
    status_error,
)
from polygateway.transport.httpx_client import HttpxTransport

KEY = "sk-test-SECRET-123"
URL = "http://upstream.test/v1/chat/completions"


def Source(name: str = "primary", **fields: Any) -> SourceConfig:
    """A source as the transport gets it from settings."""
    return SourceConfig(name=name, protocol="openai", base_url="http://upstream.test/v1", **fields)


Handler = Callable[[httpx.Request], Any]


def _transport(handler: Handler, *sources: Source) -> HttpxTransport:
    return HttpxTransport(
        list(sources) or [Source()],
        max_connections=4,
        mock_transport=httpx.MockTransport(handler),
    )


def _request(**overrides: Any) -> HttpRequest:
    base: dict[str, Any] = {
        "source": "primary",
        "url": URL,
        "timeout_s": 5.0,
        "headers": {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        "json": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    base.update(overrides)
    return HttpRequest(**base)


async def _send_error(handler: Handler, **overrides: Any) -> TransientError:
    transport = _transport(handler)
    try:
        with pytest.raises(TransientError) as info:
            await transport.send(_request(**overrides))
    finally:
        await transport.aclose()
    return info.value


def _assert_clean(err: BaseException) -> None:
    """No trace of the key in anything an error shows."""
    for text in (str(err), repr(err), str(err.args)):
        assert KEY not in text
        assert "SECRET" not in text


# --- The classification table of research-wiki/ARCHITECTURE.md §2b, one row per status ---


@pytest.mark.parametrize(
    ("status", "failure", "aimd"),
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
async def test_status_is_classified_per_design_table(status: int, failure: str, aimd: bool) -> None:
    """Each non-2xx status gets its class and status code; AIMD shrinks only on overload."""
    err = await _send_error(lambda r: httpx.Response(status, json={"error": {"message": "nope"}}))
    assert err.status_code == status
    assert err.failure == failure
    assert verdict_for(err, exempt_429=True).outcome.aimd_decrease is aimd
    assert err.timeout is False
    assert f"HTTP {status}" in str(err)


async def test_429_retry_after_seconds_are_kept() -> None:
    """A 429's Retry-After becomes retry_after_s for the pacer."""
    err = await _send_error(lambda r: httpx.Response(429, headers={"Retry-After": "7"}))
    assert err.failure == "rate_limited"
    assert err.retry_after_s == pytest.approx(7.0)


async def test_429_ratelimit_reset_header_is_kept() -> None:
    """OpenAI's x-ratelimit-reset-requests is read when Retry-After is absent."""
    err = await _send_error(
        lambda r: httpx.Response(429, headers={"x-ratelimit-reset-requests": "1m30s"})
    )
    assert err.retry_after_s == pytest.approx(90.0)


async def test_429_without_back_off_header_has_no_retry_after() -> None:
    """No header, no invented back-off: the pacer applies its default."""
    err = await _send_error(lambda r: httpx.Response(429))
    assert err.retry_after_s is None


async def test_connect_error_is_transient_without_status() -> None:
    """A refused connection is transient with no status and no AIMD decrease."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    err = await _send_error(refuse)
    assert (err.failure, err.status_code, err.timeout) == ("transient", None, False)
    assert "connect error" in str(err)
    assert isinstance(err.__cause__, httpx.ConnectError)


async def test_a_connect_failure_grouped_by_anyio_is_a_connect_error() -> None:
    """anyio's grouped connect failure (a port out of range) is a transient connect error."""

    def overflow(request: httpx.Request) -> httpx.Response:
        raise ExceptionGroup("unhandled errors in a TaskGroup", [OverflowError("port 0-65535")])

    err = await _send_error(overflow)
    assert (err.failure, err.status_code, err.timeout) == ("transient", None, False)
    assert "connect error" in str(err)
    assert "OverflowError" in str(err)
    assert isinstance(err.__cause__, ExceptionGroup)
    transport = _transport(overflow)
    try:
        with pytest.raises(TransientError, match="connect error"):
            async with transport.stream(_request(timeout_s=5.0)):
                pass
    finally:
        await transport.aclose()


@pytest.mark.parametrize("exc_type", [httpx.RemoteProtocolError, httpx.ReadError])
async def test_reset_is_transient_without_status(exc_type: type[httpx.TransportError]) -> None:
    """A connection reset mid-answer (protocol error or read error) is transient."""

    def reset(request: httpx.Request) -> httpx.Response:
        raise exc_type("Connection reset by peer", request=request)

    err = await _send_error(reset)
    decrease = verdict_for(err, exempt_429=True).outcome.aimd_decrease
    assert (err.failure, err.status_code, decrease) == ("transient", None, False)


@pytest.mark.parametrize("exc_type", [httpx.ReadTimeout, httpx.ConnectTimeout, httpx.PoolTimeout])
async def test_httpx_timeout_is_transient_with_timeout_flag(
    exc_type: type[httpx.TimeoutException],
) -> None:
    """httpx's phase timeouts are transient timeouts, which shrink AIMD."""

    def slow(request: httpx.Request) -> httpx.Response:
        raise exc_type("timed out", request=request)

    err = await _send_error(slow)
    decrease = verdict_for(err, exempt_429=True).outcome.aimd_decrease
    assert (err.failure, err.status_code, err.timeout, decrease) == (
        "transient",
        None,
        True,
        True,
    )


async def test_total_timeout_bounds_the_whole_exchange() -> None:
    """An upstream that never answers is cut at timeout_s, as a transient timeout."""

    async def hang(request: httpx.Request) -> httpx.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    err = await _send_error(hang, timeout_s=0.05)
    assert err.timeout is True
    assert err.failure == "transient"


async def test_malformed_json_body_is_transient() -> None:
    """A 2xx body that is not JSON is a malformed, transient answer without status."""
    err = await _send_error(lambda r: httpx.Response(200, content=b"<html>oops</html>"))
    assert (err.failure, err.status_code) == ("transient", None)
    assert "malformed body" in str(err)
    assert "oops" not in str(err)


async def test_unusable_url_is_source_misconfigured() -> None:
    """A URL scheme httpx cannot speak is the source's configuration, not an outage."""
    transport = HttpxTransport([Source()], max_connections=1)
    try:
        with pytest.raises(TransientError) as info:
            await transport.send(_request(url="ftp://upstream.test/x"))
    finally:
        await transport.aclose()
    assert info.value.failure == "source_misconfigured"


# --- Successful exchanges and request shape ---


async def test_success_returns_parsed_json_and_sends_the_request_as_built() -> None:
    """A 2xx answer's JSON is returned; method, URL, headers, body and timeouts go out as built."""
    seen: list[httpx.Request] = []

    def ok(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True})

    transport = _transport(ok)
    try:
        body = await transport.send(_request(timeout_s=9.0, connect_timeout_s=2.0))
    finally:
        await transport.aclose()
    assert body == {"ok": True}
    (request,) = seen
    assert (request.method, str(request.url)) == ("POST", URL)
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert json.loads(request.content) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
    }
    assert request.extensions["timeout"] == {"connect": 2.0, "read": 9.0, "write": 9.0, "pool": 9.0}


async def test_multipart_upload_carries_file_part_and_query() -> None:
    """files= becomes a multipart part with its file name; params= the query string."""
    seen: list[httpx.Request] = []

    def ok(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"success": True})

    transport = _transport(ok)
    try:
        await transport.send(
            _request(
                json=None,
                headers={},
                files={"file": ("image.png", b"\x89PNG\r\n\x1a\nDATA", "image/png")},
                params={"return_type": "content_list_json"},
            )
        )
    finally:
        await transport.aclose()
    (request,) = seen
    body = request.content
    assert request.url.params["return_type"] == "content_list_json"
    assert request.headers["content-type"].startswith("multipart/form-data; boundary=")
    assert b'name="file"; filename="image.png"' in body
    assert b"\x89PNG\r\n\x1a\nDATA" in body


# --- Secrets ---


async def test_echoed_key_never_reaches_error_message_or_repr() -> None:
    """An upstream echoing the Authorization header in its error body is scrubbed."""

    def echo(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            401,
            json={"error": f"bad key {request.headers['authorization']}; raw {KEY}"},
        )

    err = await _send_error(echo)
    _assert_clean(err)
    assert "***" in str(err)
    assert err.failure == "source_misconfigured"


async def test_key_in_transport_exception_text_is_scrubbed() -> None:
    """Even a library exception quoting the key is scrubbed before it becomes a message."""

    def leak(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"failed with header Bearer {KEY}", request=request)

    _assert_clean(await _send_error(leak))


def test_request_repr_hides_headers_and_body() -> None:
    """HttpRequest's repr shows no header value and no body."""
    text = repr(_request())
    assert KEY not in text
    assert "hi" not in text


def test_error_excerpt_is_truncated_to_200_chars() -> None:
    """A huge provider error body is cut to a short excerpt."""
    err = status_error(500, {}, "x" * 5000, source="primary", now_wall=0.0)
    assert len(str(err)) < 260
    assert str(err).endswith("...")


def test_scrub_happens_before_truncation() -> None:
    """A key straddling the excerpt limit is not left half-visible."""
    body = "a" * 190 + KEY
    assert "sk-test" not in excerpt(body, (KEY,))


def test_secrets_in_finds_bearer_token_and_key_headers() -> None:
    """Authorization (whole and bare token) and *key* headers are secrets; others are not."""
    found = secrets_in(
        {"Authorization": f"Bearer {KEY}", "api-key": "azure-key-1", "X-Org": "acme"}
    )
    assert set(found) == {f"Bearer {KEY}", KEY, "azure-key-1"}
    assert scrub(f"k={KEY} org=acme", found) == "k=*** org=acme"


def test_event_data_done_marker_is_the_end_sentinel() -> None:
    """[DONE] is the end marker; a JSON string "[DONE]" is just data."""
    assert parse_event_data("[DONE]", "s") is STREAM_END
    assert parse_event_data('"[DONE]"', "s") == "[DONE]"


def test_json_nested_past_the_parser_depth_is_a_malformed_answer() -> None:
    """An upstream's deeply nested JSON is a transient malformed answer, not a RecursionError."""
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(TransientError, match="not JSON"):
        parse_event_data(deep, "s")
    with pytest.raises(TransientError, match="not JSON"):
        parse_json_body(deep.encode(), "s")
    with pytest.raises(TransientError, match="not JSON"):
        parse_json_body(b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "s")


# --- Streams ---


class _Body(httpx.AsyncByteStream):
    """A scripted response body that records whether it was closed."""

    def __init__(self, chunks: Iterable[bytes | float | None]) -> None:
        # bytes: sent; float: a pause of that many seconds; None: hang forever.
        self.chunks = list(chunks)
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            if chunk is None:
                await asyncio.Event().wait()
            elif isinstance(chunk, float):
                await asyncio.sleep(chunk)
            else:
                yield chunk

    async def aclose(self) -> None:
        self.closed = True


def _sse(*events: Any) -> list[bytes]:
    out = []
    for event in events:
        data = event if isinstance(event, str) else json.dumps(event)
        out.append(f"data: {data}\n\n".encode())
    return out


def _stream_handler(
    body: _Body, status: int = 200, content_type: str = "text/event-stream"
) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, headers={"content-type": content_type}, stream=body)

    return handle


def _stream_request(**overrides: Any) -> HttpRequest:
    return _request(timeout_s=overrides.pop("timeout_s", 5.0), idle_timeout_s=5.0, **overrides)


async def _collect(transport: HttpxTransport, request: HttpRequest) -> list[Any]:
    async with transport.stream(request) as events:
        return [event async for event in events]


async def _drain(transport: HttpxTransport, request: HttpRequest, got: list[Any]) -> None:
    """Read a stream into ``got`` until it ends or fails, keeping what arrived before a failure."""
    async with transport.stream(request) as events:
        async for event in events:
            got.append(event)


async def test_stream_yields_parsed_events_and_ends_cleanly_at_done() -> None:
    """data: events come out as JSON, comments and pings are skipped, [DONE] ends iteration."""
    body = _Body(
        [b": keep-alive\n\n", *_sse({"n": 1}), b"event: ping\n\n", *_sse({"n": 2}, "[DONE]")]
    )
    transport = _transport(_stream_handler(body))
    try:
        assert await _collect(transport, _stream_request()) == [{"n": 1}, {"n": 2}]
    finally:
        await transport.aclose()
    assert body.closed


async def test_stream_sends_sse_accept_header() -> None:
    """A stream request asks for text/event-stream."""
    seen: list[httpx.Request] = []
    body = _Body(_sse("[DONE]"))

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body)

    transport = _transport(handle)
    try:
        assert await _collect(transport, _stream_request()) == []
    finally:
        await transport.aclose()
    assert seen[0].headers["accept"] == "text/event-stream"


async def test_stream_without_done_is_truncated_failure() -> None:
    """A stream closing without [DONE] raises a transient error marked truncated."""
    transport = _transport(_stream_handler(_Body(_sse({"n": 1}))))
    got: list[Any] = []
    try:
        with pytest.raises(TransientError) as info:
            await _drain(transport, _stream_request(), got)
    finally:
        await transport.aclose()
    assert got == [{"n": 1}]
    assert info.value.truncated is True
    assert "stream ended without [DONE]" in str(info.value)


async def test_stream_ttft_timeout_is_transient_timeout() -> None:
    """No first event within timeout_s (the TTFT) is a transient timeout."""
    body = _Body([None])
    transport = _transport(_stream_handler(body))
    try:
        with pytest.raises(TransientError) as info:
            await _collect(transport, _stream_request(timeout_s=0.05))
    finally:
        await transport.aclose()
    assert info.value.timeout is True
    assert "no first event" in str(info.value)
    assert body.closed


async def test_stream_idle_timeout_is_transient_timeout() -> None:
    """A gap longer than idle_timeout_s after the first event is a transient timeout."""
    body = _Body([*_sse({"n": 1}), None])
    transport = _transport(_stream_handler(body))
    got: list[Any] = []
    try:
        with pytest.raises(TransientError) as info:
            await _drain(transport, _request(timeout_s=5.0, idle_timeout_s=0.05), got)
    finally:
        await transport.aclose()
    assert got == [{"n": 1}]
    assert info.value.timeout is True
    assert "stream idle" in str(info.value)


async def test_stream_keepalive_pings_do_not_reset_ttft() -> None:
    """Comment pings before the first data event still count against the TTFT deadline."""
    body = _Body([b": ping\n\n", 0.03, b": ping\n\n", 0.03, b": ping\n\n", None])
    transport = _transport(_stream_handler(body))
    try:
        with pytest.raises(TransientError) as info:
            await _collect(transport, _stream_request(timeout_s=0.05))
    finally:
        await transport.aclose()
    assert info.value.timeout is True


@pytest.mark.parametrize(
    ("status", "failure"),
    [(429, "rate_limited"), (503, "transient"), (401, "source_misconfigured")],
)
async def test_stream_non_2xx_is_classified_before_any_event(status: int, failure: str) -> None:
    """A stream answered with an error status raises its class at open, with Retry-After."""
    body = _Body([b'{"error": "busy"}'])
    handler = _stream_handler(body, status=status, content_type="application/json")

    def with_retry_after(request: httpx.Request) -> httpx.Response:
        response: httpx.Response = handler(request)
        response.headers["Retry-After"] = "3"
        return response

    transport = _transport(with_retry_after)
    try:
        with pytest.raises(TransientError) as info:
            async with transport.stream(_stream_request()):
                raise AssertionError("the context must not open")
    finally:
        await transport.aclose()
    assert (info.value.status_code, info.value.failure) == (status, failure)
    assert info.value.retry_after_s == pytest.approx(3.0)
    assert body.closed


async def test_stream_with_json_content_type_is_malformed() -> None:
    """A 200 that is not an event stream is a malformed answer."""
    transport = _transport(_stream_handler(_Body([b"{}"]), content_type="application/json"))
    try:
        with pytest.raises(TransientError, match="malformed body"):
            await _collect(transport, _stream_request())
    finally:
        await transport.aclose()


async def test_stream_event_with_non_json_data_is_malformed() -> None:
    """An event whose data is not JSON raises a malformed transient error."""
    transport = _transport(_stream_handler(_Body(_sse({"n": 1}, "not json", "[DONE]"))))
    got: list[Any] = []
    try:
        with pytest.raises(TransientError, match="malformed body") as info:
            await _drain(transport, _stream_request(), got)
    finally:
        await transport.aclose()
    assert got == [{"n": 1}]
    assert info.value.status_code is None


async def test_leaving_stream_context_early_closes_response() -> None:
    """Breaking out after the first event and leaving the context closes the response."""
    body = _Body([*_sse({"n": 1}), None])
    transport = _transport(_stream_handler(body))
    try:
        async with transport.stream(_stream_request()) as events:
            async for event in events:
                assert event == {"n": 1}
                break
            assert not body.closed
        assert body.closed
    finally:
        await transport.aclose()


def _stream_timers(loop: asyncio.AbstractEventLoop) -> list[asyncio.TimerHandle]:
    """Live timer handles on ``loop`` that belong to an event stream."""
    scheduled: list[asyncio.TimerHandle] = loop._scheduled  # type: ignore[attr-defined]  # the heap
    return [
        h
        for h in scheduled
        if not h.cancelled() and isinstance(getattr(h._callback, "__self__", None), EventStream)  # type: ignore[attr-defined]
    ]


async def test_leaving_stream_context_early_cancels_the_stream_timer() -> None:
    """A stream left between events leaves no idle timer of its own on the loop."""
    body = _Body([*_sse({"n": 1}), None])
    transport = _transport(_stream_handler(body))
    loop = asyncio.get_running_loop()
    try:
        async with transport.stream(_stream_request()) as events:
            async for event in events:
                assert event == {"n": 1}
                break
            assert _stream_timers(loop) != []
        assert _stream_timers(loop) == []
    finally:
        await transport.aclose()


async def test_cancelling_a_stream_reader_closes_response() -> None:
    """A task cancelled while waiting on the stream closes the response and stays cancelled."""
    body = _Body([*_sse({"n": 1}), None])
    transport = _transport(_stream_handler(body))
    first = asyncio.Event()

    async def read() -> None:
        async with transport.stream(_request(timeout_s=5.0, idle_timeout_s=30.0)) as events:
            async for _ in events:
                first.set()

    task = asyncio.create_task(read())
    try:
        await asyncio.wait_for(first.wait(), 5.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await transport.aclose()
    assert body.closed


async def test_events_after_done_are_not_read() -> None:
    """Iteration stops at [DONE] even if the upstream sends more."""
    transport = _transport(_stream_handler(_Body(_sse({"n": 1}, "[DONE]", {"n": 2}))))
    try:
        assert await _collect(transport, _stream_request()) == [{"n": 1}]
    finally:
        await transport.aclose()


# --- Pooling ---


async def test_one_pooled_client_per_verify_proxy_combination() -> None:
    """Sources agreeing on (verify, proxy) share a client sized as asked; aclose closes all."""
    built: list[tuple[bool | str, str, httpx.Limits]] = []
    clients: list[httpx.AsyncClient] = []

    def factory(*, verify: bool | str, proxy: str, limits: httpx.Limits) -> httpx.AsyncClient:
        built.append((verify, proxy, limits))
        client = httpx.AsyncClient(
            transport=httpx.MockTransport(lambda r: httpx.Response(200, json={}))
        )
        clients.append(client)
        return client

    sources = [Source("a"), Source("b"), Source("c", proxy="http://127.0.0.1:3128")]
    transport = HttpxTransport(sources, max_connections=12, client_factory=factory)
    for name in ("a", "b", "c", "a"):
        await transport.send(_request(source=name))
    await transport.aclose()
    assert [(v, p) for v, p, _ in built] == [(True, ""), (True, "http://127.0.0.1:3128")]
    assert built[0][2] == httpx.Limits(max_connections=12, max_keepalive_connections=12)
    assert all(c.is_closed for c in clients)
    with pytest.raises(RuntimeError, match="closed"):
        await transport.send(_request(source="a"))


def test_max_connections_must_be_positive() -> None:
    """A pool of zero connections is a construction error."""
    with pytest.raises(ValueError, match="max_connections"):
        HttpxTransport([Source()], max_connections=0)
