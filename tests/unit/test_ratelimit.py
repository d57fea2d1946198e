"""Token buckets for rpm and tpm: never over ``rate x t + burst``, and that much when asked."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polygateway.backends.base import SourceSpec
from polygateway.governance import ratelimit, source_state
from polygateway.governance.ratelimit import TokenBucket
from polygateway.governance.source_state import Admission, Refusal, SourceState

T0 = 1000.0


def _try(bucket: TokenBucket, rate: float, cap: float, now: float, need: float = 1) -> bool:
    ratelimit.refill(bucket, rate, cap, now)
    if ratelimit.wait_for(bucket, min(need, cap), rate) is not None:
        return False
    ratelimit.take(bucket, need)
    return True


def test_new_bucket_is_full() -> None:
    """A bucket starts with its whole burst available."""
    assert ratelimit.new_bucket(10, T0) == TokenBucket(tokens=10, at=T0)


def test_refill_is_continuous_and_capped() -> None:
    """Tokens come back at ``rate / 60`` per second, never above the capacity."""
    b = TokenBucket(tokens=0, at=T0)
    ratelimit.refill(b, 60, 5, T0 + 2.5)
    assert b.tokens == pytest.approx(2.5)
    assert b.at == T0 + 2.5
    ratelimit.refill(b, 60, 5, T0 + 100)
    assert b.tokens == 5


def test_wait_for_says_when_enough_tokens_return() -> None:
    """The reopen time is the shortfall divided by the refill rate."""
    b = TokenBucket(tokens=0.25, at=T0)
    assert ratelimit.wait_for(b, 1, 120) == pytest.approx(0.375)
    assert ratelimit.wait_for(TokenBucket(tokens=1, at=T0), 1, 120) is None


def test_burst_then_steady_rate_is_admitted() -> None:
    """A full bucket admits its burst at once, then exactly one request per 1/rate."""
    b = ratelimit.new_bucket(3, T0)
    assert [_try(b, 60, 3, T0) for _ in range(4)] == [True, True, True, False]
    assert not _try(b, 60, 3, T0 + 0.999)
    assert _try(b, 60, 3, T0 + 1.0)
    assert not _try(b, 60, 3, T0 + 1.0)


def test_oversized_request_admitted_when_full_then_pays_debt() -> None:
    """A request larger than the bucket goes through on a full bucket and blocks until repaid."""
    b = ratelimit.new_bucket(100, T0)
    assert _try(b, 6000, 100, T0, need=250)
    assert b.tokens == -150
    assert not _try(b, 6000, 100, T0 + 1.0, need=10)
    assert _try(b, 6000, 100, T0 + 1.6, need=10)


def test_reconcile_refunds_and_charges() -> None:
    """Real usage replaces the reservation: unused tokens come back (capped), overuse is debt."""
    b = TokenBucket(tokens=10, at=T0)
    ratelimit.reconcile(b, reserved=50, used=20, capacity=100)
    assert b.tokens == 40
    ratelimit.reconcile(b, reserved=10, used=70, capacity=100)
    assert b.tokens == -20
    ratelimit.reconcile(b, reserved=500, used=0, capacity=100)
    assert b.tokens == 100


@given(
    rpm=st.integers(min_value=1, max_value=6000),
    burst=st.integers(min_value=1, max_value=20),
    gaps=st.lists(st.floats(min_value=0, max_value=3, allow_nan=False), min_size=1, max_size=150),
)
def test_admissions_never_exceed_rate_times_interval_plus_burst(
    rpm: int, burst: int, gaps: list[float]
) -> None:
    """For every interval between two arrivals, admissions <= rpm/60 * t + burst."""
    b = ratelimit.new_bucket(burst, T0)
    now = T0
    admitted: list[float] = []
    for gap in gaps:
        now += gap
        if _try(b, rpm, burst, now):
            admitted.append(now)
    for i, start in enumerate(admitted):
        for j in range(i, len(admitted)):
            t = admitted[j] - start
            assert j - i + 1 <= rpm / 60 * t + burst + 1e-6


@given(
    rpm=st.integers(min_value=1, max_value=600),
    burst=st.integers(min_value=1, max_value=10),
    seconds=st.integers(min_value=1, max_value=120),
)
def test_admits_the_full_allowance_when_asked(rpm: int, burst: int, seconds: int) -> None:
    """A caller asking as often as allowed gets ``burst`` plus one per 60/rpm seconds."""
    b = ratelimit.new_bucket(burst, T0)
    interval = 60 / rpm
    granted = sum(_try(b, rpm, burst, T0) for _ in range(burst + 1))
    assert granted == burst
    steps = int(seconds / interval)
    for k in range(1, steps + 1):
        # Ask a hair after each token is due, so float rounding cannot refuse it.
        granted += _try(b, rpm, burst, T0 + k * interval * (1 + 1e-9))
    assert granted == burst + steps


SPEC = SourceSpec(name="a", max_concurrency=100, rpm=60, rpm_burst=2, tpm=600, tpm_burst=100)


def _grant(state: SourceState, lease_id: str, now: float, cost: int) -> Admission | Refusal:
    verdict = source_state.admit(state, SPEC, now, cost)
    if isinstance(verdict, Admission):
        source_state.commit(state, SPEC, lease_id, now, ttl_s=60, cost_tokens=cost, probe=False)
    return verdict


def test_rpm_refusal_says_when_the_next_token_is_due() -> None:
    """After the burst, the rpm refusal's reopen time is the time to the next whole token."""
    state = source_state.new_source_state(SPEC, T0)
    assert isinstance(_grant(state, "1", T0, 0), Admission)
    assert isinstance(_grant(state, "2", T0 + 0.5, 0), Admission)
    refusal = _grant(state, "3", T0 + 0.5, 0)
    assert isinstance(refusal, Refusal)
    assert refusal.reason == "rpm"
    assert refusal.reopen_in_s == pytest.approx(0.5)


