"""The breaker: trips, doubling cool-downs, one half-open probe that can never wedge."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polygateway.backends.base import SourceSpec
from polygateway.governance import breaker, source_state
from polygateway.governance.breaker import Breaker, cooldown_for
from polygateway.governance.source_state import Admission, Refusal, SourceState

SPEC = SourceSpec(name="a", max_concurrency=4, breaker_failures=3, cooldown_s=10, cooldown_max_s=60)
T0 = 1000.0


def _fail(b: Breaker, now: float, lease_id: str = "x") -> None:
    breaker.on_failure(b, lease_id, now, threshold=3, cooldown_s=10, cooldown_max_s=60)


def _tripped_state(now: float = T0) -> SourceState:
    """A source whose breaker has just tripped once (cool-down 10 s)."""
    state = source_state.new_source_state(SPEC, now)
    for i in range(3):
        verdict = source_state.admit(state, SPEC, now, 0)
        assert isinstance(verdict, Admission)
        source_state.commit(state, SPEC, f"f{i}", now, ttl_s=30, cost_tokens=0, probe=False)
        assert source_state.apply_outcome(state, SPEC, f"f{i}", now, "transient")
    assert state.breaker.state == "open"
    return state


def _acquire(state: SourceState, lease_id: str, now: float, ttl_s: float = 30) -> Admission:
    verdict = source_state.admit(state, SPEC, now, 0)
    assert isinstance(verdict, Admission), verdict
    source_state.commit(state, SPEC, lease_id, now, ttl_s=ttl_s, cost_tokens=0, probe=verdict.probe)
    return verdict


def test_trips_after_threshold_consecutive_failures() -> None:
    """``breaker_failures`` consecutive transient failures open the breaker, not one fewer."""
    b = Breaker()
    _fail(b, T0)
    _fail(b, T0)
    assert b.state == "closed"
    assert b.failures == 2
    _fail(b, T0)
    assert b.state == "open"
    assert b.open_until == T0 + 10
    assert b.failures == 0
    assert b.trips == 1


def test_success_resets_consecutive_failures() -> None:
    """A success in between means the failures were not consecutive."""
    b = Breaker()
    _fail(b, T0)
    _fail(b, T0)
    breaker.on_success(b)
    _fail(b, T0)
    _fail(b, T0)
    assert b.state == "closed"


def test_open_rejects_with_time_left_then_becomes_half_open() -> None:
    """During the cool-down admission says how long is left; after it, half-open admits a probe."""
    b = Breaker()
    breaker.trip(b, T0, 10, 60)
    early = breaker.admit(b, T0 + 4)
    assert early.reason == "breaker_open"
    assert early.reopen_in_s == pytest.approx(6.0)
    assert b.state == "open"
    late = breaker.admit(b, T0 + 10)
    assert late.reason is None
    assert late.probe is True
    assert b.state == "half_open"


def test_cooldown_doubles_per_consecutive_trip_and_caps() -> None:
    """Cool-downs run 10, 20, 40, then the 60 s cap, and stay capped."""
    assert [cooldown_for(n, 10, 60) for n in range(1, 7)] == [10, 20, 40, 60, 60, 60]
    assert cooldown_for(5000, 10, 60) == 60


def test_probe_failure_reopens_with_doubled_cooldown() -> None:
    """A failing half-open probe trips again, for twice the previous cool-down."""
    state = _tripped_state()
    now = T0 + 10
    _acquire(state, "probe", now)
    source_state.apply_outcome(state, SPEC, "probe", now, "transient")
    assert state.breaker.state == "open"
    assert state.breaker.trips == 2
    assert state.breaker.open_until == now + 20


def test_probe_success_closes_and_forgets_trips() -> None:
    """A successful probe closes the breaker; the next trip starts from the base cool-down."""
    state = _tripped_state()
    _acquire(state, "probe", T0 + 10)
    source_state.apply_outcome(state, SPEC, "probe", T0 + 11, "success")
    assert state.breaker.state == "closed"
    assert state.breaker.trips == 0
    assert state.breaker.probe_id == ""


def test_half_open_admits_exactly_one_probe() -> None:
    """While the probe is in flight every other acquire is refused with ``probe_in_flight``."""
    state = _tripped_state()
    now = T0 + 10
    first = _acquire(state, "probe", now)
    assert first.probe is True
    for _ in range(5):
        again = source_state.admit(state, SPEC, now + 1, 0)
        assert again == Refusal("probe_in_flight", None)


def test_cancelled_probe_leaves_half_open_with_slot_free() -> None:
    """A cancelled probe neither closes nor reopens; the next acquire becomes the probe."""
    state = _tripped_state()
    now = T0 + 10
    _acquire(state, "probe", now)
    assert source_state.apply_outcome(state, SPEC, "probe", now + 1, "cancelled")
    assert state.breaker.state == "half_open"
    assert state.breaker.probe_id == ""
    assert _acquire(state, "probe2", now + 1).probe is True


@pytest.mark.parametrize("kind", ["rate_limited", "request_rejected"])
def test_probe_that_proves_nothing_frees_slot(kind: source_state.OutcomeKind) -> None:
    """A 429 or a rejected request from the probe proves nothing: slot freed, still half-open."""
    state = _tripped_state()
    _acquire(state, "probe", T0 + 10)
    source_state.apply_outcome(state, SPEC, "probe", T0 + 10, kind)
    assert state.breaker.state == "half_open"
    assert state.breaker.probe_id == ""


def test_probe_lease_expiry_frees_slot() -> None:
    """A probe whose holder vanished stops blocking once its lease expires: no wedge."""
    state = _tripped_state()
    now = T0 + 10
    _acquire(state, "probe", now, ttl_s=5)
    assert source_state.admit(state, SPEC, now + 4.9, 0) == Refusal("probe_in_flight")
    late = source_state.admit(state, SPEC, now + 5, 0)
    assert late == Admission(probe=True)
    # The dead probe's release arrives late: ignored, it changes nothing.
    assert not source_state.apply_outcome(state, SPEC, "probe", now + 6, "transient")
    assert state.breaker.state == "half_open"


def test_renewed_probe_keeps_its_slot() -> None:
    """A probe that renews its lease (a long stream) keeps the slot past its first TTL."""
    state = _tripped_state()
    now = T0 + 10
    _acquire(state, "probe", now, ttl_s=5)
    assert source_state.renew(state, "probe", now + 4)
    assert source_state.admit(state, SPEC, now + 8, 0) == Refusal("probe_in_flight")
    assert source_state.admit(state, SPEC, now + 9, 0) == Admission(probe=True)


def test_non_probe_failure_while_half_open_changes_nothing() -> None:
    """A failure of a lease granted before the trip does not reopen a half-open breaker."""
    state = source_state.new_source_state(SPEC, T0)
    _acquire(state, "old", T0, ttl_s=100)
    for i in range(3):
        _acquire(state, f"f{i}", T0)
        source_state.apply_outcome(state, SPEC, f"f{i}", T0, "transient")
    _acquire(state, "probe", T0 + 10)
    source_state.apply_outcome(state, SPEC, "old", T0 + 11, "transient")
    assert state.breaker.state == "half_open"
    assert state.breaker.probe_id == "probe"


def test_failures_while_open_are_ignored() -> None:
    """Failures of leases still in flight when the breaker opened neither count nor extend it."""
    b = Breaker()
    breaker.trip(b, T0, 10, 60)
    _fail(b, T0 + 1)
    assert b.open_until == T0 + 10
    assert b.failures == 0
    assert b.trips == 1


def test_source_misconfigured_trips_long() -> None:
    """A 401/403/404 opens the breaker for ``cooldown_max_s`` at once, from any state."""
    state = source_state.new_source_state(SPEC, T0)
    _acquire(state, "bad", T0)
    source_state.apply_outcome(state, SPEC, "bad", T0 + 1, "source_misconfigured")
    assert state.breaker.state == "open"
    assert state.breaker.open_until == T0 + 1 + 60
    refusal = source_state.admit(state, SPEC, T0 + 2, 0)
    assert isinstance(refusal, Refusal)
    assert refusal.reason == "breaker_open"
    assert refusal.reopen_in_s == pytest.approx(59.0)


def test_effective_state_reports_half_open_after_cooldown_without_mutating() -> None:
    """Snapshots see half-open once the cool-down passed, yet the stored state is untouched."""
    b = Breaker()
    breaker.trip(b, T0, 10, 60)
    assert breaker.effective_state(b, T0 + 9) == "open"
    assert breaker.effective_state(b, T0 + 10) == "half_open"
    assert b.state == "open"


@given(st.lists(st.sampled_from(["fail", "ok", "wait", "probe"]), max_size=60))
def test_breaker_state_stays_consistent(ops: list[str]) -> None:
    """Under any sequence, an open breaker has a cool-down within the cap and no probe holder."""
    b = Breaker()
    now = T0
    for op in ops:
        if op == "fail":
            _fail(b, now, lease_id=b.probe_id or "x")
        elif op == "ok":
            breaker.on_success(b)
        elif op == "wait":
            now += 7
        elif breaker.admit(b, now).probe:
            breaker.claim_probe(b, "p", now + 5)
        if b.state == "open":
            assert b.probe_id == ""
            assert 0 < b.open_until - now <= 60 or now >= b.open_until
        assert b.failures < 3
