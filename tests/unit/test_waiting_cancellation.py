"""Calls cancelled at any instant of the hand-over of a permit: no wake-up lost, nothing left.

A freed permit wakes one call only, the head of the scope's queue; if a call
cancelled while being woken, or while its acquire was in flight, swallowed
that wake-up, the queue would sit idle until the head's next poll. The poll
here is long (``POLL_S``), so a lost wake-up shows as a queue drained late.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest
from _closing import closing
from _release_race import ReleasedDuringAcquire
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from polygateway.backends.base import SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings
from polygateway.middleware import waiting
from polygateway.middleware.waiting import WaitingRoom, room_for
from polygateway.testing import (
    CountingBackend,
    Delay,
    FakeClock,
    FakeTimers,
    FakeTransport,
    chat_completion,
)

MESSAGES = [{"role": "user", "content": "hi"}]
POLL_S = 60.0
ANSWER_S = 0.5  # how long the source takes to answer a call


def _settings(concurrency: int, classes: bool) -> GatewaySettings:
    scope: dict[str, Any] = {
        "kind": "chat",
        "sources": [
            {
                "name": "primary",
                "protocol": "openai",
                "base_url": "http://127.0.0.1:9/primary",
                "model": "m",
                "api_key": "sk-test-primary-secret",
                "max_concurrency": concurrency,
            }
        ],
    }
    if classes:
        scope["priority_classes"] = {
            "batch": {"share": 3},
            "interactive": {"share": 1, "reserved": 1},
        }
        scope["default_priority_class"] = "batch"
    return GatewaySettings(
        _env_file=None,
        scopes={"chat": scope},
        stall_window_s=3000.0,
        poll_interval_s=POLL_S,
    )


_STEP = st.one_of(
    st.tuples(st.just("call"), st.sampled_from(["batch", "interactive"]), st.sampled_from("xy")),
    # The n-th call still running, in arrival order: 0 and 1 are the head and the next.
    st.tuples(st.just("cancel"), st.integers(0, 3), st.just("")),
    st.tuples(st.just("gate"), st.sampled_from(["close", "open"]), st.just("")),
    st.tuples(st.just("advance"), st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]), st.just("")),
    st.tuples(st.just("turns"), st.sampled_from(["1", "2", "3", "20"]), st.just("")),
)


_WOKEN_HEAD_CANCELLED = [
    ("call", "batch", "x"),
    ("call", "batch", "x"),
    ("call", "batch", "x"),
    ("turns", "1", ""),
    ("advance", 0.0, ""),
    ("advance", 0.5, ""),
    ("cancel", 0, ""),
]
"""The head, woken by a release, is cancelled before it asks: the next one must ask."""

_GIVEN_BACK_UNHEARD = [
    ("call", "batch", "x"),
    ("gate", "close", ""),
    ("advance", 0.0, ""),
    ("cancel", 0, ""),
    ("call", "batch", "x"),
    ("advance", 0.0, ""),
]
"""A cancelled call's grant is given back while the next call's acquire, refused, is in flight."""

_GIVEN_BACK_TO_A_LATER_CALL = [
    ("call", "batch", "x"),
    ("gate", "close", ""),
    ("call", "batch", "x"),
    ("advance", 0.0, ""),
    ("cancel", 0, ""),
    ("gate", "open", ""),
    ("call", "batch", "x"),
]
"""That grant given back wakes a later call, which the refused one then queues ahead of."""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(steps=_WOKEN_HEAD_CANCELLED, concurrency=1, classes=False).via("a found race")
@example(steps=_GIVEN_BACK_UNHEARD, concurrency=1, classes=False).via("a found race")
@example(steps=_GIVEN_BACK_TO_A_LATER_CALL, concurrency=1, classes=False).via("a found race")
@given(
    steps=st.lists(_STEP, max_size=50),
    concurrency=st.integers(1, 2),
    classes=st.booleans(),
)
def test_a_permit_freed_always_reaches_a_call_still_waiting(
    steps: list[tuple[str, Any, str]], concurrency: int, classes: bool
) -> None:
    """Arrivals, cancellations at any turn of the event loop (waking, acquiring, answering)
    and acquires held at a gate: the calls left are all served long before the head's next
    poll, and no waiter, permit, count or timer task is left behind."""

    async def scenario() -> None:
        clock = FakeClock()
        timers = FakeTimers(clock)
        inner = MemoryBackend(now=clock)
        backend = CountingBackend(inner)
        transport = FakeTransport(
            clock=clock, sleep=timers.sleep, default=Delay(ANSWER_S, chat_completion("ok"))
        )
        chat = closing(
            ChatClient(
                _settings(concurrency, classes),
                backend=backend,
                transport=transport,
                now=clock,
                sleep=timers.sleep,
                rng=random.Random(3),
            )
        )
        calls: list[asyncio.Task[Any]] = []
        turns = 20
        for op, arg, tenant in steps:
            if op == "call":
                calls.append(
                    asyncio.ensure_future(
                        chat.complete(
                            MESSAGES,
                            priority_class=arg if classes else None,
                            tenant=tenant,
                        )
                    )
                )
            elif op == "cancel":
                running = [c for c in calls if not c.done()]
                if running:
                    running[arg % len(running)].cancel()
            elif op == "gate" and arg == "close" and backend.hold_acquire is None:
                backend.hold_acquire = asyncio.Event()
            elif op == "gate" and arg == "open" and backend.hold_acquire is not None:
                backend.hold_acquire.set()
                backend.hold_acquire = None
            elif op == "turns":
                turns = int(arg)
            elif op == "advance":
                await timers.advance(arg, turns=turns)
        if backend.hold_acquire is not None:
            backend.hold_acquire.set()
            backend.hold_acquire = None
        # Everything left is served one batch of ``concurrency`` per answer, in far less than
        # half a poll: only a lost wake-up would leave a call waiting for the head's poll.
        drained_by = clock() + len(calls) * ANSWER_S + 5.0
        assert drained_by - clock() < POLL_S / 2
        while not all(c.done() for c in calls) and clock() < drained_by:
            await timers.advance(0.25)
        assert all(c.done() for c in calls), [c for c in calls if not c.done()]
        for c in calls:
            if not c.cancelled():
                assert c.result().text == "ok"
        await timers.advance(1.0)
        assert inner.snapshot_now("chat").in_flight == 0
        room = room_for(backend, "chat")
        assert room.empty
        assert room.asking == 0
        assert all(in_use == 0 for _, in_use in room.by_class().values())
        assert all(c.asking == 0 for c in (room.slot(n) for n in room.by_class()))
        # No timer of a wait, no shared read, no acquire left running.
        assert asyncio.all_tasks() == {asyncio.current_task()}

    asyncio.run(scenario())


async def test_a_permit_freed_while_a_call_asked_at_once_is_taken_without_a_poll() -> None:
    """Released while the refused acquire of a call nobody queued behind was in flight: the
    call asks again at once, not a poll interval later."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    backend = ReleasedDuringAcquire(clock)
    held = await backend.acquire("chat", [SourceSpec("primary", max_concurrency=1)], ttl_s=1e6)
    backend.lease = held.lease
    chat = closing(
        ChatClient(
            _settings(1, classes=False),
            backend=backend,
            transport=FakeTransport(clock=clock, sleep=timers.sleep, default=chat_completion("ok")),
            now=clock,
            sleep=timers.sleep,
            rng=random.Random(3),
        )
    )
    call = asyncio.ensure_future(chat.complete(MESSAGES))
    await timers.advance(0.0)
    await timers.advance(1.0)
    try:
        assert call.done()
        assert (await call).text == "ok"
        assert room_for(backend, "chat").empty
    finally:
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)


