"""Priority classes across a Redis fleet: a release gives its turn to a class, then a process.

Each ``RedisBackend`` object is a process of the fleet. A refused acquire
registers the process under each class it has calls waiting in; RELEASE picks
the class whose turn it is by the same stride scheduling as the waiting room
(shares, lending, no credit while idle), then that class's least recently
woken process, and tells it the class, so that class's head asks there.
research-wiki/designs/priority-fairness.md ("On Redis") is the design.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import _wakeups as wakeups
import pytest
import redis.asyncio as aioredis
from _wakeups import BOUND_S, listening

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings
from polygateway.middleware.waiting import WaitingRoom, room_for
from polygateway.simulator import FaultProfile, SimulatedUpstream
from polygateway.testing import FakeClock

SCOPE = "classes"
SHARES = {"interactive": 3.0, "batch": 1.0}
SUCCESS = AttemptOutcome("success")
SOURCE = SourceSpec(name="a", max_concurrency=16)
STRIDE_3_TO_1 = [
    "interactive",
    "batch",
    *["interactive"] * 3,
    "batch",
    "interactive",
    "interactive",
]
"""Eight turns of shares 3 (interactive) and 1: the larger share on the first tie."""


@pytest.fixture(autouse=True)
async def _fresh_scope(admin: aioredis.Redis) -> None:
    """Each test starts with no registry and no passes left by another."""
    await admin.flushdb()


def registry(priority_class: str) -> str:
    return f"pgw:{{{SCOPE}}}:waiting:{priority_class}"


def until(priority_class: str) -> str:
    return f"pgw:{{{SCOPE}}}:waiting_until:{priority_class}"


def room_of(backend: RedisBackend, *waiting: str, shares: dict[str, float] = SHARES) -> WaitingRoom:
    """The backend's room of the scope, classes declared, with a call waiting per class named."""
    room = room_for(backend, SCOPE)
    room.declare(shares, {})
    for priority_class in waiting:
        room.enter(priority_class=priority_class)
    return room


async def hold(backend: RedisBackend, n: int) -> list[Lease]:
    return await wakeups.hold(backend, SCOPE, SOURCE, n)


async def refused(backend: RedisBackend) -> None:
    await wakeups.refused(backend, SCOPE, SOURCE)


async def woken(room: WaitingRoom, count: int) -> None:
    async with asyncio.timeout(BOUND_S):
        while room.wakeups < count:
            await asyncio.sleep(0.005)


