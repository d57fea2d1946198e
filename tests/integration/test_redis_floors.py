"""Reserved floors across a Redis fleet: a class below its floor fleet-wide takes the turn.

Each ``RedisBackend`` object is a process of the fleet. A grant to a call of
a class with reserved permits adds its lease to ``pgw:{scope}:held:<class>``
(lease id -> expiry), its renewals extend it and its release removes it;
RELEASE's wake-up prefers a live class holding fewer live leases there than
its ``reserved``, before the stride order, without moving its pass.
research-wiki/designs/priority-fairness.md ("On Redis") is the design.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import _wakeups as wakeups
import pytest
import redis.asyncio as aioredis
from _behind import released
from _wakeups import BOUND_S, listening

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.backends.redis import wire as wire_module
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings
from polygateway.middleware.waiting import WaitingRoom, room_for
from polygateway.simulator import FaultProfile, SimulatedUpstream
from polygateway.testing import FakeClock

SCOPE = "floors"
SHARES = {"a": 1.0, "b": 9.0}
RESERVED = {"a": 2}
SUCCESS = AttemptOutcome("success")
SOURCE = SourceSpec(name="s", max_concurrency=4)


@pytest.fixture(autouse=True)
async def _fresh_scope(admin: aioredis.Redis) -> None:
    """Each test starts with no registry, passes or counts left by another."""
    await admin.flushdb()


def held(priority_class: str) -> str:
    return f"pgw:{{{SCOPE}}}:held:{priority_class}"


def room_of(
    backend: RedisBackend, *waiting: str, reserved: dict[str, int] = RESERVED
) -> WaitingRoom:
    """The backend's room of the scope, classes declared, a call waiting per class named."""
    room = room_for(backend, SCOPE)
    room.declare(SHARES, reserved)
    for priority_class in waiting:
        room.enter(priority_class=priority_class)
    return room


async def hold(
    backend: RedisBackend, n: int, priority_class: str = "b", ttl_s: float = 1000.0
) -> list[Lease]:
    return await wakeups.hold(backend, SCOPE, SOURCE, n, ttl_s=ttl_s, priority_class=priority_class)


async def refused(backend: RedisBackend, priority_class: str) -> None:
    await wakeups.refused(backend, SCOPE, SOURCE, priority_class=priority_class)


async def live(admin: aioredis.Redis, priority_class: str, now: float) -> int:
    return int(await admin.zcount(held(priority_class), f"({now!r}", "+inf"))


async def woken(rooms: Sequence[WaitingRoom], count: int) -> None:
    async with asyncio.timeout(BOUND_S):
        while sum(room.wakeups for room in rooms) < count:
            await asyncio.sleep(0.005)


async def test_a_reserved_class_counts_its_leases_fleet_wide(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, clock: FakeClock
) -> None:
    """A grant of class a joins held:a, a renewal extends it, a release removes it; b is
    counted nowhere (no floor), and the count is back to zero at the end."""
    p = fleet()
    room_of(p)
    (lease,) = await hold(p, 1, "a", ttl_s=30.0)
    (other,) = await hold(p, 1, "b")
    assert lease.priority_class == "a"
    assert other.priority_class is None, "b reserves nothing: in no count"
    assert await admin.zrange(held("a"), 0, -1) == [lease.lease_id]
    assert not await admin.exists(held("b"))
    assert 61 <= await admin.ttl(held("a")) <= 62, (
        "twice the lease TTL, ceil(30) + 1, to outlive it"
    )
    clock.advance(20.0)
    await admin.expire(held("a"), 5)  # less than the renewed lease needs: set again
    assert await p.renew(lease)
    assert await admin.zscore(held("a"), lease.lease_id) == pytest.approx(clock() + 30.0)
    assert 61 <= await admin.ttl(held("a")) <= 62, "twice ceil(30) + 1 again"
    await p.release(lease, SUCCESS)
    await p.release(other, SUCCESS)
    await p.snapshot(SCOPE)  # one round trip more: the releases written behind have run
    assert await live(admin, "a", clock()) == 0
    assert not await admin.exists(held("a"))


