"""The per-scope FIFO waiting room: only the head polls, a release wakes the head only."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from polygateway.backends.waiting import WaitingRoom
from polygateway.testing import FakeClock


async def _never(_: float) -> None:
    """A timer that never fires on its own: only a wake-up ends the wait."""
    await asyncio.Event().wait()


def test_first_to_enter_is_head_and_order_is_fifo() -> None:
    """Waiters are served in the order they entered."""
    room = WaitingRoom()
    a, b, c = room.enter(), room.enter(), room.enter()
    assert room.is_head(a)
    assert not room.is_head(b)
    room.leave(a)
    assert room.is_head(b)
    room.leave(b)
    assert room.is_head(c)
    assert len(room) == 1


async def test_notify_wakes_only_the_head() -> None:
    """A local release wakes the head and nobody else (O(1) per release)."""
    room = WaitingRoom()
    head, other = room.enter(), room.enter()
    head_task = asyncio.create_task(room.wait(head, 60.0, _never))
    other_task = asyncio.create_task(room.wait(other, 60.0, _never))
    await asyncio.sleep(0)
    room.notify()
    await asyncio.wait_for(head_task, 1.0)
    await asyncio.sleep(0)
    assert not other_task.done()
    assert room.wakeups == 1
    other_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await other_task


async def test_leaving_head_promotes_and_wakes_next() -> None:
    """When the head leaves, the next waiter becomes head and is woken at once."""
    room = WaitingRoom()
    head, nxt = room.enter(), room.enter()
    task = asyncio.create_task(room.wait(nxt, 60.0, _never))
    await asyncio.sleep(0)
    room.leave(head)
    await asyncio.wait_for(task, 1.0)
    assert room.is_head(nxt)


async def test_wake_before_wait_is_not_lost() -> None:
    """A wake-up that arrives between two waits makes the next wait return at once."""
    room = WaitingRoom()
    head = room.enter()
    room.notify()
    await asyncio.wait_for(room.wait(head, 60.0, _never), 1.0)


async def test_timer_ends_the_wait_on_the_injected_clock() -> None:
    """Without a wake-up the wait ends when the injected sleep returns."""
    clock = FakeClock()
    room = WaitingRoom()
    head = room.enter()
    await room.wait(head, 2.5, clock.sleep)
    assert clock() == pytest.approx(1002.5)


async def test_cancelled_waiter_leaves_and_frees_the_head_slot() -> None:
    """Cancelling the head's wait and leaving hands the head slot to the next waiter."""
    room = WaitingRoom()
    head, nxt = room.enter(), room.enter()
    task = asyncio.create_task(room.wait(head, 60.0, _never))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    room.leave(head)
    room.leave(head)  # leaving twice is harmless
    assert room.is_head(nxt)
    assert len(room) == 1


async def test_wait_leaves_no_task_behind() -> None:
    """The timer task of a wait is cancelled when a wake-up ends it."""
    room = WaitingRoom()
    head = room.enter()
    before = len(asyncio.all_tasks())
    task = asyncio.create_task(room.wait(head, 60.0, _never))
    await asyncio.sleep(0)
    room.notify()
    await task
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == before


async def test_fail_all_wakes_every_waiter_but_the_one_that_failed() -> None:
    """A backend failure marks and wakes every queued call except the head that met it."""
    room = WaitingRoom()
    head, a, b = room.enter(), room.enter(), room.enter()
    tasks = [asyncio.create_task(room.wait(w, 60.0, _never)) for w in (a, b)]
    await asyncio.sleep(0)
    failure = RuntimeError("backend down")
    room.fail_all(failure, but=head)
    await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
    assert a.failure is failure
    assert b.failure is failure
    assert head.failure is None


class _RecordingLoop:
    """Records the ``call_later`` of the real-sleep path instead of letting time pass."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loop = asyncio.get_running_loop()
        self.calls: list[tuple[float, asyncio.TimerHandle]] = []
        self._call_later = self.loop.call_later
        monkeypatch.setattr(self.loop, "call_later", self._record)

    def _record(self, delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        handle = self._call_later(3600.0, callback, *args)
        self.calls.append((delay, handle))
        return handle


async def test_real_sleep_deadline_is_a_timer_handle_not_a_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With asyncio.sleep the deadline is one call_later handle; firing it ends the wait."""
    recording = _RecordingLoop(monkeypatch)
    room = WaitingRoom()
    head = room.enter()
    before = len(asyncio.all_tasks())
    task = asyncio.create_task(room.wait(head, 2.5, asyncio.sleep))
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == before + 1  # the waiting call's own task only
    [(delay, handle)] = recording.calls
    assert delay == 2.5
    handle._run()  # the deadline passes
    await asyncio.wait_for(task, 1.0)
    assert room.is_head(head)  # a deadline ends the wait, it does not leave the queue


async def test_real_sleep_wake_up_cancels_the_timer_handle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A wake-up ends a real-sleep wait at once and cancels its deadline handle."""
    recording = _RecordingLoop(monkeypatch)
    room = WaitingRoom()
    head = room.enter()
    task = asyncio.create_task(room.wait(head, 60.0, asyncio.sleep))
    await asyncio.sleep(0)
    [(_, handle)] = recording.calls
    room.notify()
    await asyncio.wait_for(task, 1.0)
    assert handle.cancelled()
    assert not head._pending


async def test_real_sleep_wait_cancelled_passes_through_and_cancels_the_handle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelling a real-sleep wait raises CancelledError and leaves no live timer."""
    recording = _RecordingLoop(monkeypatch)
    room = WaitingRoom()
    head = room.enter()
    task = asyncio.create_task(room.wait(head, 60.0, asyncio.sleep))
    await asyncio.sleep(0)
    [(_, handle)] = recording.calls
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert handle.cancelled()
    room.notify()  # a wake-up after the wait is kept for the next one, not lost
    assert head._pending
