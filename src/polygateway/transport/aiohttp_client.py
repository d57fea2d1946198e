"""The aiohttp transport (the ``aiohttp`` extra): same contract as the httpx one, less CPU per call.

Importing this module needs aiohttp; nothing else in PolyGateway imports it
except ``factory.make_transport("aiohttp", ...)``, lazily, so ``import
polygateway`` never loads aiohttp.

This module is the one boundary where aiohttp exceptions become
``TransientError`` (``raise ... from exc``)::

    aiohttp.ServerTimeoutError (connect, socket read)   -> transient, timeout=True
    aiohttp's total expiry, asyncio deadline (TTFT, idle) -> transient, timeout=True
    aiohttp.ClientConnectorError                        -> transient, "connect error"
    aiohttp.ServerDisconnectedError                     -> transient, "connection reset"
    aiohttp.ClientOSError, ClientPayloadError           -> transient (resets, cut bodies)
    aiohttp.ClientResponseError (bad HTTP from upstream) -> transient, "protocol error"
    aiohttp.InvalidURL, NonHttpUrlClientError           -> source_misconfigured
    any other aiohttp.ClientError                       -> transient
    2xx body that is not JSON                           -> transient, "malformed body"
    non-2xx answer                                      -> classified by status, Retry-After kept

Event streams are parsed by ``transport/sse.py`` (see there why).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

try:
    import aiohttp
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "the aiohttp transport needs aiohttp: pip install polygateway[aiohttp]"
    ) from exc

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
    network_error,
    parse_json_body,
    timeout_error,
)
from polygateway.transport.pool import (
    STREAM_DRAIN_S,
    ClientPools,
    PoolKey,
    check_pool_size,
    check_proxies,
    ends_stream,
    ssl_verify,
)
from polygateway.transport.sse import SSEParser

if TYPE_CHECKING:
    from polygateway.config import SourceConfig

__all__ = ["AiohttpSessionFactory", "AiohttpTransport"]


class AiohttpSessionFactory(Protocol):
    """Builds the pooled session for one (verify, proxy) combination."""

    def __call__(self, *, verify: bool | str, max_connections: int) -> aiohttp.ClientSession: ...


def default_session(*, verify: bool | str, max_connections: int) -> aiohttp.ClientSession:
    """A pooled session; the environment (proxies, .netrc) is ignored, configuration says all."""
    connector = aiohttp.TCPConnector(
        limit=max_connections, limit_per_host=0, ssl=ssl_verify(verify)
    )
    # No session-wide timeout: every request carries its own (a total for a plain
    # request), and the asyncio deadlines of a stream bound its TTFT and idle gaps.
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None), trust_env=False
    )


_STREAM_HEADERS = {"Accept": "text/event-stream", "Cache-Control": "no-store"}
"""What every stream request adds to its source's headers."""


_LEAST_TOTAL_S = 1e-6
"""The smallest total aiohttp is given: expires on the loop's next turn, as asyncio.timeout(0)."""


@functools.lru_cache(maxsize=256)
def _client_timeout(total: float | None, connect: float) -> aiohttp.ClientTimeout:
    """The ``ClientTimeout`` of one (total, connect) pair, built once, not per request.

    ``ceil_threshold`` is infinite: aiohttp would otherwise round a bound of
    5 s or more up to a whole second of the loop's clock, and ``timeout_s``
    (clipped to a call's ``deadline_s``) must stay exact.
    """
    return aiohttp.ClientTimeout(total=total, sock_connect=connect, ceil_threshold=math.inf)


def _translate(exc: Exception, request: HttpRequest, secrets: Sequence[str]) -> TransientError:
    """The one mapping of an aiohttp exception to a classified failure."""
    source = request.source
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return connect_timed_out(request)
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return phase_timed_out(request, exc)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return network_error("connect error", source, exc, secrets)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return network_error("connection reset", source, exc, secrets)
    if isinstance(exc, aiohttp.ClientOSError | aiohttp.ClientPayloadError):
        return network_error("connection broken", source, exc, secrets)
    if isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        return unusable_url(request, exc)
    if isinstance(exc, aiohttp.ClientResponseError):
        # Raised by aiohttp itself for an unparseable answer; a status from the
        # upstream never arrives here (raise_for_status is off).
        return network_error("protocol error", source, exc, secrets)
    return network_error("transport error", source, exc, secrets)


