"""The per-scope FIFO waiting room: only the head polls, a release wakes the head only."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from polygateway.backends.base import AttemptOutcome, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.config import SourceConfig
from polygateway.middleware.policy import LoopPolicy
from polygateway.middleware.retry import RetryMW
from polygateway.middleware.waiting import MAX_ASKING, WaitingRoom, room_for
from polygateway.testing import FakeClock, TransientError


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


# --- arrival order, one room per scope, the bound on acquires in flight ------------------


def test_a_refused_earlier_arrival_queues_ahead_of_later_calls() -> None:
    """enter(ticket) places a call by its arrival: behind earlier waiters, ahead of later ones."""
    room = WaitingRoom()
    first = room.enter()  # waiting already
    early = room.ticket()  # arrives and asks at once
    later = room.enter()  # arrives while that acquire is in flight, and queues
    last = room.enter()
    refused = room.enter(early)  # the acquire was refused: it queues by its arrival
    assert (first.ticket, refused.ticket) == (0, early)
    order = []
    for _ in range(4):
        head = next(w for w in (first, refused, later, last) if room.is_head(w))
        order.append(head)
        room.leave(head)
    assert order == [first, refused, later, last]
    assert room.empty


def test_enter_without_a_ticket_takes_the_tail() -> None:
    """A call entering without a ticket takes one now: behind every ticket handed out before."""
    room = WaitingRoom()
    taken = room.ticket()
    waiter = room.enter()
    assert waiter.ticket == taken + 1
    assert room.is_head(room.enter(taken))


def _source(**fields: Any) -> SourceConfig:
    return SourceConfig(name="a", protocol="openai", base_url="http://upstream.test/v1", **fields)


def _loop(clock: FakeClock, backend: MemoryBackend) -> RetryMW:
    return RetryMW(
        scope="chat",
        sources=(_source(max_concurrency=1),),
        policy=LoopPolicy(poll_interval_s=1.0),
        backend=backend,
        now=clock,
        sleep=clock.sleep,
        rng=random.Random(7),
    )


async def test_a_call_queues_by_the_ticket_it_took_when_it_began() -> None:
    """An earlier call that was refused goes ahead of a later call already queued."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(clock, backend)
    held = await backend.acquire("chat", [SourceSpec("a", max_concurrency=1)], ttl_s=1e6)
    assert held.lease is not None
    room = room_for(backend, "chat")
    first, early, later = mw.begin(), mw.begin(), mw.begin()
    assert await early.pick() is None  # nobody waits: it asks at once, refused
    assert early._waiter is None  # not queued yet
    assert await later.pick() is None
    await later.wait()  # queues first, head for now
    assert room.is_head(later._waiter)  # type: ignore[arg-type]
    await early.wait()  # queues by its arrival: ahead of ``later``
    assert room.is_head(early._waiter)  # type: ignore[arg-type]
    assert await first.pick() is None  # the earliest of all: head, so it asks
    assert room.is_head(first._waiter)  # type: ignore[arg-type]
    assert len(room) == 3
    first.leave()
    early.leave()
    assert room.is_head(later._waiter)  # type: ignore[arg-type]


