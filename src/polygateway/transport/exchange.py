"""What both HTTP client modules do alike around one exchange, whichever library carries it.

- ``answer_error``: the classified error of a non-2xx answer; its Retry-After
  date is read against the wall clock here, at the edge.
- ``connect_timed_out``, ``phase_timed_out``, ``unusable_url``: what each
  module's exception table says for the failures both libraries share, so
  the two transports word them alike.
- ``check_opened``: a stream must answer 2xx with ``text/event-stream``.
- ``deliver_hint``: the limits a 2xx answer's headers announce, handed to the
  request's ``on_hint``; dates in them are read against the wall clock here.
- ``json_content``: a request's JSON body encoded once, here, so a body JSON
  cannot carry (bytes, a set, NaN, a lone surrogate) is refused before
  anything is sent, alike on both transports.
- ``RequestSecrets``: a request's credential values, scanned only when a
  failure's message needs them (the success path never pays for the scan).
- ``EventStream``: the parsed ``data:`` events of one stream with the TTFT and
  idle deadlines, and the call's end (``HttpRequest.deadline_in_s``), enforced
  by one timer per stream; the TTFT runs to the first event carrying content
  (``HttpRequest.is_content``), not to a role announcement before it. A client
  module subclasses it with its library's read (``_next_data``) and its
  exception boundary (``_FAILURES``, ``_translate``);
  ``stream_deadlines`` fixes the first deadline and the end when the request
  starts, and ``open_timed_out`` says which of them cut the opening.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Self, overload

from polygateway.transport.hints import read_hint
from polygateway.transport.http import (
    STREAM_END,
    HttpRequest,
    TransientError,
    excerpt,
    is_event_stream,
    malformed,
    parse_event_data,
    request_secrets,
    status_error,
    timeout_error,
    truncated_stream,
)

__all__ = [
    "EventStream",
    "RequestSecrets",
    "answer_error",
    "check_opened",
    "connect_limit",
    "connect_timed_out",
    "deadline_reached",
    "deliver_hint",
    "json_content",
    "open_timed_out",
    "phase_timed_out",
    "stream_deadlines",
    "unusable_url",
]


_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)
"""The request body encoder, built once: ``json.dumps`` with options builds one per call."""


def connect_limit(request: HttpRequest) -> float:
    """How long connecting may take: the request's own connect timeout, else the attempt's."""
    return request.connect_timeout_s or request.timeout_s


def connect_timed_out(request: HttpRequest) -> TransientError:
    """The library gave up connecting."""
    return timeout_error("connect timed out", request.source, connect_limit(request))


def phase_timed_out(request: HttpRequest, exc: Exception) -> TransientError:
    """The library's own timeout of a phase (read, write, pool), named by its class."""
    return timeout_error(f"timed out ({type(exc).__name__})", request.source, request.timeout_s)


def deadline_reached(request: HttpRequest) -> TransientError:
    """A stream cut because the call's deadline was reached, however well it flowed.

    Classified like any timeout (transient, ``timeout=True``); the loop tells
    the caller's deadline apart from the source's own timeouts by its clock.
    """
    return timeout_error("call deadline reached", request.source, request.deadline_in_s)


def stream_deadlines(request: HttpRequest, loop: asyncio.AbstractEventLoop) -> tuple[float, float]:
    """(first event, end) of a stream starting now, on the loop's clock; end ``inf`` without one.

    Both count from the request's start: the TTFT (``timeout_s``) and the
    time left before the call's deadline (``deadline_in_s``), which the first
    deadline never outlasts.
    """
    # edge: asyncio.timeout_at and call_at measure the loop's own clock, so the deadlines must too.
    started = loop.time()
    first = started + request.timeout_s
    left = request.deadline_in_s
    if left is None:
        return first, math.inf
    end = started + left
    return min(first, end), end


def open_timed_out(request: HttpRequest, first_deadline: float, end: float) -> TransientError:
    """No first event by ``first_deadline``: a TTFT timeout, or the call's end if it came first."""
    if first_deadline >= end:
        return deadline_reached(request)
    return timeout_error("no first event", request.source, request.timeout_s)


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
        return _JSON.encode(request.json).encode("utf-8")
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


