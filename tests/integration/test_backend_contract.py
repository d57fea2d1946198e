"""The backend contract: every ``Backend`` follows research-wiki/designs/governance-policies.md.

Written once against the protocol and ``snapshot`` only, and run for every
parameter of ``backend_env``; nothing here may reach into one backend's
internals. Floats are compared approximately: a backend may carry them
through a text protocol.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, Protocol, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from polygateway.backends.base import (
    AcquireResult,
    AttemptOutcome,
    Backend,
    Lease,
    Rejection,
    SourceSnapshot,
    SourceSpec,
)
from polygateway.middleware.waiting import room_for
from polygateway.testing import FakeClock


class BackendEnv(Protocol):
    """What the suite needs of the ``backend_env`` fixture (tests/integration/conftest.py)."""

    backend: Backend
    clock: FakeClock


SCOPE = "chat"
TTL = 30.0
R = TypeVar("R")

A = SourceSpec(name="a", max_concurrency=2)
B = SourceSpec(name="b", max_concurrency=2)
FLAKY = SourceSpec(
    name="flaky", max_concurrency=4, breaker_failures=3, cooldown_s=10, cooldown_max_s=60
)

SUCCESS = AttemptOutcome("success")
TRANSIENT = AttemptOutcome("transient")
CANCELLED = AttemptOutcome("cancelled")


async def _acquire(
    env: BackendEnv,
    *candidates: SourceSpec,
    cost: int = 0,
    ttl: float = TTL,
    scope: str = SCOPE,
) -> AcquireResult:
    return await env.backend.acquire(scope, candidates, cost_tokens=cost, ttl_s=ttl)


async def _grant(
    env: BackendEnv, *candidates: SourceSpec, cost: int = 0, ttl: float = TTL
) -> Lease:
    result = await _acquire(env, *candidates, cost=cost, ttl=ttl)
    assert result.lease is not None, result.rejections
    return result.lease


async def _refused(env: BackendEnv, spec: SourceSpec, cost: int = 0) -> Rejection:
    result = await _acquire(env, spec, cost=cost)
    assert result.lease is None, result.lease
    assert len(result.rejections) == 1
    return result.rejections[0]


async def _source(env: BackendEnv, name: str, scope: str = SCOPE) -> SourceSnapshot:
    snap = await env.backend.snapshot(scope)
    found = snap.source(name)
    assert found is not None, snap
    return found


async def _trip(env: BackendEnv, spec: SourceSpec = FLAKY) -> None:
    """Fail ``breaker_failures`` attempts in a row so the breaker opens (cool-down from now)."""
    leases = [await _grant(env, spec) for _ in range(spec.breaker_failures)]
    for lease in leases:
        await env.backend.release(lease, TRANSIENT)
    assert (await _source(env, spec.name)).breaker == "open"


# --- grant, release, concurrency ---------------------------------------------------------------


async def test_backend_satisfies_the_protocol(backend_env: BackendEnv) -> None:
    """Every backend is a runtime ``Backend``."""
    assert isinstance(backend_env.backend, Backend)


async def test_grant_and_release(backend_env: BackendEnv) -> None:
    """A grant holds one permit with the asked TTL and reservation; release frees it."""
    env = backend_env
    result = await _acquire(env, A, cost=7)
    lease = result.lease
    assert lease is not None
    assert result.rejections == ()
    assert (lease.scope, lease.source, lease.ttl_s, lease.tokens, lease.probe) == (
        SCOPE,
        "a",
        TTL,
        7,
        False,
    )
    assert lease.lease_id
    assert (await env.backend.snapshot(SCOPE)).in_flight == 1
    await env.backend.release(lease, SUCCESS)
    assert (await env.backend.snapshot(SCOPE)).in_flight == 0


async def test_lease_ids_are_unique(backend_env: BackendEnv) -> None:
    """Concurrent leases, across sources and scopes, never share an id."""
    env = backend_env
    ids = {(await _grant(env, spec)).lease_id for spec in (A, A, B, B)}
    other = await _acquire(env, A, scope="embed")
    assert other.lease is not None
    ids.add(other.lease.lease_id)
    assert len(ids) == 5


async def test_concurrency_limit_refuses_then_reopens_on_release(backend_env: BackendEnv) -> None:
    """``max_concurrency`` permits, then ``concurrency`` (no reopen time); a release reopens."""
    env = backend_env
    first = await _grant(env, A)
    await _grant(env, A)
    assert await _refused(env, A) == Rejection("a", "concurrency", None)
    await env.backend.release(first, SUCCESS)
    await _grant(env, A)


async def test_scopes_are_independent(backend_env: BackendEnv) -> None:
    """The same source name in another scope has its own permits."""
    env = backend_env
    await _grant(env, A)
    await _grant(env, A)
    other = await _acquire(env, A, scope="embed")
    assert other.lease is not None
    assert (await env.backend.snapshot("embed")).in_flight == 1


async def test_spill_over_to_the_next_candidate(backend_env: BackendEnv) -> None:
    """A busy first candidate is recorded and the second is granted in the same operation."""
    env = backend_env
    await _grant(env, A)
    await _grant(env, A)
    result = await _acquire(env, A, B)
    assert result.lease is not None
    assert result.lease.source == "b"
    assert result.rejections == (Rejection("a", "concurrency", None),)


async def test_candidates_after_the_admitted_one_are_not_examined(backend_env: BackendEnv) -> None:
    """Admission stops at the first fit: the next candidate's rate tokens are untouched."""
    env = backend_env
    tight = SourceSpec(name="tight", max_concurrency=5, rpm=1, rpm_burst=1)
    lease = await _grant(env, A, tight)
    assert lease.source == "a"
    assert (await _grant(env, tight)).source == "tight"


