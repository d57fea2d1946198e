"""Edges of the pure policies that mutation testing found unpinned (research-wiki/MUTATION.md).

Each test holds one boundary of governance/ (a comparison at equality, a
counter that must add, a slot that must be empty after it is freed) that the
rest of the suite passed through without looking at.
"""

from __future__ import annotations

import random

import pytest

from polygateway.governance import aimd, breaker, ratelimit, source_state
from polygateway.governance.aimd import Aimd
from polygateway.governance.breaker import Breaker
from polygateway.governance.ratelimit import TokenBucket
from polygateway.governance.selection import SelectionOrder, order_candidates
from polygateway.governance.source_state import Admission, OutcomeKind, Refusal, SourceState


class _Limits:
    """Plain limits for one source (what ``SourceSpec`` exposes)."""

    def __init__(
        self,
        *,
        max_concurrency: int = 4,
        rpm: float | None = None,
        rpm_capacity: float = 1.0,
        tpm: float | None = None,
        tpm_capacity: float = 100.0,
        breaker_failures: int = 2,
        cooldown_s: float = 10.0,
        cooldown_max_s: float = 60.0,
    ) -> None:
        self.max_concurrency = max_concurrency
        self.rpm = rpm
        self.rpm_capacity = rpm_capacity
        self.tpm = tpm
        self.tpm_capacity = tpm_capacity
        self.breaker_failures = breaker_failures
        self.cooldown_s = cooldown_s
        self.cooldown_max_s = cooldown_max_s


def _grant(state: SourceState, limits: _Limits, lease_id: str, now: float, cost: int = 0) -> None:
    verdict = source_state.admit(state, limits, now, cost)
    assert isinstance(verdict, Admission), verdict
    source_state.commit(
        state,
        limits,
        lease_id,
        now,
        ttl_s=30.0,
        cost_tokens=cost,
        probe=verdict.probe,
        pace_probe=verdict.pace_probe,
    )


# --- aimd -----------------------------------------------------------------------------


def test_concurrency_cap_is_the_max_when_the_limit_sits_exactly_on_it() -> None:
    """A limit equal to the max caps at the max (not one below, not above)."""
    assert aimd.concurrency_cap(Aimd(limit=4.0), 4) == 4
    assert aimd.concurrency_cap(Aimd(limit=4.9), 4) == 4


def test_concurrency_cap_of_a_limit_of_exactly_one_is_one() -> None:
    """floor(1.0) = 1 is its own cap; a limit between 1 and 2 caps at 1 too."""
    assert aimd.concurrency_cap(Aimd(limit=1.0), 8) == 1
    assert aimd.concurrency_cap(Aimd(limit=1.99), 8) == 1
    assert aimd.concurrency_cap(Aimd(limit=2.0), 8) == 2


def test_concurrency_cap_never_drops_below_one() -> None:
    """A limit below 1 (never stored, but guarded) still admits one permit."""
    assert aimd.concurrency_cap(Aimd(limit=0.5), 8) == 1


# --- token buckets ----------------------------------------------------------------------


def test_refill_to_exactly_the_capacity_is_the_capacity() -> None:
    """A bucket refilled to exactly its capacity holds the capacity."""
    bucket = TokenBucket(tokens=0.0, at=0.0)
    assert ratelimit.refilled_tokens(bucket, 60.0, 5.0, 5.0) == 5.0
    assert ratelimit.refilled_tokens(bucket, 60.0, 5.0, 4.0) == 4.0
    assert ratelimit.refilled_tokens(bucket, 60.0, 5.0, 9.0) == 5.0


# --- breaker ----------------------------------------------------------------------------


def test_a_freed_probe_slot_is_empty_and_admits_the_next_probe_at_time_zero() -> None:
    """free_probe clears both the id and the expiry, so the next acquire is the probe."""
    b = Breaker(state="half_open")
    breaker.claim_probe(b, "p1", 30.0)
    breaker.free_probe(b, "p1")
    assert (b.probe_id, b.probe_until) == ("", 0.0)
    # Even at time 0 (before any expiry) a claimed-then-freed slot admits the next probe.
    b.probe_id = "p2"
    breaker.free_probe(b)
    assert breaker.admit(b, 0.5).probe


