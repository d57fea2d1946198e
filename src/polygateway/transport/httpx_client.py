"""The default transport: httpx, pooled, with httpx-sse for event streams.

This module is the one boundary where httpx exceptions become
``TransientError`` (``raise ... from exc``)::

    httpx.TimeoutException (connect, read, write, pool) -> transient, timeout=True
    asyncio.timeout expiry (total, TTFT, stream idle)   -> transient, timeout=True
    httpx.ConnectError                                  -> transient, "connect error"
    httpx.ReadError / httpx.WriteError                  -> transient (resets land here)
    httpx.RemoteProtocolError                           -> transient, "connection reset"
    httpx.DecodingError, 2xx body that is not JSON      -> transient, "malformed body"
    httpx.UnsupportedProtocol, httpx.InvalidURL         -> source_misconfigured
    any other httpx.TransportError                      -> transient
    non-2xx answer                                      -> classified by status, Retry-After kept

``CancelledError`` is never caught: a cancelled attempt closes its response
on the way out and leaks no connection.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

import httpx
from httpx_sse import EventSource, ServerSentEvent, aconnect_sse

from polygateway.transport.http import (
    STREAM_END,
    HttpRequest,
    TransientError,
    is_event_stream,
    malformed,
    network_error,
    parse_event_data,
    parse_json_body,
    secrets_in,
    status_error,
    timeout_error,
    truncated_stream,
)

if TYPE_CHECKING:
    from polygateway.config import SourceConfig

__all__ = ["HttpxClientFactory", "HttpxTransport"]

_ClientKey = tuple[bool | str, str]
"""(verify, proxy): sources that agree on both share one pooled client."""

_DEFAULT_KEY: _ClientKey = (True, "")


class HttpxClientFactory(Protocol):
    """Builds the pooled client for one (verify, proxy) combination."""

    def __call__(
        self, *, verify: bool | str, proxy: str, limits: httpx.Limits
    ) -> httpx.AsyncClient: ...


def _ssl_verify(verify: bool | str) -> bool | ssl.SSLContext:
    """httpx's ``verify``: a CA bundle path becomes a context (a bare path is deprecated)."""
    if isinstance(verify, str):
        return ssl.create_default_context(cafile=verify)
    return verify


def default_client(*, verify: bool | str, proxy: str, limits: httpx.Limits) -> httpx.AsyncClient:
    """A pooled client; the environment (proxies, .netrc) is ignored, configuration says all."""
    # trust_env=False: a .netrc could add an Authorization header and an
    # HTTP_PROXY variable could reroute traffic, neither visible in the config.
    return httpx.AsyncClient(
        verify=_ssl_verify(verify),
        proxy=proxy or None,
        limits=limits,
        trust_env=False,
    )


def _mock_factory(transport: httpx.AsyncBaseTransport) -> HttpxClientFactory:
    """A factory whose clients send through ``transport`` (tests: ``httpx.MockTransport``)."""

    def build(*, verify: bool | str, proxy: str, limits: httpx.Limits) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=transport, limits=limits, trust_env=False)

    return build


def _translate(exc: Exception, request: HttpRequest, secrets: Sequence[str]) -> TransientError:
    """The one mapping of an httpx exception to a classified failure."""
    source = request.source
    if isinstance(exc, httpx.ConnectTimeout):
        connect = request.connect_timeout_s or request.timeout_s
        return timeout_error("connect timed out", source, connect)
    if isinstance(exc, httpx.TimeoutException):
        return timeout_error(f"timed out ({type(exc).__name__})", source, request.timeout_s)
    if isinstance(exc, httpx.ConnectError):
        return network_error("connect error", source, exc, secrets)
    if isinstance(exc, httpx.RemoteProtocolError):
        return network_error("connection reset", source, exc, secrets)
    if isinstance(exc, httpx.ReadError | httpx.WriteError):
        return network_error("connection broken", source, exc, secrets)
    if isinstance(exc, httpx.DecodingError):
        return malformed(source, "undecodable content encoding")
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
        # The URL comes from the source's configuration: every retry there fails alike.
        return TransientError(
            f"unusable URL for {source}: {type(exc).__name__}", failure="source_misconfigured"
        )
    return network_error("transport error", source, exc, secrets)