async def test_all_refused_lists_every_candidate_and_earliest_reopen(
    backend_env: BackendEnv,
) -> None:
    """Nothing admissible: every candidate's reason, and ``retry_after_s`` the earliest reopen."""
    env = backend_env
    lease = await _grant(env, A)
    await env.backend.release(lease, AttemptOutcome("rate_limited", retry_after_s=5))
    lease = await _grant(env, B)
    await env.backend.release(lease, AttemptOutcome("rate_limited", retry_after_s=3))
    result = await _acquire(env, A, B)
    assert result.lease is None
    assert [(r.source, r.reason) for r in result.rejections] == [("a", "paced"), ("b", "paced")]
    assert result.retry_after_s == pytest.approx(3.0)


# --- leases: expiry, renew, unknown ------------------------------------------------------------


async def test_lease_expiry_frees_the_permit(backend_env: BackendEnv) -> None:
    """A holder that never releases loses its permit when the TTL passes."""
    env = backend_env
    await _grant(env, A, ttl=5)
    await _grant(env, A, ttl=5)
    env.clock.advance(4.9)
    assert (await _refused(env, A)).reason == "concurrency"
    env.clock.advance(0.1)
    assert (await _source(env, "a")).in_flight == 0
    await _grant(env, A)


async def test_release_of_expired_lease_is_a_no_op(backend_env: BackendEnv) -> None:
    """A late release changes nothing: no permit freed twice, no progress, no breaker count."""
    env = backend_env
    late = await _grant(env, FLAKY, ttl=5)
    env.clock.advance(6)
    held = await _grant(env, FLAKY)
    await env.backend.release(late, SUCCESS)
    assert await env.backend.progress_age_s(SCOPE) == math.inf
    assert (await _source(env, "flaky")).in_flight == 1
    await env.backend.release(late, TRANSIENT)
    assert (await _source(env, "flaky")).consecutive_failures == 0
    await env.backend.release(held, SUCCESS)


async def test_release_of_unknown_lease_is_a_no_op(backend_env: BackendEnv) -> None:
    """A lease the backend never granted (or already released) is ignored without error."""
    env = backend_env
    lease = await _grant(env, A)
    await env.backend.release(lease, SUCCESS)
    await env.backend.release(lease, SUCCESS)
    ghost = Lease(scope=SCOPE, source="a", lease_id=uuid.uuid4().hex, ttl_s=TTL)
    await env.backend.release(ghost, TRANSIENT)
    await env.backend.release(Lease("nowhere", "nothing", "1", TTL), TRANSIENT)
    snap = await _source(env, "a")
    assert (snap.in_flight, snap.consecutive_failures) == (0, 0)


async def test_renew_extends_a_live_lease(backend_env: BackendEnv) -> None:
    """Renewal sets the expiry to ``ttl_s`` from now, so the permit outlives its first TTL."""
    env = backend_env
    lease = await _grant(env, A, ttl=10)
    env.clock.advance(8)
    assert await env.backend.renew(lease) is True
    env.clock.advance(8)
    assert (await _source(env, "a")).in_flight == 1
    env.clock.advance(2)
    assert (await _source(env, "a")).in_flight == 0


async def test_renew_of_expired_or_unknown_lease_is_false(backend_env: BackendEnv) -> None:
    """An expired, released or never-granted lease cannot be revived."""
    env = backend_env
    lease = await _grant(env, A, ttl=5)
    env.clock.advance(5)
    assert await env.backend.renew(lease) is False
    assert (await _source(env, "a")).in_flight == 0
    released = await _grant(env, A)
    await env.backend.release(released, SUCCESS)
    assert await env.backend.renew(released) is False
    assert await env.backend.renew(Lease("nowhere", "x", "1", TTL)) is False


# --- breaker -----------------------------------------------------------------------------------


async def test_breaker_trips_after_consecutive_transient_failures(backend_env: BackendEnv) -> None:
    """``breaker_failures`` failures in a row open it; the refusal says how long is left."""
    env = backend_env
    for _ in range(FLAKY.breaker_failures - 1):
        await env.backend.release(await _grant(env, FLAKY), TRANSIENT)
    snap = await _source(env, "flaky")
    assert (snap.breaker, snap.consecutive_failures) == ("closed", 2)
    await env.backend.release(await _grant(env, FLAKY), TRANSIENT)
    snap = await _source(env, "flaky")
    assert (snap.breaker, snap.trips, snap.consecutive_failures) == ("open", 1, 0)
    assert snap.reopen_in_s == pytest.approx(10.0)
    env.clock.advance(4)
    rejection = await _refused(env, FLAKY)
    assert rejection.reason == "breaker_open"
    assert rejection.reopen_in_s == pytest.approx(6.0)


async def test_success_between_failures_keeps_breaker_closed(backend_env: BackendEnv) -> None:
    """Failures only count while consecutive."""
    env = backend_env
    for outcome in (TRANSIENT, TRANSIENT, SUCCESS, TRANSIENT, TRANSIENT):
        await env.backend.release(await _grant(env, FLAKY), outcome)
    assert (await _source(env, "flaky")).breaker == "closed"


async def test_half_open_admits_one_probe_fleet_wide(backend_env: BackendEnv) -> None:
    """After the cool-down one lease is the probe; every other acquire is ``probe_in_flight``."""
    env = backend_env
    await _trip(env)
    env.clock.advance(10)
    assert (await _source(env, "flaky")).breaker == "half_open"
    probe = await _grant(env, FLAKY)
    assert probe.probe is True
    assert await _refused(env, FLAKY) == Rejection("flaky", "probe_in_flight", None)
    result = await _acquire(env, FLAKY, A)
    assert result.lease is not None
    assert result.lease.source == "a"
    assert result.rejections == (Rejection("flaky", "probe_in_flight", None),)


async def test_probe_success_closes_the_breaker(backend_env: BackendEnv) -> None:
    """A successful probe closes it and resets trips: full concurrency again."""
    env = backend_env
    await _trip(env)
    env.clock.advance(10)
    await env.backend.release(await _grant(env, FLAKY), SUCCESS)
    snap = await _source(env, "flaky")
    assert (snap.breaker, snap.trips, snap.reopen_in_s) == ("closed", 0, None)
    leases = [await _grant(env, FLAKY) for _ in range(3)]
    assert not any(lease.probe for lease in leases)


