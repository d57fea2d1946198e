"""The hand-off on a real Redis: a released permit is held for the process its wake-up names.

Each ``RedisBackend`` object is a process of the fleet (its own process id and
subscription). The scripts run on the tests' ``FakeClock`` (their ``now``
argument), so a placeholder's lapse is a clock step, not a sleep; only the
wake-up subscriptions are real. research-wiki/designs/fleet-wakeups.md is the
design.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from _leases import LEASES_ONLY
from _wakeups import BOUND_S, FLEET_SOCKET_TIMEOUT_S, listening

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.backends.redis.wire import bulk
from polygateway.middleware.waiting import WaitingRoom, room_for
from polygateway.testing import FakeClock

SCOPE = "handoff"
LEASES = f"pgw:{{{SCOPE}}}:leases:a"
WAITING = f"pgw:{{{SCOPE}}}:waiting"
SUCCESS = AttemptOutcome("success")


def spec(max_concurrency: int, **limits: Any) -> SourceSpec:
    return SourceSpec(name="a", max_concurrency=max_concurrency, **limits)


def waiting_in(backend: RedisBackend) -> WaitingRoom:
    """The backend's room of the scope with a call in it: its acquires name its process."""
    room = room_for(backend, SCOPE)
    room.enter()
    return room


async def hold(backend: RedisBackend, n: int, source: SourceSpec) -> list[Lease]:
    leases = []
    for _ in range(n):
        lease = (await backend.acquire(SCOPE, [source], ttl_s=1000.0)).lease
        assert lease is not None
        leases.append(lease)
    return leases


async def refused(backend: RedisBackend, source: SourceSpec, reason: str) -> None:
    result = await backend.acquire(SCOPE, [source], ttl_s=60.0)
    assert result.lease is None
    assert [r.reason for r in result.rejections] == [reason]


async def register(admin: aioredis.Redis, backend: RedisBackend, source: SourceSpec) -> str:
    """Refuse ``backend`` for concurrency, which registers it; its process id."""
    before = set(await admin.zrange(WAITING, 0, -1))
    await refused(backend, source, "concurrency")
    (proc,) = set(await admin.zrange(WAITING, 0, -1)) - before
    return str(proc)


async def woken(room: WaitingRoom, count: int = 1) -> None:
    async with asyncio.timeout(BOUND_S):
        while room.wakeups < count:
            await asyncio.sleep(0.005)


@dataclass(frozen=True)
class Waiting:
    """``holder`` holds every permit of the source; ``p`` has a call waiting, registered."""

    holder: RedisBackend
    p: RedisBackend
    room: WaitingRoom
    leases: list[Lease]
    proc: str


async def p_waiting(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, source: SourceSpec
) -> Waiting:
    """The common start: a holder at the source's limit, P refused for it and listening."""
    holder, p = fleet(), fleet()
    room = waiting_in(p)
    await listening(admin, 1)
    leases = await hold(holder, source.max_concurrency, source)
    proc = await register(admin, p, source)
    return Waiting(holder, p, room, leases, proc)


