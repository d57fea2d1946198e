"""What both HTTP client modules do alike around one exchange, whichever library carries it.

- ``answer_error``: the classified error of a non-2xx answer; its Retry-After
  date is read against the wall clock here, at the edge.
- ``connect_timed_out``, ``phase_timed_out``, ``unusable_url``: what each
  module's exception table says for the failures both libraries share, so
  the two transports word them alike.
- ``check_opened``: a stream must answer 2xx with ``text/event-stream``.
- ``json_content``: a request's JSON body encoded once, here, so a body JSON
  cannot carry (bytes, a set, NaN, a lone surrogate) is refused before
  anything is sent, alike on both transports.
- ``EventStream``: the parsed ``data:`` events of one stream with the TTFT and
  idle deadlines enforced. A client module subclasses it with its library's
  read (``_next_data``) and its exception boundary (``_FAILURES``, ``_translate``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar, Self

from polygateway.transport.http import (
    STREAM_END,
    HttpRequest,
    TransientError,
    excerpt,
    is_event_stream,
    malformed,
    parse_event_data,
    status_error,
    timeout_error,
    truncated_stream,
)

__all__ = [
    "EventStream",
    "answer_error",
    "check_opened",
    "connect_limit",
    "connect_timed_out",
    "json_content",
    "phase_timed_out",
    "unusable_url",
]


def connect_limit(request: HttpRequest) -> float:
    """How long connecting may take: the request's own connect timeout, else the attempt's."""
    return request.connect_timeout_s or request.timeout_s


def connect_timed_out(request: HttpRequest) -> TransientError:
    """The library gave up connecting."""
    return timeout_error("connect timed out", request.source, connect_limit(request))


def phase_timed_out(request: HttpRequest, exc: Exception) -> TransientError:
    """The library's own timeout of a phase (read, write, pool), named by its class."""
    return timeout_error(f"timed out ({type(exc).__name__})", request.source, request.timeout_s)


def unusable_url(request: HttpRequest, exc: Exception) -> TransientError:
    """A URL the library refuses: misconfigured, as it comes from the source's configuration."""
    return TransientError(
        f"unusable URL for {request.source}: {type(exc).__name__}",
        failure="source_misconfigured",
    )


def json_content(request: HttpRequest) -> bytes:
    """The request's JSON body as UTF-8, strict JSON (no NaN); refused as the request's fault.

    A body JSON cannot carry is the caller's input, not an outage: the loop
    raises ``RequestRejected`` at once and tries no other source.
    """
    try:
        text = json.dumps(request.json, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        return text.encode("utf-8")
    except (TypeError, ValueError) as exc:
        # TypeError: a value JSON has no type for; ValueError: NaN or infinity, a circular
        # reference, or (UnicodeEncodeError) a lone surrogate that UTF-8 cannot encode.
        raise TransientError(
            f"the request to {request.source} was not sent: its body is not valid JSON: "
            f"{excerpt(str(exc))}",
            failure="request_rejected",
        ) from exc


def answer_error(
    status: int,
    headers: Mapping[str, str],
    body: bytes,
    request: HttpRequest,
    secrets: Sequence[str],
) -> TransientError:
    """The classified error of a non-2xx answer to ``request``."""
    return status_error(
        status,
        headers,
        body,
        source=request.source,
        secrets=secrets,
        now_wall=time.time(),  # edge: Retry-After dates are wall-clock
    )


async def check_opened(
    status: int,
    headers: Mapping[str, str],
    read_body: Callable[[], Awaitable[bytes]],
    request: HttpRequest,
    secrets: Sequence[str],
) -> None:
    """Raise the classified error of a stream that did not open as an event stream.

    ``headers`` must look names up case-insensitively (both libraries' do);
    ``read_body`` is awaited only for a non-2xx answer, to quote it.
    """
    if not 200 <= status < 300:
        raise answer_error(status, headers, await read_body(), request, secrets)
    content_type = headers.get("content-type")
    if not is_event_stream(content_type):
        raise malformed(request.source, f"expected an event stream, got {content_type!r}")


class EventStream:
    """Parsed ``data:`` events of one stream, with the TTFT and idle deadlines enforced.

    The first event must arrive by ``first_deadline`` (on the loop's clock,
    the one ``asyncio.timeout_at`` measures); each later one within
    ``idle_timeout_s`` (default: ``timeout_s``) of the previous. Any way out
    but an event ends the iteration for good.
    """

    __slots__ = ("_finished", "_first_deadline", "_loop", "_request", "_secrets", "_seen")

    _FAILURES: ClassVar[tuple[type[Exception], ...]] = ()
    """The library's exceptions for a failed read, handed to ``_translate``."""

    def __init__(
        self,
        request: HttpRequest,
        secrets: Sequence[str],
        loop: asyncio.AbstractEventLoop,
        first_deadline: float,
    ) -> None:
        self._request = request
        self._secrets = secrets
        self._loop = loop
        self._first_deadline = first_deadline
        self._seen = False
        self._finished = False

    def __aiter__(self) -> Self:
        return self

    async def _next_data(self) -> str | None:
        """The data of the next event that has any, or ``None`` at end of stream.

        Events without data (a named ping, an id-only event) are not chunks:
        they neither count as the first event nor reset idle.
        """
        raise NotImplementedError

    def _translate(self, exc: Exception) -> TransientError:
        """The classified failure of one of ``_FAILURES``."""
        raise NotImplementedError

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
        self._finished = True
        try:
            async with asyncio.timeout_at(deadline):
                data = await self._next_data()
        # The library's failures first: some (aiohttp's ServerTimeoutError) are
        # TimeoutErrors too, and keep their own message.
        except self._FAILURES as exc:
            raise self._translate(exc) from exc
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