async def test_probe_failure_reopens_with_doubled_cooldown(backend_env: BackendEnv) -> None:
    """A failed probe reopens for twice the cool-down; the next probe failure doubles again."""
    env = backend_env
    await _trip(env)
    env.clock.advance(10)
    await env.backend.release(await _grant(env, FLAKY), TRANSIENT)
    snap = await _source(env, "flaky")
    assert (snap.breaker, snap.trips) == ("open", 2)
    assert snap.reopen_in_s == pytest.approx(20.0)
    env.clock.advance(20)
    await env.backend.release(await _grant(env, FLAKY), TRANSIENT)
    assert (await _source(env, "flaky")).reopen_in_s == pytest.approx(40.0)
    env.clock.advance(40)
    await env.backend.release(await _grant(env, FLAKY), TRANSIENT)
    assert (await _source(env, "flaky")).reopen_in_s == pytest.approx(60.0)


async def test_cancelled_probe_frees_the_slot_and_stays_half_open(backend_env: BackendEnv) -> None:
    """A cancelled probe neither closes nor reopens; the next acquire is the new probe."""
    env = backend_env
    await _trip(env)
    env.clock.advance(10)
    await env.backend.release(await _grant(env, FLAKY), CANCELLED)
    snap = await _source(env, "flaky")
    assert (snap.breaker, snap.trips) == ("half_open", 1)
    assert (await _grant(env, FLAKY)).probe is True


async def test_expired_probe_frees_the_slot(backend_env: BackendEnv) -> None:
    """A probe whose holder vanished blocks only until its lease expires: no wedge."""
    env = backend_env
    await _trip(env)
    env.clock.advance(10)
    await _grant(env, FLAKY, ttl=5)
    env.clock.advance(4)
    assert (await _refused(env, FLAKY)).reason == "probe_in_flight"
    env.clock.advance(1)
    assert (await _grant(env, FLAKY)).probe is True


async def test_rate_limited_probe_frees_the_slot(backend_env: BackendEnv) -> None:
    """A 429 from the probe leaves the breaker half-open and paces the source instead."""
    env = backend_env
    await _trip(env)
    env.clock.advance(10)
    await env.backend.release(await _grant(env, FLAKY), AttemptOutcome("rate_limited"))
    assert (await _source(env, "flaky")).breaker == "half_open"
    env.clock.advance(1)
    assert (await _grant(env, FLAKY)).probe is True


async def test_source_misconfigured_trips_long(backend_env: BackendEnv) -> None:
    """One 401/403/404 opens the breaker for ``cooldown_max_s`` at once."""
    env = backend_env
    await env.backend.release(await _grant(env, FLAKY), AttemptOutcome("source_misconfigured"))
    snap = await _source(env, "flaky")
    assert snap.breaker == "open"
    assert snap.reopen_in_s == pytest.approx(60.0)


async def test_request_rejected_does_not_touch_the_breaker(backend_env: BackendEnv) -> None:
    """A 400 is the request's fault: no failure counted."""
    env = backend_env
    for _ in range(5):
        await env.backend.release(await _grant(env, FLAKY), AttemptOutcome("request_rejected"))
    snap = await _source(env, "flaky")
    assert (snap.breaker, snap.consecutive_failures) == ("closed", 0)


# --- pacer, AIMD -------------------------------------------------------------------------------


async def test_rate_limited_paces_for_retry_after(backend_env: BackendEnv) -> None:
    """A 429 with Retry-After 7 s refuses the source as ``paced`` until then, fleet-wide."""
    env = backend_env
    await env.backend.release(await _grant(env, A), AttemptOutcome("rate_limited", retry_after_s=7))
    assert (await _source(env, "a")).paced_for_s == pytest.approx(7.0)
    env.clock.advance(2)
    rejection = await _refused(env, A)
    assert rejection.reason == "paced"
    assert rejection.reopen_in_s == pytest.approx(5.0)
    env.clock.advance(5)
    assert (await _source(env, "a")).paced_for_s is None
    await _grant(env, A)


async def test_rate_limited_without_retry_after_paces_one_second(backend_env: BackendEnv) -> None:
    """No Retry-After: the default 1 s pace."""
    env = backend_env
    await env.backend.release(await _grant(env, A), AttemptOutcome("rate_limited"))
    assert (await _refused(env, A)).reopen_in_s == pytest.approx(1.0)


async def test_pace_only_ever_extends(backend_env: BackendEnv) -> None:
    """A shorter Retry-After arriving later does not shorten an existing pace."""
    env = backend_env
    first, second = await _grant(env, A), await _grant(env, A)
    await env.backend.release(first, AttemptOutcome("rate_limited", retry_after_s=10))
    await env.backend.release(second, AttemptOutcome("rate_limited", retry_after_s=1))
    assert (await _source(env, "a")).paced_for_s == pytest.approx(10.0)


async def test_lapsed_pause_admits_one_probe_fleet_wide(backend_env: BackendEnv) -> None:
    """After a 429's pause, one probe goes out; the others wait for its release, not a time."""
    env = backend_env
    await env.backend.release(await _grant(env, A), AttemptOutcome("rate_limited", retry_after_s=2))
    env.clock.advance(2)
    probe = await _grant(env, A)
    rejection = await _refused(env, A)
    assert (rejection.reason, rejection.reopen_in_s) == ("probe_in_flight", None)
    await env.backend.release(probe, SUCCESS)
    # The probe's success reopens the source: both permits are free again.
    await _grant(env, A)
    await _grant(env, A)