def deliver_hint(request: HttpRequest, headers: Mapping[str, str]) -> None:
    """Hand ``request.on_hint`` what a 2xx answer's headers announce about the source's limits."""
    sink = request.on_hint
    if sink is None:
        return
    hint = read_hint(headers, time.time())  # edge: reset times are wall-clock dates
    if hint is not None:
        sink(hint)


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


class RequestSecrets(Sequence[str]):
    """``request_secrets`` of a request, found on first use: only a failure's message needs them.

    A request that succeeds never pays for the scan of its headers and URL; an
    error message built from this sequence is scrubbed exactly as with the
    eager tuple.
    """

    __slots__ = ("_found", "_request")

    def __init__(self, request: HttpRequest) -> None:
        self._request = request
        self._found: tuple[str, ...] | None = None

    def _values(self) -> tuple[str, ...]:
        """The secrets, scanned once."""
        found = self._found
        if found is None:
            request = self._request
            found = self._found = request_secrets(request.headers, request.url)
        return found

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...

    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return self._values()[index]

    def __len__(self) -> int:
        return len(self._values())

    def __iter__(self) -> Iterator[str]:
        return iter(self._values())

    def __repr__(self) -> str:
        # Never the values: they are credentials.
        return f"<RequestSecrets {'unscanned' if self._found is None else len(self._found)}>"


