"""Fake time for tests: a hand-driven clock, a bounded fake sleep, virtual timers."""

from __future__ import annotations

import asyncio
import heapq
import itertools

__all__ = ["BoundedSleep", "FakeClock", "FakeTimers", "SleepBudgetExceeded", "settle"]


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


class FakeTimers:
    """Virtual time for many concurrent sleepers on one ``FakeClock``.

    ``FakeClock.sleep`` moves time forward by itself, which is right for one
    task but adds up the sleeps of concurrent ones. Here ``sleep(d)`` waits
    until the clock reaches its deadline and only ``advance`` moves time,
    waking sleepers in deadline order with the clock set to each deadline.
    """

    __slots__ = ("_heap", "_seq", "clock")

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    @property
    def pending(self) -> int:
        """Sleepers still waiting (cancelled ones are not counted)."""
        return sum(1 for _, _, fut in self._heap if not fut.done())

    async def sleep(self, seconds: float) -> None:
        """Wait until the clock has been advanced by ``seconds``."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (self.clock() + max(0.0, seconds), next(self._seq), fut))
        await fut

    async def advance(self, seconds: float, *, turns: int = 20) -> None:
        """Move time forward, waking each due sleeper at its own deadline, and let tasks run."""
        target = self.clock() + seconds
        while self._heap and self._heap[0][0] <= target:
            deadline, _, fut = heapq.heappop(self._heap)
            if fut.done():
                continue
            self.clock.advance(max(0.0, deadline - self.clock()))
            fut.set_result(None)
            await settle(turns)
        self.clock.advance(max(0.0, target - self.clock()))
        await settle(turns)


async def settle(turns: int = 20) -> None:
    """Let the event loop run ``turns`` times, so woken tasks reach their next await."""
    for _ in range(turns):
        await asyncio.sleep(0)
