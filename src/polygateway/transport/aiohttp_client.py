"""The aiohttp transport (the ``aiohttp`` extra): same contract as the httpx one, less CPU per call.

Importing this module needs aiohttp; nothing else in PolyGateway imports it
except ``factory.make_transport("aiohttp", ...)``, lazily, so ``import
polygateway`` never loads aiohttp.

This module is the one boundary where aiohttp exceptions become
``TransientError`` (``raise ... from exc``)::

    aiohttp.ServerTimeoutError (connect, socket read)   -> transient, timeout=True
    asyncio.timeout expiry (total, TTFT, stream idle)   -> transient, timeout=True
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
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, Protocol

try:
    import aiohttp
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "the aiohttp transport needs aiohttp: pip install polygateway[aiohttp]"
    ) from exc

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
from polygateway.transport.sse import SSEParser

if TYPE_CHECKING:
    from polygateway.config import SourceConfig

__all__ = ["AiohttpSessionFactory", "AiohttpTransport"]

_ClientKey = tuple[bool | str, str]
"""(verify, proxy): sources that agree on both share one pooled session."""

_DEFAULT_KEY: _ClientKey = (True, "")


class AiohttpSessionFactory(Protocol):
    """Builds the pooled session for one (verify, proxy) combination."""

    def __call__(self, *, verify: bool | str, max_connections: int) -> aiohttp.ClientSession: ...


def default_session(*, verify: bool | str, max_connections: int) -> aiohttp.ClientSession:
    """A pooled session; the environment (proxies, .netrc) is ignored, configuration says all."""
    ssl_arg: bool | ssl.SSLContext = (
        ssl.create_default_context(cafile=verify) if isinstance(verify, str) else verify
    )
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=0, ssl=ssl_arg)
    # No session-wide timeout: every request carries its own, and asyncio
    # deadlines bound totals, TTFT and idle gaps.
    return aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=None), trust_env=False
    )


def _translate(
    exc: aiohttp.ClientError, request: HttpRequest, secrets: Sequence[str]
) -> TransientError:
    """The one mapping of an aiohttp exception to a classified failure."""
    source = request.source
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        connect = request.connect_timeout_s or request.timeout_s
        return timeout_error("connect timed out", source, connect)
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return timeout_error(f"timed out ({type(exc).__name__})", source, request.timeout_s)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return network_error("connect error", source, exc, secrets)
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return network_error("connection reset", source, exc, secrets)
    if isinstance(exc, aiohttp.ClientOSError | aiohttp.ClientPayloadError):
        return network_error("connection broken", source, exc, secrets)
    if isinstance(exc, aiohttp.InvalidURL | aiohttp.NonHttpUrlClientError):
        # The URL comes from the source's configuration: every retry there fails alike.
        return TransientError(
            f"unusable URL for {source}: {type(exc).__name__}", failure="source_misconfigured"
        )
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

    __slots__ = ("_closed", "_factory", "_keys", "_max_connections", "_sessions")

    def __init__(
        self,
        sources: Sequence[SourceConfig],
        *,
        max_connections: int,
        client_factory: AiohttpSessionFactory | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self._max_connections = max_connections
        self._factory: AiohttpSessionFactory = client_factory or default_session
        self._keys: dict[str, _ClientKey] = {s.name: (s.verify, s.proxy or "") for s in sources}
        self._sessions: dict[_ClientKey, aiohttp.ClientSession] = {}
        self._closed = False

    def _session(self, source: str) -> tuple[aiohttp.ClientSession, str | None]:
        """The pooled session of a source and the proxy its requests go through."""
        if self._closed:
            raise RuntimeError("transport is closed")
        key = self._keys.get(source, _DEFAULT_KEY)
        session = self._sessions.get(key)
        if session is None:
            verify, _ = key
            session = self._factory(verify=verify, max_connections=self._max_connections)
            self._sessions[key] = session
        return session, key[1] or None

    @staticmethod
    def _options(request: HttpRequest, proxy: str | None, *, stream: bool) -> dict[str, Any]:
        """Keyword arguments of ``session.request`` for one request."""
        connect = request.connect_timeout_s or request.timeout_s
        headers = dict(request.headers)
        if stream:
            headers["Accept"] = "text/event-stream"
            headers["Cache-Control"] = "no-store"
        options: dict[str, Any] = {
            "headers": headers,
            "proxy": proxy,
            # Redirects are not followed (as with httpx): a redirect could carry
            # the key to another host, and a 3xx is an answer to classify.
            "allow_redirects": False,
            # Only connect has its own bound: asyncio deadlines govern the rest.
            "timeout": aiohttp.ClientTimeout(total=None, sock_connect=connect),
        }
        if request.params is not None:
            options["params"] = dict(request.params)
        if request.files is not None or request.data is not None:
            form = aiohttp.FormData()
            for name, value in (request.data or {}).items():
                form.add_field(name, value)
            for name, (filename, content, content_type) in (request.files or {}).items():
                form.add_field(name, content, filename=filename, content_type=content_type)
            options["data"] = form
        elif request.json is not None:
            options["json"] = request.json
        return options

    async def send(self, request: HttpRequest) -> Any:
        """Send one request and return the JSON of a 2xx answer; every failure is classified."""
        session, proxy = self._session(request.source)
        secrets = secrets_in(request.headers)
        try:
            async with (
                asyncio.timeout(request.timeout_s),
                session.request(
                    request.method, request.url, **self._options(request, proxy, stream=False)
                ) as response,
            ):
                body = await response.read()
                status, headers = response.status, response.headers
        except aiohttp.ClientError as exc:
            raise _translate(exc, request, secrets) from exc
        except TimeoutError as exc:
            raise timeout_error("request timed out", request.source, request.timeout_s) from exc
        if not 200 <= status < 300:
            raise status_error(
                status,
                headers,
                body,
                source=request.source,
                secrets=secrets,
                now_wall=time.time(),  # edge: Retry-After dates are wall-clock
            )
        return parse_json_body(body, request.source)

    @asynccontextmanager
    async def stream(self, request: HttpRequest) -> AsyncIterator[AsyncIterator[Any]]:
        """Open an SSE stream; yields an iterator of parsed ``data:`` events up to ``[DONE]``.

        Same contract as ``HttpxTransport.stream``: ``timeout_s`` is the TTFT,
        ``idle_timeout_s`` each later gap; a non-2xx answer raises before any
        event; leaving the context by any path closes the response.
        """
        session, proxy = self._session(request.source)
        secrets = secrets_in(request.headers)
        loop = asyncio.get_running_loop()
        # edge: asyncio.timeout_at measures the loop's own clock, so the deadline must too.
        first_deadline = loop.time() + request.timeout_s
        async with AsyncExitStack() as stack:
            try:
                async with asyncio.timeout_at(first_deadline):
                    response = await stack.enter_async_context(
                        session.request(
                            request.method,
                            request.url,
                            **self._options(request, proxy, stream=True),
                        )
                    )
                    # Runs before the context manager's release: an unfinished body
                    # must close its connection, not go back to the pool.
                    stack.callback(response.close)
                    await self._check_opened(response, request, secrets)
            except aiohttp.ClientError as exc:
                raise _translate(exc, request, secrets) from exc
            except TimeoutError as exc:
                raise timeout_error("no first event", request.source, request.timeout_s) from exc
            yield _AiohttpEvents(response, request, secrets, loop, first_deadline)

    @staticmethod
    async def _check_opened(
        response: aiohttp.ClientResponse, request: HttpRequest, secrets: Sequence[str]
    ) -> None:
        """Raise the classified error of a stream that did not open as an event stream."""
        if not 200 <= response.status < 300:
            body = await response.read()
            raise status_error(
                response.status,
                response.headers,
                body,
                source=request.source,
                secrets=secrets,
                now_wall=time.time(),  # edge: Retry-After dates are wall-clock
            )
        content_type = response.headers.get("Content-Type")
        if not is_event_stream(content_type):
            raise malformed(request.source, f"expected an event stream, got {content_type!r}")

    async def aclose(self) -> None:
        """Close every pooled session; idempotent."""
        self._closed = True
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()


class _AiohttpEvents:
    """Parsed ``data:`` events of one stream, with the TTFT and idle deadlines enforced."""

    __slots__ = (
        "_eof",
        "_finished",
        "_first_deadline",
        "_loop",
        "_parser",
        "_ready",
        "_request",
        "_response",
        "_secrets",
        "_seen",
    )

    def __init__(
        self,
        response: aiohttp.ClientResponse,
        request: HttpRequest,
        secrets: Sequence[str],
        loop: asyncio.AbstractEventLoop,
        first_deadline: float,
    ) -> None:
        self._response = response
        self._request = request
        self._secrets = secrets
        self._loop = loop
        self._first_deadline = first_deadline
        self._parser = SSEParser()
        self._ready: deque[str] = deque()
        self._eof = False
        self._seen = False
        self._finished = False

    def __aiter__(self) -> _AiohttpEvents:
        return self

    async def _next_data(self) -> str | None:
        """The data of the next event that has any, or ``None`` at end of stream."""
        while True:
            while self._ready:
                data = self._ready.popleft()
                # Events without data (a named ping, an id-only event) are not
                # chunks: they neither count as the first event nor reset idle.
                if data:
                    return data
            if self._eof:
                return None
            chunk = await self._response.content.readany()
            if chunk:
                self._ready.extend(self._parser.feed_bytes(chunk))
            else:
                self._eof = True
                self._parser.close()

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
        # Any way out but an event ends the stream.
        self._finished = True
        try:
            async with asyncio.timeout_at(deadline):
                data = await self._next_data()
        except aiohttp.ClientError as exc:
            raise _translate(exc, request, self._secrets) from exc
        except TimeoutError as exc:
            raise timeout_error(what, request.source, limit) from exc
        if data is None:
            raise truncated_stream(request.source)
        parsed = parse_event_data(data, request.source)
        if parsed is STREAM_END:
            raise StopAsyncIteration
        self._seen = True
        self._finished = False
        return parsed
