"""Reserved permits per priority class, and permits in use counted per class, in one process:
the floor goes first, lends what it does not use, and every release path gives its count back."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from _closing import closing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _priority_walk import SCOPE, STEP, walk
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings
from polygateway.errors import ConfigError, RequestRejected
from polygateway.middleware.waiting import WaitingRoom, room_for
from polygateway.testing import (
    BoundedSleep,
    FakeClock,
    FakeTimers,
    FakeTransport,
    Gate,
    StreamScript,
    TransientError,
    chat_chunk_events,
    chat_completion,
    settle,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def _serve(room: WaitingRoom, grants: int) -> list[str]:
    """Grant the head ``grants`` times, as the loop does (leave, then hold): the classes served."""
    served = []
    for _ in range(grants):
        head = room.head()
        assert head is not None
        served.append(head.priority_class)
        room.leave(head, granted=True)
        room.hold(room.slot(head.priority_class))
    return served


class TestTheFloor:
    """The room alone: a class below its reserved permits asks first."""

    def test_a_class_below_its_floor_is_served_before_the_stride_choice(self) -> None:
        """Share 1 against 9, reserved 2: its first two calls go before any of the nine."""
        room = WaitingRoom({"interactive": 1.0, "batch": 9.0}, {"interactive": 2})
        for _ in range(10):
            room.enter(priority_class="batch")
        for _ in range(5):
            room.enter(priority_class="interactive")
        assert _serve(room, 2) == ["interactive", "interactive"]
        assert room.by_class() == {"interactive": (3, 2), "batch": (10, 0)}

    def test_without_a_floor_the_larger_share_goes_first(self) -> None:
        """The same queue with nothing reserved: stride alone, batch (share 9) first."""
        room = WaitingRoom({"interactive": 1.0, "batch": 9.0})
        for _ in range(10):
            room.enter(priority_class="batch")
        for _ in range(5):
            room.enter(priority_class="interactive")
        assert _serve(room, 1) == ["batch"]

    def test_the_floor_counts_permits_held_so_a_release_puts_the_class_first_again(self) -> None:
        """At its floor the class waits its stride turn; one of its permits released, it is next."""
        room = WaitingRoom({"interactive": 1.0, "batch": 9.0}, {"interactive": 1})
        for _ in range(10):
            room.enter(priority_class="batch")
        for _ in range(3):
            room.enter(priority_class="interactive")
        assert _serve(room, 1) == ["interactive"]
        assert _serve(room, 1) == ["batch"]  # at its floor: the stride choice (batch, share 9)
        room.unhold(room.slot("interactive"))
        head = room.head()
        assert head is not None
        assert head.priority_class == "interactive"

    def test_grants_at_the_floor_do_not_cost_the_class_its_share(self) -> None:
        """Floor grants leave the virtual time alone: above the floor, shares hold as before."""
        room = WaitingRoom({"a": 1.0, "b": 1.0}, {"a": 2})
        for _ in range(20):
            room.enter(priority_class="a")
            room.enter(priority_class="b")
        served = _serve(room, 12)
        assert served[:2] == ["a", "a"]
        assert served[2:].count("a") == served[2:].count("b") == 5

    def test_a_reserved_class_with_nobody_waiting_lends_every_permit(self) -> None:
        """Reserved 3 and no call of that class waiting: the other class takes every grant."""
        room = WaitingRoom({"interactive": 1.0, "batch": 1.0}, {"interactive": 3})
        for _ in range(5):
            room.enter(priority_class="batch")
        assert _serve(room, 5) == ["batch"] * 5
        assert room.by_class() == {"interactive": (0, 0), "batch": (0, 5)}

    def test_a_class_crossing_its_floor_wakes_the_new_head(self) -> None:
        """A permit taken without queueing lifts the class to its floor: the other head is woken."""
        room = WaitingRoom({"interactive": 1.0, "batch": 2.0}, {"interactive": 1})
        first = room.enter(priority_class="interactive")
        batch = room.enter(priority_class="batch")
        assert room.is_head(first)
        room.hold(room.slot("interactive"))  # a call of the class got a permit at once
        assert room.is_head(batch)
        assert batch._pending  # woken: it asks now rather than at its stall timer


def _settings(
    classes: dict[str, dict[str, Any]], *, concurrency: int = 2, default: str | None = None
) -> GatewaySettings:
    return GatewaySettings(
        **{
            "scopes": {
                "chat": {
                    "kind": "chat",
                    "priority_classes": classes,
                    "default_priority_class": default or next(iter(classes)),
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
            }
        }
    )


CLASSES = {"batch": {"share": 1}, "interactive": {"share": 1, "reserved": 1}}


class TestSettings:
    """``reserved`` is checked at load: a ConfigError naming the key."""

    @pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
    def test_a_reserved_that_is_not_a_whole_number_of_permits_is_refused(self, bad: Any) -> None:
        """Negative, fractional, a string, a boolean: refused, naming the class's reserved key."""
        with pytest.raises(ConfigError) as caught:
            _settings({"batch": {"share": 1}, "interactive": {"share": 1, "reserved": bad}})
        assert caught.value.field == "scopes.chat.priority_classes.interactive.reserved"
        assert "whole number of permits" in str(caught.value)

    def test_reserving_more_than_the_scope_has_is_refused(self) -> None:
        """3 + 2 reserved on a scope of 4 permits: refused with the sum and the capacity."""
        with pytest.raises(ConfigError) as caught:
            _settings(
                {"a": {"share": 1, "reserved": 3}, "b": {"share": 1, "reserved": 2}},
                concurrency=4,
            )
        assert caught.value.field == "scopes.chat.priority_classes.b.reserved"
        assert "reserve 5 permits" in str(caught.value)
        assert "(4:" in str(caught.value)

    def test_reserving_exactly_the_scope_loads(self) -> None:
        """The floors may add up to the scope's capacity; 0 is the default."""
        scope = _settings(
            {"a": {"share": 1, "reserved": 3}, "b": {"share": 1, "reserved": 1}, "c": {"share": 1}},
            concurrency=4,
        ).scope("chat")
        assert {n: c.reserved for n, c in scope.priority_classes.items()} == {
            "a": 3,
            "b": 1,
            "c": 0,
        }


