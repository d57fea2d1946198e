"""AIMD concurrency: a source's limit grows slowly with successes and shrinks on overload.

Additive increase (``+1/limit`` per success, so about ``+1`` per ``limit``
successes) and multiplicative decrease (``x0.7`` on 429, timeout, 503, 529),
kept inside ``[1, max_concurrency]``. A decrease is allowed at most once per
``AIMD_COOLOFF_S``: the 50 attempts in flight when an upstream starts
shedding load all come back 429 together, and that is one signal, not 50.
A spec that lowers ``max_concurrency`` brings the limit down to it at once, so
that the limit reported is the one that admits, and the next decrease starts
from the new max; a raised max is grown into by successes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "AIMD_COOLOFF_S",
    "AIMD_FACTOR",
    "Aimd",
    "concurrency_cap",
    "on_max_change",
    "on_overload",
    "on_success",
]

AIMD_COOLOFF_S = 2.0
"""Shortest time between two decreases of one source's limit."""

AIMD_FACTOR = 0.7
"""Multiplicative decrease applied on an overload signal."""


@dataclass(slots=True)
class Aimd:
    """One source's adaptive limit (a float, so increases accumulate) and its last decrease."""

    limit: float
    last_decrease: float = -math.inf


def concurrency_cap(a: Aimd, max_concurrency: int) -> int:
    """Permits the source may hold now: ``floor(limit)``, at least 1, at most the configured max."""
    # Comparisons, not max()/min(): this runs for every candidate of every acquire,
    # and the builtins' call overhead is most of its cost. Same value, same order.
    cap = math.floor(a.limit)
    if cap > max_concurrency:
        cap = max_concurrency
    return cap if cap >= 1 else 1


def on_success(a: Aimd, max_concurrency: int) -> None:
    """Additive increase, capped at ``max_concurrency``."""
    # A healthy source sits at its cap, where the increase is a no-op: skip the float work.
    # (A limit above a lowered cap is not equal to it, so it is still brought down.)
    if a.limit != max_concurrency:
        a.limit = min(float(max_concurrency), a.limit + 1.0 / a.limit)


def on_overload(a: Aimd, now: float) -> bool:
    """Multiplicative decrease, at most once per cool-off; says whether it happened."""
    if now - a.last_decrease < AIMD_COOLOFF_S:
        return False
    a.limit = max(1.0, a.limit * AIMD_FACTOR)
    a.last_decrease = now
    return True


def on_max_change(a: Aimd, max_concurrency: int) -> None:
    """A new spec's max: a limit above it comes down to it; one below it stays where it is."""
    if a.limit > max_concurrency:
        a.limit = float(max_concurrency)
