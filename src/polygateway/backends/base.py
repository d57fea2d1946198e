"""The backend protocol: the governance state a fleet shares, behind atomic operations.

Two implementations pass one contract suite: ``MemoryBackend`` (one process,
the injected monotonic clock) and ``RedisBackend`` (many processes, the Redis
server's clock). Every operation is atomic. A backend never raises anything
but ``GovernanceBackendError`` for its own failures (fail closed).

Time: every value a backend returns is *relative* (seconds from now), so the
caller's monotonic clock and the backend's clock are never mixed.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

# Re-exported: these live in governance (the lower layer) and are named here too.
from polygateway.governance.source_state import OutcomeKind, RejectReason, SourceSnapshot

__all__ = [
    "AcquireResult",
    "AttemptOutcome",
    "Backend",
    "Lease",
    "OutcomeKind",
    "RejectReason",
    "Rejection",
    "ReleaseListener",
    "ReleaseListeners",
    "ScopeSnapshot",
    "SourceSnapshot",
    "SourceSpec",
]


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """The limits a backend enforces for one source; built once per client from SourceConfig.

    ``rpm_burst`` / ``tpm_burst`` of ``None`` mean one second's worth, at least 1.
    """

    name: str
    max_concurrency: int
    rpm: float | None = None
    rpm_burst: float | None = None
    tpm: float | None = None
    tpm_burst: float | None = None
    breaker_failures: int = 5
    cooldown_s: float = 30.0
    cooldown_max_s: float = 300.0

    @property
    def rpm_capacity(self) -> float:
        """Bucket size of the rpm limit (only meaningful when ``rpm`` is set)."""
        if self.rpm_burst is not None:
            return self.rpm_burst
        return max(1.0, (self.rpm or 0.0) / 60.0)

    @property
    def tpm_capacity(self) -> float:
        """Bucket size of the tpm limit (only meaningful when ``tpm`` is set)."""
        if self.tpm_burst is not None:
            return self.tpm_burst
        return max(1.0, (self.tpm or 0.0) / 60.0)


@dataclass(frozen=True, slots=True)
class Lease:
    """The right to one attempt in flight at one source; expires ``ttl_s`` after grant or renewal.

    ``tokens`` is the tpm reservation made at acquire; ``probe`` marks the one
    half-open probe of a breaker. ``priority_class``: the class whose permits
    held fleet-wide count this lease (a class with reserved permits, on a
    backend that keeps floors fleet-wide; research-wiki/designs/priority-fairness.md,
    "On Redis"), so that its release and renewals update that count; ``None``
    when it is in no count.
    """

    scope: str
    source: str
    lease_id: str
    ttl_s: float
    tokens: int = 0
    probe: bool = False
    priority_class: str | None = None


@dataclass(frozen=True, slots=True)
class Rejection:
    """One candidate passed over by ``acquire``.

    ``reopen_in_s`` is the time after which the reason lifts by itself (breaker
    cool-down, pacer deadline, rate window), or ``None`` when only a release can
    lift it (concurrency, probe in flight).
    """

    source: str
    reason: RejectReason
    reopen_in_s: float | None = None


@dataclass(frozen=True, slots=True)
class AcquireResult:
    """A lease on the first admissible candidate, or every candidate's rejection."""

    lease: Lease | None
    rejections: tuple[Rejection, ...] = ()

    @property
    def retry_after_s(self) -> float | None:
        """Seconds until the earliest rejection lifts by time alone; ``None`` if none will."""
        times = [r.reopen_in_s for r in self.rejections if r.reopen_in_s is not None]
        return min(times) if times else None


@dataclass(frozen=True, slots=True)
class AttemptOutcome:
    """What ``release`` records for the attempt a lease was held for.

    ``aimd_decrease``: the failure was overload (429, timeout, 503, 529).
    ``retry_after_s``: pace the source this long (from Retry-After / x-ratelimit-reset-*).
    ``tokens_used``: real usage, to reconcile the tpm reservation with.
    """

    kind: OutcomeKind
    aimd_decrease: bool = False
    retry_after_s: float | None = None
    tokens_used: int | None = None


@dataclass(frozen=True, slots=True)
class ScopeSnapshot:
    """A scope's live state: every known source and the fleet-wide progress age."""

    scope: str
    progress_age_s: float
    sources: tuple[SourceSnapshot, ...] = field(default=())

    def source(self, name: str) -> SourceSnapshot | None:
        """The snapshot of one source, or ``None`` when the backend has not seen it."""
        for s in self.sources:
            if s.name == name:
                return s
        return None

    @property
    def in_flight(self) -> int:
        """Permits held across the scope."""
        return sum(s.in_flight for s in self.sources)


NEVER = math.inf
"""``progress_age_s`` of a scope that has never served."""