async def test_after_a_failure_a_call_queues_behind_calls_that_arrived_meanwhile() -> None:
    """A failed attempt sends the call to the tail of the arrivals, not back to its old place."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(clock, backend)
    failing = mw.begin()
    lease = await failing.pick()
    assert lease is not None
    meanwhile = mw.begin()  # arrives while the attempt runs
    assert await meanwhile.pick() is None
    await meanwhile.wait()  # queues, head

    async def fail(source: SourceConfig, ctx: Any) -> str:
        raise TransientError("x", status_code=503)

    failed = await failing.attempt(lease, fail)
    await failing.after_failure(failed)  # type: ignore[arg-type]
    assert await failing.pick() is None  # behind ``meanwhile``: does not ask
    room = room_for(backend, "chat")
    assert not room.is_head(failing._waiter)  # type: ignore[arg-type]
    assert room.is_head(meanwhile._waiter)  # type: ignore[arg-type]


async def test_room_for_is_one_room_per_backend_and_scope_woken_by_its_releases() -> None:
    """The same room for the same (backend, scope); a release on the backend wakes its head."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    room = room_for(backend, "chat")
    assert room_for(backend, "chat") is room  # subscribed once, not twice
    other_scope = room_for(backend, "embed")
    other_backend = room_for(MemoryBackend(now=clock), "chat")
    assert other_scope is not room
    assert other_backend is not room
    head, behind = room.enter(), room.enter()
    elsewhere = other_scope.enter()

    spec = [SourceSpec("a", max_concurrency=2)]
    lease = (await backend.acquire("chat", spec, ttl_s=60.0)).lease
    assert lease is not None
    await backend.release(lease, AttemptOutcome("success"))
    assert room.wakeups == 1
    assert head._pending
    assert not behind._pending
    assert other_scope.wakeups == 0
    assert not elsewhere._pending
    await asyncio.wait_for(room.wait(head, 60.0, _never), 1.0)  # the wake-up was kept

    embed = (await backend.acquire("embed", spec, ttl_s=60.0)).lease
    assert embed is not None
    await backend.release(embed, AttemptOutcome("cancelled"))
    assert other_scope.wakeups == 1
    assert room.wakeups == 1


def test_may_ask_at_once_stops_one_short_of_the_bound_and_when_someone_waits() -> None:
    """Nobody waiting and at most MAX_ASKING - 2 acquires in flight: ask; otherwise queue."""
    assert MAX_ASKING == 64
    room = WaitingRoom()
    assert room.may_ask_at_once
    room.asking = MAX_ASKING - 2
    assert room.may_ask_at_once
    room.asking = MAX_ASKING - 1
    assert not room.may_ask_at_once
    room.asking = 0
    waiter = room.enter()
    assert not room.may_ask_at_once
    room.leave(waiter)
    assert room.may_ask_at_once


async def test_past_the_bound_a_new_call_queues_and_asks_as_head() -> None:
    """MAX_ASKING - 1 acquires in flight: the call queues; as the head it asks, then leaves."""
    clock = FakeClock()
    gate = asyncio.Event()

    class _Slow(MemoryBackend):
        __slots__ = ()

        async def acquire(self, *args: Any, **kwargs: Any) -> Any:
            await gate.wait()
            return await super().acquire(*args, **kwargs)

    backend = _Slow(now=clock)
    mw = _loop(clock, backend)
    room = room_for(backend, "chat")
    room.asking = MAX_ASKING - 1
    call = mw.begin()
    picking = asyncio.create_task(call.pick())
    await asyncio.sleep(0)
    assert len(room) == 1  # queued ...
    assert room.is_head(call._waiter)  # type: ignore[arg-type]
    assert room.asking == MAX_ASKING  # ... and asking, as the head
    gate.set()
    assert await picking is not None
    assert room.asking == MAX_ASKING - 1
    assert call._waiter is None
    assert room.empty  # served: it left the queue
    # A fail_fast call never queues, however many acquires are in flight.
    quick = mw.begin(fail_fast=True)
    assert await quick.pick() is None  # refused (the one permit is held), not queued
    assert quick._waiter is None
    assert room.empty


class TestAFleetsTurn:
    """``notify(priority_class)``: a fleet's backend gave the permit to that class."""

    def _room(self) -> WaitingRoom:
        room = WaitingRoom({"interactive": 3.0, "batch": 1.0})
        room.enter(priority_class="interactive")
        room.enter(priority_class="batch")
        return room

    def test_the_named_classs_head_is_head_until_the_rooms_next_grant(self) -> None:
        room = self._room()
        assert room.head().priority_class == "interactive"  # type: ignore[union-attr]
        room.notify("batch")
        turn = room.head()
        assert turn is not None
        assert turn.priority_class == "batch"
        assert room.wakeups == 1
        room.enter(priority_class="interactive")  # a change of the room keeps the turn
        assert room.head() is turn
        room.leave(turn, granted=True)
        assert room.head().priority_class == "interactive"  # type: ignore[union-attr]

    def test_a_turn_for_a_class_with_nobody_waiting_here_leaves_the_rooms_order(self) -> None:
        room = WaitingRoom({"interactive": 3.0, "batch": 1.0})
        waiter = room.enter(priority_class="interactive")
        room.notify("batch")
        assert room.head() is waiter
        assert room.wakeups == 1

    def test_a_release_without_a_class_ends_a_turn_not_taken(self) -> None:
        room = self._room()
        room.notify("batch")
        room.notify()
        assert room.head().priority_class == "interactive"  # type: ignore[union-attr]

    def test_wanting_counts_the_calls_waiting_or_asking_per_class(self) -> None:
        room = WaitingRoom({"interactive": 3.0, "batch": 1.0})
        assert room.wanting() == {}
        room.enter(priority_class="batch")
        room.enter(priority_class="batch")
        room.slot("interactive").asking += 1
        assert room.wanting() == {"interactive": 1, "batch": 2}


