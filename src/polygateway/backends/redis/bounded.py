"""Waiting a fixed time at most for work that goes on without its caller (Redis timeouts).

An operation's reply must still be read and acted on when its caller left
(the limiter's "Late replies"): an acquire granted after its caller timed
out gives its lease back, a release still wakes the waiting room. So the
wire hands every reply to a ``Reply``, not to the caller: while the caller
waits, the reply resolves the caller's future; once it stopped waiting, the
reply goes to the operation's ``late`` action instead. ``Deadlines`` wakes
the caller's future with ``TIMED_OUT`` when the backend's socket timeout
passes first, and ``LeftBehind`` keeps what callers left referenced, cut
after a bound, and awaitable when the backend closes.

Why not ``asyncio.shield`` inside ``asyncio.timeout`` (the first version),
nor a Task per operation (the second): per operation the first cost a
second future chained to the Task, a ``Timeout`` object and a timer handle
pushed onto, and cancelled in, the event loop's heap, plus two more
event-loop turns; the second a Task and its steps. Here the only
per-operation objects are the caller's future, the ``Reply`` and one deque
entry: every operation of a backend has the same timeout, so deadlines
arrive in the order operations start, and one timer, armed for the oldest
pending deadline, serves them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Final

__all__ = ["TIMED_OUT", "Deadlines", "LeftBehind", "Reply"]

logger = logging.getLogger("polygateway.backends.redis")

TIMED_OUT: Final = object()
"""What a caller's future holds when the timeout passed before the work's outcome."""

Late = Callable[[Any], None]
"""What to do with a reply (a value or an exception) that its caller no longer waits for."""


class Reply:
    """The caller's side of one operation: its future while it waits, ``late`` after."""

    __slots__ = ("_done", "finished", "late", "quiet", "waiter")

    def __init__(self, waiter: asyncio.Future[Any], late: Late | None = None) -> None:
        self.waiter = waiter
        self.late = late
        self.quiet = False  # cut on purpose: its failure is no news
        self.finished = False  # its reply came after its caller left, and was acted on
        self._done: Callable[[Reply], None] | None = None

    def __call__(self, reply: Any) -> None:
        """The wire's callback: exactly once per operation."""
        if not self.waiter.done():
            self.waiter.set_result(reply)
        else:
            self.left_with(reply)

    def left_with(self, reply: Any) -> None:
        """Act on a reply its caller will not read (it left, or left in the turn it came)."""
        self.finished = True
        try:
            if isinstance(reply, BaseException):
                if not self.quiet:
                    _warn(reply)
            elif self.late is not None:
                self.late(reply)
        except Exception as exc:  # a late action failing must not break the wire's read loop
            _warn(exc)
        finally:
            if self._done is not None:
                self._done(self)


def _warn(exc: BaseException) -> None:
    logger.warning(
        "work a caller stopped waiting for failed; any permit it holds frees "
        "itself when its lease expires: %s",
        exc,
    )


class LeftBehind:
    """Operations whose callers stopped waiting: kept until their reply, cut after ``bound_s``."""

    __slots__ = ("_settled", "_tasks", "_timers")

    def __init__(self) -> None:
        self._timers: dict[Reply, asyncio.TimerHandle] = {}
        self._settled: dict[Reply, asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Future[Any]] = set()

    def __len__(self) -> int:
        return len(self._timers) + len(self._tasks)

    def adopt(self, reply: Reply, cut: Callable[[], None], bound_s: float) -> None:
        """Keep ``reply`` until its reply comes; ``cut`` it if none came within ``bound_s``."""
        if reply.finished or reply in self._timers:
            return
        loop = asyncio.get_running_loop()

        def give_up() -> None:
            reply.quiet = True
            cut()

        self._timers[reply] = loop.call_later(bound_s, give_up)
        self._settled[reply] = loop.create_future()
        reply._done = self._forget

    def adopt_task(self, task: asyncio.Future[Any]) -> None:
        """Keep a task started for a late reply (an acquire's give-back) until it ends."""
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _forget(self, reply: Reply) -> None:
        timer = self._timers.pop(reply, None)
        if timer is not None:
            timer.cancel()
        settled = self._settled.pop(reply, None)
        if settled is not None and not settled.done():
            settled.set_result(None)

    def _task_done(self, task: asyncio.Future[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            _warn(exc)

    async def drain(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every reply still due and every late task."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while self._settled or self._tasks:
                    await asyncio.gather(
                        *self._settled.values(), *self._tasks, return_exceptions=True
                    )
        if self._tasks:
            # The timeout cancelled them through gather; let them unwind.
            await asyncio.gather(*self._tasks, return_exceptions=True)


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