async def test_probe_429_starts_the_next_pause(backend_env: BackendEnv) -> None:
    """A probe answered 429 pauses the source again for its hint, then probes once more."""
    env = backend_env
    await env.backend.release(await _grant(env, A), AttemptOutcome("rate_limited", retry_after_s=2))
    env.clock.advance(2)
    await env.backend.release(await _grant(env, A), AttemptOutcome("rate_limited", retry_after_s=3))
    rejection = await _refused(env, A)
    assert rejection.reason == "paced"
    assert rejection.reopen_in_s == pytest.approx(3.0)
    env.clock.advance(3)
    await _grant(env, A)
    assert (await _refused(env, A)).reason == "probe_in_flight"


@pytest.mark.parametrize("outcome", [CANCELLED, TRANSIENT, AttemptOutcome("request_rejected")])
async def test_probe_that_ends_otherwise_frees_the_slot(
    backend_env: BackendEnv, outcome: AttemptOutcome
) -> None:
    """A cancelled, failed or rejected probe frees its slot at once: the next call probes."""
    env = backend_env
    await env.backend.release(await _grant(env, A), AttemptOutcome("rate_limited", retry_after_s=1))
    env.clock.advance(1)
    await env.backend.release(await _grant(env, A), outcome)
    await _grant(env, A)
    assert (await _refused(env, A)).reason == "probe_in_flight"


async def test_probe_slot_lapses_with_its_lease_and_follows_renewals(
    backend_env: BackendEnv,
) -> None:
    """A probe whose holder died frees the slot at its lease's expiry; a renewal extends it."""
    env = backend_env
    await env.backend.release(await _grant(env, A), AttemptOutcome("rate_limited", retry_after_s=1))
    env.clock.advance(1)
    probe = await _grant(env, A, ttl=5)
    env.clock.advance(4)
    assert await env.backend.renew(probe)
    env.clock.advance(4)
    assert (await _refused(env, A)).reason == "probe_in_flight"
    env.clock.advance(1)
    await _grant(env, A)


async def test_hinted_transient_failure_pauses_and_probes(backend_env: BackendEnv) -> None:
    """A 503 with Retry-After pauses the source for the hint; one without it pauses nothing."""
    env = backend_env
    await env.backend.release(await _grant(env, B), TRANSIENT)
    await _grant(env, B)
    await env.backend.release(
        await _grant(env, A), AttemptOutcome("transient", aimd_decrease=True, retry_after_s=4)
    )
    rejection = await _refused(env, A)
    assert rejection.reason == "paced"
    assert rejection.reopen_in_s == pytest.approx(4.0)
    env.clock.advance(4)
    await _grant(env, A)
    assert (await _refused(env, A)).reason == "probe_in_flight"


async def test_success_announcing_exhaustion_pauses_without_probe(
    backend_env: BackendEnv,
) -> None:
    """A success whose window is spent pauses the source until the reset, then reopens fully."""
    env = backend_env
    await env.backend.release(await _grant(env, A), AttemptOutcome("success", retry_after_s=2))
    rejection = await _refused(env, A)
    assert rejection.reason == "paced"
    assert rejection.reopen_in_s == pytest.approx(2.0)
    env.clock.advance(2)
    await _grant(env, A)
    await _grant(env, A)


async def test_success_reopens_a_source_waiting_for_its_probe(backend_env: BackendEnv) -> None:
    """Any success, even of a lease granted before the pause, reopens the source."""
    env = backend_env
    early, late = await _grant(env, A), await _grant(env, A)
    await env.backend.release(late, AttemptOutcome("rate_limited", retry_after_s=1))
    env.clock.advance(1)
    await env.backend.release(early, SUCCESS)
    await _grant(env, A)
    await _grant(env, A)


async def test_aimd_decreases_once_per_cooloff_and_limits_in_flight(
    backend_env: BackendEnv,
) -> None:
    """A burst of 429s lowers 10 to 7 once; 7 permits are then granted; 2 s later it drops again."""
    env = backend_env
    wide = SourceSpec(name="wide", max_concurrency=10)
    leases = [await _grant(env, wide) for _ in range(10)]
    for lease in leases:
        await env.backend.release(lease, AttemptOutcome("rate_limited", retry_after_s=0))
    assert (await _source(env, "wide")).limit == pytest.approx(7.0)
    # The pause has lapsed at once: one probe reopens the source (limit 7 + 1/7).
    await env.backend.release(await _grant(env, wide), SUCCESS)
    held = [await _grant(env, wide) for _ in range(7)]
    assert (await _refused(env, wide)).reason == "concurrency"
    env.clock.advance(2)
    await env.backend.release(held[0], AttemptOutcome("rate_limited", retry_after_s=0))
    assert (await _source(env, "wide")).limit == pytest.approx((7 + 1 / 7) * 0.7)
    # Six still in flight above the new cap of 5: nothing more until they drain.
    assert (await _refused(env, wide)).reason == "concurrency"
    await env.backend.release(held[1], CANCELLED)
    assert (await _refused(env, wide)).reason == "concurrency"
    await env.backend.release(held[2], CANCELLED)
    await _grant(env, wide)


async def test_aimd_transient_decreases_only_when_flagged(backend_env: BackendEnv) -> None:
    """A timeout/503 (``aimd_decrease``) lowers the limit; a plain transient failure does not."""
    env = backend_env
    wide = SourceSpec(name="wide", max_concurrency=10, breaker_failures=100)
    await env.backend.release(await _grant(env, wide), TRANSIENT)
    assert (await _source(env, "wide")).limit == pytest.approx(10.0)
    overload = AttemptOutcome("transient", aimd_decrease=True)
    await env.backend.release(await _grant(env, wide), overload)
    assert (await _source(env, "wide")).limit == pytest.approx(7.0)
    env.clock.advance(1.9)
    await env.backend.release(await _grant(env, wide), overload)
    assert (await _source(env, "wide")).limit == pytest.approx(7.0)
    env.clock.advance(0.1)
    await env.backend.release(await _grant(env, wide), overload)
    assert (await _source(env, "wide")).limit == pytest.approx(4.9)


