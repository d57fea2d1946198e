"""Selection: priority tiers, weighted order inside a tier, deterministic for a seeded rng."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from polygateway.governance.selection import (
    SelectionOrder,
    _key,
    order_candidates,
    untried_first,
)


@dataclass(frozen=True)
class Src:
    name: str
    priority: int = 0
    weight: float = 1.0


def _order(sources: list[Src], rng: random.Random) -> list[Src]:
    return order_candidates(
        sources, priority=lambda s: s.priority, weight=lambda s: s.weight, rng=rng
    )


def test_same_seed_same_order() -> None:
    """Two rngs with the same seed produce the same sequence of orders."""
    sources = [Src(c) for c in "abcdef"]
    a, b = random.Random(7), random.Random(7)
    assert [_order(sources, a) for _ in range(20)] == [_order(sources, b) for _ in range(20)]


def test_lower_priority_tier_always_first() -> None:
    """Every tier-0 source precedes every tier-1 source, whatever the weights."""
    sources = [Src("x", 1, 100.0), Src("a", 0, 0.01), Src("y", 1), Src("b", 0)]
    rng = random.Random(3)
    for _ in range(200):
        order = [s.name for s in _order(sources, rng)]
        assert set(order[:2]) == {"a", "b"}
        assert set(order[2:]) == {"x", "y"}


def test_weights_split_the_lead_roughly_in_proportion() -> None:
    """With weights 3:1, the heavier source leads about 75% of 4000 orders (fixed seed)."""
    sources = [Src("heavy", weight=3.0), Src("light", weight=1.0)]
    rng = random.Random(12345)
    leads = Counter(_order(sources, rng)[0].name for _ in range(4000))
    assert 0.72 < leads["heavy"] / 4000 < 0.78


def test_equal_weights_split_evenly_across_three() -> None:
    """Equal weights give each of three sources about a third of the leads."""
    sources = [Src("a"), Src("b"), Src("c")]
    rng = random.Random(99)
    leads = Counter(_order(sources, rng)[0].name for _ in range(3000))
    assert all(900 < leads[n] < 1100 for n in "abc")


def test_non_positive_weight_sorts_last_in_its_tier() -> None:
    """A weight of 0 never leads its tier but still appears."""
    sources = [Src("zero", weight=0.0), Src("one")]
    rng = random.Random(1)
    for _ in range(100):
        assert [s.name for s in _order(sources, rng)] == ["one", "zero"]


def test_untried_first_keeps_each_group_in_order() -> None:
    """Untried sources come first, then tried ones, each group in selection order."""
    ordered = [Src("a"), Src("b"), Src("c"), Src("d")]
    assert [s.name for s in untried_first(ordered, {"a", "c"})] == ["b", "d", "a", "c"]
    assert [s.name for s in untried_first(ordered, ())] == ["a", "b", "c", "d"]


def test_untried_first_takes_a_name_function() -> None:
    """Plain strings work with an explicit ``name``."""
    assert untried_first(["a", "b"], {"a"}, name=lambda s: s) == ["b", "a"]


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.floats(min_value=0.001, max_value=100)),
        max_size=12,
    ),
    st.integers(),
)
def test_order_is_a_permutation_sorted_by_tier(specs: list[tuple[int, float]], seed: int) -> None:
    """The result holds every source once, tiers ascending."""
    sources = [Src(str(i), p, w) for i, (p, w) in enumerate(specs)]
    order = _order(sources, random.Random(seed))
    assert sorted(s.name for s in order) == sorted(s.name for s in sources)
    assert [s.priority for s in order] == sorted(s.priority for s in sources)


@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from([0.0, -1.0, 0.5, 1.0, 1.0, 3.0])),
        min_size=1,
        max_size=5,
    ),
    st.integers(0, 2**32),
)
def test_selection_order_is_order_candidates_draw_for_draw(
    spec: list[tuple[int, float]], seed: int
) -> None:
    """SelectionOrder (tiers and weights read once) orders as the key sort does, same draws."""
    sources = [Src(f"s{i}", p, w) for i, (p, w) in enumerate(spec)]
    order = SelectionOrder(sources, priority=lambda s: s.priority, weight=lambda s: s.weight)
    fast, plain = random.Random(seed), random.Random(seed)
    for _ in range(5):
        keyed = sorted(
            (s.priority, -_key(plain.random(), s.weight), i) for i, s in enumerate(sources)
        )
        assert order.order(fast) == [sources[i] for _, _, i in keyed]
    assert fast.random() == plain.random()  # the same number of draws were made