async def test_a_permit_handed_to_a_waiting_process_is_refused_to_others_and_granted_to_it(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """A release holds the permit for waiting P: others are refused; P's lease replaces it."""
    holder, p, other = fleet(), fleet(), fleet()
    room = waiting_in(p)
    room_for(other, SCOPE)  # an empty room: other's calls ask at once, with its process id
    await listening(admin, 2)
    (lease,) = await hold(holder, 1, spec(1))
    proc = await register(admin, p, spec(1))
    await holder.release(lease, SUCCESS)
    await woken(room)
    assert await admin.zrangebyscore(LEASES, *LEASES_ONLY) == [f"handoff:{proc}"]
    await refused(other, spec(1), "concurrency")
    await refused(holder, spec(1), "concurrency")
    snapshot = await other.snapshot(SCOPE)
    assert snapshot.sources[0].in_flight == 1, "the promised permit is counted"
    granted = (await p.acquire(SCOPE, [spec(1)], ttl_s=60.0)).lease
    assert granted is not None
    assert await admin.zrangebyscore(LEASES, *LEASES_ONLY) == [granted.lease_id]
    assert proc not in await admin.zrange(WAITING, 0, -1), "a grant unregisters P"


async def test_an_unclaimed_placeholder_lapses_after_the_handoff_ttl(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, clock: FakeClock
) -> None:
    """A permit held for a process that never asks is anyone's once the socket timeout passed."""
    w = await p_waiting(fleet, admin, spec(1))
    clock.advance(30.0)  # within P's registration (60 s)
    # The lease zset as older scripts left it, no SKIPLIST member: the release empties it.
    expiry = await admin.zscore(LEASES, w.leases[0].lease_id)
    await admin.delete(LEASES)
    await admin.zadd(LEASES, {w.leases[0].lease_id: expiry})
    await w.holder.release(w.leases[0], SUCCESS)
    await woken(w.room)
    # The placeholder made the lease key anew; the lease that claims it will live in it, so
    # it gets what the source's state has left (a day from its first acquire), not 1 s more.
    assert await admin.ttl(LEASES) == 86_400 - 30
    clock.advance(FLEET_SOCKET_TIMEOUT_S - 0.01)
    await refused(w.holder, spec(1), "concurrency")
    clock.advance(0.01)
    assert (await w.holder.acquire(SCOPE, [spec(1)], ttl_s=60.0)).lease is not None


async def test_a_placeholder_at_its_exact_expiry_is_no_longer_the_processs(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, clock: FakeClock
) -> None:
    """At the instant its placeholder lapses, the permit is anyone's: taken by another, P
    is refused, as a lease expiring at that instant is dead."""
    w = await p_waiting(fleet, admin, spec(1))
    await w.holder.release(w.leases[0], SUCCESS)
    await woken(w.room)
    clock.advance(FLEET_SOCKET_TIMEOUT_S)
    assert (await w.holder.acquire(SCOPE, [spec(1)], ttl_s=60.0)).lease is not None
    await refused(w.p, spec(1), "concurrency")


async def test_releasing_a_lease_that_expired_wakes_nobody(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, clock: FakeClock
) -> None:
    """A lease gone by its TTL frees nothing when released late: no wake-up, no placeholder."""
    b = fleet()
    room = waiting_in(b)
    await listening(admin, 1)
    (lease,) = await hold(b, 1, spec(1))
    await register(admin, b, spec(1))
    clock.advance(1000.0)  # the lease's TTL
    await b.release(lease, SUCCESS)
    await b.snapshot(SCOPE)  # one more round trip on the same connection: the reply was read
    assert room.wakeups == 0
    assert await admin.zrangebyscore(LEASES, *LEASES_ONLY) == []


async def test_a_claiming_process_is_still_refused_by_rpm(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """The placeholder passes the concurrency check only: an empty rpm bucket refuses P too."""
    source = spec(1, rpm=1.0)
    w = await p_waiting(fleet, admin, source)
    await w.holder.release(w.leases[0], SUCCESS)
    await woken(w.room)
    await refused(w.p, source, "rpm")
    assert len(await admin.zrangebyscore(LEASES, *LEASES_ONLY)) == 1, (
        "the placeholder waits for its TTL"
    )


async def test_a_claiming_process_is_still_refused_by_an_open_breaker(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """A release that trips the breaker still hands the permit on, and the breaker refuses P."""
    w = await p_waiting(fleet, admin, spec(1))
    await w.holder.release(w.leases[0], AttemptOutcome("source_misconfigured"))
    await woken(w.room)
    await refused(w.p, spec(1), "breaker_open")


async def test_no_permit_is_held_beyond_a_limit_that_aimd_just_lowered(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """A release leaving the source at its lowered limit wakes P but holds nothing for it."""
    w = await p_waiting(fleet, admin, spec(4))
    await w.holder.release(w.leases[0], AttemptOutcome("rate_limited"))  # limit 4 -> 2.8
    await woken(w.room)
    assert f"handoff:{w.proc}" not in await admin.zrangebyscore(LEASES, *LEASES_ONLY)
    await w.holder.release(w.leases[1], AttemptOutcome("cancelled"))  # 2 leases, limit 2
    await woken(w.room, 2)
    assert await admin.zrangebyscore(LEASES, *LEASES_ONLY) == [
        w.leases[2].lease_id,
        w.leases[3].lease_id,
    ]


async def test_a_process_already_promised_a_permit_is_passed_over_for_the_next(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, clock: FakeClock
) -> None:
    """P, first in line but holding a promise, is skipped: the next release is held for Q."""
    holder, p, q = fleet(), fleet(), fleet()
    rooms = waiting_in(p), waiting_in(q)
    await listening(admin, 2)
    leases = await hold(holder, 3, spec(3))
    first = await register(admin, p, spec(3))
    await holder.release(leases[0], SUCCESS)  # promised to P, whose score becomes now
    await woken(rooms[0])
    clock.advance(0.1)
    second = await register(admin, q, spec(3))  # Q registers after P was woken: behind P
    await holder.release(leases[1], SUCCESS)
    await woken(rooms[1])
    held = set(await admin.zrangebyscore(LEASES, *LEASES_ONLY)) - {leases[2].lease_id}
    assert held == {f"handoff:{first}", f"handoff:{second}"}


async def test_a_lone_waiting_process_already_promised_is_woken_with_nothing_more_held(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """Every registered process holding a promise: a release wakes the first, holding nothing."""
    w = await p_waiting(fleet, admin, spec(2))
    other = fleet()
    await w.holder.release(w.leases[0], SUCCESS)
    await woken(w.room)
    await w.holder.release(w.leases[1], SUCCESS)
    await woken(w.room, 2)
    assert await admin.zrangebyscore(LEASES, *LEASES_ONLY) == [f"handoff:{w.proc}"]
    assert (await other.acquire(SCOPE, [spec(2)], ttl_s=60.0)).lease is not None


async def _published(admin: aioredis.Redis) -> int:
    """PUBLISH commands the server has run so far."""
    stats = await admin.info("commandstats")
    return int(stats.get("cmdstat_publish", {}).get("calls", 0))


async def test_the_releasing_process_holds_a_permit_for_itself_when_the_turn_is_its_own(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """Self-handoff: P's own release, P first in line, is held for P's head against the rest;
    P hears of it in the release's reply, with no wake-up published."""
    p, other = fleet(), fleet()
    room = waiting_in(p)
    await listening(admin, 1)
    (lease,) = await hold(p, 1, spec(1))
    proc = await register(admin, p, spec(1))
    published = await _published(admin)
    await p.release(lease, SUCCESS)
    await woken(room)
    assert await _published(admin) == published, "its own turn: nothing published"
    assert await admin.zrangebyscore(LEASES, *LEASES_ONLY) == [f"handoff:{proc}"]
    await refused(other, spec(1), "concurrency")
    assert (await p.acquire(SCOPE, [spec(1)], ttl_s=60.0)).lease is not None


async def test_a_permit_held_for_a_process_that_stopped_listening_goes_to_the_next(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, clock: FakeClock
) -> None:
    """On one server a wake-up nobody hears takes its placeholder back and holds it for the next."""
    holder, gone, alive = fleet(), fleet(), fleet()
    waiting_in(gone)
    room = waiting_in(alive)
    await listening(admin, 2)
    (lease,) = await hold(holder, 1, spec(1))
    await register(admin, gone, spec(1))
    clock.advance(0.1)  # gone first in line
    proc = await register(admin, alive, spec(1))
    await gone.aclose()
    async with asyncio.timeout(BOUND_S):
        while len(await admin.pubsub_channels("pgw:wake:*")) > 1:
            await asyncio.sleep(0.01)
    await holder.release(lease, SUCCESS)
    await woken(room)
    assert await admin.zrangebyscore(LEASES, *LEASES_ONLY) == [f"handoff:{proc}"]
    # The key emptied when the first placeholder was taken back, and the second made it anew:
    # it expires with the source's state, as the lease that claims it will need.
    assert await admin.ttl(LEASES) > 3600


async def test_the_permit_is_held_for_the_first_registered_process_only(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, clock: FakeClock
) -> None:
    """P registered before Q: one release holds one permit, for P, and wakes P alone."""
    holder, p, q = fleet(), fleet(), fleet()
    rooms = waiting_in(p), waiting_in(q)
    await listening(admin, 2)
    leases = await hold(holder, 2, spec(2))
    first = await register(admin, p, spec(2))
    clock.advance(0.1)
    await register(admin, q, spec(2))
    await holder.release(leases[0], SUCCESS)
    await woken(rooms[0])
    assert set(await admin.zrangebyscore(LEASES, *LEASES_ONLY)) == {
        leases[1].lease_id,
        f"handoff:{first}",
    }
    assert rooms[1].wakeups == 0


async def test_with_every_process_promised_the_least_recently_woken_is_woken_again(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, clock: FakeClock
) -> None:
    """P and Q each hold a promise: a third release wakes P (woken first), holding nothing."""
    holder, p, q = fleet(), fleet(), fleet()
    rooms = waiting_in(p), waiting_in(q)
    await listening(admin, 2)
    leases = await hold(holder, 3, spec(3))
    await register(admin, p, spec(3))
    clock.advance(0.1)  # P first in line: equal scores would order by process id
    await register(admin, q, spec(3))
    for i in range(2):
        clock.advance(0.1)
        await holder.release(leases[i], SUCCESS)
        await woken(rooms[i])
    clock.advance(0.1)
    await holder.release(leases[2], SUCCESS)
    await woken(rooms[0], 2)
    assert rooms[1].wakeups == 1
    assert len(await admin.zrangebyscore(LEASES, *LEASES_ONLY)) == 2, (
        "two promises, the third permit free"
    )


async def test_a_release_finding_only_lapsed_registrations_wakes_its_own_waiters(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, clock: FakeClock
) -> None:
    """Every registration lapsed: nothing is held and the releasing process's room is told."""
    p = fleet()
    room = waiting_in(p)
    await listening(admin, 1)
    (lease,) = await hold(p, 1, spec(1))
    await register(admin, p, spec(1))
    clock.advance(61.0)  # past the 60 s registration
    await p.release(lease, SUCCESS)
    await woken(room)
    assert await admin.zrangebyscore(LEASES, *LEASES_ONLY) == []


async def test_a_grant_at_a_source_with_room_still_replaces_the_processs_placeholder(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """P promised a permit, granted where there was room anyway: its promise is fulfilled.

    Left standing, the placeholder would hold a permit for nobody once P's
    waiters are served (the grant unregisters P): after the last call, the
    source would read one in flight until the hand-off TTL.
    """
    w = await p_waiting(fleet, admin, spec(2))
    await w.holder.release(w.leases[0], SUCCESS)  # held for P
    await woken(w.room)
    await w.holder.release(w.leases[1], SUCCESS)  # P promised already: woken, nothing held
    await woken(w.room, 2)
    granted = (await w.p.acquire(SCOPE, [spec(2)], ttl_s=60.0)).lease
    assert granted is not None
    assert await admin.zrangebyscore(LEASES, *LEASES_ONLY) == [granted.lease_id]
    await w.p.release(granted, SUCCESS)
    assert (await w.p.snapshot(SCOPE)).in_flight == 0


async def test_a_release_whose_only_registrant_is_gone_wakes_the_releasing_processs_room(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """The one registered process stopped listening: its placeholder is taken back and the
    releasing process's own waiters hear of the permit (nobody else will)."""
    p, gone = fleet(), fleet()
    room = waiting_in(p)  # a call waits in P, which was never refused: not registered
    waiting_in(gone)
    await listening(admin, 2)
    (lease,) = await hold(p, 1, spec(1))
    await register(admin, gone, spec(1))
    await gone.aclose()
    async with asyncio.timeout(BOUND_S):
        while len(await admin.pubsub_channels("pgw:wake:*")) > 1:
            await asyncio.sleep(0.01)
    await p.release(lease, SUCCESS)
    await woken(room)
    assert await admin.zrangebyscore(LEASES, *LEASES_ONLY) == []
    assert await admin.zcard(WAITING) == 0


async def test_a_permit_is_held_a_second_at_most_whatever_the_release_asks(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, clock: FakeClock
) -> None:
    """A release asking to hold the permit 5 s holds it 1 s: ACQUIRE marks no source full
    whose earliest live member lapses within a second, so a placeholder must lapse by
    then (research-wiki/designs/script-cost.md, "The O(1) contract")."""
    w = await p_waiting(fleet, admin, spec(1))
    w.holder._handoff_arg = bulk(repr(5.0))  # what the client never sends: more than 1 s
    await w.holder.release(w.leases[0], SUCCESS)
    await woken(w.room)
    assert await admin.zscore(LEASES, f"handoff:{w.proc}") == clock() + 1.0
