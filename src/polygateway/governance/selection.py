"""Which source to try first: priority tiers, then a weighted random order inside each tier.

Lower priority tiers come first; inside a tier sources are ordered by
Efraimidis-Spirakis weighted sampling without replacement (key
``u ** (1 / weight)``, highest first), so over many calls each source leads
its tier in proportion to its weight. ``u`` comes from the injected ``rng``:
the same seed gives the same order. The governance loop then puts the
sources a call has not tried yet first and hands the whole list to one
``acquire``, so a busy or closed higher tier spills over to a lower one at
no extra cost.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection, Sequence
from operator import attrgetter
from typing import TypeVar

__all__ = ["order_candidates", "untried_first"]

T = TypeVar("T")


def _key(u: float, weight: float) -> float:
    """Sort key of one source; ``log(u) / weight`` orders exactly as ``u ** (1 / weight)``.

    The log form does not underflow to 0 for small weights, which would turn
    distinct keys into ties. A non-positive weight sorts last in its tier.
    """
    if weight <= 0 or u <= 0.0:
        return -math.inf
    return math.log(u) / weight


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
    keyed = [(priority(s), -_key(rng.random(), weight(s)), i) for i, s in enumerate(sources)]
    keyed.sort()
    return [sources[i] for _, _, i in keyed]


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
