"""The per-scope, per-process FIFO of calls waiting for a permit (research-wiki/ARCHITECTURE.md §5).

Only the head of the queue asks the backend for a permit. A local release
wakes the head only (O(1) per release, no thundering herd); the head's own
jittered poll notices releases made by other processes. Calls behind the head
sleep until they become head, or until a timer of their own fires (their stall
deadline), so waiting costs at most one backend poll per scope per poll
interval per process, whatever the number of waiters.

Waiters are futures in a deque, as in aiolimiter; a waiter that leaves (done,
failed or cancelled) is removed at once and, if it was the head, the next one
is promoted.

A waiter's stall-deadline timer has two paths. With the real ``asyncio.sleep``
(the default) it is a ``loop.call_later`` handle that resolves the wake-up
future: no second Task per waiting call, which with thousands of calls queued
is memory and garbage-collector work. With any other ``sleep`` (a fake clock in
tests, an application's own) the timer must run that coroutine, so it is a Task
raced against the wake-up future; the handle path cannot serve it because a
fake clock does not drive the event loop's timers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable

__all__ = ["Waiter", "WaitingRoom"]

Sleep = Callable[[float], Awaitable[None]]


def _resolve(signal: asyncio.Future[None]) -> None:
    """The deadline passed: end the wait (unless a wake-up already did)."""
    if not signal.done():
        signal.set_result(None)


class Waiter:
    """One call's place in the queue."""

    __slots__ = ("_pending", "_signal", "failure", "left")

    def __init__(self) -> None:
        self._signal: asyncio.Future[None] | None = None
        self._pending = False
        self.left = False
        # Set when the backend failed for a call ahead: this one must fail closed too.
        self.failure: BaseException | None = None

    def _fire(self) -> None:
        if self._signal is not None and not self._signal.done():
            self._signal.set_result(None)
        else:
            # Not waiting right now (between a poll and the next wait): keep the
            # wake-up so the next wait returns at once instead of losing it.
            self._pending = True


class WaitingRoom:
    """FIFO of waiting calls for one scope in this process."""

    __slots__ = ("_queue", "asking", "wakeups")

    def __init__(self) -> None:
        self._queue: deque[Waiter] = deque()
        self.wakeups = 0  # releases that found a head to wake; for tests and telemetry
        # Acquires in flight for this scope in this process (kept by the loop). Past a
        # bound a new call queues instead of asking too: a burst reaches the backend
        # through the head of the queue, not as thousands of concurrent acquires.
        self.asking = 0

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def empty(self) -> bool:
        """No call is waiting: a new call may ask the backend directly."""
        return not self._queue

    def enter(self) -> Waiter:
        """Join the tail of the queue."""
        waiter = Waiter()
        self._queue.append(waiter)
        return waiter

    def is_head(self, waiter: Waiter) -> bool:
        """Only the head asks the backend for a permit."""
        return bool(self._queue) and self._queue[0] is waiter

    def leave(self, waiter: Waiter) -> None:
        """Leave the queue (served, failed or cancelled); promote the next head if needed."""
        if waiter.left:
            return
        waiter.left = True
        was_head = self.is_head(waiter)
        with contextlib.suppress(ValueError):
            self._queue.remove(waiter)
        if was_head and self._queue:
            # The new head must ask at once: the permit that served the old head
            # may not have been the last one free.
            self._queue[0]._fire()

    def fail_all(self, failure: BaseException, *, but: Waiter | None = None) -> None:
        """The backend failed: wake every waiter (but ``but``) to fail closed at once.

        Without this, each queued call would become head in turn and wait out
        the backend's timeout on its own: the last of N would fail N timeouts late.
        """
        for waiter in self._queue:
            if waiter is not but:
                waiter.failure = failure
                waiter._fire()

    def notify(self) -> None:
        """A permit was released in this process: wake the head only."""
        if self._queue:
            self.wakeups += 1
            self._queue[0]._fire()

    async def wait(self, waiter: Waiter, timeout_s: float, sleep: Sleep) -> None:
        """Sleep until woken (release, or promotion to head) or until ``timeout_s`` passes.

        Cancellation passes through; the caller still owns ``leave``.
        """
        if waiter._pending:
            waiter._pending = False
            return
        loop = asyncio.get_running_loop()
        signal: asyncio.Future[None] = loop.create_future()
        waiter._signal = signal
        delay = max(0.0, timeout_s)
        if sleep is asyncio.sleep:
            # The real clock: a timer handle on the loop, no Task (see the module doc).
            handle = loop.call_later(delay, _resolve, signal)
            try:
                await signal
            finally:
                waiter._signal = None
                waiter._pending = False
                handle.cancel()
            return
        timer = asyncio.ensure_future(sleep(delay))
        try:
            await asyncio.wait((signal, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter._signal = None
            waiter._pending = False
            # Cancel, never await: awaiting here could swallow a cancellation of the caller.
            timer.cancel()