def _chat(settings: GatewaySettings, clock: FakeClock, script: Any, **parts: Any) -> ChatClient:
    return closing(
        ChatClient(
            settings,
            backend=MemoryBackend(now=clock),
            transport=FakeTransport(script, clock=clock),
            now=clock,
            sleep=BoundedSleep(clock),
            rng=random.Random(5),
            **parts,
        )
    )


def _counts(chat: ChatClient) -> dict[str, tuple[int, int]]:
    return room_for(chat.backend, "chat").by_class()


IDLE = {"batch": (0, 0), "interactive": (0, 0)}


class TestPermitsInUsePerClass:
    """Each permit a call holds is counted in its class, and given back on every path."""

    async def test_a_call_that_asks_at_once_is_counted_and_uncounted(self) -> None:
        """No queue: the call still counts in its class while its attempt runs."""
        clock = FakeClock()
        gate = Gate(chat_completion("ok"))
        chat = _chat(_settings(CLASSES), clock, [gate])
        call = asyncio.create_task(chat.complete(MESSAGES, priority_class="interactive"))
        await gate.wait_entered(1)
        assert _counts(chat) == {"batch": (0, 0), "interactive": (0, 1)}
        gate.open()
        await call
        assert _counts(chat) == IDLE

    async def test_a_failing_attempt_gives_its_count_back_before_the_retry(self) -> None:
        """503 then success: the failed attempt's count is given back before the back-off."""
        clock = FakeClock()
        gate = Gate(chat_completion("ok"))
        chat = _chat(_settings(CLASSES), clock, [TransientError(status_code=503), gate])
        task = asyncio.create_task(chat.complete(MESSAGES))
        await gate.wait_entered(1)
        assert _counts(chat) == {"batch": (0, 1), "interactive": (0, 0)}
        gate.open()
        response = await task
        assert len(response.attempts) == 2
        assert _counts(chat) == IDLE

    async def test_a_rejected_request_gives_its_count_back(self) -> None:
        """400: RequestRejected at once, the count back to zero."""
        clock = FakeClock()
        chat = _chat(_settings(CLASSES), clock, [TransientError(status_code=400)])
        with pytest.raises(RequestRejected):
            await chat.complete(MESSAGES, priority_class="interactive")
        assert _counts(chat) == IDLE

    async def test_a_call_cancelled_during_its_attempt_gives_its_count_back(self) -> None:
        """Cancelled while the upstream has not answered: count and permit back at once."""
        clock = FakeClock()
        gate = Gate()
        chat = _chat(_settings(CLASSES), clock, [gate])
        task = asyncio.create_task(chat.complete(MESSAGES, priority_class="interactive"))
        await gate.wait_entered(1)
        assert _counts(chat)["interactive"] == (0, 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _counts(chat) == IDLE
        assert (await chat.backend.snapshot("chat")).in_flight == 0

    async def test_a_call_cancelled_while_waiting_holds_no_count(self) -> None:
        """Queued behind a full scope and cancelled: nothing was counted for it, nothing leaks."""
        clock = FakeClock()
        gate = Gate()
        chat = _chat(_settings(CLASSES, concurrency=1), clock, [gate, chat_completion("ok")])
        first = asyncio.create_task(chat.complete(MESSAGES))
        await gate.wait_entered(1)
        queued = asyncio.create_task(chat.complete(MESSAGES, priority_class="interactive"))
        await settle()
        assert _counts(chat) == {"batch": (0, 1), "interactive": (1, 0)}
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert _counts(chat) == {"batch": (0, 1), "interactive": (0, 0)}
        gate.open()
        await first
        assert _counts(chat) == IDLE

    async def test_a_stream_closed_early_gives_its_count_back(self) -> None:
        """A stream left after its first chunk: counted while open, uncounted at close."""
        clock = FakeClock()
        words = [f"w{i}" for i in range(5)]
        chat = _chat(_settings(CLASSES), clock, [StreamScript(chat_chunk_events(words))])
        async with chat.stream(MESSAGES, priority_class="interactive") as stream:
            async for _chunk in stream:
                assert _counts(chat)["interactive"] == (0, 1)
                break
        assert _counts(chat) == IDLE

    async def test_a_bare_async_for_broken_early_gives_its_count_back(self) -> None:
        """No ``async with``: the count comes back when the loop finalizes the stream."""
        clock = FakeClock()
        words = [f"w{i}" for i in range(5)]
        chat = _chat(_settings(CLASSES), clock, [StreamScript(chat_chunk_events(words))])
        async for _chunk in chat.stream(MESSAGES, priority_class="interactive"):
            break
        for _ in range(5):
            await asyncio.sleep(0)
        assert _counts(chat) == IDLE

    async def test_a_stream_read_to_its_end_gives_its_count_back(self) -> None:
        """A bare ``async for`` to the end: uncounted once the stream closes."""
        clock = FakeClock()
        chat = _chat(_settings(CLASSES), clock, [StreamScript(chat_chunk_events(["a", "b"]))])
        async for _chunk in chat.stream(MESSAGES):
            pass
        await settle()
        assert _counts(chat) == IDLE

    async def test_a_scope_without_classes_counts_in_the_empty_class(self) -> None:
        """No classes declared: one count, under ``""``."""
        clock = FakeClock()
        settings = _settings(CLASSES).model_copy(deep=True)
        plain = settings.scopes["chat"].model_copy(
            update={"priority_classes": {}, "default_priority_class": None}
        )
        settings = settings.model_copy(update={"scopes": {"chat": plain}})
        gate = Gate()
        chat = _chat(settings, clock, [gate])
        task = asyncio.create_task(chat.complete(MESSAGES))
        await gate.wait_entered(1)
        assert _counts(chat) == {"": (0, 1)}
        gate.open()
        await task
        assert _counts(chat) == {"": (0, 0)}


async def test_a_reserved_class_goes_first_through_the_loop_and_lends_when_idle() -> None:
    """Scope of 2, interactive (share 1 to 9) reserves 1: batch held both permits while no
    interactive call waited (lent); a queued interactive call gets the next permit freed."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    first, second = Gate(chat_completion("b")), Gate(chat_completion("b"))
    rest = Gate(chat_completion("b"))
    script = [first, second, chat_completion("third"), rest, rest, rest, rest]
    settings = _settings(
        {"batch": {"share": 9}, "interactive": {"share": 1, "reserved": 1}}, concurrency=2
    )
    transport = FakeTransport(script, clock=clock, sleep=timers.sleep)
    chat = closing(
        ChatClient(
            settings,
            backend=MemoryBackend(now=clock),
            transport=transport,
            now=clock,
            sleep=timers.sleep,
            rng=random.Random(5),
        )
    )

    async def one(label: str, priority_class: str | None = None) -> None:
        await chat.complete([{"role": "user", "content": label}], priority_class=priority_class)

    batch = [asyncio.create_task(one(f"b{i}")) for i in range(6)]
    await second.wait_entered(1)
    await settle()
    assert _counts(chat)["batch"] == (4, 2)  # the reserved permit is lent while nobody needs it
    urgent = asyncio.create_task(one("urgent", "interactive"))
    await settle()
    assert _counts(chat)["interactive"] == (1, 0)
    first.open()
    await urgent  # the next permit: ahead of the four batch calls queued before it
    order = [str(r.json["messages"][0]["content"]) for r in transport.requests]
    assert order[2] == "urgent", order
    assert _counts(chat)["interactive"] == (0, 0)
    second.open()
    rest.open()
    await asyncio.gather(*batch)
    assert _counts(chat) == IDLE


# --- random arrivals, cancellations and releases ------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(STEP, max_size=40))
def test_counts_never_go_negative_never_pass_the_limit_and_end_at_zero(
    steps: list[tuple[Any, ...]],
) -> None:
    """Random arrivals, releases (success or failure) and cancellations: the counts per class
    equal the attempts in flight of each class, within the scope's limit, and end at zero."""

    async def run() -> None:
        clock = FakeClock()
        backend = MemoryBackend(now=clock)
        await walk(steps, clock, backend, settle, _in_flight)

    asyncio.run(run())


async def _in_flight(backend: Any) -> int:
    return int((await backend.snapshot(SCOPE)).in_flight)