class ScanCountingDeque(deque[Any]):
    """A deque that counts the elements its searches and copies walk through."""

    walked = 0

    def remove(self, value: Any) -> None:
        ScanCountingDeque.walked += self.index(value) + 1
        super().remove(value)

    def __iter__(self) -> Iterator[Any]:
        for item in super().__iter__():
            ScanCountingDeque.walked += 1
            yield item


@pytest.mark.parametrize("tenants", [1, 3, 10_000])
def test_calls_leaving_a_deep_queue_in_any_order_cost_a_bounded_walk_each(
    monkeypatch: pytest.MonkeyPatch, tenants: int
) -> None:
    """Ten thousand waiting calls cancelled in random order, a grant now and then: the room
    walks a bounded number of queued calls per call that leaves, however deep the queue."""
    monkeypatch.setattr(waiting, "deque", ScanCountingDeque)
    ScanCountingDeque.walked = 0
    room = WaitingRoom()
    waiters = [room.enter(tenant=f"t{i % tenants}") for i in range(10_000)]
    order = random.Random(7).sample(waiters, len(waiters))
    for i, waiter in enumerate(order):
        if i % 10 == 0 and room.head() is not None:
            head = room.head()
            assert head is not None
            assert not head.left
            room.leave(head, granted=True)
        room.leave(waiter)
    assert room.empty
    assert room.head() is None
    assert ScanCountingDeque.walked <= 4 * len(waiters)


