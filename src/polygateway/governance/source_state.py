"""One source's shared governance state and the acquire / release / renew steps over it.

This module is the single Python statement of
research-wiki/designs/governance-policies.md; the Redis backend's Lua scripts
mirror it line for line and a differential test compares every decision. It
composes the pure policies (breaker, AIMD, pacer, token buckets) over one
plain state object and never reads a clock: ``now`` is the backend's clock,
passed in. A backend makes each operation atomic around these functions.

- ``admit`` runs the checks of acquire for one candidate, in order, and says
  why it refuses or whether the admission is a probe (the breaker's
  half-open probe, or the probe that reopens a source after a pause).
- ``commit`` takes the permit, the rate tokens and the probe slots.
- ``apply_outcome`` is release: remove the lease, then breaker, AIMD, pacer
  and tpm reconciliation. The caller records scope progress on success.
- ``renew`` extends a live lease (and the probe slots it may hold).
- ``new_limits`` brings the state inside a changed spec's limits, before
  that spec's first check (a lowered ``max_concurrency`` lowers the AIMD limit).
- ``view`` is the read-only, relative-time picture for snapshots
  (``SourceSnapshot``, which ``backends.base`` re-exports).

The spec drops expired leases at every operation; here ``drop_expired`` does
so lazily (see ``SourceState.next_expiry``), which decides exactly the same:
after it, every lease left is live, and it walks the leases only once the
earliest expiry has passed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

from polygateway.governance import aimd, breaker, ratelimit
from polygateway.governance.aimd import Aimd
from polygateway.governance.breaker import Breaker, BreakerState
from polygateway.governance.pacer import pause_for
from polygateway.governance.ratelimit import TokenBucket

__all__ = [
    "Admission",
    "LeaseEntry",
    "OutcomeKind",
    "Refusal",
    "RejectReason",
    "SourceLimits",
    "SourceSnapshot",
    "SourceState",
    "admit",
    "apply_outcome",
    "commit",
    "drop_expired",
    "new_limits",
    "new_source_state",
    "renew",
    "view",
]

# Defined here, the lowest layer that needs them; backends.base re-exports both.
RejectReason = Literal["breaker_open", "probe_in_flight", "paced", "concurrency", "rpm", "tpm"]
"""Why ``acquire`` passed over a candidate, checked in this order."""

OutcomeKind = Literal[
    "success",
    "rate_limited",
    "transient",
    "source_misconfigured",
    "request_rejected",
    "cancelled",
]
"""What an attempt came to, as far as shared state cares (research-wiki/ARCHITECTURE.md §2b)."""


class SourceLimits(Protocol):
    """The limits of one source, read-only; ``backends.base.SourceSpec`` is one."""

    @property
    def max_concurrency(self) -> int: ...
    @property
    def rpm(self) -> float | None: ...
    @property
    def rpm_capacity(self) -> float: ...
    @property
    def tpm(self) -> float | None: ...
    @property
    def tpm_capacity(self) -> float: ...
    @property
    def breaker_failures(self) -> int: ...
    @property
    def cooldown_s(self) -> float: ...
    @property
    def cooldown_max_s(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a candidate was passed over, and when time alone lifts it (``None``: only a release)."""

    reason: RejectReason
    reopen_in_s: float | None = None


@dataclass(frozen=True, slots=True)
class Admission:
    """A candidate passed every check.

    ``probe``: its lease will be the breaker's half-open probe; ``pace_probe``:
    the probe that reopens a source after a pause (one fleet-wide).
    """

    probe: bool = False
    pace_probe: bool = False


@dataclass(slots=True)
class LeaseEntry:
    """One live permit: when it expires, its tpm reservation, and the TTL a renewal restores."""

    expiry: float
    tokens: int
    ttl_s: float


@dataclass(slots=True)
class SourceState:
    """Everything the fleet shares about one source (the spec page's per-source table)."""

    breaker: Breaker
    aimd: Aimd
    not_before: float = 0.0
    reopen_by_probe: bool = False
    """A failure's pause was set: once ``not_before`` passes, one probe reopens the source."""
    pace_probe_id: str = ""
    pace_probe_until: float = 0.0
    """The lease holding the pause's probe slot, and when that slot lapses with the lease."""
    rpm: TokenBucket | None = None
    tpm: TokenBucket | None = None
    leases: dict[str, LeaseEntry] = field(default_factory=dict)
    next_expiry: float = -math.inf
    """No lease in ``leases`` expires before this (a lower bound, not always the minimum).

    It lets the sweep of expired leases, due at every operation, cost one
    comparison while nothing can have expired: ``commit`` lowers it, a sweep
    sets it to the exact minimum, a release leaves it (still a lower bound).
    ``-inf`` (the default) means "unknown": the next operation sweeps.
    """


@dataclass(frozen=True, slots=True)
class SourceSnapshot:
    """One source's live state, for ``polygateway status`` and tests; every time relative."""

    name: str
    in_flight: int
    limit: float
    breaker: BreakerState
    consecutive_failures: int
    trips: int
    reopen_in_s: float | None
    paced_for_s: float | None
    rpm_tokens: float | None
    tpm_tokens: float | None


