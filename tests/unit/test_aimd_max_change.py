"""A changed ``max_concurrency``: the AIMD limit is brought inside the new bounds at once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polygateway.backends.base import SourceSpec
from polygateway.governance import aimd, source_state
from polygateway.governance.aimd import Aimd
from polygateway.governance.source_state import Admission, Refusal

T0 = 1000.0


def test_a_lowered_max_brings_the_limit_down_to_it() -> None:
    """A limit above the new max becomes exactly that max, as a float."""
    a = Aimd(limit=8.0)
    aimd.on_max_change(a, 2)
    assert a.limit == 2.0
    assert isinstance(a.limit, float)


def test_a_limit_inside_the_new_bounds_is_left_where_it_is() -> None:
    """A limit at or below the new max stays: a raised max is grown into by successes."""
    a = Aimd(limit=5.6, last_decrease=T0)
    aimd.on_max_change(a, 6)
    assert (a.limit, a.last_decrease) == (5.6, T0)
    aimd.on_max_change(a, 40)
    assert a.limit == 5.6
    b = Aimd(limit=3.0)
    aimd.on_max_change(b, 3)
    assert b.limit == 3.0


def test_a_clamp_is_no_decrease_and_starts_no_cooloff() -> None:
    """Lowering the max is configuration, not an overload signal: the next 429 still decreases."""
    a = Aimd(limit=8.0)
    aimd.on_max_change(a, 2)
    assert aimd.on_overload(a, T0)
    assert a.limit == pytest.approx(1.4)


def test_new_limits_caps_admission_and_the_next_decrease_at_the_new_max() -> None:
    """``source_state.new_limits`` with max 8 -> 2: two permits, and a 429 leaves one."""
    wide = SourceSpec(name="a", max_concurrency=8)
    narrow = SourceSpec(name="a", max_concurrency=2)
    state = source_state.new_source_state(wide, T0)
    source_state.new_limits(state, narrow)
    assert state.aimd.limit == 2.0
    for i in range(2):
        assert isinstance(source_state.admit(state, narrow, T0, 0), Admission)
        source_state.commit(state, narrow, str(i), T0, ttl_s=60, cost_tokens=0, probe=False)
    assert source_state.admit(state, narrow, T0, 0) == Refusal("concurrency")
    assert source_state.apply_outcome(state, narrow, "0", T0, "rate_limited", retry_after_s=0)
    assert state.aimd.limit == pytest.approx(1.4)
    assert aimd.concurrency_cap(state.aimd, narrow.max_concurrency) == 1


@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(("success", "overload", "max")),
            st.integers(min_value=1, max_value=64),
            st.floats(min_value=0, max_value=5, allow_nan=False),
        ),
        max_size=200,
    ),
)
def test_limit_never_leaves_one_to_the_current_max(steps: list[tuple[str, int, float]]) -> None:
    """Successes, overloads and changes of the max in any order keep ``1 <= limit <= max``."""
    max_concurrency = 8
    a = Aimd(limit=float(max_concurrency))
    now = T0
    for step, new_max, dt in steps:
        now += dt
        if step == "success":
            aimd.on_success(a, max_concurrency)
        elif step == "overload":
            aimd.on_overload(a, now)
        else:
            max_concurrency = new_max
            aimd.on_max_change(a, max_concurrency)
        assert 1.0 <= a.limit <= max_concurrency
