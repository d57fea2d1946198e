"""Verdicts on a real Redis: a full source is refused unexamined, and never wrongly.

ACQUIRE marks a candidate it refused for concurrency as full until its
earliest live lease lapses, and later calls of two candidates or more refuse
it without reading its state (research-wiki/designs/script-cost.md, "The O(1)
contract"). A mark must never outlive what made it true: each test below
breaks one way it could (the lapse's exact instant, a release, a changed spec,
a hand-off placeholder, a lost spec set or verdict key) and checks that the
decision is the one an examination gives. The scripts run on the tests'
``FakeClock``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis.asyncio as aioredis
from _behind import released
from _leases import LEASES_ONLY
from _wakeups import listening

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.middleware.waiting import room_for
from polygateway.testing import FakeClock

SCOPE = "verdicts"
VERDICTS = f"pgw:{{{SCOPE}}}:verdicts"
SUCCESS = AttemptOutcome("success")


def one(name: str, max_concurrency: int = 1) -> SourceSpec:
    return SourceSpec(name=name, max_concurrency=max_concurrency)


A, B = one("a"), one("b")


async def hold(backend: RedisBackend, source: SourceSpec, ttl_s: float = 1000.0) -> Lease:
    """A lease at ``source`` taken alone (a single candidate reads and writes no verdict)."""
    lease = (await backend.acquire(SCOPE, [source], ttl_s=ttl_s)).lease
    assert lease is not None
    return lease


async def reasons(backend: RedisBackend, candidates: list[SourceSpec]) -> list[str]:
    result = await backend.acquire(SCOPE, candidates, ttl_s=60.0)
    assert result.lease is None, f"granted at {result.lease.source}" if result.lease else ""
    return [r.reason for r in result.rejections]


async def granted_at(backend: RedisBackend, candidates: list[SourceSpec]) -> str:
    result = await backend.acquire(SCOPE, candidates, ttl_s=60.0)
    assert result.lease is not None, [r.reason for r in result.rejections]
    return result.lease.source


async def calls(admin: aioredis.Redis, command: str) -> int:
    stats = (await admin.info("commandstats")).get(f"cmdstat_{command}")
    return int(stats["calls"]) if stats else 0


async def marked(
    fleet: Callable[[], RedisBackend], a: SourceSpec = A, ttl_s: float = 1000.0
) -> tuple[RedisBackend, RedisBackend, Lease]:
    """A holder holds the only permits of ``a`` (its lease lasting ``ttl_s``) and of b; a
    second process, refused at both, has marked them full. The holder, that process, and
    the lease at ``a``."""
    holder, p = fleet(), fleet()
    lease = await hold(holder, a, ttl_s=ttl_s)
    await hold(holder, B)
    assert await reasons(p, [A, B]) == ["concurrency", "concurrency"]
    return holder, p, lease


async def refused_unexamined(p: RedisBackend, admin: aioredis.Redis) -> None:
    """Both refused for concurrency, and no source's state read: their marks stand."""
    before = await calls(admin, "hmget")
    assert await reasons(p, [A, B]) == ["concurrency", "concurrency"]
    assert await calls(admin, "hmget") == before


