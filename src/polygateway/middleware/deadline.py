"""A call's hard time bound (``deadline_s``): the one home of every deadline decision.

``deadline_s`` is a bound the caller sets on the whole call (research-wiki/ARCHITECTURE.md §2):

- no attempt starts with less than ``EPSILON_S`` left (it could only time out);
- each attempt's timeouts (request, TTFT, stream idle) are clipped to the
  time left, and so is a back-off or a wait in the queue;
- a timeout once no time is left was the deadline's, not the source's: the
  attempt is released as cancelled (``classify.DEADLINE_CUT``), not charged.

A call without a deadline has an unbounded one (``Deadline.none``): every
method then answers as if infinite time were left.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

__all__ = ["EPSILON_S", "Deadline", "Timeouts", "check_deadline_s"]

EPSILON_S: Final = 1e-3
"""No attempt starts with less time left than this: it could only time out.

A timeout this close to the deadline is the deadline's: timers and the
injected clock may disagree by a hair."""

Timeouts = tuple[float, float, float]
"""(timeout, TTFT, idle) of one attempt, in seconds."""


def check_deadline_s(deadline_s: object) -> bool:
    """A per-call deadline is a real number of seconds, finite and not negative (NaN is not)."""
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float):
        return False
    return math.isfinite(deadline_s) and deadline_s >= 0.0


class Deadline:
    """When a call must end, read on the loop's injected clock."""

    __slots__ = ("_now", "at")

    def __init__(self, at: float, now: Callable[[], float]) -> None:
        self.at = at  # math.inf: no deadline
        self._now = now

    @classmethod
    def after(cls, deadline_s: float | None, now: Callable[[], float]) -> Deadline:
        """The deadline ``deadline_s`` seconds from now (``None``: unbounded); checked before."""
        return cls(math.inf if deadline_s is None else now() + deadline_s, now)

    @property
    def bounded(self) -> bool:
        """Whether the caller set a deadline."""
        return self.at != math.inf

    def left_or_none(self) -> float | None:
        """Seconds left, or ``None`` without a deadline (what records and requests carry)."""
        return None if self.at == math.inf else self.at - self._now()

    def over(self) -> bool:
        """Whether no attempt may start any more: less than ``EPSILON_S`` is left."""
        return self.at - self._now() <= EPSILON_S

    def clip(self, timeouts: Timeouts) -> Timeouts:
        """An attempt's (timeout, TTFT, idle), each at most the time left."""
        left = self.at - self._now()
        if left == math.inf:
            return timeouts
        timeout_s, ttft_s, idle_s = timeouts
        return min(timeout_s, left), min(ttft_s, left), min(idle_s, left)

    def bound(self, delay_s: float) -> float:
        """A wait of ``delay_s`` cut to the time left (never below 0)."""
        return min(delay_s, max(self.at - self._now(), 0.0))

    def cut(self, timeout_s: float, own_timeout_s: float, *, streaming: bool) -> bool:
        """Whether an attempt's timeout was this deadline rather than the source's own.

        Only once no time is left (a timeout before that is the source's). A
        request's one bound is its effective ``timeout_s``, so the deadline cut
        it only if it clipped the source's ``own_timeout_s``; a stream's end is
        the deadline itself.
        """
        if not self.over():
            return False
        return streaming or timeout_s < own_timeout_s
