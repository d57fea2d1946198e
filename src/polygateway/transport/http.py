"""The wire as the governance loop sees it: a transport protocol and one failure classification.

A transport sends one ``HttpRequest`` and either returns the parsed JSON body
of a 2xx answer, yields the parsed ``data:`` events of an SSE stream, or
raises ``TransientError`` carrying the failure class of research-wiki/ARCHITECTURE.md §2b.
This module is the one place where what the upstream did becomes a class;
``middleware/retry.py`` decides what each class does to the loop. Foreign
exceptions (httpx, aiohttp) are translated inside their transport module with
``raise TransientError(...) from exc``.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, runtime_checkable

from polygateway.config.masking import mask_url, scrub, secrets_in, url_secrets
from polygateway.models import FailureClass
from polygateway.transport.hints import ServerHint, retry_after_from_headers

__all__ = [
    "DONE",
    "EXCERPT_CHARS",
    "STREAM_END",
    "HintSink",
    "HttpRequest",
    "TransientError",
    "Transport",
    "classify_status",
    "excerpt",
    "is_event_stream",
    "malformed",
    "network_error",
    "parse_event_data",
    "parse_json_body",
    "request_secrets",
    "scrub",
    "secrets_in",
    "status_error",
    "timeout_error",
    "truncated_stream",
]

_RATE_LIMITED = frozenset({429})
_TRANSIENT = frozenset({408, 500, 502, 503, 504, 529})
_MISCONFIGURED = frozenset({401, 402, 403, 404})
_REJECTED = frozenset({400, 413, 422})


def classify_status(status_code: int | None) -> FailureClass:
    """The failure class of an HTTP status; ``None`` (no answer at all) is transient.

    Statuses outside the table: other 4xx are the request's fault, other 5xx
    and anything else are transient.
    """
    if status_code is None:
        return "transient"
    if status_code in _RATE_LIMITED:
        return "rate_limited"
    if status_code in _TRANSIENT:
        return "transient"
    if status_code in _MISCONFIGURED:
        # 402: the account cannot be billed; another source's account may be.
        return "source_misconfigured"
    if status_code in _REJECTED or 400 <= status_code < 500:
        return "request_rejected"
    return "transient"


class TransientError(Exception):
    """A failed attempt, classified. Lives only inside the loop; never escapes a client.

    Args:
        message: what happened, without secrets (no header values, no URL credentials).
        status_code: the HTTP status, or ``None`` when no answer came (connect
            error, reset, timeout, malformed body).
        failure: the class; derived from ``status_code`` when not given.
        retry_after_s: how long the upstream asked to be left alone (Retry-After,
            x-ratelimit-reset-*), already turned into relative seconds.
        timeout: the attempt ran out of time.
        truncated: a stream closed before ``data: [DONE]``; the caller decides
            whether a ``finish_reason`` already seen makes that acceptable.
    """

    def __init__(
        self,
        message: str = "",
        *,
        status_code: int | None = None,
        failure: FailureClass | None = None,
        retry_after_s: float | None = None,
        timeout: bool = False,
        truncated: bool = False,
    ) -> None:
        self.status_code = status_code
        self.failure: FailureClass = failure or classify_status(status_code)
        self.retry_after_s = retry_after_s
        self.timeout = timeout
        self.truncated = truncated
        if not message:
            message = f"HTTP {status_code}" if status_code is not None else self.failure
        super().__init__(message)

    def __repr__(self) -> str:
        return (
            f"TransientError({str(self)!r}, status_code={self.status_code!r}, "
            f"failure={self.failure!r}, retry_after_s={self.retry_after_s!r})"
        )


HintSink = Callable[[ServerHint], None]
"""Receives what a 2xx answer's headers announce (``HttpRequest.on_hint``)."""