async def test_a_refusal_registers_the_process_under_each_class_it_waits_in(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """Registered where its calls wait, unregistered where they no longer do, all on a grant."""
    holder, p = fleet(), fleet()
    room = room_of(p, "batch")
    leases = await hold(holder, SOURCE.max_concurrency)
    await refused(p)
    assert await admin.zcard(registry("batch")) == 1
    assert await admin.zcard(registry("interactive")) == 0
    assert await admin.zcard(f"pgw:{{{SCOPE}}}:waiting") == 0, "no classless registry"
    room.leave(room.head())  # type: ignore[arg-type]
    room.enter(priority_class="interactive")
    await refused(p)
    assert await admin.zcard(registry("batch")) == 0, "it no longer waits in batch"
    assert await admin.zcard(until("batch")) == 0
    assert await admin.zcard(registry("interactive")) == 1
    batch = room.enter(priority_class="batch")
    await refused(p)
    assert await admin.zcard(registry("batch")) == 1
    room.leave(batch)
    await holder.release(leases[0], SUCCESS)
    granted = await p.acquire(SCOPE, [SOURCE], ttl_s=60.0, priority_class="interactive")
    assert granted.lease is not None
    for priority_class in SHARES:  # the grant of its last call unregisters it everywhere
        assert await admin.zcard(registry(priority_class)) == 0
        assert await admin.zcard(until(priority_class)) == 0


async def test_a_grant_keeps_the_process_registered_where_its_other_calls_wait(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, clock: FakeClock
) -> None:
    """Kept, at the back, in each class where a call waits besides the one granted.

    Unregistered there until the next refusal, the process would miss the
    turns of its class given in between (research-wiki/designs/
    priority-fairness.md, "On Redis").
    """
    holder, p, q = fleet(), fleet(), fleet()
    room_of(holder)  # its releases wake the fleet
    room = room_of(p, "interactive", "interactive", "batch")
    room_of(q, "interactive", "batch")
    await listening(admin, 3)
    leases = await hold(holder, SOURCE.max_concurrency)
    await refused(p)
    clock.advance(1.0)
    await refused(q)
    p_id, q_id = await admin.zrange(registry("interactive"), 0, -1)
    clock.advance(1.0)
    await holder.release(leases[0], SUCCESS)  # interactive's turn (the larger share): P's
    await woken(room, 1)
    granted = await p.acquire(SCOPE, [SOURCE], ttl_s=60.0, priority_class="interactive")
    assert granted.lease is not None
    assert await admin.zrange(registry("interactive"), 0, -1) == [q_id, p_id], "to the back"
    assert await admin.zrange(registry("batch"), 0, -1) == [q_id, p_id]
    assert await admin.zcard(until("interactive")) == 2
    room.leave(room.head(), granted=True)  # type: ignore[arg-type]
    # Batch's turn goes to Q, then interactive's passes Q over (its batch turn is pending):
    # P is woken, one call left in each class.
    clock.advance(1.0)
    await holder.release(leases[1], SUCCESS)
    await holder.release(leases[2], SUCCESS)
    await woken(room, 2)
    assert await admin.zrange(registry("batch"), 0, -1) == [p_id, q_id], "Q woken last"
    clock.advance(0.1)  # within the hand-off
    granted = await p.acquire(SCOPE, [SOURCE], ttl_s=60.0, priority_class="interactive")
    assert granted.lease is not None
    assert await admin.zrange(registry("interactive"), 0, -1) == [q_id], "its last call there"
    assert await admin.zrange(registry("batch"), 0, -1) == [q_id, p_id], "to the back"


async def wake_order(
    fleet: Callable[[], RedisBackend],
    admin: aioredis.Redis,
    shares: dict[str, float],
    releases: int,
) -> list[str]:
    """A process per class of ``shares``, each with a call waiting: whom ``releases`` wake."""
    holder = fleet()
    room_for(holder, SCOPE).declare(shares, {})
    procs = {name: fleet() for name in shares}
    rooms = {name: room_of(procs[name], name, shares=shares) for name in shares}
    await listening(admin, len(shares) + 1)  # the holder's room subscribes too
    leases = await hold(holder, SOURCE.max_concurrency)
    for name in shares:
        await refused(procs[name])
    order: list[str] = []
    for i, lease in enumerate(leases[:releases]):
        await holder.release(lease, SUCCESS)
        async with asyncio.timeout(BOUND_S):
            while sum(room.wakeups for room in rooms.values()) <= i:
                await asyncio.sleep(0.005)
        order.append(next(name for name, room in rooms.items() if room.wakeups > order.count(name)))
    return order


async def test_releases_go_to_the_classes_in_proportion_to_their_shares(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """P waits in batch (share 1), Q in interactive (share 3): eight releases wake Q 6, P 2.

    Round robin between the two processes would wake each 4 times: the turn
    goes to the class first. The order is the stride order: interactive on
    the tie (larger share), then batch, then interactive three times, ...
    whichever class is declared first.
    """
    assert await wake_order(fleet, admin, SHARES, 8) == STRIDE_3_TO_1


async def test_the_stride_order_does_not_depend_on_the_order_classes_are_declared(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """The same eight turns with the share-1 class declared first."""
    low_first = {"batch": 1.0, "interactive": 3.0}
    assert await wake_order(fleet, admin, low_first, 8) == STRIDE_3_TO_1


async def test_on_a_tie_of_passes_and_shares_the_class_declared_first_goes(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """Equal shares: the turns alternate, the first to the class declared first."""
    assert await wake_order(fleet, admin, {"y": 1.0, "x": 1.0}, 4) == ["y", "x", "y", "x"]


async def test_a_class_back_from_idle_gets_no_credit_for_its_idle_time(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """Batch alone takes ten turns; interactive then arrives level with it, not ten behind."""
    holder, p, q = fleet(), fleet(), fleet()
    batch = room_of(p, "batch")
    room_for(holder, SCOPE).declare(SHARES, {})
    await listening(admin, 2)  # the holder's room subscribes too
    leases = await hold(holder, SOURCE.max_concurrency)
    await refused(p)
    for i, lease in enumerate(leases[:10]):
        await holder.release(lease, SUCCESS)
        await woken(batch, i + 1)
    # Full again (nine leases more beside the six left and P's placeholder): Q is refused.
    leases = leases[10:] + await hold(holder, 9)
    interactive = room_of(q, "interactive")
    await listening(admin, 3)
    await refused(q)
    order = []
    for i, lease in enumerate(leases[:4]):
        await holder.release(lease, SUCCESS)
        async with asyncio.timeout(BOUND_S):
            while batch.wakeups + interactive.wakeups < 11 + i:
                await asyncio.sleep(0.005)
        order.append("interactive" if interactive.wakeups > order.count("interactive") else "batch")
    # Level at 10: interactive on the tie (larger share), batch, then interactive twice.
    # Ten behind, it would take all four; started at batch's last pass (9), the first three.
    assert order == ["interactive", "batch", "interactive", "interactive"]


@pytest.mark.parametrize(
    ("passes", "first"),
    [
        ({"interactive": 4, "batch": 2}, "interactive"),  # both level at 10: the larger share
        ({"interactive": 12, "batch": 2}, "batch"),  # interactive ahead at 12, batch at 10
    ],
)
async def test_classes_back_together_from_idle_start_where_the_last_turn_left_off(
    fleet: Callable[[], RedisBackend],
    admin: aioredis.Redis,
    passes: dict[str, int],
    first: str,
) -> None:
    """Nobody waited at the last wake-up, which left off at 10 (``vtime``): both classes
    come back with their pass raised to 10, not with the credit of their idle time."""
    holder, p, q = fleet(), fleet(), fleet()
    room_for(holder, SCOPE).declare(SHARES, {})
    rooms = {"interactive": room_of(p, "interactive"), "batch": room_of(q, "batch")}
    await listening(admin, 3)
    leases = await hold(holder, SOURCE.max_concurrency)
    state = {"vtime": "10", "on:interactive": "0", "on:batch": "0"}
    state |= {f"pass:{name}": str(value) for name, value in passes.items()}
    await admin.hset(f"pgw:{{{SCOPE}}}:classes", mapping=state)
    await refused(p)
    await refused(q)
    await holder.release(leases[0], SUCCESS)
    async with asyncio.timeout(BOUND_S):
        while sum(room.wakeups for room in rooms.values()) < 1:
            await asyncio.sleep(0.005)
    assert {name: room.wakeups for name, room in rooms.items()} == {
        name: int(name == first) for name in rooms
    }


async def test_with_three_classes_a_release_keeps_the_passes_in_the_classes_hash(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """Three classes (six registry keys before the passes' hash): the release wakes the one
    waiting class and moves its pass in ``pgw:{scope}:classes``."""
    three = {**SHARES, "bulk": 1.0}
    holder, p = fleet(), fleet()
    room_of(holder, shares=three)
    bulk = room_of(p, "bulk", shares=three)
    await listening(admin, 2)
    leases = await hold(holder, SOURCE.max_concurrency)
    await refused(p)
    await holder.release(leases[0], SUCCESS)
    await woken(bulk, 1)
    passes = await admin.hgetall(f"pgw:{{{SCOPE}}}:classes")
    assert float(passes["pass:bulk"]) == 1.0, passes
    assert passes["on:bulk"] == "1"


async def test_a_class_whose_registrations_lapsed_takes_no_turn(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, clock: FakeClock
) -> None:
    """Interactive's one process stopped polling 60 s ago (lapsed at that very instant):
    the release goes to batch's process, not to an empty class with the larger share."""
    holder, p, q = fleet(), fleet(), fleet()
    room_for(holder, SCOPE).declare(SHARES, {})
    lapsed, batch = room_of(p, "interactive"), room_of(q, "batch")
    await listening(admin, 3)
    leases = await hold(holder, SOURCE.max_concurrency)
    await refused(p)
    clock.advance(60.0)  # the registration's TTL: it expires now
    await refused(q)
    await holder.release(leases[0], SUCCESS)
    await woken(batch, 1)
    assert lapsed.wakeups == 0
    assert await admin.zcard(registry("interactive")) == 0, "swept"
    assert await admin.zcard(until("interactive")) == 0, "swept from the expiry set too"


async def test_the_releasing_process_is_told_which_class_the_turn_is_for(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """P waits in both classes; the fleet owes batch a turn: P's own release makes batch head.

    P's room alone would pick interactive (level passes, the larger share).
    """
    p = fleet()
    room = room_of(p, "interactive", "batch")
    leases = await hold(p, SOURCE.max_concurrency)
    await refused(p)
    assert room.head() is not None
    assert room.head().priority_class == "interactive"
    await admin.hset(
        f"pgw:{{{SCOPE}}}:classes",
        mapping={"pass:interactive": 5, "on:interactive": 1, "pass:batch": 0, "on:batch": 1},
    )
    await p.release(leases[0], SUCCESS)
    await woken(room, 1)
    head = room.head()
    assert head is not None
    assert head.priority_class == "batch"
    assert (await p.acquire(SCOPE, [SOURCE], ttl_s=60.0)).lease is not None
    room.leave(head, granted=True)
    after = room.head()
    assert after is not None
    assert after.priority_class == "interactive", "the turn was one grant"


def _settings(url: str, base_url: str) -> GatewaySettings:
    return GatewaySettings.model_validate(
        {
            "backend": "redis",
            "redis_url": url,
            "poll_interval_s": 2.0,  # far above the test's run: only wake-ups serve waiters
            "scopes": {
                SCOPE: {
                    "kind": "chat",
                    "priority_classes": {"interactive": {"share": 3}, "batch": {"share": 1}},
                    "default_priority_class": "batch",
                    "sources": [
                        {
                            "name": "a",
                            "protocol": "openai",
                            "base_url": base_url,
                            "api_key": "sk-test",
                            "max_concurrency": 2,
                            "timeout_s": 10,
                        }
                    ],
                }
            },
        }
    )


@pytest.mark.timeout(60)
async def test_two_processes_one_class_each_are_served_in_proportion_to_the_shares(
    redis_url: str,
) -> None:
    """Over real sockets: A floods batch, B floods interactive, 2 permits: B gets about 3:1.

    With turns per process (no classes on the fleet's wake-ups) the two would
    share 1:1. Counted over the 80 calls after both queues filled.
    """
    async with SimulatedUpstream({"a": FaultProfile(latency_s=0.04)}) as sim:
        settings = _settings(redis_url, sim.base_url("a"))
        served: list[str] = []
        async with wakeups.two_processes(redis_url, settings, SCOPE) as ((_, chat_a), (_, chat_b)):

            async def one(chat: ChatClient, priority_class: str) -> None:
                await wakeups.ask_in_class(chat, priority_class)
                served.append(priority_class)

            async with asyncio.timeout(45):
                tasks = [asyncio.create_task(one(chat_a, "batch")) for _ in range(70)]
                tasks += [asyncio.create_task(one(chat_b, "interactive")) for _ in range(70)]
                window = await wakeups.served_window(served, tasks, 10, 90)
        assert sim.stats("a").max_concurrent <= 2
    # 3:1 is 60:20, and is what this run gives; turns per process would give 40:40 (and
    # do: see the design page). Unregistered at each grant until its next call's refusal
    # (a round trip later), B lost the turns released meanwhile to batch: 45:35 on a busy
    # machine. A turn can still go to batch when two interactive turns come before B's
    # claim of the first (a process holds one placeholder per source).
    assert window["interactive"] >= 2.5 * window["batch"], window


async def test_the_class_registries_and_passes_expire_like_the_rest_of_the_scope(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """A crashed fleet leaves nothing for ever: registries live 61 s, the passes a day."""
    holder, p = fleet(), fleet()
    room = room_of(p, "batch")
    room_for(holder, SCOPE).declare(SHARES, {})
    await listening(admin, 2)
    leases = await hold(holder, SOURCE.max_concurrency)
    await refused(p)
    assert await admin.ttl(registry("batch")) == 61
    assert await admin.ttl(until("batch")) == 61
    await holder.release(leases[0], SUCCESS)
    await woken(room, 1)
    assert await admin.ttl(f"pgw:{{{SCOPE}}}:classes") == 86400