async def test_aimd_success_grows_the_limit_up_to_max(backend_env: BackendEnv) -> None:
    """Each success adds ``1/limit``, capped at ``max_concurrency``."""
    env = backend_env
    wide = SourceSpec(name="wide", max_concurrency=10)
    await env.backend.release(
        await _grant(env, wide), AttemptOutcome("rate_limited", retry_after_s=0)
    )
    env.clock.advance(1)
    await env.backend.release(await _grant(env, wide), SUCCESS)
    assert (await _source(env, "wide")).limit == pytest.approx(7.0 + 1 / 7.0)
    for _ in range(40):
        await env.backend.release(await _grant(env, wide), SUCCESS)
    assert (await _source(env, "wide")).limit == pytest.approx(10.0)


async def test_a_lowered_max_concurrency_clamps_the_limit_at_once(backend_env: BackendEnv) -> None:
    """A spec lowering ``max_concurrency`` brings the limit down to it at that acquire."""
    env = backend_env
    await env.backend.release(await _grant(env, SourceSpec(name="s", max_concurrency=8)), SUCCESS)
    assert (await _source(env, "s")).limit == pytest.approx(8.0)
    narrow = SourceSpec(name="s", max_concurrency=2)
    await _grant(env, narrow)
    assert (await _source(env, "s")).limit == pytest.approx(2.0)
    await _grant(env, narrow)
    assert (await _refused(env, narrow)).reason == "concurrency"
    assert (await _source(env, "s")).limit == pytest.approx(2.0)


async def test_a_lowered_max_concurrency_is_where_the_next_decrease_starts(
    backend_env: BackendEnv,
) -> None:
    """After max 8 -> 2, an overload lowers 2 to 1.4 (one permit), not 8 to 5.6 (still two)."""
    env = backend_env
    await _grant(env, SourceSpec(name="s", max_concurrency=8))
    narrow = SourceSpec(name="s", max_concurrency=2, breaker_failures=100)
    lease = await _grant(env, narrow)
    await env.backend.release(lease, AttemptOutcome("transient", aimd_decrease=True))
    assert (await _source(env, "s")).limit == pytest.approx(1.4)
    env.clock.advance(TTL)  # the first lease lapses: only the limit holds permits back
    await _grant(env, narrow)
    assert (await _refused(env, narrow)).reason == "concurrency"


async def test_a_limit_below_a_lowered_max_is_left_where_it_is(backend_env: BackendEnv) -> None:
    """A limit already inside the new bounds is not moved, and a raised max is grown into."""
    env = backend_env
    wide = SourceSpec(name="s", max_concurrency=10)
    await env.backend.release(
        await _grant(env, wide), AttemptOutcome("transient", aimd_decrease=True)
    )
    assert (await _source(env, "s")).limit == pytest.approx(7.0)
    await _grant(env, SourceSpec(name="s", max_concurrency=9))
    assert (await _source(env, "s")).limit == pytest.approx(7.0)
    await _grant(env, SourceSpec(name="s", max_concurrency=20))
    assert (await _source(env, "s")).limit == pytest.approx(7.0)


async def test_pacer_is_checked_before_concurrency(backend_env: BackendEnv) -> None:
    """A source both paced and full reports ``paced``; once the pace ends, ``concurrency``."""
    env = backend_env
    three = SourceSpec(name="three", max_concurrency=3)
    leases = [await _grant(env, three) for _ in range(3)]
    await env.backend.release(leases[0], AttemptOutcome("rate_limited", retry_after_s=4))
    assert (await _refused(env, three)).reason == "paced"
    env.clock.advance(4)
    # The 429 also lowered the limit to 2.1: two in flight fill it.
    assert (await _refused(env, three)).reason == "concurrency"


async def test_breaker_is_checked_before_pacer(backend_env: BackendEnv) -> None:
    """A source both open and paced reports ``breaker_open`` with the cool-down's time."""
    env = backend_env
    first, second = await _grant(env, FLAKY), await _grant(env, FLAKY)
    await env.backend.release(first, AttemptOutcome("rate_limited", retry_after_s=100))
    await env.backend.release(second, AttemptOutcome("source_misconfigured"))
    rejection = await _refused(env, FLAKY)
    assert rejection.reason == "breaker_open"
    assert rejection.reopen_in_s == pytest.approx(60.0)


# --- rate limits -------------------------------------------------------------------------------


async def test_rpm_bucket_admits_burst_then_refills(backend_env: BackendEnv) -> None:
    """rpm 60 with burst 2: two at once, then ``rpm`` with the wait to the next token."""
    env = backend_env
    spec = SourceSpec(name="r", max_concurrency=100, rpm=60, rpm_burst=2)
    await _grant(env, spec)
    await _grant(env, spec)
    rejection = await _refused(env, spec)
    assert rejection.reason == "rpm"
    assert rejection.reopen_in_s == pytest.approx(1.0)
    env.clock.advance(0.25)
    assert (await _refused(env, spec)).reopen_in_s == pytest.approx(0.75)
    env.clock.advance(0.75)
    await _grant(env, spec)
    assert (await _source(env, "r")).rpm_tokens == pytest.approx(0.0, abs=1e-9)


async def test_rpm_default_burst_is_one_seconds_worth(backend_env: BackendEnv) -> None:
    """Without ``rpm_burst``, rpm 300 allows 5 at once."""
    env = backend_env
    spec = SourceSpec(name="r", max_concurrency=100, rpm=300)
    for _ in range(5):
        await _grant(env, spec)
    assert (await _refused(env, spec)).reason == "rpm"


async def test_rpm_never_exceeds_rate_over_a_minute(backend_env: BackendEnv) -> None:
    """Asking every 1/8 s for a minute at rpm 120 / burst 2 yields exactly 120 + 2 grants."""
    env = backend_env
    spec = SourceSpec(name="r", max_concurrency=1000, rpm=120, rpm_burst=2)
    granted = 0
    for _ in range(480):
        result = await _acquire(env, spec, ttl=1)
        granted += result.lease is not None
        env.clock.advance(0.125)
    result = await _acquire(env, spec, ttl=1)
    granted += result.lease is not None
    assert granted == 122