class ReleaseListener(Protocol):
    """A scope's waiting room in this process, as a backend sees it.

    ``middleware/waiting.py``'s ``WaitingRoom`` is the implementation. A
    backend tells it of freed permits (``notify``); a backend shared by a
    fleet also reads the room's priority classes, to register the process
    under the classes it waits in so that a release anywhere gives the turn
    to the class and process whose turn it is
    (research-wiki/designs/priority-fairness.md, "On Redis").
    """

    @property
    def shares(self) -> Mapping[str, float]:
        """The scope's declared priority classes and their shares, in order; empty: none."""
        ...

    @property
    def floors(self) -> Mapping[str, int]:
        """The declared classes with reserved permits, and how many; empty: none."""
        ...

    fleet_floors: bool
    """Set by a backend that keeps the reserved floors fleet-wide: the room then leaves
    the floor to the backend's wake-ups instead of applying its own per-process one."""

    def wanting(self) -> Mapping[str, int]:
        """Per class, how many calls of this process wait or ask for a permit (each once)."""
        ...

    named_tenants: bool
    """Whether a call of the room (or a wake-up for it) ever named a tenant: from then on
    the fleet takes turns of tenants for it (``waiting_tenants`` is not ``None``)."""

    def waiting_tenants(self) -> Mapping[str, Collection[str]] | None:
        """Per class, the tenants with calls of this process waiting (``""``: no tenant).

        ``None`` while no call of the room named a tenant: the fleet then
        registers the process per class only.
        """
        ...

    def notify(self, priority_class: str | None = None, tenant: str | None = None) -> None:
        """A freed permit is this process's to take (for that class, and that tenant of it).

        Runs synchronously and must not raise.
        """
        ...


class ReleaseListeners:
    """Who wants to hear of freed permits, per scope: the part of waking waiters a backend owns.

    The loop's waiting room (``middleware/waiting.py``) registers itself once
    per scope; a backend calls ``released(scope)`` each time it frees a
    permit of that scope. Nothing else of the loop's queueing lives in a
    backend.
    """

    __slots__ = ("_by_scope",)

    def __init__(self) -> None:
        self._by_scope: dict[str, list[ReleaseListener]] = {}

    def add(self, scope: str, listener: ReleaseListener) -> None:
        """Tell ``listener`` of every later release of a permit of ``scope``."""
        self._by_scope.setdefault(scope, []).append(listener)

    def released(
        self, scope: str, priority_class: str | None = None, tenant: str | None = None
    ) -> None:
        """A permit of ``scope`` was freed (for that class's, and tenant's, turn): tell them."""
        listeners = self._by_scope.get(scope)
        if listeners:
            for listener in listeners:
                listener.notify(priority_class, tenant)


@runtime_checkable
class Backend(Protocol):
    """Shared governance state. Every method is one atomic operation.

    Cancellation-safe: ``acquire`` and ``release`` finish what they started
    even when their caller is cancelled while they run (a cancelled
    ``acquire`` gives back any lease it grants; a cancelled ``release`` still
    frees the permit). The loop awaits them directly, so a backend that must
    suspend mid-operation shields that work itself.

    A backend object is hashable and weak-referenceable (a slotted class
    lists ``__weakref__``): the loop keeps its waiting rooms per backend
    object, for as long as the backend lives.
    """

    async def acquire(
        self,
        scope: str,
        candidates: Sequence[SourceSpec],
        *,
        cost_tokens: int = 0,
        ttl_s: float,
        priority_class: str = "",
    ) -> AcquireResult:
        """Lease the first candidate, in the given order, that passes every check.

        Checks, in order: breaker admission (half-open admits one probe
        fleet-wide), pacer deadline, AIMD limit and ``max_concurrency`` against
        live leases, rpm bucket, tpm bucket (reserving ``cost_tokens``).
        ``priority_class`` is the calling call's class: a backend shared by a
        fleet counts the permits of classes with reserved floors by it (the
        lease then names it); a backend of one process ignores it.
        """
        ...

    async def release(self, lease: Lease, outcome: AttemptOutcome) -> None:
        """Free the permit and record the outcome; an expired or unknown lease is a no-op.

        Records: breaker transition, AIMD step, pacer deadline, tpm
        reconciliation, and progress on success. A permit freed is announced
        to the scope's release listeners (``on_release``).
        """
        ...

    async def renew(self, lease: Lease) -> bool:
        """Extend a live lease by its ``ttl_s`` from now; ``False`` when it has expired."""
        ...

    async def progress_age_s(self, scope: str) -> float:
        """Seconds since the scope last served anywhere in the fleet; ``inf`` if never."""
        ...

    async def snapshot(self, scope: str) -> ScopeSnapshot:
        """The scope's live state."""
        ...

    def on_release(self, scope: str, listener: ReleaseListener) -> None:
        """Notify ``listener`` when a freed permit of ``scope`` is this process's to take.

        A backend of one process announces every permit it frees. A backend
        shared by a fleet announces the permits whose turn falls to this
        process: releases made elsewhere that woke it, and its own releases
        unless it handed their turn to a process that waits (the Redis
        backend's round robin, research-wiki/designs/fleet-wakeups.md), naming
        the priority class whose turn it is when the scope has classes.
        """
        ...

    async def aclose(self) -> None:
        """Release connections; the backend is not used afterwards."""
        ...