_CONCURRENCY = Refusal("concurrency")
_PROBE_IN_FLIGHT = Refusal("probe_in_flight")
_ADMIT = Admission()
_ADMIT_PROBE = Admission(probe=True)
_ADMIT_PACE_PROBE = Admission(pace_probe=True)
_ADMIT_BOTH_PROBES = Admission(probe=True, pace_probe=True)


def new_source_state(limits: SourceLimits, now: float) -> SourceState:
    """A source at first sight: breaker closed, limit at its max, buckets full."""
    return SourceState(
        breaker=Breaker(),
        aimd=Aimd(limit=float(limits.max_concurrency)),
        rpm=ratelimit.new_bucket(limits.rpm_capacity, now) if limits.rpm is not None else None,
        tpm=ratelimit.new_bucket(limits.tpm_capacity, now) if limits.tpm is not None else None,
        next_expiry=math.inf,  # no lease yet: nothing can expire
    )


def new_limits(state: SourceState, limits: SourceLimits) -> None:
    """A source about to be examined with limits other than the last ones seen: fit its state.

    Only the AIMD limit is bounded by a limit this way (``aimd.on_max_change``):
    a bucket is brought under its capacity by every refill, and one that a new
    rate adds starts full. A backend calls this only when the spec changed,
    which a healthy fleet never does between two deploys.
    """
    aimd.on_max_change(state.aimd, limits.max_concurrency)


def drop_expired(state: SourceState, now: float) -> None:
    """Forget leases whose holder neither released nor renewed them in time (expiry <= now).

    Afterwards every lease left is live. Before ``state.next_expiry`` none can
    have expired, so the common case is one comparison instead of a walk over
    every lease (64 of them at concurrency 64, twice per call).
    """
    if now >= state.next_expiry:
        _sweep(state, now)


def _sweep(state: SourceState, now: float) -> None:
    """Drop every expired lease and record the exact earliest expiry of those left."""
    leases = state.leases
    earliest = math.inf
    expired: list[str] = []
    for lease_id, entry in leases.items():
        expiry = entry.expiry
        if expiry <= now:
            expired.append(lease_id)
        elif expiry < earliest:
            earliest = expiry
    for lease_id in expired:
        del leases[lease_id]
    state.next_expiry = earliest


def admit(
    state: SourceState, limits: SourceLimits, now: float, cost_tokens: int
) -> Admission | Refusal:
    """Acquire's checks for one candidate, in the spec's order; the first failing one refuses.

    Mutates only what the spec stores regardless of the verdict: expired
    leases dropped, open-to-half-open after the cool-down, buckets refilled.
    """
    # drop_expired's guard, tested here to save a call on every candidate examined.
    if now >= state.next_expiry:
        _sweep(state, now)

    probe = False
    b = state.breaker
    # A closed breaker admits everything (breaker.admit's last case), and closed
    # is the state of a healthy source: the common case skips the call.
    if b.state != "closed":
        verdict = breaker.admit(b, now)
        if verdict.reason == "probe_in_flight":
            return _PROBE_IN_FLIGHT
        if verdict.reason is not None:
            return Refusal(verdict.reason, verdict.reopen_in_s)
        probe = verdict.probe

    if now < state.not_before:
        return Refusal("paced", state.not_before - now)
    pace_probe = False
    if state.reopen_by_probe:
        # The pause has lapsed: one probe fleet-wide, the others wait for its release.
        if state.pace_probe_id != "" and state.pace_probe_until > now:
            return _PROBE_IN_FLIGHT
        pace_probe = True

    if len(state.leases) >= aimd.concurrency_cap(state.aimd, limits.max_concurrency):
        return _CONCURRENCY

    # Each limit read once: on a SourceSpec the capacities are computed properties.
    rpm = limits.rpm
    if rpm is not None:
        cap = limits.rpm_capacity
        bucket = state.rpm
        if bucket is None:
            # Added to the config after first sight: a new bucket starts full.
            bucket = state.rpm = ratelimit.new_bucket(cap, now)
        ratelimit.refill(bucket, rpm, cap, now)
        wait = ratelimit.wait_for(bucket, 1, rpm)
        if wait is not None:
            return Refusal("rpm", wait)

    tpm = limits.tpm
    if tpm is not None:
        cap = limits.tpm_capacity
        bucket = state.tpm
        if bucket is None:
            bucket = state.tpm = ratelimit.new_bucket(cap, now)
        ratelimit.refill(bucket, tpm, cap, now)
        wait = ratelimit.wait_for(bucket, min(cost_tokens, cap), tpm)
        if wait is not None:
            return Refusal("tpm", wait)

    if pace_probe:
        return _ADMIT_BOTH_PROBES if probe else _ADMIT_PACE_PROBE
    return _ADMIT_PROBE if probe else _ADMIT


