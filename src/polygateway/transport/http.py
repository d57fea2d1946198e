"""The wire as the governance loop sees it: a transport protocol and one failure classification.

A transport sends one ``HttpRequest`` and either returns the parsed JSON body
of a 2xx answer, yields the parsed ``data:`` events of an SSE stream, or
raises ``TransientError`` carrying the failure class of DESIGN.md section 4.
This module is the one place where what the upstream did becomes a class;
``middleware/retry.py`` decides what each class does to the loop. Foreign
exceptions (httpx, aiohttp) are translated inside their transport module with
``raise TransientError(...) from exc``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from polygateway.models import FailureClass

__all__ = [
    "AIMD_DECREASE_STATUSES",
    "HttpRequest",
    "TransientError",
    "Transport",
    "classify_status",
]

_RATE_LIMITED = frozenset({429})
_TRANSIENT = frozenset({408, 500, 502, 503, 504, 529})
_MISCONFIGURED = frozenset({401, 403, 404})
_REJECTED = frozenset({400, 413, 422})

AIMD_DECREASE_STATUSES = frozenset({429, 503, 529})
"""Statuses that mean overload: the source's AIMD limit shrinks (timeouts do too)."""


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
        timeout: the attempt ran out of time (an overload signal for AIMD).
    """

    def __init__(
        self,
        message: str = "",
        *,
        status_code: int | None = None,
        failure: FailureClass | None = None,
        retry_after_s: float | None = None,
        timeout: bool = False,
    ) -> None:
        self.status_code = status_code
        self.failure: FailureClass = failure or classify_status(status_code)
        self.retry_after_s = retry_after_s
        self.timeout = timeout
        if not message:
            message = f"HTTP {status_code}" if status_code is not None else self.failure
        super().__init__(message)

    @property
    def aimd_decrease(self) -> bool:
        """Overload: 429, 503, 529 or a timeout."""
        return self.timeout or self.status_code in AIMD_DECREASE_STATUSES

    def __repr__(self) -> str:
        return (
            f"TransientError({str(self)!r}, status_code={self.status_code!r}, "
            f"failure={self.failure!r}, retry_after_s={self.retry_after_s!r})"
        )


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """One request to one source. ``headers`` may hold credentials: never print them.

    For a non-streamed request ``timeout_s`` bounds the whole exchange. For a
    stream it bounds the wait for the first event (TTFT), and
    ``idle_timeout_s`` bounds each gap between events. Both are the *effective*
    timeouts of this attempt (already clipped to the call's deadline).
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