async def test_a_reserved_class_counts_its_leases_when_its_calls_name_tenants(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """With tenants, ACQUIRE carries three tenant keys per class before the held key, the
    last: the grant still joins held:a, and b's lease joins no count."""
    p = fleet()
    room = room_of(p)
    room.enter(priority_class="a", tenant="T1")
    room.enter(priority_class="b", tenant="T2")
    (lease,) = await hold(p, 1, "a")
    (other,) = await hold(p, 1, "b")
    assert await admin.zrange(held("a"), 0, -1) == [lease.lease_id]
    assert not await admin.exists(held("b"))
    assert other.lease_id not in await admin.zrange(held("a"), 0, -1)


async def test_a_fleet_user_allowed_only_the_gateways_keys_holds_floors_and_classes(
    locked_fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """Classes, reserved floors and the hand-off touch pgw:{scope} keys only: a Redis user
    allowed no other key or channel counts, registers, wakes and renews."""
    p1, p2 = locked_fleet(), locked_fleet()
    rooms = {"a": room_of(p1, "a"), "b": room_of(p2, "b")}
    await listening(admin, 2)
    leases = await hold(p2, SOURCE.max_concurrency, "b")
    await refused(p1, "a")
    await refused(p2, "b")
    await p2.release(leases[0], SUCCESS)
    await woken(list(rooms.values()), 1)
    assert rooms["a"].wakeups == 1, "a is below its floor: its room is woken"
    (got,) = await hold(p1, 1, "a", ttl_s=30.0)
    assert await admin.zrange(held("a"), 0, -1) == [got.lease_id]
    assert await p1.renew(got)
    await released(p1, got, SUCCESS)
    assert await admin.zrange(held("a"), 0, -1) == [], "the release ran: a's count is 0"


async def test_a_class_reserving_one_permit_and_holding_none_is_below_its_floor(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """a reserves 1 and holds 0 fleet-wide: the release goes to a, though b's share is 9."""
    p1, p2 = fleet(), fleet()
    one = {"a": 1}
    rooms = [room_of(p1, "a", reserved=one), room_of(p2, "b", reserved=one)]
    await listening(admin, 2)
    leases = await hold(p2, SOURCE.max_concurrency, "b")
    await refused(p1, "a")
    await refused(p2, "b")
    await p2.release(leases[0], SUCCESS)
    await woken(rooms, 1)
    assert [room.wakeups for room in rooms] == [1, 0]


async def test_a_scope_without_reserved_classes_sends_todays_keys_and_arguments(
    fleet: Callable[[], RedisBackend],
    admin: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No held key, no floors argument, no class on the lease: nothing changes for them."""
    sent: list[tuple[list[bytes], int]] = []
    command = wire_module.Script.command

    def spy(self: Any, keys: Sequence[Any], argv: Sequence[Any]) -> bytes:
        sent.append(([bytes(k) for k in keys], len(argv)))
        return command(self, keys, argv)

    monkeypatch.setattr(wire_module.Script, "command", spy)
    holder, p = fleet(), fleet()
    room_for(holder, SCOPE).declare(SHARES, {})
    room_of(p, "a", reserved={})
    await listening(admin, 2)
    leases = await hold(holder, SOURCE.max_concurrency, "a")
    assert all(lease.priority_class is None for lease in leases)
    await refused(p, "a")
    await holder.release(leases[0], SUCCESS)
    await woken([room_for(p, SCOPE)], 1)
    assert not any(b":held:" in key for keys, _ in sent for key in keys)
    assert not await admin.keys("*held*")
    # RELEASE with two classes: the source's 2 keys, progress and verdicts, two registry keys
    # per class and the classes' hash; the 15 arguments and a name and a share per class.
    assert (len(sent[-1][0]), sent[-1][1]) == (2 + 2 + 4 + 1, 15 + 4)


async def wake_classes(
    rooms: dict[str, WaitingRoom], releases: Sequence[tuple[RedisBackend, Lease]], order: list[str]
) -> None:
    """Release each lease in turn and note the class of the room the fleet woke."""
    for backend, lease in releases:
        before = {name: room.wakeups for name, room in rooms.items()}
        await backend.release(lease, SUCCESS)
        await woken(list(rooms.values()), sum(before.values()) + 1)
        order.append(next(n for n, room in rooms.items() if room.wakeups > before[n]))


async def test_a_class_below_its_floor_fleet_wide_takes_the_releases_of_another_process(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, clock: FakeClock
) -> None:
    """a (reserved 2, share 1) waits in P1 only, b (share 9) in P2, which holds every permit.

    P2's releases go to a until a holds 2 fleet-wide, then by stride (b first: the
    floor's turns did not move a's pass). Without fleet-wide floors the stride order
    gives b, a, b, ...: P1's own floor never sees P2's releases.
    """
    p1, p2 = fleet(), fleet()
    rooms = {"a": room_of(p1, "a", "a", "a"), "b": room_of(p2, "b", "b", "b")}
    await listening(admin, 2)
    leases = await hold(p2, SOURCE.max_concurrency, "b")
    await refused(p1, "a")
    await refused(p2, "b")
    order: list[str] = []
    await wake_classes(rooms, [(p2, leases[0])], order)
    assert order == ["a"], "below its floor (0 of 2): a first, though b's share is 9"
    got = await hold(p1, 1, "a")  # claims the permit promised to P1
    rooms["a"].leave(rooms["a"].head(), granted=True)  # type: ignore[arg-type]
    assert await live(admin, "a", clock()) == 1
    await refused(p1, "a")
    await wake_classes(rooms, [(p2, leases[1])], order)
    got += await hold(p1, 1, "a")
    rooms["a"].leave(rooms["a"].head(), granted=True)  # type: ignore[arg-type]
    assert order == ["a", "a"]
    assert await live(admin, "a", clock()) == 2, "a holds its floor fleet-wide"
    await refused(p1, "a")
    await refused(p2, "b")
    await wake_classes(rooms, [(p2, leases[2])], order)
    assert order == ["a", "a", "b"], "at its floor: stride, a tie the larger share wins"
    assert await admin.hget(f"pgw:{{{SCOPE}}}:classes", "pass:a") == "0"
    for lease in got:
        await p1.release(lease, SUCCESS)
    await p1.snapshot(SCOPE)
    assert await live(admin, "a", clock()) == 0, "back to zero"


async def test_a_crashed_process_lapsed_leases_no_longer_count_toward_the_floor(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, clock: FakeClock
) -> None:
    """P3 holds a's 2 (then crashes): b's turn by stride; once they lapse, a's by its floor."""
    p1, p2, p3 = fleet(), fleet(), fleet()
    room_of(p3)
    rooms = {"a": room_of(p1, "a"), "b": room_of(p2, "b", "b")}
    await listening(admin, 3)
    crashed = await hold(p3, 2, "a", ttl_s=10.0)
    leases = await hold(p2, 2, "b")
    await refused(p1, "a")
    await refused(p2, "b")
    # The fleet owes b the turn by stride: only the floor can give it to a.
    await admin.hset(
        f"pgw:{{{SCOPE}}}:classes", mapping={"pass:a": 0, "on:a": 1, "pass:b": -5, "on:b": 1}
    )
    order: list[str] = []
    await wake_classes(rooms, [(p2, leases[0])], order)
    assert order == ["b"], "a holds 2 fleet-wide (in P3): at its floor"
    clock.advance(10.0)  # P3's leases lapse, never released (P2's promise too)
    assert await live(admin, "a", clock()) == 0
    await hold(p2, 3, "b")  # full again: b's leases in place of P3's
    await refused(p1, "a")
    await refused(p2, "b")
    await wake_classes(rooms, [(p2, leases[1])], order)
    assert order == ["b", "a"], "lapsed: a is below its floor again"
    # Dead members stay until a release of class a sweeps them, or their key expires
    # (twice the longest lease TTL, plus a second each way, after the last grant).
    assert crashed[0].lease_id in await admin.zrange(held("a"), 0, -1)
    assert 0 < await admin.ttl(held("a")) <= 22


async def test_on_redis_the_room_leaves_the_floor_to_the_fleet(
    fleet: Callable[[], RedisBackend],
) -> None:
    """A room on Redis applies no per-process floor: its count is one process's."""
    room = room_of(fleet(), "a", "b")
    assert room.fleet_floors
    head = room.head()
    assert head is not None
    assert head.priority_class == "b", "stride: the tie to the larger share, no local floor"
    local = WaitingRoom(SHARES, RESERVED)
    local.enter(priority_class="a")
    local.enter(priority_class="b")
    assert local.head().priority_class == "a"  # type: ignore[union-attr]


def _settings(url: str, base_url: str) -> GatewaySettings:
    return GatewaySettings.model_validate(
        {
            "backend": "redis",
            "redis_url": url,
            "poll_interval_s": 2.0,  # far above the test's run: only wake-ups serve waiters
            "scopes": {
                SCOPE: {
                    "kind": "chat",
                    "priority_classes": {"a": {"share": 1, "reserved": 2}, "b": {"share": 9}},
                    "default_priority_class": "b",
                    "sources": [
                        {
                            "name": "s",
                            "protocol": "openai",
                            "base_url": base_url,
                            "api_key": "sk-test",
                            "max_concurrency": 4,
                            "timeout_s": 10,
                        }
                    ],
                }
            },
        }
    )


@pytest.mark.timeout(60)
async def test_over_real_sockets_a_holds_its_floor_fleet_wide(redis_url: str) -> None:
    """P2 floods b; P1's a calls then hold 2 permits (fleet-wide) nearly all the time.

    Measured by sampling P1's room (a's calls are all there: its count is the
    fleet's). Without fleet-wide floors P2's releases go to b 9 times in 10 and
    a rarely holds 2.
    """
    async with SimulatedUpstream({"s": FaultProfile(latency_s=0.03)}) as sim:
        settings = _settings(redis_url, sim.base_url("s"))
        samples: list[int] = []
        async with wakeups.two_processes(redis_url, settings, SCOPE) as ((p1, chat_1), (_, chat_2)):

            async def flood(chat: ChatClient, priority_class: str, n: int) -> None:
                await asyncio.gather(
                    *(wakeups.ask_in_class(chat, priority_class) for _ in range(n))
                )

            room = room_for(p1, SCOPE)
            async with asyncio.timeout(45):
                bs = asyncio.create_task(flood(chat_2, "b", 400))
                while sim.stats("s").max_concurrent < 4:
                    await asyncio.sleep(0.005)
                a_calls = asyncio.create_task(flood(chat_1, "a", 40))
                await asyncio.sleep(0.2)  # a's calls queue; the floor takes hold
                for _ in range(100):
                    samples.append(room.by_class()["a"][1])
                    await asyncio.sleep(0.005)
                a_calls.cancel()
                bs.cancel()
                await asyncio.gather(a_calls, bs, return_exceptions=True)
        assert sim.stats("s").max_concurrent <= 4
    at_floor = sum(1 for n in samples if n >= 2)
    assert at_floor >= 50, samples