async def test_full_sources_are_refused_unexamined_once_marked(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """Ten full sources before a free one: the first call reads all eleven states, the next
    only the free one's (its state and its spec), with the same ten refusals."""
    holder, p = fleet(), fleet()
    full = [one(f"s{i}") for i in range(10)]
    for source in full:
        await hold(holder, source)
    free = one("z", max_concurrency=2)
    before = await calls(admin, "hmget")
    assert await granted_at(p, [*full, free]) == "z"
    first = await calls(admin, "hmget") - before
    assert first >= 11
    before = await calls(admin, "hmget")
    result = await p.acquire(SCOPE, [*full, free], ttl_s=60.0)
    assert result.lease is not None
    assert result.lease.source == "z"
    assert [(r.source, r.reason) for r in result.rejections] == [
        (s.name, "concurrency") for s in full
    ]
    assert await calls(admin, "hmget") - before == 2


async def test_a_mark_lapses_at_the_exact_expiry_of_the_earliest_lease(
    fleet: Callable[[], RedisBackend], clock: FakeClock, admin: aioredis.Redis
) -> None:
    """A lease dead at 1030.0 (expiry <= now): its source is refused unexamined up to a
    millisecond before and granted at that instant, as an examination would."""
    _, p, _ = await marked(fleet, ttl_s=30.0)
    clock.advance(29.999)
    await refused_unexamined(p, admin)
    clock.advance(0.001)
    assert await granted_at(p, [A, B]) == "a"


async def test_a_release_at_a_marked_source_clears_its_mark(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """A lease freed long before it lapses: the next call is granted there."""
    holder, p, lease = await marked(fleet)
    assert await admin.hget(f"pgw:{{{SCOPE}}}:src:a", "verdict")
    await released(holder, lease, SUCCESS)
    assert await admin.hget(f"pgw:{{{SCOPE}}}:src:a", "verdict") == ""
    assert await granted_at(p, [A, B]) == "a"


async def test_a_changed_spec_reads_no_mark_made_under_the_old_one(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """a, first seen at max_concurrency 4, is asked for at 1 with one lease live: refused and
    marked. Asked for at 4 again, it is examined (the new spec stored), and still full: the
    lowered max lowered AIMD's limit to 1, which only successes raise."""
    _, p, _ = await marked(fleet, one("a", max_concurrency=4))
    assert await admin.hget(f"pgw:{{{SCOPE}}}:src:a", "max_concurrency") == "1"
    assert await reasons(p, [one("a", max_concurrency=4), B]) == ["concurrency", "concurrency"]
    assert await admin.hget(f"pgw:{{{SCOPE}}}:src:a", "max_concurrency") == "4"


async def test_no_mark_stands_where_a_permit_is_held_for_a_waiting_process(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """A release hands a's permit to waiting P; another process, refused there meanwhile,
    must not mark a full: P, calling next with both candidates, claims its permit."""
    holder, p, other = fleet(), fleet(), fleet()
    room = room_for(p, SCOPE)
    room.enter()
    room_for(other, SCOPE)  # asks at once, with its process id
    await listening(admin, 2)
    lease = await hold(holder, A)
    await hold(holder, B)
    assert await reasons(p, [A, B]) == ["concurrency", "concurrency"]  # registers P
    await released(holder, lease, SUCCESS)
    assert await reasons(other, [A, B]) == ["concurrency", "concurrency"]
    assert await granted_at(p, [A, B]) == "a"


@pytest.mark.parametrize(("ttl_s", "expected"), [(1.0, False), (1.001, True)])
async def test_no_mark_is_made_a_second_or_less_before_it_would_lapse(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis, ttl_s: float, expected: bool
) -> None:
    """A hand-off placeholder lives 1 s at most, so a source whose earliest live member
    lapses within a second is not marked (it may be a placeholder a waiting process is
    about to claim); a millisecond later than that, it is."""
    await marked(fleet, ttl_s=ttl_s)
    assert bool(await admin.hget(f"pgw:{{{SCOPE}}}:src:a", "verdict")) is expected
    assert await admin.hget(f"pgw:{{{SCOPE}}}:src:b", "verdict")


async def test_a_spec_set_redis_lost_is_sent_again(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """The set stored under its digest is gone (expired, a new primary): the call that needs
    it is answered all the same, and the set is stored again."""
    holder, p = fleet(), fleet()
    await hold(holder, A)
    assert await granted_at(p, [A, B]) == "b"
    (key,) = await admin.keys(f"pgw:{{{SCOPE}}}:specs:*")
    stored = await admin.hgetall(key)
    assert len(stored.pop("encoding")) > 64, "kept a hashtable (script-cost.md)"
    assert stored == {
        "n0": "a",
        "s0": "1     5 30.0 300.0",
        "n1": "b",
        "s1": "1     5 30.0 300.0",
    }
    assert await admin.object("encoding", key) == "hashtable"
    assert 0 < await admin.ttl(key) <= 86_400
    await admin.delete(key, VERDICTS)
    assert await reasons(p, [A, B]) == ["concurrency", "concurrency"]
    assert await admin.exists(key)


async def test_a_stored_spec_set_is_only_read_by_later_calls(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """The set is written once, with its lifetime: a later call that walks past a full
    source reads it and neither writes to it nor sets its expiry again."""
    holder, p = fleet(), fleet()
    await hold(holder, A)
    first = (await p.acquire(SCOPE, [A, B], ttl_s=60.0)).lease
    assert first is not None
    assert first.source == "b"
    await released(p, first, SUCCESS)
    (key,) = await admin.keys(f"pgw:{{{SCOPE}}}:specs:*")
    stored = await admin.hgetall(key)
    await admin.expire(key, 1000)
    assert await granted_at(p, [A, B]) == "b"
    assert 0 < await admin.ttl(key) <= 1000
    assert await admin.hgetall(key) == stored


async def test_a_release_does_not_make_a_verdict_key_anew(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """The verdict key is gone (expired) when a marked source's lease is released: nothing
    is written to it (a key made by SETRANGE would never expire), the state's mark goes."""
    holder, _, lease = await marked(fleet)
    assert 0 < await admin.ttl(VERDICTS) <= 86_400
    await admin.delete(VERDICTS)
    await released(holder, lease, SUCCESS)
    assert not await admin.exists(VERDICTS)
    assert await admin.hget(f"pgw:{{{SCOPE}}}:src:a", "verdict") == ""


async def test_a_single_candidate_reads_and_writes_no_verdict(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """Nothing to skip to: a call of one candidate examines it, reads no verdict (not even
    where marks exist) and makes none."""
    holder, p = fleet(), fleet()
    await hold(holder, A)
    await hold(holder, B)
    assert await reasons(p, [B, A]) == ["concurrency", "concurrency"]  # a and b marked
    await admin.delete(f"pgw:{{{SCOPE}}}:src:a", f"pgw:{{{SCOPE}}}:leases:a")  # marked, free
    sets = await admin.keys(f"pgw:{{{SCOPE}}}:specs:*")
    before = await calls(admin, "get")
    assert await granted_at(p, [A]) == "a"
    assert await calls(admin, "get") == before
    await admin.delete(VERDICTS)
    assert await reasons(p, [A]) == ["concurrency"]
    assert not await admin.exists(VERDICTS)
    assert await admin.keys(f"pgw:{{{SCOPE}}}:specs:*") == sets


async def test_a_fleet_user_allowed_only_the_gateways_keys_walks_and_marks(
    locked_fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """The keys ACQUIRE makes for later candidates, the spec set and the verdicts are all
    ``pgw:`` keys: a Redis user allowed no other key walks past a full source, marks it,
    and has its release clear the mark."""
    holder, p = locked_fleet(), locked_fleet()
    lease = await hold(holder, A)
    assert await granted_at(p, [A, B]) == "b"
    assert await admin.hget(f"pgw:{{{SCOPE}}}:src:a", "verdict")
    await released(holder, lease, SUCCESS)
    assert await granted_at(p, [A, B]) == "a"


async def test_indices_beyond_one_byte_name_their_own_source_and_mark(
    fleet: Callable[[], RedisBackend], admin: aioredis.Redis
) -> None:
    """A scope of 300 sources: an index travels as two bytes, so s280 (index 280) is marked
    at its own offset and s281 is read, and leased, as itself."""
    holder, p = fleet(), fleet()
    every = [one(f"s{i:03d}") for i in range(300)]
    assert await granted_at(p, every) == "s000"  # stores the set of all 300
    await hold(holder, every[280])
    result = await p.acquire(SCOPE, [every[280], every[281]], ttl_s=60.0)
    assert result.lease is not None
    assert result.lease.source == "s281"
    assert [(r.source, r.reason) for r in result.rejections] == [("s280", "concurrency")]
    assert result.lease.lease_id in await admin.zrangebyscore(
        f"pgw:{{{SCOPE}}}:leases:s281", *LEASES_ONLY
    )
    offset = 32 + 13 * 280  # after the digest
    assert await admin.hget(f"pgw:{{{SCOPE}}}:src:s280", "verdict") == str(offset)
    assert await admin.getrange(VERDICTS, offset, offset + 12) == "0000002000000"  # 1000 + 1000


async def test_a_mark_stands_to_the_millisecond(
    fleet: Callable[[], RedisBackend], clock: FakeClock, admin: aioredis.Redis
) -> None:
    """A lease dead at 1030.009: 8 ms before, its source's mark still stands (the call reads
    no state), though the two times differ only in their last digit."""
    _, p, _ = await marked(fleet, ttl_s=30.009)
    clock.advance(30.001)
    await refused_unexamined(p, admin)