class TestAFleetsTenantTurn:
    """``notify(priority_class, tenant)``: a fleet's backend gave the permit to that tenant."""

    def test_the_named_tenants_first_call_is_head_until_the_rooms_next_grant(self) -> None:
        room = WaitingRoom()
        first = room.enter(tenant="T1")
        room.enter(tenant="T1")
        turn = room.enter(tenant="T2")
        room.enter(tenant="T2")
        assert room.head() is first
        room.notify("", "T2")
        assert room.head() is turn
        room.leave(turn, granted=True)
        assert room.head() is first, "the turn was one grant"

    def test_a_turn_for_a_tenant_not_waiting_here_leaves_the_classs_own_turn(self) -> None:
        room = WaitingRoom({"interactive": 3.0, "batch": 1.0})
        room.enter(priority_class="batch", tenant="T2")
        waiter = room.enter(priority_class="interactive", tenant="T1")
        room.notify("interactive", "T2")  # T2 waits here, but in batch
        assert room.head() is waiter

    def test_waiting_tenants_are_none_until_a_call_or_a_wake_up_names_one(self) -> None:
        room = WaitingRoom({"interactive": 3.0, "batch": 1.0})
        room.enter(priority_class="batch")
        assert room.waiting_tenants() is None
        room.enter(priority_class="interactive", tenant="T1")
        room.enter(priority_class="interactive", tenant="")
        assert room.waiting_tenants() == {"interactive": ["T1", ""], "batch": [""]}
        other = WaitingRoom()
        other.enter()
        other.notify("", "")  # the fleet takes turns of tenants: the tenant "" is one
        assert other.waiting_tenants() == {"": [""]}


class TestReservedFloors:
    """``declare`` names the classes with reserved permits; ``unhold`` may change the head."""

    def test_floors_are_the_declared_classes_with_reserved_permits_only(self) -> None:
        room = WaitingRoom({"interactive": 3.0, "batch": 1.0, "bulk": 1.0}, {"interactive": 2})
        room.declare({"batch": 1.0}, {"batch": 1})
        assert room.floors == {"interactive": 2, "batch": 1}
        room.declare({"interactive": 3.0}, {})
        assert room.floors == {"batch": 1}, "a class declared again without reserve leaves"

    def test_a_class_the_room_was_not_told_of_reserves_nothing(self) -> None:
        """A class made at first use (``slot``) has no floor: it goes by stride like any
        other, never before a declared class for want of permits (a tie goes to the
        class declared first)."""
        room = WaitingRoom({"a": 1.0})
        wa = room.enter(priority_class="a")
        room.enter(priority_class="b")
        assert room.head() is wa

    def test_a_release_that_takes_a_class_below_its_floor_makes_its_call_head(self) -> None:
        """Class a (reserved 1) at its floor, b ahead by share; a's permit is released: a's
        waiting call is head at once and woken (the release's own wake-up reads the head)."""
        room = WaitingRoom({"a": 1.0, "b": 9.0}, {"a": 1})
        a = room.slot("a")
        room.hold(a)
        wa = room.enter(priority_class="a")
        wb = room.enter(priority_class="b")
        assert room.head() is wb, "a at its floor: b goes first on its larger share"
        room.unhold(a)
        assert room.head() is wa
        assert wa._pending, "woken: nobody else would tell it"
        room.notify()
        assert room.head() is wa
