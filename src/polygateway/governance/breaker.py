"""The circuit breaker of one source: closed, open for a cool-down, then half-open for one probe.

Pure state and transitions (research-wiki/designs/governance-policies.md):
``breaker_failures`` consecutive transient failures trip it open; the
cool-down doubles per consecutive trip up to ``cooldown_max_s``; once it has
passed, the breaker is half-open and admits exactly one probe fleet-wide. The
probe's slot is tied to the probe's lease: it frees itself when the lease
expires, so a probe whose holder died or hung can never wedge the breaker.
A cancelled (or rate-limited, or rejected) probe frees the slot at once and
leaves the breaker half-open. Time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Breaker",
    "BreakerAdmission",
    "BreakerState",
    "admit",
    "claim_probe",
    "cooldown_for",
    "effective_state",
    "free_probe",
    "is_probe",
    "on_failure",
    "on_success",
    "renew_probe",
    "trip",
    "trip_long",
]

BreakerState = Literal["closed", "open", "half_open"]

# 2.0 ** 1024 overflows; any exponent past this already exceeds every sane cap.
_MAX_DOUBLINGS = 1000


@dataclass(slots=True)
class Breaker:
    """One source's breaker state; field names and initial values follow the spec table."""

    state: BreakerState = "closed"
    failures: int = 0
    trips: int = 0
    open_until: float = 0.0
    probe_id: str = ""
    probe_until: float = 0.0


@dataclass(frozen=True, slots=True)
class BreakerAdmission:
    """The breaker's answer to an acquire: a rejection reason, or admission (maybe as the probe)."""

    reason: Literal["breaker_open", "probe_in_flight"] | None
    reopen_in_s: float | None = None
    probe: bool = False


_ADMIT = BreakerAdmission(None)
_ADMIT_PROBE = BreakerAdmission(None, probe=True)
_PROBE_BUSY = BreakerAdmission("probe_in_flight")


def cooldown_for(trips: int, cooldown_s: float, cooldown_max_s: float) -> float:
    """Cool-down of the ``trips``-th consecutive trip: doubling from ``cooldown_s``, capped."""
    doublings = min(max(trips - 1, 0), _MAX_DOUBLINGS)
    return min(cooldown_s * 2.0**doublings, cooldown_max_s)


def admit(b: Breaker, now: float) -> BreakerAdmission:
    """Step 1 of acquire; an open breaker whose cool-down has passed becomes half-open here.

    The open-to-half-open transition is stored even if a later check rejects
    the candidate: it is a fact about time, not about this request.
    """
    if b.state == "open":
        if now < b.open_until:
            return BreakerAdmission("breaker_open", b.open_until - now)
        b.state = "half_open"
    if b.state == "half_open":
        if b.probe_id != "" and b.probe_until > now:
            return _PROBE_BUSY
        return _ADMIT_PROBE
    return _ADMIT


def effective_state(b: Breaker, now: float) -> BreakerState:
    """The state the next acquire would see, without changing anything (for snapshots)."""
    if b.state == "open" and now >= b.open_until:
        return "half_open"
    return b.state


def claim_probe(b: Breaker, lease_id: str, lease_expiry: float) -> None:
    """The admitted lease is the half-open probe; its slot lives as long as the lease."""
    b.probe_id = lease_id
    b.probe_until = lease_expiry


def is_probe(b: Breaker, lease_id: str) -> bool:
    """Whether ``lease_id`` holds the probe slot."""
    return b.probe_id != "" and b.probe_id == lease_id


def renew_probe(b: Breaker, lease_id: str, lease_expiry: float) -> None:
    """A renewed probe lease keeps its slot as long as the lease lives."""
    if is_probe(b, lease_id):
        b.probe_until = lease_expiry


def free_probe(b: Breaker, lease_id: str | None = None) -> None:
    """Free the probe slot (only if ``lease_id`` holds it, when given); the state is unchanged."""
    if lease_id is None or is_probe(b, lease_id):
        b.probe_id = ""
        b.probe_until = 0.0


def trip(b: Breaker, now: float, cooldown_s: float, cooldown_max_s: float) -> None:
    """Open the breaker for the doubling cool-down of one more consecutive trip."""
    b.trips += 1
    b.open_until = now + cooldown_for(b.trips, cooldown_s, cooldown_max_s)
    b.state = "open"
    b.failures = 0
    free_probe(b)


def trip_long(b: Breaker, now: float, cooldown_max_s: float) -> None:
    """Open the breaker for the longest cool-down: the source is misconfigured, not overloaded."""
    b.trips += 1
    b.open_until = now + cooldown_max_s
    b.state = "open"
    b.failures = 0
    free_probe(b)


def on_success(b: Breaker) -> None:
    """Any success closes the breaker and forgets its failures and trips."""
    b.state = "closed"
    b.failures = 0
    b.trips = 0
    free_probe(b)


def on_failure(
    b: Breaker,
    lease_id: str,
    now: float,
    *,
    threshold: int,
    cooldown_s: float,
    cooldown_max_s: float,
) -> None:
    """A transient failure: counts while closed, reopens from the probe, is ignored otherwise."""
    if b.state == "closed":
        b.failures += 1
        if b.failures >= threshold:
            trip(b, now, cooldown_s, cooldown_max_s)
    elif b.state == "half_open" and is_probe(b, lease_id):
        trip(b, now, cooldown_s, cooldown_max_s)
