"""Priority classes and tenants in one process: shares while calls wait, idle shares lent,
tenants in turn, arrival order within a tenant; checked parameters and settings."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import pytest
from _closing import closing

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings
from polygateway.errors import ConfigError, RequestRejected
from polygateway.middleware.waiting import WaitingRoom
from polygateway.testing import (
    Delay,
    FakeClock,
    FakeTimers,
    FakeTransport,
    chat_completion,
    gateway_settings,
)

MESSAGES = [{"role": "user", "content": "hi"}]
SHARES = {"interactive": 3.0, "batch": 1.0}


def _grant_order(room: WaitingRoom, grants: int) -> list[tuple[str, str, int]]:
    """Serve the head ``grants`` times: (class, tenant, ticket) of each call served."""
    served = []
    for _ in range(grants):
        head = room.head()
        assert head is not None
        served.append((head.priority_class, head.tenant, head.ticket))
        room.leave(head, granted=True)
    return served


class TestTheRoom:
    """The scheduler alone: which waiting call asks next."""

    def test_classes_get_permits_in_proportion_to_their_shares(self) -> None:
        """Both classes waiting: interactive (share 3) gets 3 permits of every 4."""
        room = WaitingRoom(SHARES)
        for _ in range(20):
            room.enter(priority_class="batch")
            room.enter(priority_class="interactive")
        served = Counter(c for c, _, _ in _grant_order(room, 16))
        assert served == {"interactive": 12, "batch": 4}

    def test_a_class_with_nobody_waiting_lends_its_share(self) -> None:
        """Only batch calls wait: every permit goes to them (work-conserving)."""
        room = WaitingRoom(SHARES)
        for _ in range(5):
            room.enter(priority_class="batch")
        assert [c for c, _, _ in _grant_order(room, 5)] == ["batch"] * 5

    def test_a_class_back_from_idle_saves_no_credit(self) -> None:
        """Batch served alone 100 times, then interactive comes: 3 to 1 again, batch not starved."""
        room = WaitingRoom(SHARES)
        for _ in range(110):
            room.enter(priority_class="batch")
        _grant_order(room, 100)
        for _ in range(10):
            room.enter(priority_class="interactive")
        served = [c for c, _, _ in _grant_order(room, 8)]
        assert served.count("batch") == 2
        assert served.count("interactive") == 6

    def test_no_class_with_a_share_starves(self) -> None:
        """A share of 0.01 against 100 still gets served within about 10,000 grants."""
        room = WaitingRoom({"big": 100.0, "tiny": 0.01})
        for _ in range(10_200):
            room.enter(priority_class="big")
        room.enter(priority_class="tiny")
        served = [c for c, _, _ in _grant_order(room, 10_100)]
        assert "tiny" in served

    def test_tenants_of_a_class_are_served_in_turn_each_in_arrival_order(self) -> None:
        """Tenant a (4 calls) and b (2 calls): a, b, a, b, a, a; each tenant's calls by ticket."""
        room = WaitingRoom()
        tickets = {t: [room.enter(tenant=t).ticket for _ in range(n)] for t, n in (("a", 4),)}
        tickets["b"] = [room.enter(tenant="b").ticket for _ in range(2)]
        order = _grant_order(room, 6)
        assert [t for _, t, _ in order] == ["a", "b", "a", "b", "a", "a"]
        assert [k for _, t, k in order if t == "a"] == tickets["a"]
        assert [k for _, t, k in order if t == "b"] == tickets["b"]

    def test_one_heavy_tenant_does_not_crowd_out_a_light_one(self) -> None:
        """A tenant with 1,000 waiting calls and one with 1: the light one is served second."""
        room = WaitingRoom()
        for _ in range(1000):
            room.enter(tenant="heavy")
        room.enter(tenant="light")
        assert [t for _, t, _ in _grant_order(room, 2)] == ["heavy", "light"]

    def test_without_classes_or_tenants_the_room_is_one_queue_in_arrival_order(self) -> None:
        """The default: tickets served in order, as before classes existed."""
        room = WaitingRoom()
        tickets = [room.enter().ticket for _ in range(5)]
        assert [k for _, _, k in _grant_order(room, 5)] == tickets

    def test_calls_waiting_are_counted_per_class(self) -> None:
        """``waiting_by_class`` counts the waiters of each class that has some."""
        room = WaitingRoom(SHARES)
        for _ in range(3):
            room.enter(priority_class="batch")
        room.enter(priority_class="interactive")
        assert room.waiting_by_class() == {"batch": 3, "interactive": 1}


def _settings(**scope: Any) -> GatewaySettings:
    base = gateway_settings({"name": "primary", "max_concurrency": 1})
    chat = base.scopes["chat"].model_copy(update=scope)
    return base.model_copy(update={"scopes": {"chat": chat}})