# Everything httpx raises for a failed exchange; its StreamError family (our
# own misuse of a response) is deliberately absent: that is a bug, not an outage.
_HTTPX_FAILURES = (httpx.TransportError, httpx.DecodingError, httpx.InvalidURL)


class HttpxTransport:
    """``Transport`` on httpx: one pooled ``AsyncClient`` per distinct (verify, proxy).

    Args:
        sources: the sources this transport serves (their ``verify`` and
            ``proxy`` pick the client).
        max_connections: pool size per client, sized by the caller to the
            scope's total concurrency so the pool never throttles governance.
        client_factory: builds each client (default: ``default_client``).
        mock_transport: an ``httpx.AsyncBaseTransport`` every client sends
            through (tests), so the real code path runs over ``MockTransport``.
    """

    __slots__ = ("_clients", "_closed", "_factory", "_keys", "_limits")

    def __init__(
        self,
        sources: Sequence[SourceConfig],
        *,
        max_connections: int,
        client_factory: HttpxClientFactory | None = None,
        mock_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        if client_factory is not None and mock_transport is not None:
            raise ValueError("pass client_factory or mock_transport, not both")
        self._limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        if mock_transport is not None:
            client_factory = _mock_factory(mock_transport)
        self._factory: HttpxClientFactory = client_factory or default_client
        self._keys: dict[str, _ClientKey] = {s.name: (s.verify, s.proxy or "") for s in sources}
        self._clients: dict[_ClientKey, httpx.AsyncClient] = {}
        self._closed = False

    def _client(self, source: str) -> httpx.AsyncClient:
        """The pooled client of a source, built on first use."""
        if self._closed:
            raise RuntimeError("transport is closed")
        key = self._keys.get(source, _DEFAULT_KEY)
        client = self._clients.get(key)
        if client is None:
            verify, proxy = key
            client = self._factory(verify=verify, proxy=proxy, limits=self._limits)
            self._clients[key] = client
        return client

    @staticmethod
    def _body(request: HttpRequest) -> dict[str, Any]:
        """The keyword arguments that carry a request's body and query."""
        kwargs: dict[str, Any] = {}
        if request.json is not None:
            kwargs["json"] = request.json
        if request.files is not None:
            kwargs["files"] = dict(request.files)
        if request.data is not None:
            kwargs["data"] = dict(request.data)
        if request.params is not None:
            kwargs["params"] = dict(request.params)
        return kwargs

    async def send(self, request: HttpRequest) -> Any:
        """Send one request and return the JSON of a 2xx answer; every failure is classified."""
        client = self._client(request.source)
        secrets = secrets_in(request.headers)
        connect = request.connect_timeout_s or request.timeout_s
        try:
            # httpx's timeouts bound each phase; asyncio.timeout bounds the whole
            # exchange, as timeout_s promises (a trickling body cannot outlive it).
            async with asyncio.timeout(request.timeout_s):
                response = await client.request(
                    request.method,
                    request.url,
                    headers=dict(request.headers),
                    timeout=httpx.Timeout(request.timeout_s, connect=connect),
                    **self._body(request),
                )
        except TimeoutError as exc:
            raise timeout_error("request timed out", request.source, request.timeout_s) from exc
        except _HTTPX_FAILURES as exc:
            raise _translate(exc, request, secrets) from exc
        if not response.is_success:
            raise status_error(
                response.status_code,
                response.headers,
                response.content,
                source=request.source,
                secrets=secrets,
                now_wall=time.time(),  # edge: Retry-After dates are wall-clock
            )
        return parse_json_body(response.content, request.source)

    @asynccontextmanager
    async def stream(self, request: HttpRequest) -> AsyncIterator[AsyncIterator[Any]]:
        """Open an SSE stream; yields an iterator of parsed ``data:`` events up to ``[DONE]``.

        ``request.timeout_s`` bounds the wait from now to the first event
        (TTFT), ``request.idle_timeout_s`` (default: ``timeout_s``) each later
        gap. A non-2xx answer raises its classified error before any event.
        Exiting the context, normally, by error or by cancellation, closes the response.
        """
        client = self._client(request.source)
        secrets = secrets_in(request.headers)
        loop = asyncio.get_running_loop()
        # edge: asyncio.timeout_at measures the loop's own clock, so the deadline must too.
        first_deadline = loop.time() + request.timeout_s
        async with AsyncExitStack() as stack:
            try:
                async with asyncio.timeout_at(first_deadline):
                    source = await stack.enter_async_context(
                        aconnect_sse(
                            client,
                            request.method,
                            request.url,
                            headers=dict(request.headers),
                            # Only connect has its own bound: the asyncio deadlines
                            # (TTFT, idle) govern everything after it.
                            timeout=httpx.Timeout(
                                None, connect=request.connect_timeout_s or request.timeout_s
                            ),
                            **self._body(request),
                        )
                    )
                    await self._check_opened(source, request, secrets)
            except TimeoutError as exc:
                raise timeout_error("no first event", request.source, request.timeout_s) from exc
            except _HTTPX_FAILURES as exc:
                raise _translate(exc, request, secrets) from exc
            sse = source.aiter_sse()
            # LIFO: the event generator is closed before its response.
            stack.push_async_callback(sse.aclose)
            yield _HttpxEvents(sse, request, secrets, loop, first_deadline)

    @staticmethod
    async def _check_opened(
        source: EventSource, request: HttpRequest, secrets: Sequence[str]
    ) -> None:
        """Raise the classified error of a stream that did not open as an event stream."""
        response = source.response
        if not response.is_success:
            body = await response.aread()
            raise status_error(
                response.status_code,
                response.headers,
                body,
                source=request.source,
                secrets=secrets,
                now_wall=time.time(),  # edge: Retry-After dates are wall-clock
            )
        content_type = response.headers.get("content-type")
        if not is_event_stream(content_type):
            raise malformed(request.source, f"expected an event stream, got {content_type!r}")

    async def aclose(self) -> None:
        """Close every pooled client; idempotent."""
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()


class _HttpxEvents:
    """Parsed ``data:`` events of one stream, with the TTFT and idle deadlines enforced."""

    __slots__ = ("_finished", "_first_deadline", "_loop", "_request", "_secrets", "_seen", "_sse")

    def __init__(
        self,
        sse: AsyncIterator[ServerSentEvent],
        request: HttpRequest,
        secrets: Sequence[str],
        loop: asyncio.AbstractEventLoop,
        first_deadline: float,
    ) -> None:
        self._sse = sse
        self._request = request
        self._secrets = secrets
        self._loop = loop
        self._first_deadline = first_deadline
        self._seen = False
        self._finished = False

    def __aiter__(self) -> _HttpxEvents:
        return self

    async def __anext__(self) -> Any:
        if self._finished:
            raise StopAsyncIteration
        request = self._request
        idle = request.idle_timeout_s or request.timeout_s
        if self._seen:
            what, limit = "stream idle", idle
            deadline = self._loop.time() + idle  # edge: the loop clock asyncio.timeout_at uses
        else:
            what, limit, deadline = "no first event", request.timeout_s, self._first_deadline
        # Any way out but an event ends the stream: the generator is spent.
        self._finished = True
        try:
            async with asyncio.timeout_at(deadline):
                event = await anext(self._sse)
                # Events without data (a named ping, an id-only event) are not
                # chunks: they neither count as the first event nor reset idle.
                while not event.data:
                    event = await anext(self._sse)
        except StopAsyncIteration:
            raise truncated_stream(request.source) from None
        except TimeoutError as exc:
            raise timeout_error(what, request.source, limit) from exc
        except _HTTPX_FAILURES as exc:
            raise _translate(exc, request, self._secrets) from exc
        parsed = parse_event_data(event.data, request.source)
        if parsed is STREAM_END:
            raise StopAsyncIteration
        self._seen = True
        self._finished = False
        return parsed