async def test_tpm_bucket_reserves_the_estimate(backend_env: BackendEnv) -> None:
    """tpm 600 / burst 100: an 80-token call leaves 20; a 50-token call waits for 30 tokens."""
    env = backend_env
    spec = SourceSpec(name="t", max_concurrency=10, tpm=600, tpm_burst=100)
    await _grant(env, spec, cost=80)
    rejection = await _refused(env, spec, cost=50)
    assert rejection.reason == "tpm"
    assert rejection.reopen_in_s == pytest.approx(3.0)
    assert (await _source(env, "t")).tpm_tokens == pytest.approx(20.0)


async def test_tpm_oversized_request_is_admitted_on_a_full_bucket(backend_env: BackendEnv) -> None:
    """A request larger than the bucket goes through when full, then its debt blocks the next."""
    env = backend_env
    spec = SourceSpec(name="t", max_concurrency=10, tpm=600, tpm_burst=100)
    await _grant(env, spec, cost=250)
    assert (await _source(env, "t")).tpm_tokens == pytest.approx(-150.0)
    rejection = await _refused(env, spec, cost=10)
    assert rejection.reopen_in_s == pytest.approx(16.0)


async def test_tpm_reconciles_with_reported_usage(backend_env: BackendEnv) -> None:
    """Release with ``tokens_used`` refunds an over-estimate and charges an under-estimate."""
    env = backend_env
    spec = SourceSpec(name="t", max_concurrency=10, tpm=600, tpm_burst=100)
    lease = await _grant(env, spec, cost=80)
    await env.backend.release(lease, AttemptOutcome("success", tokens_used=30))
    assert (await _source(env, "t")).tpm_tokens == pytest.approx(70.0)
    lease = await _grant(env, spec, cost=10)
    await env.backend.release(lease, AttemptOutcome("transient", tokens_used=60))
    assert (await _source(env, "t")).tpm_tokens == pytest.approx(10.0)


# --- progress, snapshot, waiting room ----------------------------------------------------------


async def test_progress_age_inf_then_zero_then_grows(backend_env: BackendEnv) -> None:
    """Never served is ``inf``; a success makes it 0; it then grows with the clock."""
    env = backend_env
    assert await env.backend.progress_age_s(SCOPE) == math.inf
    await env.backend.release(await _grant(env, A), TRANSIENT)
    assert await env.backend.progress_age_s(SCOPE) == math.inf
    await env.backend.release(await _grant(env, A), SUCCESS)
    assert await env.backend.progress_age_s(SCOPE) == pytest.approx(0.0, abs=1e-9)
    env.clock.advance(12.5)
    assert await env.backend.progress_age_s(SCOPE) == pytest.approx(12.5)
    assert await env.backend.progress_age_s("embed") == math.inf


async def test_snapshot_of_an_unknown_scope_is_empty(backend_env: BackendEnv) -> None:
    """A scope nobody used has no sources and has never served."""
    snap = await backend_env.backend.snapshot("nobody")
    assert (snap.scope, snap.progress_age_s, snap.sources) == ("nobody", math.inf, ())


async def test_snapshot_reports_every_field(backend_env: BackendEnv) -> None:
    """A fresh, limited source reads as closed, full limit, full buckets, nothing pending."""
    env = backend_env
    spec = SourceSpec(name="s", max_concurrency=4, rpm=60, rpm_burst=3, tpm=6000, tpm_burst=500)
    await _grant(env, spec, cost=100)
    await _grant(env, A)
    snap = await env.backend.snapshot(SCOPE)
    assert snap.scope == SCOPE
    assert snap.in_flight == 2
    assert {s.name for s in snap.sources} == {"s", "a"}
    s = snap.source("s")
    assert s is not None
    assert (s.in_flight, s.breaker, s.consecutive_failures, s.trips) == (1, "closed", 0, 0)
    assert s.limit == pytest.approx(4.0)
    assert (s.reopen_in_s, s.paced_for_s) == (None, None)
    assert s.rpm_tokens == pytest.approx(2.0)
    assert s.tpm_tokens == pytest.approx(400.0)
    a = snap.source("a")
    assert a is not None
    assert (a.rpm_tokens, a.tpm_tokens) == (None, None)


async def test_snapshot_times_are_relative_and_buckets_refilled(backend_env: BackendEnv) -> None:
    """Reopen and pace times count down with the clock; bucket levels are as of now."""
    env = backend_env
    spec = SourceSpec(
        name="s",
        max_concurrency=4,
        rpm=60,
        rpm_burst=3,
        breaker_failures=1,
        cooldown_s=10,
        cooldown_max_s=60,
    )
    paced, failing = await _grant(env, spec), await _grant(env, spec)
    await env.backend.release(paced, AttemptOutcome("rate_limited", retry_after_s=20))
    await env.backend.release(failing, TRANSIENT)
    env.clock.advance(1.5)
    s = await _source(env, "s")
    assert s.breaker == "open"
    assert s.reopen_in_s == pytest.approx(8.5)
    assert s.paced_for_s == pytest.approx(18.5)
    assert s.rpm_tokens == pytest.approx(2.5)
    env.clock.advance(0.25)
    s = await _source(env, "s")
    assert s.reopen_in_s == pytest.approx(8.25)
    assert s.rpm_tokens == pytest.approx(2.75)


async def _never(_seconds: float) -> None:
    """A wait timer that never fires: only a release may end the wait (and time stands still)."""
    await asyncio.Event().wait()