_ROOM_OP = st.one_of(
    st.tuples(st.just("enter"), st.sampled_from(["hi", "lo"]), st.sampled_from(["", "t1", "t2"])),
    st.tuples(st.just("enter_early"), st.sampled_from(["hi", "lo"]), st.sampled_from(["", "t1"])),
    st.tuples(st.just("leave"), st.integers(0, 60), st.just("")),
    st.tuples(st.just("grant"), st.just(""), st.just("")),
    st.tuples(st.just("turn"), st.sampled_from(["hi", "lo"]), st.sampled_from(["", "t1", "t2"])),
)


@settings(max_examples=400, deadline=None)
@given(ops=st.lists(_ROOM_OP, max_size=120))
def test_calls_left_in_place_never_become_head_and_keep_their_order(
    ops: list[tuple[str, Any, str]],
) -> None:
    """Arrivals (some by an earlier ticket), cancellations from anywhere, grants and a fleet's
    turns: the head is always a call still waiting, the first of its flow by ticket; the
    counts and the calls ``fail_all`` reaches are exactly the calls still waiting."""
    room = WaitingRoom({"hi": 3.0, "lo": 1.0})
    waiting_now: list[Any] = []
    early = -1
    for op, arg, tenant in ops:
        if op == "enter":
            waiting_now.append(room.enter(priority_class=arg, tenant=tenant))
        elif op == "enter_early":
            # A call refused outside the queue comes in by the ticket it took earlier.
            ticket = min((w.ticket for w in waiting_now), default=0) + early
            early -= 1
            waiting_now.append(room.enter(ticket, priority_class=arg, tenant=tenant))
        elif op == "leave" and waiting_now:
            room.leave(waiting_now.pop(arg % len(waiting_now)))
        elif op == "grant" and waiting_now:
            head = room.head()
            assert head is not None
            waiting_now.remove(head)
            room.leave(head, granted=True)
        elif op == "turn":
            room.notify(arg, tenant or None)
        head = room.head()
        assert len(room) == len(waiting_now)
        assert (head is None) == (not waiting_now)
        if head is not None:
            assert not head.left
            flow = [
                w.ticket
                for w in waiting_now
                if (w.priority_class, w.tenant) == (head.priority_class, head.tenant)
            ]
            assert head.ticket == min(flow)
        assert {id(w) for w in room._waiters()} == {id(w) for w in waiting_now}
        counted = {name: n for name, (n, _) in room.by_class().items() if n}
        expected: dict[str, int] = {}
        for w in waiting_now:
            expected[w.priority_class] = expected.get(w.priority_class, 0) + 1
        assert counted == expected