class EventStream:
    """Parsed ``data:`` events of one stream, with the TTFT and idle deadlines and the end enforced.

    The first content must arrive by ``first_deadline`` (on the loop's clock):
    events before it that ``request.is_content`` rejects (a role-only chunk,
    usage only) are returned but leave that deadline in force, so a source
    that announces itself and then stalls is cut at its TTFT, not after an
    idle timeout (without ``is_content`` every event is content). After the
    first content, each event must come within ``idle_timeout_s`` (default:
    ``timeout_s``) of the call that asks for it, and none after ``end``, the
    call's deadline (``stream_deadlines``; ``inf``: none), however well the
    stream flows.
    Any way out but an event ends the iteration for good, and so does
    ``close()`` (the transport calls it when its context exits).

    One timer per stream, not one per event: each read only stores its
    deadline (pushed forward per event), and a single ``loop.call_at`` handle,
    when it fires, re-arms itself at the stored deadline if that has not
    passed yet, or cancels the reading task if it has. The end costs one
    ``min()`` per event: each read's deadline is the earlier of its idle
    deadline and the end. The expiry is then told
    apart from an outside cancellation exactly as ``asyncio.Timeout`` does it
    (``uncancel()`` against the count seen when the read began), so a
    consumer's own cancellation still passes through as ``CancelledError``.
    """

    __slots__ = (
        "_armed",
        "_cancelling",
        "_deadline",
        "_end",
        "_expiring",
        "_finished",
        "_first_deadline",
        "_handle",
        "_idle_s",
        "_is_content",
        "_loop",
        "_preamble",
        "_reader",
        "_request",
        "_secrets",
        "_seen",
    )

    _FAILURES: ClassVar[tuple[type[Exception], ...]] = ()
    """The library's exceptions for a failed read, handed to ``_translate``."""

    def __init__(
        self,
        request: HttpRequest,
        secrets: Sequence[str],
        loop: asyncio.AbstractEventLoop,
        first_deadline: float,
        end: float = math.inf,
    ) -> None:
        self._request = request
        self._secrets = secrets
        self._loop = loop
        first_deadline = min(first_deadline, end)
        self._first_deadline = first_deadline
        self._end = end
        """The call's deadline on the loop's clock: no event is waited for past it."""
        self._idle_s = request.idle_timeout_s or request.timeout_s
        self._is_content = request.is_content
        self._seen = False
        """Content has come: each read's deadline is idle, no longer the first deadline."""
        self._preamble = False
        """Events without content came before any content (they do not end the TTFT)."""
        self._finished = False
        self._deadline = first_deadline
        """The deadline of the read in progress (or of the last one)."""
        self._handle: asyncio.TimerHandle | None = None
        self._armed = math.inf
        """When ``_handle`` fires (``inf``: no handle scheduled)."""
        self._reader: asyncio.Task[Any] | None = None
        """The task inside ``_next_data`` now, the one an expiry cancels; ``None`` between reads."""
        self._cancelling = 0
        self._expiring = False
        """Our timer has cancelled the reader and the read has not yet come back."""

    def __aiter__(self) -> Self:
        return self

    async def _next_data(self) -> str | None:
        """The data of the next event that has any, or ``None`` at end of stream.

        Events without data (a named ping, an id-only event) are not chunks:
        they neither count as the first content nor reset idle.
        """
        raise NotImplementedError

    def _translate(self, exc: Exception) -> TransientError:
        """The classified failure of one of ``_FAILURES``."""
        raise NotImplementedError

    def close(self) -> None:
        """End the iteration and cancel the stream's timer; idempotent.

        A stream that ends by itself (``[DONE]``, a failure, a cancellation)
        closes on the way out; one the consumer leaves between events is
        closed by its transport, so no timer outlives the stream.
        """
        self._finished = True
        handle = self._handle
        if handle is not None:
            handle.cancel()
            self._handle = None
            self._armed = math.inf

    def _arm(self, when: float) -> None:
        """(Re)schedule the stream's one timer at ``when``."""
        handle = self._handle
        if handle is not None:
            handle.cancel()
        self._handle = self._loop.call_at(when, self._on_timer)
        self._armed = when

    def _on_timer(self) -> None:
        """The timer fired: cut the read in progress if its deadline has really passed."""
        self._handle = None
        self._armed = math.inf
        reader = self._reader
        if reader is None:
            # Between reads (the consumer is busy with the last event): the next read re-arms.
            return
        deadline = self._deadline
        if deadline > self._loop.time():
            # Events came since the timer was set: the deadline moved, follow it.
            self._arm(deadline)
            return
        self._expiring = True
        reader.cancel()

    def _expired(self, reader: asyncio.Task[Any]) -> bool:
        """Whether our timer cut this read and nobody else cancelled it since (as asyncio.Timeout).

        Withdraws our cancellation request whenever we made one, as
        ``asyncio.Timeout.__aexit__`` does, whatever way the read ended.
        """
        if not self._expiring:
            return False
        self._expiring = False
        return reader.uncancel() <= self._cancelling

    def _timed_out(self) -> TransientError:
        """The classified expiry of a read: the call's end, else TTFT (no content yet) or idle."""
        request = self._request
        if self._deadline >= self._end:
            return deadline_reached(request)
        if self._seen:
            return timeout_error("stream idle", request.source, self._idle_s)
        if self._preamble:
            return timeout_error("no first content", request.source, request.timeout_s)
        return timeout_error("no first event", request.source, request.timeout_s)

    async def __anext__(self) -> Any:
        if self._finished:
            raise StopAsyncIteration
        reader = asyncio.current_task()
        if reader is None:
            raise RuntimeError("an event stream must be read inside a task")
        if self._seen:
            # edge: the loop's own clock, the one call_at measures.
            now = self._loop.time()
            deadline = min(now + self._idle_s, self._end)
            if deadline <= now:
                # The end passed while the consumer held the last event: read nothing more.
                self._deadline = deadline
                self.close()
                raise self._timed_out()
        else:
            deadline = self._first_deadline
        self._deadline = deadline
        if deadline < self._armed:
            # First read, or a deadline earlier than the armed one (idle shorter than
            # the TTFT left): later deadlines only move forward and need no new handle.
            self._arm(deadline)
        self._cancelling = reader.cancelling()
        self._reader = reader
        self._finished = True
        event = False
        try:
            try:
                data = await self._next_data()
            except asyncio.CancelledError as exc:
                if self._expired(reader):
                    raise self._timed_out() from exc
                raise
            # The library's failures first: some (aiohttp's ServerTimeoutError) are
            # TimeoutErrors too, and keep their own message.
            except self._FAILURES as exc:
                raise self._translate(exc) from exc
            except TimeoutError as exc:
                raise self._timed_out() from exc
            finally:
                self._reader = None
                if self._expiring:
                    # Cut by our timer but the read ended another way: withdraw the request.
                    self._expired(reader)
            if data is None:
                raise truncated_stream(self._request.source)
            parsed = parse_event_data(data, self._request.source)
            if parsed is STREAM_END:
                raise StopAsyncIteration
            if not self._seen:
                # The predicate runs only until the first content: once per event of
                # the preamble, never on the chunks after it.
                is_content = self._is_content
                if is_content is None or is_content(parsed):
                    self._seen = True
                else:
                    self._preamble = True
            event = True
        finally:
            if not event:
                self.close()
        self._finished = False
        return parsed