class AiohttpTransport:
    """``Transport`` on aiohttp: one pooled ``ClientSession`` per distinct (verify, proxy).

    Args:
        sources: the sources this transport serves (their ``verify`` and
            ``proxy`` pick the session).
        max_connections: connector limit per session, sized by the caller to
            the scope's total concurrency.
        client_factory: builds each session (default: ``default_session``).
            Sessions are built on first use, inside the running loop, as
            aiohttp requires.
    """

    __slots__ = ("_by_source", "_pools")

    def __init__(
        self,
        sources: Sequence[SourceConfig],
        *,
        max_connections: int,
        client_factory: AiohttpSessionFactory | None = None,
    ) -> None:
        check_pool_size(max_connections)
        check_proxies(sources, "aiohttp")
        factory: AiohttpSessionFactory = client_factory or default_session

        def build(key: PoolKey) -> aiohttp.ClientSession:
            # The proxy is not the session's: aiohttp takes it per request.
            return factory(verify=key[0], max_connections=max_connections)

        self._pools = ClientPools(sources, build=build, close=aiohttp.ClientSession.close)
        self._by_source: dict[str, tuple[aiohttp.ClientSession, str | None]] = {}
        """Each source's session and proxy once looked up: one dict probe per request."""

    def _session(self, source: str) -> tuple[aiohttp.ClientSession, str | None]:
        """The pooled session of a source and the proxy its requests go through."""
        found = self._by_source.get(source)
        if found is None:
            session, (_, proxy) = self._pools.get(source)
            found = self._by_source[source] = (session, proxy or None)
        return found

    @staticmethod
    def _body(request: HttpRequest) -> aiohttp.FormData | bytes | None:
        """The body of one request: a multipart form, or its JSON encoded by us."""
        if request.files is not None or request.data is not None:
            form = aiohttp.FormData()
            for name, value in (request.data or {}).items():
                form.add_field(name, value)
            for name, (filename, content, content_type) in (request.files or {}).items():
                form.add_field(name, content, filename=filename, content_type=content_type)
            return form
        if request.json is not None:
            # Encoded by us, not by aiohttp: a body JSON cannot carry is refused alike on
            # both transports (the wire formats always set the JSON Content-Type header).
            return json_content(request)
        return None

    async def send(self, request: HttpRequest) -> Any:
        """Send one request and return the JSON of a 2xx answer; every failure is classified.

        aiohttp's own ``total`` timeout bounds the whole exchange, reading the
        body included, as ``timeout_s`` promises (a trickling body cannot
        outlive it); its expiry is a plain ``TimeoutError``.
        """
        session, proxy = self._session(request.source)
        try:
            async with session.request(
                request.method,
                request.url,
                # aiohttp copies the headers into its own multidict: no copy of ours.
                headers=request.headers,
                params=None if request.params is None else dict(request.params),
                data=self._body(request),
                proxy=proxy,
                # Redirects are not followed (as with httpx): a redirect could carry
                # the key to another host, and a 3xx is an answer to classify.
                allow_redirects=False,
                # aiohttp reads a total <= 0 as "no bound": a deadline already reached
                # (timeout_s clipped to zero or below) must expire at once instead.
                timeout=_client_timeout(
                    max(request.timeout_s, _LEAST_TOTAL_S), connect_limit(request)
                ),
            ) as response:
                body = await response.read()
                status, headers = response.status, response.headers
        # Secrets are looked for only here, on the failure paths: success never pays for it.
        except aiohttp.ClientError as exc:
            raise _translate(exc, request, RequestSecrets(request)) from exc
        except TimeoutError as exc:
            raise timeout_error("request timed out", request.source, request.timeout_s) from exc
        if not 200 <= status < 300:
            raise answer_error(status, headers, body, request, RequestSecrets(request))
        if request.on_hint is not None:
            deliver_hint(request, headers)
        return parse_json_body(body, request.source)

    @asynccontextmanager
    async def stream(self, request: HttpRequest) -> AsyncIterator[AsyncIterator[Any]]:
        """Open an SSE stream; yields an iterator of parsed ``data:`` events up to ``[DONE]``.

        Same contract as ``HttpxTransport.stream``: ``timeout_s`` is the TTFT,
        ``idle_timeout_s`` each later gap, ``deadline_in_s`` the whole stream; a
        non-2xx answer raises before any event; leaving the context by any path
        closes the response, but a stream read to ``[DONE]`` whose body ends
        within ``STREAM_DRAIN_S`` has given its connection back to the pool.
        """
        session, proxy = self._session(request.source)
        secrets = RequestSecrets(request)
        loop = asyncio.get_running_loop()
        first_deadline, end = stream_deadlines(request, loop)
        async with AsyncExitStack() as stack:
            try:
                async with asyncio.timeout_at(first_deadline):
                    response = await stack.enter_async_context(
                        session.request(
                            request.method,
                            request.url,
                            headers={**request.headers, **_STREAM_HEADERS},
                            params=None if request.params is None else dict(request.params),
                            data=self._body(request),
                            proxy=proxy,
                            allow_redirects=False,
                            # Only connect has its own bound: the asyncio deadlines
                            # (TTFT, idle) govern everything after it.
                            timeout=_client_timeout(None, connect_limit(request)),
                        )
                    )
                    # Runs before the context manager's release: an unfinished body
                    # must close its connection, not go back to the pool.
                    stack.callback(response.close)
                    await check_opened(
                        response.status, response.headers, response.read, request, secrets
                    )
            except aiohttp.ClientError as exc:
                raise _translate(exc, request, secrets) from exc
            except TimeoutError as exc:
                raise open_timed_out(request, first_deadline, end) from exc
            if request.on_hint is not None:
                deliver_hint(request, response.headers)
            events = _AiohttpEvents(response, request, secrets, loop, first_deadline, end)
            # First out (LIFO): the stream's timer goes before the response closes.
            stack.callback(events.close)
            yield events
            await events.drain()

    async def aclose(self) -> None:
        """Close every pooled session; idempotent."""
        # Emptied first: a request after close asks the pools again, which refuse it.
        self._by_source.clear()
        await self._pools.aclose()