@dataclass(frozen=True, slots=True, repr=False)
class HttpRequest:
    """One request to one source. ``headers`` may hold credentials: never print them.

    So may ``url``: a source's ``query`` (``?key=...``) and ``base_url``
    (``user:password@``) land in it. Its repr shows the URL masked.

    For a non-streamed request ``timeout_s`` bounds the whole exchange. For a
    stream it bounds the wait for the first content (TTFT, ``is_content``), and
    ``idle_timeout_s`` bounds each gap between events. Both are the *effective*
    timeouts of this attempt (already clipped to the call's deadline).
    ``deadline_in_s`` bounds a whole stream: seconds from the request's start
    until the call's deadline, when the stream is cut however well it flows
    (``None``: the call has no deadline). ``on_hint``, when set, is handed
    the limits a 2xx answer's headers announce (a stream's, when it opens;
    ``transport/hints.py``), if they announce any.
    ``is_content``, set for streams, tells a parsed event that carries content
    (a token, a tool-call piece, a finish) from a preamble (a role announcement,
    usage only): the TTFT deadline holds until the first content, not the first
    event (``None``: every event is content).
    """

    source: str
    url: str
    timeout_s: float
    method: str = "POST"
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)
    json: Any = field(default=None, repr=False)
    files: Mapping[str, tuple[str, bytes, str]] | None = field(default=None, repr=False)
    data: Mapping[str, str] | None = field(default=None, repr=False)
    params: Mapping[str, str] | None = None
    idle_timeout_s: float | None = None
    connect_timeout_s: float | None = None
    deadline_in_s: float | None = None
    on_hint: HintSink | None = field(default=None, repr=False, compare=False)
    is_content: Callable[[Any], bool] | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        return (
            f"HttpRequest(source={self.source!r}, url={mask_url(self.url)!r}, "
            f"method={self.method!r}, timeout_s={self.timeout_s!r}, params={self.params!r})"
        )


def request_secrets(headers: Mapping[str, str], url: str) -> tuple[str, ...]:
    """The credential values a request carries, in its headers or its URL, longest first.

    A key in the query (``?key=...``, a source's ``query``) or the URL's
    ``user:password@`` is as secret as an ``Authorization`` header: an
    upstream that echoes the URL it was asked must not carry it into a message.
    """
    found = {*secrets_in(headers), *url_secrets(url)}
    return tuple(sorted(found, key=len, reverse=True))


@runtime_checkable
class Transport(Protocol):
    """Sends requests for one client; implemented by httpx (default) and aiohttp (extra)."""

    async def send(self, request: HttpRequest) -> Any:
        """Send one request; return the parsed JSON body of a 2xx answer.

        Raises:
            TransientError: for every failure, classified.
        """
        ...

    def stream(self, request: HttpRequest) -> AbstractAsyncContextManager[AsyncIterator[Any]]:
        """Open an SSE stream; iterate the parsed JSON of each ``data:`` event.

        Iteration ends cleanly only at ``data: [DONE]``; a stream that closes
        without it raises ``TransientError`` (the caller decides whether a
        ``finish_reason`` already seen makes that acceptable). Exiting the
        context closes the connection.
        """
        ...

    async def aclose(self) -> None:
        """Close pooled connections."""
        ...


# --- Helpers shared by every transport module --------------------------------
#
# Each client module (httpx, aiohttp) catches its library's exceptions and
# builds the TransientError with these, so both transports say the same thing
# for the same failure and no secret can slip into a message on either.

EXCERPT_CHARS: Final = 200
"""Longest excerpt of a provider's error body kept in a message: enough to debug, no dump."""

DONE: Final = "[DONE]"
"""The ``data:`` payload that ends an OpenAI-style event stream."""