async def test_release_wakes_the_waiting_room_head(backend_env: BackendEnv) -> None:
    """Releasing a live lease wakes the head of its scope's room; a no-op release wakes nobody."""
    env = backend_env
    room = room_for(env.backend, SCOPE)
    assert room_for(env.backend, SCOPE) is room
    assert room_for(env.backend, "embed") is not room
    head = room.enter()
    second = room.enter()
    lease = await _grant(env, A)
    waiting = asyncio.ensure_future(room.wait(head, 60, _never))
    await asyncio.sleep(0)
    await env.backend.release(lease, SUCCESS)
    await asyncio.wait_for(waiting, 1)
    assert room.wakeups == 1
    await env.backend.release(lease, SUCCESS)
    assert room.wakeups == 1
    room.leave(head)
    room.leave(second)


# --- the random walk ---------------------------------------------------------------------------

_WALK_SPECS = (
    SourceSpec(name="w1", max_concurrency=3, breaker_failures=2, cooldown_s=3, cooldown_max_s=12),
    SourceSpec(name="w2", max_concurrency=2, rpm=120, rpm_burst=2, tpm=600, tpm_burst=5),
)
_MAX_CAP = {s.name: s.max_concurrency for s in _WALK_SPECS}
_OUTCOMES = (
    AttemptOutcome("success"),
    AttemptOutcome("success", tokens_used=2),
    AttemptOutcome("transient"),
    AttemptOutcome("transient", aimd_decrease=True),
    AttemptOutcome("rate_limited", aimd_decrease=True, retry_after_s=0.5),
    AttemptOutcome("rate_limited", aimd_decrease=True),
    AttemptOutcome("source_misconfigured"),
    AttemptOutcome("request_rejected"),
    AttemptOutcome("cancelled"),
)
_TTLS = (0.5, 2.0, 8.0)


def _walk_machine(env: BackendEnv, loop: asyncio.AbstractEventLoop) -> type[RuleBasedStateMachine]:
    """A state machine class driving ``env``'s backend on ``loop`` from hypothesis' thread."""

    def run(coro: Coroutine[Any, Any, R]) -> R:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=10)

    clock: FakeClock = env.clock

    class BackendWalk(RuleBasedStateMachine):
        """Random acquire / release / renew / clock steps against a model of live leases."""

        def __init__(self) -> None:
            super().__init__()
            self.scope = f"walk-{uuid.uuid4().hex}"
            self.expiry: dict[str, float] = {}
            self.leases: dict[str, Lease] = {}
            self.longest_ttl = max(_TTLS)

        def _live(self, source: str) -> int:
            now = clock()
            return sum(
                1
                for lease_id, exp in self.expiry.items()
                if exp > now and self.leases[lease_id].source == source
            )

        @rule(
            order=st.permutations(_WALK_SPECS),
            ttl=st.sampled_from(_TTLS),
            cost=st.integers(0, 3),
        )
        def acquire(self, order: Sequence[SourceSpec], ttl: float, cost: int) -> None:
            before = run(env.backend.snapshot(self.scope))
            result = run(env.backend.acquire(self.scope, order, cost_tokens=cost, ttl_s=ttl))
            if result.lease is None:
                assert len(result.rejections) == len(order)
                return
            lease = result.lease
            assert lease.scope == self.scope
            assert lease.lease_id not in self.leases
            previous = before.source(lease.source)
            if previous is not None:
                # The grant respected the limit as it stood when it was made.
                assert previous.in_flight < max(1, min(_MAX_CAP[lease.source], int(previous.limit)))
            self.leases[lease.lease_id] = lease
            self.expiry[lease.lease_id] = clock() + ttl

        @precondition(lambda self: bool(self.leases))
        @rule(data=st.data(), outcome=st.sampled_from(_OUTCOMES))
        def release(self, data: st.DataObject, outcome: AttemptOutcome) -> None:
            # Insertion order, not sorted ids: ids are opaque and their order differs by backend.
            lease_id = data.draw(st.sampled_from(list(self.leases)))
            lease = self.leases.pop(lease_id)
            self.expiry.pop(lease_id)
            run(env.backend.release(lease, outcome))

        @precondition(lambda self: bool(self.leases))
        @rule(data=st.data())
        def renew(self, data: st.DataObject) -> None:
            lease_id = data.draw(st.sampled_from(list(self.leases)))
            lease = self.leases[lease_id]
            live = self.expiry[lease_id] > clock()
            assert run(env.backend.renew(lease)) is live
            if live:
                self.expiry[lease_id] = clock() + lease.ttl_s

        @rule(dt=st.sampled_from((0.1, 0.5, 1.0, 2.5, 6.0)))
        def advance(self, dt: float) -> None:
            clock.advance(dt)

        @invariant()
        def in_flight_matches_the_model_and_the_limits(self) -> None:
            snap = run(env.backend.snapshot(self.scope))
            for spec in _WALK_SPECS:
                s = snap.source(spec.name)
                count = 0 if s is None else s.in_flight
                assert 0 <= count <= spec.max_concurrency
                assert count == self._live(spec.name)
                if s is not None:
                    assert 1.0 <= s.limit <= spec.max_concurrency

        def teardown(self) -> None:
            clock.advance(self.longest_ttl + 0.1)
            snap = run(env.backend.snapshot(self.scope))
            assert snap.in_flight == 0

    return BackendWalk


