"""AIMD: additive increase, multiplicative decrease once per cool-off, always inside [1, max]."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polygateway.backends.base import SourceSpec
from polygateway.governance import aimd, source_state
from polygateway.governance.aimd import AIMD_COOLOFF_S, AIMD_FACTOR, Aimd
from polygateway.governance.source_state import Admission, Refusal

T0 = 1000.0


def test_constants_are_the_documented_ones() -> None:
    """Cool-off 2 s and factor 0.7, as research-wiki/designs/governance-policies.md states."""
    assert AIMD_COOLOFF_S == 2.0
    assert AIMD_FACTOR == 0.7


def test_success_adds_one_over_limit_and_caps_at_max() -> None:
    """Each success adds ``1/limit``; the limit never passes ``max_concurrency``."""
    a = Aimd(limit=4.0)
    aimd.on_success(a, 8)
    assert a.limit == pytest.approx(4.25)
    a = Aimd(limit=7.9)
    aimd.on_success(a, 8)
    assert a.limit == 8.0


def test_decrease_multiplies_by_factor_and_floors_at_one() -> None:
    """An overload signal multiplies by 0.7, never below 1."""
    a = Aimd(limit=10.0)
    assert aimd.on_overload(a, T0)
    assert a.limit == pytest.approx(7.0)
    a = Aimd(limit=1.2)
    aimd.on_overload(a, T0)
    assert a.limit == 1.0


def test_decrease_at_most_once_per_cooloff() -> None:
    """A second signal inside the cool-off is ignored; one at exactly 2 s later applies."""
    a = Aimd(limit=10.0)
    assert aimd.on_overload(a, T0)
    assert not aimd.on_overload(a, T0 + 1.999)
    assert a.limit == pytest.approx(7.0)
    assert aimd.on_overload(a, T0 + 2.0)
    assert a.limit == pytest.approx(4.9)


def test_first_decrease_is_never_blocked() -> None:
    """A fresh limit has never decreased (``last_decrease = -inf``), whatever the clock says."""
    a = Aimd(limit=10.0)
    assert a.last_decrease == -math.inf
    assert aimd.on_overload(a, 0.0)


def test_concurrency_cap_floors_and_respects_bounds() -> None:
    """The permit count is ``floor(limit)``, at least 1, at most ``max_concurrency``."""
    assert aimd.concurrency_cap(Aimd(limit=4.99), 8) == 4
    assert aimd.concurrency_cap(Aimd(limit=1.0), 8) == 1
    assert aimd.concurrency_cap(Aimd(limit=12.0), 8) == 8


def test_burst_of_fifty_429s_lowers_limit_once() -> None:
    """50 attempts that all come back 429 at once shrink the limit by one factor, not 0.7**50."""
    spec = SourceSpec(name="a", max_concurrency=50)
    state = source_state.new_source_state(spec, T0)
    for i in range(50):
        assert isinstance(source_state.admit(state, spec, T0, 0), Admission)
        source_state.commit(state, spec, str(i), T0, ttl_s=60, cost_tokens=0, probe=False)
    for i in range(50):
        assert source_state.apply_outcome(
            state, spec, str(i), T0 + 0.5 + i * 0.01, "rate_limited", retry_after_s=0
        )
    assert state.aimd.limit == pytest.approx(35.0)


def test_lowered_limit_caps_in_flight() -> None:
    """After a decrease from 4 to 2.8, only 2 permits are granted."""
    spec = SourceSpec(name="a", max_concurrency=4)
    state = source_state.new_source_state(spec, T0)
    aimd.on_overload(state.aimd, T0)
    for i in range(2):
        assert isinstance(source_state.admit(state, spec, T0, 0), Admission)
        source_state.commit(state, spec, str(i), T0, ttl_s=60, cost_tokens=0, probe=False)
    assert source_state.admit(state, spec, T0, 0) == Refusal("concurrency")


@given(
    max_concurrency=st.integers(min_value=1, max_value=64),
    steps=st.lists(
        st.tuples(st.booleans(), st.floats(min_value=0, max_value=5, allow_nan=False)),
        max_size=200,
    ),
)
def test_limit_never_leaves_one_to_max(
    max_concurrency: int, steps: list[tuple[bool, float]]
) -> None:
    """Any mix of successes, overloads and clock steps keeps ``1 <= limit <= max_concurrency``."""
    a = Aimd(limit=float(max_concurrency))
    now = T0
    for success, dt in steps:
        now += dt
        if success:
            aimd.on_success(a, max_concurrency)
        else:
            aimd.on_overload(a, now)
        assert 1.0 <= a.limit <= max_concurrency
        assert 1 <= aimd.concurrency_cap(a, max_concurrency) <= max_concurrency


@given(
    limit=st.floats(min_value=-10.0, max_value=1e6, allow_nan=False),
    max_concurrency=st.integers(min_value=-2, max_value=1000),
)
def test_concurrency_cap_is_the_spec_formula(limit: float, max_concurrency: int) -> None:
    """The cap equals ``max(1, min(max_concurrency, floor(limit)))`` for any limit and max."""
    expected = max(1, min(max_concurrency, math.floor(limit)))
    assert aimd.concurrency_cap(Aimd(limit=limit), max_concurrency) == expected


@given(
    limit=st.floats(min_value=1.0, max_value=1e4, allow_nan=False),
    max_concurrency=st.integers(min_value=1, max_value=1000),
)
def test_success_is_the_spec_formula_bit_for_bit(limit: float, max_concurrency: int) -> None:
    """Success gives exactly ``min(max, limit + 1/limit)``, the Lua twin's float, at the cap too."""
    a = Aimd(limit=limit)
    aimd.on_success(a, max_concurrency)
    assert a.limit == min(float(max_concurrency), limit + 1.0 / limit)


def test_success_at_the_cap_leaves_the_limit_and_above_a_lowered_cap_brings_it_down() -> None:
    """At ``max_concurrency`` a success changes nothing; above a lowered max it lands on the max."""
    a = Aimd(limit=8.0)
    aimd.on_success(a, 8)
    assert a.limit == 8.0
    aimd.on_success(a, 3)
    assert a.limit == 3.0
