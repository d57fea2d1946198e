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
    ExceptionGroup (anyio's connect, unmapped by httpx)  -> transient, "connect error"
    any other httpx.TransportError                      -> transient
    non-2xx answer                                      -> classified by status, Retry-After kept

``CancelledError`` is never caught: a cancelled attempt closes its response
on the way out and leaks no connection.

Each pool is sharded (``ShardGroup``): httpcore's connection pool does work
proportional to (requests waiting x connections) on every request start and
finish, so one pool of 64 busy connections costs milliseconds of CPU per
request; several small pools, each given the least busy, cost a fraction.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import httpx
from httpx_sse import ServerSentEvent, aconnect_sse

from polygateway.transport.exchange import (
    EventStream,
    RequestSecrets,
    answer_error,
    check_opened,
    connect_limit,
    connect_timed_out,
    deliver_hint,
    json_content,
    open_timed_out,
    phase_timed_out,
    stream_deadlines,
    unusable_url,
)
from polygateway.transport.http import (
    HttpRequest,
    TransientError,
    malformed,
    network_error,
    parse_json_body,
    timeout_error,
)
from polygateway.transport.pool import (
    STREAM_DRAIN_S,
    ClientPools,
    PoolKey,
    ShardGroup,
    check_pool_size,
    check_proxies,
    ends_stream,
    shard_plan,
    ssl_verify,
)

if TYPE_CHECKING:
    from polygateway.config import SourceConfig

__all__ = ["SHARD_SIZE", "HttpxClientFactory", "HttpxTransport"]

SHARD_SIZE = 12
"""Most connections one httpx client (shard) of a pool gets.

Measured on the benchmark machine, 1,000 POSTs at concurrency 64 to the
simulator, client CPU per call against requests in flight per httpx client:
16 -> ~1,650 us, 11 -> ~1,180 us, 8 -> ~850-990 us, 6 -> ~800 us, 4 -> ~790 us
(one client of all 64: ~2,300-3,300 us). Below ~8 per client the gain flattens
while every shard costs a client (~20 ms to build with TLS verification, done
on first use). 12 keeps pools of up to 12 connections one client exactly as
before and puts about 6 requests per client at concurrency 64 when two
sources of 64 share a pool (~800 us), about 11 for one source of 64.
"""


_EVENT_STREAM = "text/event-stream"

_EVENT_STREAM_ENCODING = "utf-8-sig"
"""How an event stream's body is decoded: UTF-8, a leading BOM dropped, as ``SSEParser`` does."""


class HttpxClientFactory(Protocol):
    """Builds one pooled client (one shard) for a (verify, proxy) combination."""

    def __call__(
        self, *, verify: bool | str, proxy: str, limits: httpx.Limits
    ) -> httpx.AsyncClient: ...


def default_client(*, verify: bool | str, proxy: str, limits: httpx.Limits) -> httpx.AsyncClient:
    """A pooled client; the environment (proxies, .netrc) is ignored, configuration says all."""
    # trust_env=False: a .netrc could add an Authorization header and an
    # HTTP_PROXY variable could reroute traffic, neither visible in the config.
    return httpx.AsyncClient(
        # A CA bundle path becomes a context: httpx deprecates a bare path.
        verify=ssl_verify(verify),
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
        return connect_timed_out(request)
    if isinstance(exc, httpx.TimeoutException):
        return phase_timed_out(request, exc)
    if isinstance(exc, httpx.ConnectError):
        return network_error("connect error", source, exc, secrets)
    if isinstance(exc, httpx.RemoteProtocolError):
        return network_error("connection reset", source, exc, secrets)
    if isinstance(exc, httpx.ReadError | httpx.WriteError):
        return network_error("connection broken", source, exc, secrets)
    if isinstance(exc, httpx.DecodingError):
        return malformed(source, "undecodable content encoding")
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
        return unusable_url(request, exc)
    if isinstance(exc, ExceptionGroup):
        # anyio's connect_tcp races the host's addresses in a task group and maps only
        # OSError; anything else (OverflowError for a port out of range) leaves httpx
        # as a group. Its first leaf says what failed.
        first: BaseException = exc
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        return network_error("connect error", source, first, secrets)
    return network_error("transport error", source, exc, secrets)


# Everything httpx raises for a failed exchange; its StreamError family (our
# own misuse of a response) is deliberately absent: that is a bug, not an outage.
# ExceptionGroup (Exception leaves only: a cancelled connect is a BaseExceptionGroup
# and passes) is anyio's failed connect, which httpx does not translate.
_HTTPX_FAILURES = (httpx.TransportError, httpx.DecodingError, httpx.InvalidURL, ExceptionGroup)


def _attr(obj: object, *names: str) -> Any:
    """``obj.<names[0]>.<names[1]>...``, or None where one is missing."""
    for name in names:
        obj = getattr(obj, name, None)
    return obj


_RECLAIMS: set[asyncio.Task[None]] = set()
"""Closes of orphaned connections, held until done (the loop keeps weak references)."""


def _reclaimed(task: asyncio.Task[None]) -> None:
    _RECLAIMS.discard(task)
    if not task.cancelled():
        task.exception()  # a socket that fails to close has nobody to tell: it is gone anyway


class _Slot:
    """The pooled HTTP/1.1 connection a response came on, closed if its close was cut short.

    httpcore 1.0.9 marks a response closed before its close has finished
    (encode/httpcore#1115): a second cancellation landing in that close
    leaves the connection counted as active in its pool for good, so each
    such call takes a slot for ever, until every request waits for one.
    Once the response is over, a connection still active that has started
    no request since is that orphan: it is closed in a task of its own
    (the caller may be unwinding a cancellation), and its pool is then
    told to hand the freed slot to a request already queued for one
    (``_reassign``). The slot reads httpcore's private attributes; where
    they are not found (another httpcore), it does nothing.
    """

    __slots__ = ("_connection", "_pool", "_requests")

    def __init__(self, connection: Any, requests: int, pool: Any = None) -> None:
        self._connection = connection
        self._requests = requests
        self._pool = pool

    @classmethod
    def of(cls, response: httpx.Response) -> _Slot | None:
        """The slot of ``response``, when it came from an httpcore pool over HTTP/1.1."""
        if response.http_version != "HTTP/1.1":
            return None  # HTTP/2 multiplexes: an active connection may serve others
        stream = _attr(response.stream, "_stream", "_httpcore_stream")
        connection = _attr(stream, "_pool_request", "connection")
        requests = _attr(connection, "_connection", "_request_count")
        if not isinstance(requests, int):
            return None
        return cls(connection, requests, _attr(stream, "_pool"))

    def reclaim(self) -> None:
        """Close the connection if the response left it orphaned (see the class)."""
        connection = self._connection
        if connection.is_closed() or connection.is_idle():
            return
        if _attr(connection, "_connection", "_request_count") != self._requests:
            return  # it went on to another request
        task = asyncio.get_running_loop().create_task(_close_orphan(connection, self._pool))
        _RECLAIMS.add(task)
        task.add_done_callback(_reclaimed)


async def _close_orphan(connection: Any, pool: Any) -> None:
    """Close an orphaned connection, then let its pool give the freed slot away."""
    try:
        await connection.aclose()
    finally:
        # The connection counts as closed from the start of its close: the slot is
        # free even when the socket fails to close.
        await _reassign(pool)


async def _reassign(pool: Any) -> None:
    """Hand ``pool``'s free slots to the requests queued in it, as httpcore itself does.

    httpcore 1.0.9 assigns queued requests to connections only when a request
    starts or a response is closed (``AsyncConnectionPool.handle_async_request``
    and ``PoolByteStream.aclose``), never when a connection is closed from
    outside. The orphan of encode/httpcore#1115 is closed from outside, so a
    request queued for its slot would wait for the pool's next request or
    release, or its pool timeout. This runs the pool's own assignment step,
    under its lock, and closes what that step drops, as those two paths do.
    Where httpcore's private attributes are not found, it does nothing.
    """
    lock = _attr(pool, "_optional_thread_lock")
    assign = _attr(pool, "_assign_requests_to_connections")
    close = _attr(pool, "_close_connections")
    if not (hasattr(lock, "__enter__") and callable(assign) and callable(close)):
        return
    with lock:
        closing = assign()
    await close(closing)


def _reclaim(slot: _Slot | None) -> None:
    if slot is not None:
        slot.reclaim()


class HttpxTransport:
    """``Transport`` on httpx: one shard group of pooled ``AsyncClient``s per (verify, proxy).

    A group holds ``K = ceil(max_connections / SHARD_SIZE)`` clients of
    ``ceil(max_connections / K)`` connections (and as many keep-alive) each,
    so a group never opens more than ``K * ceil(max_connections / K)``
    connections: ``max_connections`` plus at most ``K - 1``. Each request or
    stream goes to the client with the fewest in flight (ties: the first, so
    a lone caller reuses one warm connection); a stream counts until its
    context exits.

    Args:
        sources: the sources this transport serves (their ``verify`` and
            ``proxy`` pick the group).
        max_connections: connections per group, sized by the caller to the
            scope's total concurrency so the pool never throttles governance.
        client_factory: builds each client, called once per shard, lazily:
            shard ``i`` the first time ``i + 1`` requests of its group are in
            flight at once (default: ``default_client``).
        mock_transport: an ``httpx.AsyncBaseTransport`` every client sends
            through (tests), so the real code path runs over ``MockTransport``.
    """

    __slots__ = ("_pools",)

    def __init__(
        self,
        sources: Sequence[SourceConfig],
        *,
        max_connections: int,
        client_factory: HttpxClientFactory | None = None,
        mock_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        check_pool_size(max_connections)
        check_proxies(sources, "httpx")
        if client_factory is not None and mock_transport is not None:
            raise ValueError("pass client_factory or mock_transport, not both")
        shards, per_shard = shard_plan(max_connections, SHARD_SIZE)
        limits = httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
        if mock_transport is not None:
            client_factory = _mock_factory(mock_transport)
        factory: HttpxClientFactory = client_factory or default_client

        def build(key: PoolKey) -> ShardGroup[httpx.AsyncClient]:
            verify, proxy = key

            def build_shard() -> httpx.AsyncClient:
                return factory(verify=verify, proxy=proxy, limits=limits)

            return ShardGroup(shards, build=build_shard, close=httpx.AsyncClient.aclose)

        self._pools = ClientPools(sources, build=build, close=ShardGroup.aclose)

    def _group(self, source: str) -> ShardGroup[httpx.AsyncClient]:
        """The shard group of a source, built on first use."""
        return self._pools.get(source)[0]

    def in_flight(self, source: str) -> tuple[int, ...]:
        """Requests and streams in flight per shard of a source's group (tests, diagnostics)."""
        return self._group(source).in_flight

    @staticmethod
    def _body(request: HttpRequest) -> dict[str, Any]:
        """The keyword arguments that carry a request's body and query."""
        kwargs: dict[str, Any] = {}
        if request.json is not None:
            # Encoded by us, not by httpx: a body JSON cannot carry is refused alike on both
            # transports (the wire formats always set the JSON Content-Type header).
            kwargs["content"] = json_content(request)
        if request.files is not None:
            kwargs["files"] = dict(request.files)
        if request.data is not None:
            kwargs["data"] = dict(request.data)
        if request.params is not None:
            kwargs["params"] = dict(request.params)
        return kwargs

    async def send(self, request: HttpRequest) -> Any:
        """Send one request and return the JSON of a 2xx answer; every failure is classified."""
        group = self._group(request.source)
        secrets = RequestSecrets(request)
        shard, client = group.acquire()
        slot: _Slot | None = None
        try:
            # httpx's timeouts bound each phase; asyncio.timeout bounds the whole
            # exchange, as timeout_s promises (a trickling body cannot outlive it).
            async with asyncio.timeout(request.timeout_s):
                # client.request, with the response in hand while its body is read.
                response = await client.send(
                    client.build_request(
                        request.method,
                        request.url,
                        headers=dict(request.headers),
                        timeout=httpx.Timeout(request.timeout_s, connect=connect_limit(request)),
                        **self._body(request),
                    ),
                    stream=True,
                )
                slot = _Slot.of(response)
                try:
                    await response.aread()
                except BaseException:
                    await response.aclose()
                    raise
        except TimeoutError as exc:
            raise timeout_error("request timed out", request.source, request.timeout_s) from exc
        except _HTTPX_FAILURES as exc:
            raise _translate(exc, request, secrets) from exc
        finally:
            # The body is read by now (or the exchange is over): the shard is free again,
            # whatever ended it, cancellation included.
            group.release(shard)
            _reclaim(slot)
        if not response.is_success:
            raise answer_error(
                response.status_code, response.headers, response.content, request, secrets
            )
        if request.on_hint is not None:
            deliver_hint(request, response.headers)
        return parse_json_body(response.content, request.source)

    @asynccontextmanager
    async def stream(self, request: HttpRequest) -> AsyncIterator[AsyncIterator[Any]]:
        """Open an SSE stream; yields an iterator of parsed ``data:`` events up to ``[DONE]``.

        ``request.timeout_s`` bounds the wait from now to the first event
        (TTFT), ``request.idle_timeout_s`` (default: ``timeout_s``) each later
        gap, and ``request.deadline_in_s`` the whole stream from now. A non-2xx
        answer raises its classified error before any event.
        Exiting the context, normally, by error or by cancellation, closes the response;
        a stream read to ``[DONE]`` gives its connection back to the pool if the
        body ends within ``STREAM_DRAIN_S`` (``transport/pool.py``).
        """
        group = self._group(request.source)
        secrets = RequestSecrets(request)
        loop = asyncio.get_running_loop()
        first_deadline, end = stream_deadlines(request, loop)
        async with AsyncExitStack() as stack:
            shard, client = group.acquire()
            # Pushed first, so it runs last: the shard is free once its response is closed.
            stack.callback(group.release, shard)
            # Then the connection's slot, checked once the response is closed (_Slot).
            slot: list[_Slot | None] = [None]
            stack.callback(lambda: _reclaim(slot[0]))
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
                            timeout=httpx.Timeout(None, connect=connect_limit(request)),
                            **self._body(request),
                        )
                    )
                    response = source.response
                    slot[0] = _Slot.of(response)
                    await check_opened(
                        response.status_code, response.headers, response.aread, request, secrets
                    )
            except TimeoutError as exc:
                raise open_timed_out(request, first_deadline, end) from exc
            except _HTTPX_FAILURES as exc:
                raise _translate(exc, request, secrets) from exc
            if request.on_hint is not None:
                deliver_hint(request, response.headers)
            # An event stream is UTF-8 whatever its charset says, and a leading BOM is
            # dropped (WHATWG event stream interpretation); httpx-sse decodes with the
            # response's encoding, where a BOM would hide the first field.
            response.encoding = _EVENT_STREAM_ENCODING
            # check_opened accepted the media type in any case, as HTTP says; httpx-sse
            # looks for it in lower case only (its parameters no longer matter).
            response.headers["content-type"] = _EVENT_STREAM
            sse = source.aiter_sse()
            # LIFO: the event generator is closed before its response.
            stack.push_async_callback(sse.aclose)
            events = _HttpxEvents(sse, request, secrets, loop, first_deadline, end)
            # A stream left between events must not keep its idle timer on the loop.
            stack.callback(events.close)
            yield events
            await events.drain()

    async def aclose(self) -> None:
        """Close every pooled client; idempotent."""
        await self._pools.aclose()


class _HttpxEvents(EventStream):
    """The events of one httpx-sse stream (see ``EventStream``)."""

    __slots__ = ("_done", "_sse")

    _FAILURES: ClassVar[tuple[type[Exception], ...]] = _HTTPX_FAILURES

    def __init__(
        self,
        sse: AsyncIterator[ServerSentEvent],
        request: HttpRequest,
        secrets: Sequence[str],
        loop: asyncio.AbstractEventLoop,
        first_deadline: float,
        end: float,
    ) -> None:
        super().__init__(request, secrets, loop, first_deadline, end)
        self._sse = sse
        self._done = False
        """``[DONE]`` was read: the body is all but over."""

    async def _next_data(self) -> str | None:
        event = await anext(self._sse, None)
        while event is not None and not event.data:
            event = await anext(self._sse, None)
        if event is None:
            return None
        if ends_stream(event.data):
            self._done = True
        return event.data

    async def drain(self) -> None:
        """After ``[DONE]``, read to the body's end (briefly), so the connection can be pooled.

        Anything after the marker is discarded; a failure or a body that does
        not end within ``STREAM_DRAIN_S`` leaves the connection to be closed.
        """
        if not self._done:
            return
        with contextlib.suppress(TimeoutError, *self._FAILURES):
            async with asyncio.timeout(STREAM_DRAIN_S):
                async for _ in self._sse:
                    pass

    def _translate(self, exc: Exception) -> TransientError:
        return _translate(exc, self._request, self._secrets)