def test_an_empty_probe_id_never_holds_the_slot() -> None:
    """A lease id of "" is no probe: an empty slot with a future expiry still admits."""
    b = Breaker(state="half_open", probe_id="", probe_until=100.0)
    assert breaker.admit(b, 1.0).probe
    assert not breaker.is_probe(b, "")
    assert breaker.is_probe(Breaker(probe_id="XXXX"), "XXXX")
    busy = Breaker(state="half_open", probe_id="XXXX", probe_until=100.0)
    assert breaker.admit(busy, 1.0).reason == "probe_in_flight"


def test_trip_long_counts_one_more_trip_and_forgets_the_failures() -> None:
    """A misconfigured source's trip adds exactly one trip and resets the failure count."""
    b = Breaker(failures=3, trips=2)
    breaker.trip_long(b, 100.0, 300.0)
    assert (b.state, b.trips, b.failures, b.open_until) == ("open", 3, 0, 400.0)


# --- selection --------------------------------------------------------------------------


def test_a_draw_of_exactly_zero_sorts_last_in_its_tier() -> None:
    """u = 0 has no logarithm: that source sorts after every positive draw of its tier."""

    class _Rng(random.Random):
        def __init__(self, draws: list[float]) -> None:
            super().__init__(0)
            self._draws = draws

        def random(self) -> float:
            return self._draws.pop(0)

    order = order_candidates(
        ["a", "b", "c"], priority=lambda _: 0, weight=lambda _: 1.0, rng=_Rng([0.0, 0.2, 0.1])
    )
    assert order == ["b", "c", "a"]


class _Draws(random.Random):
    """An rng that returns the given draws in order."""

    def __init__(self, *draws: float) -> None:
        super().__init__(0)
        self._draws = list(draws)

    def random(self) -> float:
        return self._draws.pop(0)


def test_distinct_tiers_order_by_tier_whatever_the_draws() -> None:
    """With one source per tier the order is the tiers' order, and one draw is made per source."""
    tiers = {"late": 1, "early": 0}
    order = SelectionOrder(["late", "early"], priority=tiers.__getitem__, weight=lambda _: 1.0)
    rng = _Draws(0.9, 0.1, 0.5)
    assert order.order(rng) == ["early", "late"]
    assert rng.random() == 0.5


def test_two_sources_of_one_tier_and_weight_lead_by_their_draws() -> None:
    """The pair shortcut: the higher draw leads, and equal draws keep input order."""
    order = SelectionOrder(["a", "b"], priority=lambda _: 0, weight=lambda _: 2.0)
    assert order.order(_Draws(0.3, 0.6)) == ["b", "a"]
    assert order.order(_Draws(0.6, 0.3)) == ["a", "b"]
    assert order.order(_Draws(0.4, 0.4)) == ["a", "b"]


def test_two_sources_of_different_weights_are_keyed_by_weight() -> None:
    """Unequal weights never take the pair shortcut: u**(1/w) decides, not the raw draw."""
    weights = {"a": 1.0, "b": 9.0}
    order = SelectionOrder(["a", "b"], priority=lambda _: 0, weight=weights.__getitem__)
    # a: log(0.5)/1 = -0.69; b: log(0.2)/9 = -0.18: b leads though its draw is lower.
    assert order.order(_Draws(0.5, 0.2)) == ["b", "a"]


def test_two_sources_of_different_tiers_and_equal_weights_keep_tier_order() -> None:
    """Two sources in two tiers are ordered by tier even when their weights match."""
    tiers = {"a": 1, "b": 0}
    order = SelectionOrder(["a", "b"], priority=tiers.__getitem__, weight=lambda _: 1.0)
    assert order.order(_Draws(0.9, 0.1)) == ["b", "a"]


def test_two_sources_of_weight_zero_keep_input_order_whatever_the_draws() -> None:
    """A non-positive weight sorts last: two of them tie and keep their input order."""
    order = SelectionOrder(["a", "b"], priority=lambda _: 0, weight=lambda _: 0.0)
    assert order.order(_Draws(0.1, 0.9)) == ["a", "b"]


def test_a_pair_in_one_tier_with_a_third_source_in_another_is_keyed() -> None:
    """Three sources, two sharing a tier: the shared tier is ordered by weighted draws."""
    tiers = {"a": 0, "b": 0, "c": 1}
    weights = {"a": 1.0, "b": 1.0, "c": 1.0}
    order = SelectionOrder(["a", "b", "c"], priority=tiers.__getitem__, weight=weights.get)
    assert order.order(_Draws(0.2, 0.7, 0.9)) == ["b", "a", "c"]


# --- source_state -------------------------------------------------------------------------