async def test_random_walk_keeps_permits_consistent(backend_env: BackendEnv) -> None:
    """Random operations never exceed a limit, never go negative, and leak no permit."""
    loop = asyncio.get_running_loop()
    machine = _walk_machine(backend_env, loop)
    walk_settings = settings(
        max_examples=100,
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    await asyncio.to_thread(run_state_machine_as_test, machine, settings=walk_settings)


# --- sweeps larger than one chunk --------------------------------------------------------------

# The Redis scripts drop expired leases 1000 at a time (Lua's unpack has a stack limit);
# one more than that puts a lease in a second chunk, where an off-by-one would miss it.
_MANY = 1001


async def _expired_crowd(env: BackendEnv, name: str) -> list[Lease]:
    """``_MANY`` leases of one source, each expiring a little after the one before, all expired."""
    crowd = SourceSpec(name=name, max_concurrency=_MANY)
    leases = []
    for _ in range(_MANY):
        leases.append(await _grant(env, crowd, ttl=5.0))
        env.clock.advance(0.001)
    env.clock.advance(10.0)
    return leases


async def test_an_acquire_drops_more_than_a_chunk_of_expired_leases(
    backend_env: BackendEnv,
) -> None:
    """After 1001 leases expired, none still counts against a limit of one permit."""
    await _expired_crowd(backend_env, "crowd")
    assert (await _acquire(backend_env, SourceSpec(name="crowd", max_concurrency=1))).lease


@pytest.mark.parametrize("index", [999, 1000])
async def test_a_renewal_drops_more_than_a_chunk_of_expired_leases(
    backend_env: BackendEnv, index: int
) -> None:
    """Any of 1001 expired leases, renewed first, is dead: the sweep reached every chunk."""
    leases = await _expired_crowd(backend_env, "crowd")
    assert await backend_env.backend.renew(leases[index]) is False


async def test_an_acquire_over_nine_busy_sources_refuses_each_once(
    backend_env: BackendEnv,
) -> None:
    """Nine candidates, all at their limit: nine rejections, in order, and no lease."""
    specs = [SourceSpec(name=f"s{i}", max_concurrency=1) for i in range(9)]
    for spec in specs:
        await _grant(backend_env, spec)
    result = await _acquire(backend_env, *specs)
    assert result.lease is None
    assert [(r.source, r.reason) for r in result.rejections] == [
        (spec.name, "concurrency") for spec in specs
    ]


# --- edges the Lua scripts' mutants found (research-wiki/MUTATION.md) ----------------------------


async def test_a_release_exactly_at_its_lease_expiry_records_nothing(
    backend_env: BackendEnv,
) -> None:
    """A lease is dead at its expiry: a failure released at that instant does not count."""
    env = backend_env
    one_strike = SourceSpec(name="strict", max_concurrency=2, breaker_failures=1)
    lease = await _grant(env, one_strike, ttl=30.0)
    env.clock.advance(30.0)
    await env.backend.release(lease, TRANSIENT)
    state = await _source(env, "strict")
    assert (state.breaker, state.consecutive_failures) == ("closed", 0)


async def test_a_refund_never_lifts_the_tpm_bucket_above_its_capacity(
    backend_env: BackendEnv,
) -> None:
    """A reservation refunded after the bucket refilled stops at the burst, not at the rate."""
    env = backend_env
    spec = SourceSpec(name="t", max_concurrency=4, tpm=6000.0, tpm_burst=100.0)
    lease = await _grant(env, spec, cost=50)
    env.clock.advance(60.0)
    await _grant(env, spec, cost=0)  # refills the bucket to its burst
    await env.backend.release(lease, AttemptOutcome("success", tokens_used=0))
    assert (await _source(env, "t")).tpm_tokens == pytest.approx(100.0)


async def test_usage_released_while_tpm_is_off_is_not_reconciled(
    backend_env: BackendEnv,
) -> None:
    """tpm dropped from the spec: a release's usage leaves the old bucket as it was."""
    env = backend_env
    with_tpm = SourceSpec(name="t", max_concurrency=4, tpm=6000.0, tpm_burst=100.0)
    without = SourceSpec(name="t", max_concurrency=4)
    lease = await _grant(env, with_tpm, cost=40)
    await _grant(env, without)
    await env.backend.release(lease, AttemptOutcome("success", tokens_used=0))
    assert (await _source(env, "t")).in_flight == 1
    assert await env.backend.progress_age_s(SCOPE) == 0.0  # the release ran to its end
    await _grant(env, with_tpm, cost=0)
    assert (await _source(env, "t")).tpm_tokens == pytest.approx(60.0)


async def test_another_leases_release_leaves_the_half_open_probe_held(
    backend_env: BackendEnv,
) -> None:
    """While the breaker's probe runs, a sibling lease released as cancelled frees nothing."""
    env = backend_env
    sibling = await _grant(env, FLAKY)
    await _trip(env)
    env.clock.advance(FLAKY.cooldown_s)
    probe = await _acquire(env, FLAKY)
    assert probe.lease is not None
    assert probe.lease.probe
    await env.backend.release(sibling, CANCELLED)
    assert (await _refused(env, FLAKY)).reason == "probe_in_flight"


async def test_the_half_open_probe_slot_follows_its_renewals(backend_env: BackendEnv) -> None:
    """A renewed half-open probe keeps its slot past its first expiry, until the renewed one.

    The source has reopened from a pause once before, so the pause's probe slot is empty.
    """
    env = backend_env
    paced = AttemptOutcome("rate_limited", retry_after_s=1)
    await env.backend.release(await _grant(env, FLAKY), paced)
    env.clock.advance(1)
    await env.backend.release(await _grant(env, FLAKY), SUCCESS)
    await _trip(env)
    env.clock.advance(FLAKY.cooldown_s)
    probe = await _grant(env, FLAKY, ttl=5.0)
    assert probe.probe
    env.clock.advance(4.0)
    assert await env.backend.renew(probe)
    env.clock.advance(4.0)
    assert (await _refused(env, FLAKY)).reason == "probe_in_flight"


async def test_a_renewed_probe_of_a_source_never_paused_keeps_its_slot(
    backend_env: BackendEnv,
) -> None:
    """The half-open probe's renewal holds its slot on a source that was never paused either.

    Such a source has no pause probe at all (not even an empty one): the renewal
    must look at the breaker's probe alone.
    """
    env = backend_env
    await _trip(env)
    env.clock.advance(FLAKY.cooldown_s)
    probe = await _grant(env, FLAKY, ttl=5.0)
    assert probe.probe
    env.clock.advance(4.0)
    assert await env.backend.renew(probe)
    env.clock.advance(4.0)
    assert (await _refused(env, FLAKY)).reason == "probe_in_flight"
