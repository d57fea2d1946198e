"""Waiting a fixed time at most for work that goes on without its caller (Redis timeouts).

An operation's reply must still be read and acted on when its caller left
(the limiter's "Late replies"): an acquire granted after its caller timed
out gives its lease back, a release still wakes the waiting room. So the
wire hands every reply to a ``Reply``, not to the caller: while the caller
waits, the reply resolves the caller's future; once it stopped waiting (or
for a release written behind, which nobody waits for), the reply goes to
the operation's ``late`` action, and a failure is reported. ``Deadlines``
wakes the caller's future with ``TIMED_OUT`` when the backend's socket
timeout passes first.

Why not ``asyncio.shield`` inside ``asyncio.timeout``, nor a Task per
operation: per operation the first costs a second future chained to the
Task, a ``Timeout`` object and a timer handle pushed onto, and cancelled in,
the event loop's heap, plus two more event-loop turns; the second a Task and
its steps. Here the only
per-operation objects are the caller's future, the ``Reply`` and one deque
entry: every operation of a backend has the same timeout, so deadlines
arrive in the order operations start, and one timer, armed for the oldest
pending deadline, serves them all.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, Final

__all__ = ["TIMED_OUT", "Deadlines", "Failed", "Late", "Reply"]

TIMED_OUT: Final = object()
"""What a caller's future holds when the timeout passed before the work's outcome."""

Late = Callable[[Any], None]
"""What to do with a reply (a value, never an exception) that its caller no longer waits for."""

Failed = Callable[[str, str, BaseException], None]
"""How an operation nobody waits for reports its failure: ``(operation, scope, error)``."""


class Reply:
    """The wire's callback for one operation: the caller's future while it waits, ``late`` after.

    ``waiter`` is ``None`` for an operation written behind, which nobody waits for.
    """

    __slots__ = ("failed", "late", "operation", "scope", "waiter")

    def __init__(
        self,
        waiter: asyncio.Future[Any] | None,
        late: Late | None,
        operation: str,
        scope: str,
        failed: Failed,
    ) -> None:
        self.waiter = waiter
        self.late = late
        self.operation = operation
        self.scope = scope
        self.failed = failed

    def __call__(self, reply: Any) -> None:
        """The wire's callback: exactly once per operation."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(reply)
        else:
            self.left_with(reply)

    def left_with(self, reply: Any) -> None:
        """Act on a reply its caller will not read (it left, or left in the turn it came)."""
        try:
            if isinstance(reply, BaseException):
                self.failed(self.operation, self.scope, reply)
            elif self.late is not None:
                self.late(reply)
        except Exception as exc:  # a late action failing must not break the wire's read loop
            self.failed(self.operation, self.scope, exc)


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
