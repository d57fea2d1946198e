"""Which source to try first: priority tiers, then a weighted random order inside each tier.

Lower priority tiers come first; inside a tier sources are ordered by
Efraimidis-Spirakis weighted sampling without replacement (key
``u ** (1 / weight)``, highest first), so over many calls each source leads
its tier in proportion to its weight. ``u`` comes from the injected ``rng``:
the same seed gives the same order. The governance loop then puts the
sources a call has not tried yet first and hands the whole list to one
``acquire``, so a busy or closed higher tier spills over to a lower one at
no extra cost.

``SelectionOrder`` is the same order for a fixed list of sources, with
their tiers and weights read once: the loop orders its scope's sources on
every call, and reading them anew each time would cost on every call.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection, Sequence
from operator import attrgetter
from typing import Generic, TypeVar

__all__ = ["SelectionOrder", "order_candidates", "untried_first"]

T = TypeVar("T")


def _key(u: float, weight: float) -> float:
    """Sort key of one source; ``log(u) / weight`` orders exactly as ``u ** (1 / weight)``.

    The log form does not underflow to 0 for small weights, which would turn
    distinct keys into ties. A non-positive weight sorts last in its tier.
    """
    if weight <= 0 or u <= 0.0:
        return -math.inf
    return math.log(u) / weight


class SelectionOrder(Generic[T]):
    """``order_candidates`` over a fixed list of sources, tiers and weights read once.

    When no tier holds two sources the order is the tiers' order whatever
    the draws, so it is computed once; the draws are still made, one per
    source, so the rng's later values (back-off jitter) are the same either way.
    """

    __slots__ = ("_fixed", "_keyed", "_pair", "_sources")

    def __init__(
        self,
        sources: Sequence[T],
        *,
        priority: Callable[[T], int],
        weight: Callable[[T], float],
    ) -> None:
        self._sources = tuple(sources)
        self._keyed = tuple((priority(s), weight(s), i) for i, s in enumerate(self._sources))
        tiers = [p for p, _, _ in self._keyed]
        self._fixed: tuple[T, ...] | None = None
        if len(set(tiers)) == len(tiers):
            self._fixed = tuple(self._sources[i] for _, _, i in sorted(self._keyed))
        # Two sources of one tier and one positive weight (a common scope): the keys
        # order as the draws do, so the draws are compared without logs or a sort.
        self._pair = (
            len(self._keyed) == 2
            and tiers[0] == tiers[1]
            and self._keyed[0][1] == self._keyed[1][1]
            and self._keyed[0][1] > 0
        )

    @property
    def sources(self) -> tuple[T, ...]:
        """The sources in input order."""
        return self._sources

    def order(self, rng: random.Random) -> list[T]:
        """The sources in selection order; one ``rng.random()`` per source, in input order."""
        draw = rng.random
        if self._fixed is not None:
            for _ in self._keyed:
                draw()
            return list(self._fixed)
        if self._pair:
            first, second = self._sources
            return [first, second] if draw() >= draw() else [second, first]
        keyed = [(p, -_key(draw(), w), i) for p, w, i in self._keyed]
        keyed.sort()
        sources = self._sources
        return [sources[i] for _, _, i in keyed]


def order_candidates(
    sources: Sequence[T],
    *,
    priority: Callable[[T], int],
    weight: Callable[[T], float],
    rng: random.Random,
) -> list[T]:
    """The sources in selection order: ascending priority, weighted random inside a tier.

    Draws exactly one ``rng.random()`` per source, in input order, so the
    result is deterministic given the rng's state; ties keep input order.
    """
    return SelectionOrder(sources, priority=priority, weight=weight).order(rng)


def untried_first(
    ordered: Sequence[T],
    tried: Collection[str],
    *,
    name: Callable[[T], str] = attrgetter("name"),
) -> list[T]:
    """Sources this call has not tried yet, then the tried ones, each group keeping its order."""
    fresh = [s for s in ordered if name(s) not in tried]
    stale = [s for s in ordered if name(s) in tried]
    return fresh + stale