class _AiohttpEvents(EventStream):
    """The events of one aiohttp response, parsed by ``SSEParser`` (see ``EventStream``)."""

    __slots__ = ("_done", "_eof", "_parser", "_ready", "_response")

    _FAILURES: ClassVar[tuple[type[Exception], ...]] = (aiohttp.ClientError,)

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        request: HttpRequest,
        secrets: Sequence[str],
        loop: asyncio.AbstractEventLoop,
        first_deadline: float,
        end: float,
    ) -> None:
        super().__init__(request, secrets, loop, first_deadline, end)
        self._response = response
        self._parser = SSEParser()
        self._ready: deque[str] = deque()
        self._eof = False
        self._done = False
        """``[DONE]`` was read: the body is all but over."""

    async def _next_data(self) -> str | None:
        while True:
            while self._ready:
                data = self._ready.popleft()
                if data:
                    if ends_stream(data):
                        self._done = True
                    return data
            if self._eof:
                return None
            chunk = await self._response.content.readany()
            if chunk:
                self._ready.extend(self._parser.feed_bytes(chunk))
            else:
                self._eof = True
                self._parser.close()

    async def drain(self) -> None:
        """After ``[DONE]``, read to the body's end (briefly): aiohttp then pools the connection.

        Anything after the marker is discarded; a failure or a body that does
        not end within ``STREAM_DRAIN_S`` leaves the connection to be closed.
        """
        if not self._done or self._eof:
            return
        content = self._response.content
        with contextlib.suppress(TimeoutError, *self._FAILURES):
            async with asyncio.timeout(STREAM_DRAIN_S):
                while await content.readany():
                    pass

    def _translate(self, exc: Exception) -> TransientError:
        return _translate(exc, self._request, self._secrets)
