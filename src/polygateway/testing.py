"""Test kit, public so users can test their own code against PolyGateway without a network.

- ``FakeClock``: a monotonic clock advanced by hand or by its fake ``sleep``.
- ``BoundedSleep``: a fake sleep that fails the test after N calls instead of looping forever.
"""

from __future__ import annotations

import asyncio

__all__ = [
    "BoundedSleep",
    "FakeClock",
    "SleepBudgetExceeded",
]


class FakeClock:
    """A monotonic clock that only moves when told to.

    Call it for the time (``now=clock``); ``await clock.sleep(d)`` advances it
    by ``d`` and yields to the event loop once, so other tasks run as they
    would during a real sleep.
    """

    __slots__ = ("_now", "sleeps")

    def __init__(self, start: float = 1000.0) -> None:
        self._now = float(start)
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward (never backward: the clock is monotonic)."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back ({seconds} s)")
        self._now += seconds

    async def sleep(self, seconds: float) -> None:
        """A sleep that takes no real time."""
        self.sleeps.append(seconds)
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)

    def __repr__(self) -> str:
        return f"FakeClock(now={self._now})"


class SleepBudgetExceeded(AssertionError):
    """A loop slept more often than the test allowed: it would have spun forever."""


class BoundedSleep:
    """A fake sleep on a ``FakeClock`` that fails after ``max_calls`` sleeps."""

    __slots__ = ("calls", "clock", "max_calls")

    def __init__(self, clock: FakeClock, max_calls: int = 1000) -> None:
        self.clock = clock
        self.max_calls = max_calls
        self.calls = 0

    async def __call__(self, seconds: float) -> None:
        self.calls += 1
        if self.calls > self.max_calls:
            raise SleepBudgetExceeded(f"slept more than {self.max_calls} times")
        await self.clock.sleep(seconds)