def commit(
    state: SourceState,
    limits: SourceLimits,
    lease_id: str,
    now: float,
    *,
    ttl_s: float,
    cost_tokens: int,
    probe: bool,
    pace_probe: bool = False,
) -> LeaseEntry:
    """Take the admitted permit: one rpm token, ``cost_tokens`` tpm tokens, and the probe slots."""
    if limits.rpm is not None and state.rpm is not None:
        ratelimit.take(state.rpm, 1)
    if limits.tpm is not None and state.tpm is not None:
        ratelimit.take(state.tpm, cost_tokens)
    expiry = now + ttl_s
    entry = LeaseEntry(expiry, cost_tokens, ttl_s)
    state.leases[lease_id] = entry
    if expiry < state.next_expiry:
        state.next_expiry = expiry
    if probe:
        breaker.claim_probe(state.breaker, lease_id, expiry)
    if pace_probe:
        state.pace_probe_id = lease_id
        state.pace_probe_until = expiry
    return entry


def apply_outcome(
    state: SourceState,
    limits: SourceLimits,
    lease_id: str,
    now: float,
    kind: OutcomeKind,
    *,
    aimd_decrease: bool = False,
    retry_after_s: float | None = None,
    tokens_used: int | None = None,
) -> bool:
    """Release a lease and record its outcome; ``False`` (and nothing changed) if it was not live.

    ``retry_after_s`` is the upstream's back-off (or, on a success, how long
    it announced its window exhausted); ``pacer.pause_for`` says what it
    pauses. A failure's pause reopens through one probe; any success reopens.
    The caller sets the scope's progress when this returns ``True`` for a success.
    """
    # One dict operation finds and removes the lease. Had it expired, the sweep
    # would drop it anyway, and the check below makes its release a no-op.
    entry = state.leases.pop(lease_id, None)
    if now >= state.next_expiry:  # drop_expired's guard, inline as in admit
        _sweep(state, now)
    if entry is None or entry.expiry <= now:
        return False

    if state.pace_probe_id != "" and state.pace_probe_id == lease_id:
        state.pace_probe_id = ""
        state.pace_probe_until = 0.0
    pause: float | None = None
    b = state.breaker
    if kind == "success":
        breaker.on_success(b)
        aimd.on_success(state.aimd, limits.max_concurrency)
        state.reopen_by_probe = False
        pause = pause_for(False, retry_after_s)
    elif kind == "transient":
        breaker.on_failure(
            b,
            lease_id,
            now,
            threshold=limits.breaker_failures,
            cooldown_s=limits.cooldown_s,
            cooldown_max_s=limits.cooldown_max_s,
        )
        if aimd_decrease:
            aimd.on_overload(state.aimd, now)
        pause = pause_for(False, retry_after_s)
        if pause is not None:
            state.reopen_by_probe = True
    elif kind == "rate_limited":
        breaker.free_probe(b, lease_id)
        aimd.on_overload(state.aimd, now)
        pause = pause_for(True, retry_after_s)
        state.reopen_by_probe = True
    elif kind == "source_misconfigured":
        breaker.trip_long(b, now, limits.cooldown_max_s)
    else:  # request_rejected, cancelled: the source did nothing wrong
        breaker.free_probe(b, lease_id)
    if pause is not None:
        state.not_before = max(state.not_before, now + pause)

    if tokens_used is not None and limits.tpm is not None and state.tpm is not None:
        ratelimit.reconcile(state.tpm, entry.tokens, tokens_used, limits.tpm_capacity)
    return True


def renew(state: SourceState, lease_id: str, now: float) -> bool:
    """Extend a live lease by its TTL from ``now`` (the probe slot too); ``False`` if not live."""
    drop_expired(state, now)
    entry = state.leases.get(lease_id)
    if entry is None:
        return False
    entry.expiry = expiry = now + entry.ttl_s
    # Only a clock that went back could make this lower than before; keep the bound safe anyway.
    if expiry < state.next_expiry:
        state.next_expiry = expiry
    breaker.renew_probe(state.breaker, lease_id, expiry)
    if state.pace_probe_id != "" and state.pace_probe_id == lease_id:
        state.pace_probe_until = expiry
    return True


def view(state: SourceState, limits: SourceLimits, now: float, *, name: str) -> SourceSnapshot:
    """The source ``name`` as the next acquire would see it, without changing anything."""
    b = state.breaker
    effective = breaker.effective_state(b, now)
    rpm_tokens: float | None = None
    if limits.rpm is not None:
        rpm_tokens = (
            ratelimit.refilled_tokens(state.rpm, limits.rpm, limits.rpm_capacity, now)
            if state.rpm is not None
            else limits.rpm_capacity
        )
    tpm_tokens: float | None = None
    if limits.tpm is not None:
        tpm_tokens = (
            ratelimit.refilled_tokens(state.tpm, limits.tpm, limits.tpm_capacity, now)
            if state.tpm is not None
            else limits.tpm_capacity
        )
    return SourceSnapshot(
        name=name,
        in_flight=sum(1 for entry in state.leases.values() if entry.expiry > now),
        limit=state.aimd.limit,
        breaker=effective,
        consecutive_failures=b.failures,
        trips=b.trips,
        reopen_in_s=b.open_until - now if effective == "open" else None,
        paced_for_s=state.not_before - now if now < state.not_before else None,
        rpm_tokens=rpm_tokens,
        tpm_tokens=tpm_tokens,
    )
