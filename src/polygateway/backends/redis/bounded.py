"""Waiting a fixed time at most for work that goes on without its caller (Redis timeouts).

Every Redis operation runs as a Task of its own (its reply must still be read
when its caller left, see the limiter's "Late replies"), and its caller waits
on a plain future instead of on the Task, so that the caller's cancellation
or timeout never reaches the Task. ``relay`` resolves that future in the
step that ends the work; ``Deadlines`` wakes it with ``TIMED_OUT`` when the
backend's socket timeout passes first.

Why not ``asyncio.shield`` inside ``asyncio.timeout`` (the first version):
per operation that is a second future chained to the Task by a done
callback, a ``Timeout`` object rescheduled on entry and one timer handle
pushed onto, and cancelled in, the event loop's heap, plus two more
event-loop turns before the caller resumes. Here the only per-operation
objects are the Task, the future and one deque entry: every operation of a
backend has the same timeout, so deadlines arrive in the order operations
start, and one timer, armed for the oldest pending deadline, serves them all
(at concurrency 64 the heap held ~64 live timers and each operation paid for
its push, its cancellation and the comparisons between).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

__all__ = ["TIMED_OUT", "Deadlines", "relay"]

T = TypeVar("T")

TIMED_OUT: Final = object()
"""What a caller's future holds when the timeout passed before the work's outcome."""


async def relay(work: Coroutine[Any, Any, T], waiter: asyncio.Future[Any]) -> T:
    """Run ``work`` and hand its outcome to a caller still waiting, in the same step."""
    try:
        result = await work
    except asyncio.CancelledError:
        waiter.cancel()  # the work was cancelled (closing, abandoned): so is its caller's wait
        raise
    except Exception as exc:  # relayed and re-raised: the task keeps its own outcome
        if not waiter.done():
            waiter.set_exception(exc)
        raise
    if not waiter.done():
        waiter.set_result(result)
    return result


class Deadlines:
    """Futures that each wait ``timeout_s`` at most, woken with ``TIMED_OUT`` at their deadline."""

    __slots__ = ("_entries", "_loop", "_timeout_s", "_timer")

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._entries: deque[tuple[float, asyncio.Future[Any]]] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def add(self, loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[Any]) -> None:
        """Wake ``waiter`` with ``TIMED_OUT`` ``timeout_s`` from now, unless it is done by then."""
        if loop is not self._loop:
            # A new event loop (the old one's futures cannot be woken from this one).
            self._entries.clear()
            self._loop, self._timer = loop, None
        deadline = loop.time() + self._timeout_s
        self._entries.append((deadline, waiter))
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._expire)

    def _expire(self) -> None:
        """Wake what is due, drop what is done, re-arm for the oldest deadline still pending."""
        loop = self._loop
        if loop is None:  # never: only add() arms the timer, after setting the loop
            return
        now = loop.time()
        entries = self._entries
        while entries:
            deadline, waiter = entries[0]
            if not waiter.done():
                if deadline > now:
                    break
                waiter.set_result(TIMED_OUT)
            entries.popleft()
        self._timer = loop.call_at(entries[0][0], self._expire) if entries else None
