"""The loop's queue of calls waiting for a permit (research-wiki/ARCHITECTURE.md §5).

The waiting room is the loop's: one per backend and scope in a process
(``room_for``), shared by every client of that scope. A backend only tells
it when a permit was freed (``Backend.on_release``); the room wakes its head.

Only the head of the queue asks the backend for a permit. A release wakes
the head only (O(1) per release, no thundering herd); the head's own jittered
poll notices releases the backend did not announce (other processes). Calls
behind the head sleep until they become head, or until a timer of their own
fires (their stall deadline), so waiting costs at most one backend poll per
scope per poll interval per process, whatever the number of waiters.

Arrival order: a call takes a ticket when it starts looking for a permit,
and the queue is ordered by ticket. A call that asked at once (nobody was
waiting) and was refused takes its place by its ticket, ahead of calls that
arrived after it and queued while its acquire was in flight.

At most ``MAX_ASKING`` acquires of a scope are in flight at once in a
process: past that a new call queues, so a burst reaches a shared backend
as a stream of acquires through the head, not all at once.

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
import bisect
import contextlib
import itertools
import weakref
from collections.abc import Awaitable, Callable
from typing import Final

from polygateway.backends.base import Backend

__all__ = ["MAX_ASKING", "Waiter", "WaitingRoom", "room_for"]

Sleep = Callable[[float], Awaitable[None]]

MAX_ASKING: Final = 64
"""Acquires of one scope in flight at once per process before new calls queue instead.

The head of the queue asks whatever the count (nobody else would ask for
it), so the fast path stops one short of this bound.
"""

_ROOMS: weakref.WeakKeyDictionary[Backend, dict[str, WaitingRoom]] = weakref.WeakKeyDictionary()
"""Every waiting room of the process, per backend object and scope; gone with the backend."""


def room_for(backend: Backend, scope: str) -> WaitingRoom:
    """The process's waiting room of ``scope`` on ``backend``, made and subscribed at first use."""
    rooms = _ROOMS.get(backend)
    if rooms is None:
        rooms = _ROOMS[backend] = {}
    room = rooms.get(scope)
    if room is None:
        room = rooms[scope] = WaitingRoom()
        backend.on_release(scope, room.notify)
    return room


def _ticket_of(waiter: Waiter) -> int:
    return waiter.ticket


def _resolve(signal: asyncio.Future[None]) -> None:
    """The deadline passed: end the wait (unless a wake-up already did)."""
    if not signal.done():
        signal.set_result(None)


class Waiter:
    """One call's place in the queue, ordered by its ticket (arrival order)."""

    __slots__ = ("_pending", "_signal", "failure", "left", "ticket")

    def __init__(self, ticket: int) -> None:
        self.ticket = ticket
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
    """The queue of waiting calls for one scope in this process, in arrival order."""

    __slots__ = ("_queue", "_tickets", "asking", "wakeups")

    def __init__(self) -> None:
        # Sorted by ticket; almost every entry is an append (a list: inserts are by bisect).
        self._queue: list[Waiter] = []
        self._tickets = itertools.count()
        self.wakeups = 0  # releases that found a head to wake; for tests and telemetry
        # Acquires in flight for this scope in this process (kept by the loop): past
        # MAX_ASKING a new call queues instead of asking too.
        self.asking = 0

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def empty(self) -> bool:
        """No call is waiting."""
        return not self._queue

    @property
    def may_ask_at_once(self) -> bool:
        """Whether a new call may ask the backend without queueing: nobody waits, room to ask."""
        return not self._queue and self.asking < MAX_ASKING - 1

    def ticket(self) -> int:
        """A place in the arrival order, taken when a call starts looking for a permit."""
        return next(self._tickets)

    def enter(self, ticket: int | None = None) -> Waiter:
        """Join the queue at the place of ``ticket`` (behind every call that arrived earlier).

        Without a ticket: at the tail, with a ticket taken now.
        """
        waiter = Waiter(self.ticket() if ticket is None else ticket)
        ticket = waiter.ticket
        queue = self._queue
        if not queue or queue[-1].ticket < ticket:
            queue.append(waiter)
        else:
            queue.insert(bisect.bisect(queue, ticket, key=_ticket_of), waiter)
        return waiter

    def is_head(self, waiter: Waiter) -> bool:
        """Only the head asks the backend for a permit."""
        queue = self._queue
        return bool(queue) and queue[0] is waiter

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
