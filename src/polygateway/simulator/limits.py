"""Server-side rate limits of a simulated source: sliding-window logs of requests and tokens.

A window log remembers what was spent in the last ``window_s`` seconds, so
what it reports is exact and easy to predict in a test: remaining = limit
minus what the window holds; reset = time until the oldest entry leaves it
(the moment the window frees something). A request over the limit is refused
and spends nothing. The window length is passed on every call, because a
source's profile may change while the server runs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["Quota", "RateState", "SlidingWindow"]


@dataclass(frozen=True, slots=True)
class Quota:
    """One limited quantity as a response reports it.

    Attributes:
        limit: the most the window may hold.
        remaining: what is left of it (never below 0).
        reset_s: seconds until the window frees something (0 when it is empty).
    """

    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class RateState:
    """What the rate-limit headers of one response say; a dimension without a limit is None."""

    requests: Quota | None = None
    tokens: Quota | None = None


class SlidingWindow:
    """What a source spent in the last ``window_s`` seconds, oldest first."""

    __slots__ = ("_log", "_used")

    def __init__(self) -> None:
        self._log: deque[tuple[float, int]] = deque()
        self._used = 0

    def _expire(self, now: float, window_s: float) -> None:
        """Forget what left the window by ``now``."""
        log = self._log
        while log and log[0][0] <= now - window_s:
            self._used -= log.popleft()[1]

    def used(self, now: float, window_s: float) -> int:
        """What the window holds at ``now``."""
        self._expire(now, window_s)
        return self._used

    def spend(self, now: float, amount: int) -> None:
        """Record ``amount`` spent at ``now``."""
        self._log.append((now, amount))
        self._used += amount

    def reset_in(self, now: float, window_s: float) -> float:
        """Seconds until the oldest entry leaves the window; 0 when the window is empty."""
        self._expire(now, window_s)
        if not self._log:
            return 0.0
        return max(0.0, self._log[0][0] + window_s - now)

    def wait_for(self, amount: int, limit: int, now: float, window_s: float) -> float:
        """Seconds until ``amount`` more fits under ``limit``: 0 if it fits now.

        An amount larger than the limit never fits; it is told to wait a whole
        window, a finite answer a client can act on.
        """
        self._expire(now, window_s)
        if amount > limit:
            return window_s
        excess = self._used + amount - limit
        if excess <= 0:
            return 0.0
        freed = 0
        for at, spent in self._log:
            freed += spent
            if freed >= excess:
                return max(0.0, at + window_s - now)
        return window_s  # unreachable: the whole log frees at least the excess

    def quota(self, limit: int, now: float, window_s: float) -> Quota:
        """The window as a response reports it against ``limit``."""
        used = self.used(now, window_s)
        return Quota(limit, max(0, limit - used), self.reset_in(now, window_s))
