"""Waiting-room edges that mutation testing found unpinned (research-wiki/MUTATION.md).

Every release is seen by a call that read the count before it, and calls
cancelled behind a first call that stays are kept in place exactly as long as
``_COMPACT_ABOVE`` says, then swept at once.
"""

from __future__ import annotations

from polygateway.middleware.waiting import _COMPACT_ABOVE, WaitingRoom


def test_every_release_changes_the_count_a_call_read_before_it() -> None:
    """A call outside the queue compares ``releases`` with its earlier reading: each release,
    the first of the room's or any later one, must make the two differ."""
    room = WaitingRoom()
    for _ in range(3):
        before = room.releases
        room.notify()
        assert room.releases != before


def test_calls_left_behind_a_waiting_first_are_swept_once_they_outnumber_the_live() -> None:
    """Calls cancelled behind a first call that stays are kept in place (no walk per call)
    until the left ones exceed the live ones by more than ``_COMPACT_ABOVE``; then all go at
    once. Forty calls, cancelled from the back: the sweep comes at the 29th (29 left, 11
    live) and not at the 28th, where 28 left and 12 live fill the flow of 40 = 2 * 12 + 16
    exactly; the 11 kept are not swept again, however many of them leave."""
    assert _COMPACT_ABOVE == 16
    room = WaitingRoom()
    first, *behind = [room.enter() for _ in range(40)]
    klass = room.slot("")
    for left, waiter in enumerate(reversed(behind), start=1):
        room.leave(waiter)
        flow = klass.flows[""]
        assert len(flow) == (40 if left < 29 else 11), left
        assert flow[0] is first
    assert room.head() is first