def test_tpm_reserves_the_estimate_and_reconciles_with_usage() -> None:
    """tpm takes the estimate at acquire; release with real usage refunds the difference."""
    state = source_state.new_source_state(SPEC, T0)
    assert isinstance(_grant(state, "1", T0, 80), Admission)
    refusal = _grant(state, "2", T0, 50)
    assert isinstance(refusal, Refusal)
    assert refusal.reason == "tpm"
    assert refusal.reopen_in_s == pytest.approx((50 - 20) * 60 / 600)
    source_state.apply_outcome(state, SPEC, "1", T0, "success", tokens_used=30)
    assert state.tpm is not None
    assert state.tpm.tokens == pytest.approx(70)
    assert isinstance(_grant(state, "2", T0, 50), Admission)


def test_tpm_reconciles_whatever_the_outcome() -> None:
    """A failed attempt that reports usage is reconciled too."""
    state = source_state.new_source_state(SPEC, T0)
    _grant(state, "1", T0, 80)
    source_state.apply_outcome(state, SPEC, "1", T0, "transient", tokens_used=0)
    assert state.tpm is not None
    assert state.tpm.tokens == 100


def test_refill_is_stored_even_when_refused() -> None:
    """A refusal still brings the bucket up to date (``at`` moves to now)."""
    state = source_state.new_source_state(SPEC, T0)
    _grant(state, "1", T0, 100)
    _grant(state, "2", T0 + 1, 100)
    assert state.tpm is not None
    assert state.tpm.at == T0 + 1
    assert state.tpm.tokens == pytest.approx(10)


@given(
    tokens=st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    elapsed=st.floats(min_value=0.0, max_value=1e5, allow_nan=False),
    rate=st.floats(min_value=1e-3, max_value=1e7, allow_nan=False),
    cap=st.floats(min_value=1.0, max_value=1e6, allow_nan=False),
)
def test_refilled_tokens_is_the_spec_expression_bit_for_bit(
    tokens: float, elapsed: float, rate: float, cap: float
) -> None:
    """Refill is ``min(cap, tokens + (now - at) * rate / 60)``, the float the Lua twin computes."""
    bucket = TokenBucket(tokens=tokens, at=T0)
    now = T0 + elapsed
    expected = min(cap, tokens + (now - T0) * rate / 60)
    assert ratelimit.refilled_tokens(bucket, rate, cap, now) == expected
