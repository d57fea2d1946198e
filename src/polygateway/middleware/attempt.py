"""What the governance loop hands an attempt and what a served call hands back.

``AttemptContext`` carries one attempt's effective timeouts (already clipped
to the call's deadline) and collects what the attempt reports (usage, TTFT).
``Served`` is the attempt that served a call; inside ``RetryMW.session`` its
permit is still held, so a stream can renew its lease and report a clean end.
``release_quietly`` frees a permit whatever befalls the caller: backends are
cancellation-safe (``backends/base.py``), and a failing backend is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Generic, TypeVar

from polygateway.backends.base import AttemptOutcome, Backend, Lease
from polygateway.errors import GovernanceBackendError
from polygateway.models import AttemptRecord, Usage
from polygateway.transport.hints import ServerHint

if TYPE_CHECKING:
    from polygateway.config import SourceConfig

__all__ = [
    "AttemptContext",
    "AttemptFn",
    "Served",
    "release_quietly",
]

T = TypeVar("T")

AttemptFn = Callable[["SourceConfig", "AttemptContext"], Awaitable[T]]
"""Performs one real request to a source within the effective timeouts of the context."""

_log = logging.getLogger("polygateway.retry")


class AttemptContext:
    """One attempt's effective timeouts (clipped to the deadline) and what it reports back.

    The attempt function sets ``usage`` (tpm reconciliation, telemetry),
    ``response_model`` and ``finish_reasons`` when its answer names them
    (telemetry), and, for streams, ``ttft_s``; ``see_hint`` (a request's
    ``on_hint``) keeps what the answer's headers announce about the source's
    limits. ``headers`` are extra request headers telemetry asks this attempt
    to send (trace context, research-wiki/guides/observability.md): the
    attempt function hands them to its request builder, which never lets
    them replace a header of the source's own. ``permit_wait_s``
    and ``stalled_s`` describe the wait before the attempt, for its telemetry
    record. ``deadline_in_s`` is the time left before the call's deadline when
    the attempt began (``None``: no deadline): a stream's request carries it,
    so the stream ends there.
    """

    __slots__ = (
        "attempt",
        "call_id",
        "deadline_in_s",
        "finish_reasons",
        "headers",
        "hint",
        "idle_timeout_s",
        "lease",
        "permit_wait_s",
        "response_model",
        "stalled_s",
        "started_at",
        "timeout_s",
        "ttft_s",
        "ttft_timeout_s",
        "usage",
    )

    def __init__(
        self,
        call_id: str,
        attempt: int,
        lease: Lease,
        timeout_s: float,
        ttft_timeout_s: float,
        idle_timeout_s: float,
        started_at: float,
        permit_wait_s: float = 0.0,
        stalled_s: float = 0.0,
        deadline_in_s: float | None = None,
    ) -> None:
        self.call_id = call_id
        self.attempt = attempt
        self.lease = lease
        self.timeout_s = timeout_s
        self.ttft_timeout_s = ttft_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.started_at = started_at
        self.permit_wait_s = permit_wait_s
        self.stalled_s = stalled_s
        self.deadline_in_s = deadline_in_s
        self.usage: Usage | None = None
        self.ttft_s: float | None = None
        self.hint: ServerHint | None = None
        self.headers: Mapping[str, str] | None = None
        self.response_model: str | None = None
        self.finish_reasons: tuple[str, ...] = ()

    def see_hint(self, hint: ServerHint) -> None:
        """Keep what the answer's headers announced (``HttpRequest.on_hint``)."""
        self.hint = hint

    @property
    def source(self) -> str:
        """Name of the source this attempt goes to."""
        return self.lease.source

    def __repr__(self) -> str:
        return (
            f"AttemptContext(call_id={self.call_id!r}, attempt={self.attempt}, "
            f"source={self.lease.source!r}, timeout_s={self.timeout_s:g})"
        )


class Served(Generic[T]):
    """The attempt that served a call: its value, its source, and every attempt record of the call.

    Inside ``RetryMW.session`` the permit is still held: the body calls
    ``complete()`` after a clean end (released as success; anything else is
    released as cancelled, or as the failure that ended it) and, for a long
    stream, ``renew_if_due()`` as chunks arrive.
    """

    __slots__ = ("_backend", "_completed", "_now", "_records", "_renewed_at", "ctx", "value")

    def __init__(
        self,
        value: T,
        ctx: AttemptContext,
        records: list[AttemptRecord],
        backend: Backend,
        now: Callable[[], float],
    ) -> None:
        self.value = value
        self.ctx = ctx
        self._records = records
        self._backend = backend
        self._now = now
        self._renewed_at = now()
        self._completed = False

    def __repr__(self) -> str:
        return f"Served(source={self.source!r}, attempts={len(self._records)})"

    @property
    def source(self) -> str:
        """Name of the source that served."""
        return self.ctx.lease.source

    @property
    def attempts(self) -> tuple[AttemptRecord, ...]:
        """Every attempt of the call so far (complete once the session has ended)."""
        return tuple(self._records)

    @property
    def completed(self) -> bool:
        """Whether the body reported a clean end."""
        return self._completed

    def complete(self) -> None:
        """The work ended cleanly: the permit is released as a success."""
        self._completed = True

    def renew_due(self) -> bool:
        """Whether a third of the TTL has passed since the last renewal (sync: runs per chunk)."""
        return self._now() - self._renewed_at >= self.ctx.lease.ttl_s / 3.0

    async def renew_if_due(self) -> bool:
        """Renew the lease once a third of its TTL has passed; ``True`` when a renewal was sent.

        One backend operation per renewal, never one per chunk. A failed
        renewal is logged, not raised: the answer is already flowing, and the
        next chunk tries again.
        """
        if not self.renew_due():
            return False
        lease = self.ctx.lease
        try:
            alive = await self._backend.renew(lease)
        except GovernanceBackendError as exc:
            _log.warning("lease renewal failed at %s: %s", lease.source, exc)
            return True
        self._renewed_at = self._now()
        if not alive:
            _log.warning("the lease at %s expired before its renewal", lease.source)
        return True


async def release_quietly(
    backend: Backend, lease: Lease, outcome: AttemptOutcome, text: Callable[[BaseException], str]
) -> None:
    """Free the permit; a backend failure is logged, not raised.

    The upstream has answered by now: losing the answer to a backend
    hiccup would be worse than a permit the lease's expiry frees anyway.
    ``text`` gives the failure's message without the scope's credentials.
    A cancellation of the caller passes through; the backend, being
    cancellation-safe, frees the permit all the same.
    """
    try:
        await backend.release(lease, outcome)
    except GovernanceBackendError as exc:
        _log.warning(
            "release of a %s lease at %s failed (its expiry frees the permit): %s",
            outcome.kind,
            lease.source,
            text(exc),
        )