def test_a_new_source_with_rpm_and_tpm_starts_with_full_buckets() -> None:
    """First sight fills both buckets to their capacity, stamped with the current time."""
    limits = _Limits(rpm=60.0, rpm_capacity=3.0, tpm=600.0, tpm_capacity=50.0)
    state = source_state.new_source_state(limits, 7.0)
    assert state.rpm == TokenBucket(tokens=3.0, at=7.0)
    assert state.tpm == TokenBucket(tokens=50.0, at=7.0)
    assert source_state.new_source_state(_Limits(), 7.0).tpm is None


def test_tpm_added_to_the_config_later_starts_a_full_bucket() -> None:
    """A source first seen without tpm gets a full tpm bucket when tpm appears."""
    state = source_state.new_source_state(_Limits(), 0.0)
    limits = _Limits(tpm=60.0, tpm_capacity=100.0)
    assert isinstance(source_state.admit(state, limits, 5.0, 100), Admission)
    assert state.tpm == TokenBucket(tokens=100.0, at=5.0)


def test_a_lapsed_pause_and_half_open_breaker_admit_both_probes() -> None:
    """After a failure's pause on a half-open breaker, the one acquire is both probes."""
    limits = _Limits(breaker_failures=1)
    state = source_state.new_source_state(limits, 0.0)
    _grant(state, limits, "a", 0.0)
    source_state.apply_outcome(state, limits, "a", 0.0, "transient", retry_after_s=5.0)
    verdict = source_state.admit(state, limits, 20.0, 0)
    assert verdict == Admission(probe=True, pace_probe=True)


def test_release_defaults_to_no_aimd_decrease() -> None:
    """A transient failure released without aimd_decrease leaves the limit alone."""
    limits = _Limits(max_concurrency=4, breaker_failures=10)
    state = source_state.new_source_state(limits, 0.0)
    _grant(state, limits, "a", 0.0)
    source_state.apply_outcome(state, limits, "a", 1.0, "transient")
    assert state.aimd.limit == 4.0


@pytest.mark.parametrize("kind", ["rate_limited", "request_rejected", "cancelled"])
def test_a_non_probe_release_leaves_the_probe_slot_to_its_holder(kind: OutcomeKind) -> None:
    """Only the probe's own release frees the half-open slot; another lease's does not."""
    limits = _Limits(breaker_failures=1)
    state = source_state.new_source_state(limits, 0.0)
    _grant(state, limits, "other", 0.0)
    _grant(state, limits, "trip", 0.0)
    source_state.apply_outcome(state, limits, "trip", 0.0, "transient")
    _grant(state, limits, "probe", 20.0)
    assert state.breaker.probe_id == "probe"
    source_state.apply_outcome(state, limits, "other", 21.0, kind)
    assert state.breaker.probe_id == "probe"
    assert source_state.admit(state, limits, 22.0, 0) == Refusal("probe_in_flight")


@pytest.mark.parametrize("kind", ["rate_limited", "transient"])
def test_a_lapsed_pause_reopens_through_exactly_one_probe(kind: OutcomeKind) -> None:
    """Once a failure's pause lapses, one acquire is the probe and the next waits for it."""
    limits = _Limits(breaker_failures=10)
    state = source_state.new_source_state(limits, 0.0)
    _grant(state, limits, "a", 0.0)
    source_state.apply_outcome(state, limits, "a", 0.0, kind, retry_after_s=2.0)
    assert source_state.admit(state, limits, 1.0, 0) == Refusal("paced", 1.0)
    _grant(state, limits, "probe", 2.0)
    assert state.pace_probe_id == "probe"
    assert source_state.admit(state, limits, 2.5, 0) == Refusal("probe_in_flight")


def test_usage_is_reconciled_only_on_a_source_with_tpm() -> None:
    """Reported usage on a source without a tpm limit (its bucket left over) changes nothing."""
    with_tpm = _Limits(tpm=60.0, tpm_capacity=100.0)
    state = source_state.new_source_state(with_tpm, 0.0)
    _grant(state, with_tpm, "a", 0.0, cost=40)
    without = _Limits()
    source_state.apply_outcome(state, without, "a", 0.0, "success", tokens_used=0)
    assert state.tpm == TokenBucket(tokens=60.0, at=0.0)


