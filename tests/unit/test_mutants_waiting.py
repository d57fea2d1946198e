"""Waiting-room edges that mutation testing found unpinned (research-wiki/MUTATION.md).

A kept wake-up is consumed by exactly one wait, a wait that ended on its
timer leaves nothing behind that would cut the next one short, and every
release that finds a head is counted.
"""

from __future__ import annotations

from typing import Any

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


async def _woken(room: WaitingRoom, waiter: Any, clock: FakeClock) -> bool:
    """Whether ``waiter`` holds a wake-up: its next wait ends at once instead of on its timer."""
    start = clock()
    await room.wait(waiter, 2.5, clock.sleep)
    return clock() == start


async def test_a_count_crossing_no_floor_wakes_nobody() -> None:
    """``hold`` on a reserved class whose head stays head: no wake-up, so no needless poll."""
    clock = FakeClock()
    room = WaitingRoom({"a": 1.0}, {"a": 2})
    head = room.enter(priority_class="a")
    room.hold(room.slot("a"))
    assert room.head() is head
    assert not await _woken(room, head, clock)


async def test_a_call_behind_the_head_that_leaves_wakes_nobody() -> None:
    """A waiter behind the head cancelled (not granted): the head is not woken for it."""
    clock = FakeClock()
    room = WaitingRoom()
    head = room.enter()
    behind = room.enter()
    room.leave(behind)
    assert room.head() is head
    assert not await _woken(room, head, clock)


def test_a_tenant_whose_call_is_cancelled_keeps_its_turn() -> None:
    """Only a grant sends a tenant to the back of its class's turn; a cancellation does not."""
    room = WaitingRoom()
    first = room.enter(tenant="A")
    second = room.enter(tenant="A")
    room.enter(tenant="B")
    room.leave(second)  # cancelled, not granted
    assert room.head() is first


def test_on_a_tie_the_class_declared_first_goes_first() -> None:
    """Equal virtual time and equal shares: the class declared first asks first."""
    room = WaitingRoom({"a": 1.0, "b": 1.0})
    in_b = room.enter(priority_class="b")
    in_a = room.enter(priority_class="a")
    assert room.head() is in_a
    room.leave(in_a, granted=True)
    assert room.head() is in_b


def test_the_class_furthest_behind_goes_first_whatever_its_share() -> None:
    """A larger share wins only a tie: a class further behind in virtual time goes first."""
    room = WaitingRoom({"small": 1.0, "big": 4.0})
    big = room.enter(priority_class="big")
    room.leave(big, granted=True)  # big is a quarter of a permit ahead now
    small = room.enter(priority_class="small")
    room.enter(priority_class="big")
    assert room.head() is small


def test_declaring_a_floor_while_calls_wait_changes_the_head() -> None:
    """A client declaring the scope's classes again (a floor now) is seen by the next head."""
    room = WaitingRoom({"a": 1.0, "b": 1.0})
    in_a = room.enter(priority_class="a")
    in_b = room.enter(priority_class="b")
    assert room.head() is in_a
    room.declare({"b": 1.0}, {"b": 1})
    assert room.head() is in_b