def _classes_settings() -> GatewaySettings:
    return GatewaySettings.model_validate(
        {
            "scopes": {
                "chat": {
                    "kind": "chat",
                    "priority_classes": {"interactive": {"share": 9}, "batch": {"share": 1}},
                    "default_priority_class": "batch",
                    "sources": [
                        {
                            "name": "primary",
                            "protocol": "openai",
                            "base_url": "http://127.0.0.1:9/primary",
                            "model": "m",
                            "api_key": "sk-test-primary-secret",
                            "max_concurrency": 1,
                        }
                    ],
                }
            }
        }
    )


class TestSettings:
    """Classes are declared per scope, with a default among them."""

    def test_classes_without_a_default_are_refused(self) -> None:
        """Declaring classes and no default_priority_class is a ConfigError naming the classes."""
        with pytest.raises(ConfigError, match="default_priority_class"):
            GatewaySettings(
                **{
                    "scopes": {
                        "chat": {
                            "kind": "chat",
                            "priority_classes": {"a": {"share": 1}},
                            "sources": [
                                {"name": "p", "protocol": "openai", "base_url": "http://h:1/v1"}
                            ],
                        }
                    }
                }
            )

    def test_a_share_must_be_positive(self) -> None:
        """A share of 0 would starve its class: refused."""
        with pytest.raises(ConfigError, match="share"):
            GatewaySettings(
                **{
                    "scopes": {
                        "chat": {
                            "kind": "chat",
                            "priority_classes": {"a": {"share": 0}},
                            "default_priority_class": "a",
                            "sources": [
                                {"name": "p", "protocol": "openai", "base_url": "http://h:1/v1"}
                            ],
                        }
                    }
                }
            )

    def test_declared_classes_load(self) -> None:
        """The classes and their default are read as declared."""
        scope = _classes_settings().scope("chat")
        assert {n: c.share for n, c in scope.priority_classes.items()} == {
            "interactive": 9.0,
            "batch": 1.0,
        }
        assert scope.default_priority_class == "batch"


def _client(settings: GatewaySettings, clock: FakeClock, **parts: Any) -> ChatClient:
    return closing(
        ChatClient(
            settings,
            backend=MemoryBackend(now=clock),
            transport=FakeTransport([], clock=clock, default=chat_completion()),
            now=clock,
            rng=random.Random(5),
            **parts,
        )
    )


class TestCheckedParameters:
    """A class the scope does not declare, or a tenant that is not a string, is refused."""

    async def test_an_unknown_class_names_the_scopes_classes(self) -> None:
        """priority_class="urgent" on a scope of interactive and batch: RequestRejected."""
        clock = FakeClock()
        chat = _client(_classes_settings(), clock)
        with pytest.raises(RequestRejected, match="batch, interactive"):
            await chat.complete(MESSAGES, priority_class="urgent")
        with pytest.raises(RequestRejected, match="priority_class"):
            chat.stream(MESSAGES, priority_class="urgent")

    async def test_a_class_on_a_scope_without_classes_is_refused(self) -> None:
        """A scope that declares no classes takes no priority_class."""
        clock = FakeClock()
        chat = _client(gateway_settings("primary"), clock)
        with pytest.raises(RequestRejected, match="declares no priority classes"):
            await chat.complete(MESSAGES, priority_class="interactive")

    async def test_a_tenant_must_be_a_string(self) -> None:
        """tenant=42 is refused before anything is sent."""
        clock = FakeClock()
        chat = _client(gateway_settings("primary"), clock)
        with pytest.raises(RequestRejected, match="tenant"):
            await chat.complete(MESSAGES, tenant=42)  # type: ignore[arg-type]  # the point


async def test_an_interactive_call_is_served_before_a_queue_of_batch_calls() -> None:
    """20 batch calls queued on one permit, then one interactive call: it is served next but one.

    Shares 9 to 1: the interactive call waits for the permit in use and at most
    one batch call, not for the twenty.
    """
    clock = FakeClock()
    timers = FakeTimers(clock)
    settings = _classes_settings()
    transport = FakeTransport([], clock=clock, sleep=timers.sleep, default=Delay(1.0, _answer()))
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

    async def one(label: str, priority_class: str) -> None:
        await chat.complete([{"role": "user", "content": label}], priority_class=priority_class)

    batch = [asyncio.create_task(one(f"b{i}", "batch")) for i in range(20)]
    for _ in range(20):
        await asyncio.sleep(0)
    urgent = asyncio.create_task(one("urgent", "interactive"))
    for _ in range(200):
        await timers.advance(0.5)
        if urgent.done() and all(t.done() for t in batch):
            break
    await asyncio.gather(urgent, *batch)
    order = [str(r.json["messages"][0]["content"]) for r in transport.requests]
    assert order.index("urgent") <= 2, order


def _answer() -> Any:
    return chat_completion("ok")