def test_the_probe_after_a_pause_is_not_the_breakers_probe() -> None:
    """With the breaker closed, the acquire that reopens a paused source is a pace probe only."""
    limits = _Limits(breaker_failures=10)
    state = source_state.new_source_state(limits, 0.0)
    _grant(state, limits, "a", 0.0)
    source_state.apply_outcome(state, limits, "a", 0.0, "rate_limited", retry_after_s=1.0)
    assert source_state.admit(state, limits, 2.0, 0) == Admission(pace_probe=True)


def test_commit_takes_no_pace_probe_slot_unless_asked() -> None:
    """commit's default is an ordinary lease: the pause's probe slot stays empty."""
    limits = _Limits()
    state = source_state.new_source_state(limits, 0.0)
    source_state.commit(state, limits, "a", 0.0, ttl_s=30.0, cost_tokens=0, probe=False)
    assert (state.pace_probe_id, state.pace_probe_until) == ("", 0.0)


def test_leases_taken_while_a_limit_is_off_do_not_drain_its_bucket() -> None:
    """rpm and tpm dropped from the config, then restored: the old buckets were not charged."""
    limited = _Limits(rpm=6.0, rpm_capacity=2.0, tpm=60.0, tpm_capacity=20.0, max_concurrency=50)
    free = _Limits(max_concurrency=50)
    state = source_state.new_source_state(limited, 0.0)
    for n in range(5):
        _grant(state, free, f"free-{n}", 0.0, cost=10)
    assert state.rpm == TokenBucket(tokens=2.0, at=0.0)
    assert state.tpm == TokenBucket(tokens=20.0, at=0.0)
    assert isinstance(source_state.admit(state, limited, 0.0, 10), Admission)


def test_another_lease_released_leaves_the_pace_probe_slot_held() -> None:
    """Only the pace probe's own release frees its slot; a sibling lease's release does not."""
    limits = _Limits(breaker_failures=10)
    state = source_state.new_source_state(limits, 0.0)
    _grant(state, limits, "old", 0.0)
    _grant(state, limits, "hit", 0.0)
    source_state.apply_outcome(state, limits, "hit", 0.0, "rate_limited", retry_after_s=1.0)
    _grant(state, limits, "probe", 2.0)
    source_state.apply_outcome(state, limits, "old", 3.0, "cancelled")
    assert state.pace_probe_id == "probe"
    assert source_state.admit(state, limits, 3.0, 0) == Refusal("probe_in_flight")


def test_renewing_another_lease_does_not_extend_the_pace_probe_slot() -> None:
    """The slot lives as long as the probe's lease, whoever else renews meanwhile."""
    limits = _Limits(breaker_failures=10)
    state = source_state.new_source_state(limits, 0.0)
    _grant(state, limits, "other", 0.0)
    _grant(state, limits, "hit", 0.0)
    source_state.apply_outcome(state, limits, "hit", 0.0, "rate_limited", retry_after_s=1.0)
    _grant(state, limits, "probe", 2.0)  # its slot lapses with its lease, at 32
    assert source_state.renew(state, "other", 20.0)
    assert state.pace_probe_until == 32.0
    # The probe's holder died: at 33 its slot has lapsed, and one new probe is admitted.
    assert source_state.admit(state, limits, 33.0, 0) == Admission(pace_probe=True)


def test_a_snapshot_of_a_limit_whose_bucket_is_not_made_yet_shows_it_full() -> None:
    """rpm and tpm added to the config but not yet checked: the snapshot shows full buckets."""
    state = source_state.new_source_state(_Limits(), 0.0)
    limits = _Limits(rpm=60.0, rpm_capacity=3.0, tpm=600.0, tpm_capacity=50.0)
    snap = source_state.view(state, limits, 1.0, name="a")
    assert (snap.rpm_tokens, snap.tpm_tokens) == (3.0, 50.0)


def test_a_release_exactly_at_the_lease_expiry_is_a_no_op() -> None:
    """A lease is dead at expiry <= now: released at exactly its expiry, nothing is recorded."""
    limits = _Limits()
    state = source_state.new_source_state(limits, 0.0)
    _grant(state, limits, "a", 0.0)
    assert source_state.apply_outcome(state, limits, "a", 30.0, "transient") is False
    assert state.breaker.failures == 0


def test_a_weightless_source_never_leads_a_weighted_one() -> None:
    """Weights 2 and 0 in one tier: the weight-0 source is last whatever the draws."""
    weights = {"a": 2.0, "b": 0.0}
    order = SelectionOrder(["a", "b"], priority=lambda _: 0, weight=weights.__getitem__)
    assert order.order(_Draws(0.1, 0.9)) == ["a", "b"]
