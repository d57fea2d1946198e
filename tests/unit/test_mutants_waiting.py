"""Waiting-room edges that mutation testing found unpinned (research-wiki/MUTATION.md).

A kept wake-up is consumed by exactly one wait, a wait that ended on its
timer leaves nothing behind that would cut the next one short, and every
release that finds a head is counted.
"""

from __future__ import annotations

import pytest

from polygateway.middleware.waiting import WaitingRoom
from polygateway.testing import FakeClock


def test_every_release_that_finds_a_head_is_counted() -> None:
    """Two releases with a waiter queued are two wake-ups; none without a waiter."""
    room = WaitingRoom()
    room.notify()
    assert room.wakeups == 0
    room.enter()
    room.notify()
    room.notify()
    assert room.wakeups == 2


async def test_a_kept_wake_up_serves_one_wait_only() -> None:
    """A wake-up kept between waits ends the next wait at once, and only that one."""
    clock = FakeClock()
    room = WaitingRoom()
    head = room.enter()
    room.notify()
    start = clock()
    await room.wait(head, 2.5, clock.sleep)
    assert clock() == start  # served by the kept wake-up, no time passed
    await room.wait(head, 2.5, clock.sleep)
    assert clock() == pytest.approx(start + 2.5)  # nothing kept: the timer ended it


async def test_a_wait_ended_by_its_timer_leaves_the_next_wait_whole() -> None:
    """After a timer ends a wait, the next wait runs its own full timer."""
    clock = FakeClock()
    room = WaitingRoom()
    head = room.enter()
    start = clock()
    await room.wait(head, 1.0, clock.sleep)
    await room.wait(head, 1.0, clock.sleep)
    assert clock() == pytest.approx(start + 2.0)


async def test_a_wake_up_after_a_timed_out_wait_is_kept_for_the_next() -> None:
    """A release between two injected-clock waits is neither lost nor an error."""
    clock = FakeClock()
    room = WaitingRoom()
    head = room.enter()
    await room.wait(head, 1.0, clock.sleep)
    room.notify()
    start = clock()
    await room.wait(head, 5.0, clock.sleep)
    assert clock() == start
