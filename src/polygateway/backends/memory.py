"""The in-process backend: governance state in a dict, shared by the clients of one process.

Every operation is atomic because it never awaits: the ``async def`` methods
do all their work synchronously between two event-loop turns, so no other
task can see a half-applied decision. The policy itself lives in
``governance/source_state.py``; this module only keeps the state per scope
and source, hands out lease ids, records progress and announces freed permits
to the scope's release listeners (the loop's waiting room).
Time is the injected monotonic clock (a ``FakeClock`` in tests).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from polygateway.backends.base import (
    AcquireResult,
    AttemptOutcome,
    Lease,
    Rejection,
    ReleaseListener,
    ReleaseListeners,
    ScopeSnapshot,
    SourceSpec,
)
from polygateway.governance import source_state
from polygateway.governance.source_state import Admission, SourceState

__all__ = ["MemoryBackend"]


@dataclass(frozen=True, slots=True)
class _Limits:
    """A spec's limits as plain fields, read by the policy on every acquire and release.

    ``SourceSpec`` computes its bucket capacities in properties at every read
    (about 0.2 µs each, two per acquire of a source with rpm and tpm); this copy
    computes them once per spec seen.
    """

    max_concurrency: int
    rpm: float | None
    rpm_capacity: float
    tpm: float | None
    tpm_capacity: float
    breaker_failures: int
    cooldown_s: float
    cooldown_max_s: float

    @classmethod
    def of(cls, spec: SourceSpec) -> _Limits:
        """The limits of ``spec``, capacities computed now."""
        return cls(
            spec.max_concurrency,
            spec.rpm,
            spec.rpm_capacity,
            spec.tpm,
            spec.tpm_capacity,
            spec.breaker_failures,
            spec.cooldown_s,
            spec.cooldown_max_s,
        )


@dataclass(slots=True)
class _Source:
    """One source's state plus the last spec seen for it (release and snapshots need its limits)."""

    spec: SourceSpec
    limits: _Limits
    state: SourceState


@dataclass(slots=True)
class _Scope:
    """A scope's sources in order of first sight, and when it last served."""

    sources: dict[str, _Source] = field(default_factory=dict)
    progress_at: float | None = None


class MemoryBackend:
    """Governance state for one process; implements ``backends.base.Backend``."""

    # No operation ever suspends, so a cancellation cannot cut one short (cancellation-safe).
    __slots__ = ("__weakref__", "_ids", "_listeners", "_now", "_scopes")

    def __init__(self, *, now: Callable[[], float] | None = None) -> None:
        self._now: Callable[[], float] = (
            now if now is not None else time.monotonic
        )  # edge: default clock
        self._scopes: dict[str, _Scope] = {}
        self._listeners = ReleaseListeners()
        self._ids = itertools.count(1)

    def __repr__(self) -> str:
        return f"MemoryBackend(scopes={sorted(self._scopes)!r})"

    def _scope(self, scope: str) -> _Scope:
        found = self._scopes.get(scope)
        if found is None:
            found = self._scopes[scope] = _Scope()
        return found

    async def acquire(
        self,
        scope: str,
        candidates: Sequence[SourceSpec],
        *,
        cost_tokens: int = 0,
        ttl_s: float,
        priority_class: str = "",
    ) -> AcquireResult:
        """Lease the first admissible candidate, in order; see governance/source_state.py.

        ``priority_class`` is ignored: in one process the waiting room's floors are
        the fleet's.
        """
        now = self._now()
        sc = self._scopes.get(scope)
        if sc is None:
            sc = self._scope(scope)
        sources = sc.sources
        # Built only on a first refusal: the common grant on the first candidate needs no list.
        rejections: list[Rejection] | None = None
        for spec in candidates:
            name = spec.name
            src = sources.get(name)
            if src is None:
                src = sources[name] = _Source(
                    spec, _Limits.of(spec), source_state.new_source_state(spec, now)
                )
            elif src.spec is not spec:
                # A client builds its specs once, so this identity test almost always holds.
                src.spec = spec
                src.limits = _Limits.of(spec)
                source_state.new_limits(src.state, src.limits)
            state = src.state
            limits = src.limits
            verdict = source_state.admit(state, limits, now, cost_tokens)
            if isinstance(verdict, Admission):
                probe = verdict.probe
                lease_id = str(next(self._ids))
                source_state.commit(
                    state,
                    limits,
                    lease_id,
                    now,
                    ttl_s=ttl_s,
                    cost_tokens=cost_tokens,
                    probe=probe,
                    pace_probe=verdict.pace_probe,
                )
                lease = Lease(scope, name, lease_id, ttl_s, cost_tokens, probe)
                return AcquireResult(lease, tuple(rejections) if rejections else ())
            if rejections is None:
                rejections = []
            rejections.append(Rejection(name, verdict.reason, verdict.reopen_in_s))
        return AcquireResult(None, tuple(rejections) if rejections else ())

    async def release(self, lease: Lease, outcome: AttemptOutcome) -> None:
        """Free the permit, record the outcome, tell the listeners; a dead lease is a no-op."""
        sc = self._scopes.get(lease.scope)
        src = sc.sources.get(lease.source) if sc is not None else None
        if sc is None or src is None:
            return
        now = self._now()
        freed = source_state.apply_outcome(
            src.state,
            src.limits,
            lease.lease_id,
            now,
            outcome.kind,
            aimd_decrease=outcome.aimd_decrease,
            retry_after_s=outcome.retry_after_s,
            tokens_used=outcome.tokens_used,
        )
        if not freed:
            return
        if outcome.kind == "success":
            sc.progress_at = now
        self._listeners.released(lease.scope)

    async def renew(self, lease: Lease) -> bool:
        """Extend a live lease by its TTL from now; ``False`` when it is unknown or expired."""
        sc = self._scopes.get(lease.scope)
        src = sc.sources.get(lease.source) if sc is not None else None
        if src is None:
            return False
        return source_state.renew(src.state, lease.lease_id, self._now())

    async def progress_age_s(self, scope: str) -> float:
        """Seconds since the scope last served; ``inf`` if it never has."""
        sc = self._scopes.get(scope)
        if sc is None or sc.progress_at is None:
            return math.inf
        return max(0.0, self._now() - sc.progress_at)

    async def snapshot(self, scope: str) -> ScopeSnapshot:
        """Every source seen in the scope, in order of first sight, as of now."""
        return self.snapshot_now(scope)

    def snapshot_now(self, scope: str) -> ScopeSnapshot:
        """``snapshot`` without a coroutine: what a synchronous reader (a scrape) can call.

        Safe on the event loop's thread, or once no loop uses the backend; from
        another thread while the loop runs, go through the loop instead (the
        state may change under the read).
        """
        now = self._now()
        sc = self._scopes.get(scope)
        if sc is None:
            return ScopeSnapshot(scope=scope, progress_age_s=math.inf)
        age = math.inf if sc.progress_at is None else max(0.0, now - sc.progress_at)
        sources = tuple(
            source_state.view(src.state, src.limits, now, name=name)
            for name, src in sc.sources.items()
        )
        return ScopeSnapshot(scope=scope, progress_age_s=age, sources=sources)

    def on_release(self, scope: str, listener: ReleaseListener) -> None:
        """Notify ``listener`` of every permit of ``scope`` this backend frees."""
        self._listeners.add(scope, listener)

    async def aclose(self) -> None:
        """Nothing to release: the state lives and dies with the process."""