class _StreamEnd:
    """Type of ``STREAM_END``: a sentinel no JSON value can equal."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "STREAM_END"


STREAM_END: Final = _StreamEnd()
"""What ``parse_event_data`` returns for ``data: [DONE]`` (compare with ``is``)."""

_WHITESPACE = re.compile(r"\s+")


def excerpt(body: bytes | str, secrets: Iterable[str] = (), limit: int = EXCERPT_CHARS) -> str:
    """A short, one-line, scrubbed excerpt of a provider's body for an error message.

    Scrubbing happens before truncation, so a key cut in half by the limit
    cannot survive as a recognisable prefix.
    """
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    text = _WHITESPACE.sub(" ", scrub(text, secrets)).strip()
    if len(text) > limit:
        text = text[:limit] + "..."
    return text


def status_error(
    status_code: int,
    headers: Mapping[str, str],
    body: bytes | str,
    *,
    source: str,
    secrets: Iterable[str] = (),
    now_wall: float,
) -> TransientError:
    """The classified error of a non-2xx answer, with its back-off and a scrubbed excerpt.

    ``now_wall`` (epoch seconds) resolves a Retry-After given as an HTTP date.
    """
    detail = excerpt(body, secrets)
    message = f"HTTP {status_code} from {source}" + (f": {detail}" if detail else "")
    spent = status_code in _RATE_LIMITED and quota_spent(body)
    return TransientError(
        message,
        status_code=status_code,
        failure="source_misconfigured" if spent else None,
        retry_after_s=retry_after_from_headers(
            headers, now_wall, rate_limited=status_code in _RATE_LIMITED
        ),
    )


_QUOTA_SPENT: Final = "insufficient_quota"


def quota_spent(body: bytes | str) -> bool:
    """Whether a 429's body says the account is out of credit, not over a rate.

    OpenAI answers both with 429; the error object's ``code`` (or ``type``)
    ``insufficient_quota`` tells the account's credit or monthly spend is used
    up. No pause fixes that, so the source is misconfigured until someone
    pays: the breaker trips long and another source serves, where pacing would
    hold the call for the whole stall budget when no other source is left.
    """
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    if _QUOTA_SPENT not in text:
        return False  # the common 429, read no further
    try:
        payload = json.loads(text)
    except ValueError:
        return False
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return False
    return _QUOTA_SPENT in (error.get("code"), error.get("type"))


def network_error(
    what: str, source: str, exc: BaseException, secrets: Iterable[str] = ()
) -> TransientError:
    """A failure with no answer (connect error, reset, protocol error): transient, no status."""
    detail = excerpt(str(exc), secrets)
    name = type(exc).__name__
    return TransientError(
        f"{what} at {source}: {name}" + (f": {detail}" if detail else ""), failure="transient"
    )


def timeout_error(what: str, source: str, seconds: float | None) -> TransientError:
    """An attempt that ran out of time: transient, and an overload signal for AIMD."""
    limit = f" after {seconds:g} s" if seconds is not None else ""
    return TransientError(f"{what} at {source}{limit}", failure="transient", timeout=True)


def malformed(source: str, detail: str = "") -> TransientError:
    """A 2xx answer whose body is not what the protocol promises: transient, no status."""
    message = f"malformed body from {source}" + (f": {detail}" if detail else "")
    return TransientError(message, failure="transient")


def truncated_stream(source: str) -> TransientError:
    """A stream that closed without ``data: [DONE]``."""
    return TransientError(
        f"stream ended without [DONE] at {source}", failure="transient", truncated=True
    )


_OPEN_BRACE = ord("{")
"""No BOM starts with it: a body opening with it and a non-zero byte is UTF-8 to ``json``."""


def parse_json_body(body: bytes, source: str) -> Any:
    """The JSON of a 2xx body; anything undecodable is a malformed answer."""
    try:
        if len(body) > 1 and body[0] == _OPEN_BRACE and body[1]:
            # What json.detect_encoding decides for these first bytes (UTF-8), decoded as
            # json.loads decodes bytes, without running detect_encoding in Python per body.
            return json.loads(body.decode("utf-8", "surrogatepass"))
        return json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # json.JSONDecodeError is a ValueError, and nesting past the parser's depth a
        # RecursionError; the body itself is never quoted back, a 2xx body may well
        # contain the caller's own data.
        raise malformed(source, "not JSON") from exc


def parse_event_data(data: str, source: str) -> Any:
    """The JSON of one ``data:`` event, or ``STREAM_END`` for the ``[DONE]`` marker."""
    if data.strip() == DONE:
        return STREAM_END
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise malformed(source, "event data is not JSON") from exc


def is_event_stream(content_type: str | None) -> bool:
    """Whether a Content-Type announces an SSE stream."""
    return bool(content_type) and "text/event-stream" in str(content_type).lower()
