"""What the Redis scripts write on a call's path, and that they write nothing more.

A governed call's cost on Redis is the number of commands its two scripts run
(research-wiki/designs/script-cost.md): ACQUIRE writes a source's state in one
HSET and only what moved (the spec only when it changed), so a grant at a
source without rpm or tpm, same spec as before, writes no state at all. These
tests count the commands a real server ran (``INFO commandstats``) and read
the state hash, on the tests' fake clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis
from _behind import released
from _leases import LEASES_ONLY

from polygateway.backends.base import AttemptOutcome, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.testing import FakeClock

SCOPE = "writes"
STATE = f"pgw:{{{SCOPE}}}:src:a"
LEASES = f"pgw:{{{SCOPE}}}:leases:a"
PLAIN = SourceSpec("a", max_concurrency=4)


@pytest.fixture
async def backend(redis_url: str) -> AsyncIterator[RedisBackend]:
    b = RedisBackend(redis_url, now=FakeClock())
    yield b
    await b.aclose()


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def _calls(client: redis.Redis, command: str) -> int:
    stats = client.info("commandstats").get(f"cmdstat_{command}")
    return int(stats["calls"]) if stats else 0


async def test_a_grant_with_the_spec_unchanged_writes_no_state(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """No bucket, no probe, the same spec: the second grant's only write is its lease."""
    assert (await backend.acquire(SCOPE, [PLAIN], ttl_s=30.0)).lease is not None
    before = _calls(client, "hset"), _calls(client, "zadd")
    assert (await backend.acquire(SCOPE, [PLAIN], ttl_s=30.0)).lease is not None
    assert (_calls(client, "hset"), _calls(client, "zadd")) == (before[0], before[1] + 1)


async def test_a_changed_spec_is_written_and_then_used_by_release_and_snapshot(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """A larger max_concurrency in a later acquire is stored, refused or not: the release
    that follows caps the AIMD increase at it, not at the old one."""
    first = (await backend.acquire(SCOPE, [SourceSpec("a", max_concurrency=1)], ttl_s=30.0)).lease
    assert first is not None
    old = client.hget(STATE, "spec")
    refused = await backend.acquire(SCOPE, [SourceSpec("a", max_concurrency=3)], ttl_s=30.0)
    assert [r.reason for r in refused.rejections] == ["concurrency"], "AIMD's limit is still 1"
    assert client.hget(STATE, "max_concurrency") == "3"
    assert client.hget(STATE, "spec") not in (None, old)
    await released(backend, first, AttemptOutcome("success"))
    [source] = (await backend.snapshot(SCOPE)).sources
    assert source.limit == 2.0, "1 + 1/1, capped at 3 (at the old 1 it would stay 1)"


async def test_a_refusal_stores_what_moved_and_nothing_else(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """Refused for rpm: the refilled bucket is stored (one HSET), the lease zset untouched."""
    spec = SourceSpec("a", max_concurrency=4, rpm=60.0, rpm_burst=1.0)
    assert (await backend.acquire(SCOPE, [spec], ttl_s=30.0)).lease is not None
    before = _calls(client, "hset"), _calls(client, "zadd")
    refused = await backend.acquire(SCOPE, [spec], ttl_s=30.0)
    assert [r.reason for r in refused.rejections] == ["rpm"]
    assert (_calls(client, "hset"), _calls(client, "zadd")) == (before[0] + 1, before[1])
    assert client.hget(STATE, "rpm_tokens") == "0"


async def test_a_success_at_a_closed_source_at_its_limit_writes_no_state(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """AIMD's limit at its max, breaker closed, nothing paused: RELEASE has nothing to store."""
    spec = SourceSpec("a", max_concurrency=1)
    lease = (await backend.acquire(SCOPE, [spec], ttl_s=30.0)).lease
    assert lease is not None
    before = _calls(client, "hset")
    await released(backend, lease, AttemptOutcome("success"))
    assert _calls(client, "hset") == before
    assert client.hget(STATE, "limit") == "1"
    assert (await backend.acquire(SCOPE, [spec], ttl_s=30.0)).lease is not None, "freed"


async def test_a_release_rewrites_no_field_that_holds_its_value_already(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """A transient failure moves the failure count alone. Fields stored as "0.0" hold the
    value the release computes (0) in another spelling: rewritten, they would read "0"."""
    lease = (await backend.acquire(SCOPE, [PLAIN], ttl_s=30.0)).lease
    assert lease is not None
    unchanged = ("trips", "open_until", "probe_until", "not_before")
    client.hset(STATE, mapping={field: "0.0" for field in unchanged})
    client.hset(STATE, "limit", "4.0")
    await released(backend, lease, AttemptOutcome("transient"))
    assert client.hget(STATE, "failures") == "1"
    assert client.hmget(STATE, [*unchanged, "limit"]) == ["0.0"] * 4 + ["4.0"]
    assert client.hmget(STATE, ["breaker", "probe_id"]) == ["closed", ""]


async def test_a_release_writes_each_field_that_moved(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """Enough failures trip the breaker: state, counts, the reopen time and the limit's
    decrease are all stored (a field left out here would keep its old value)."""
    spec = SourceSpec("a", max_concurrency=4, breaker_failures=1, cooldown_s=5.0)
    lease = (await backend.acquire(SCOPE, [spec], ttl_s=30.0)).lease
    assert lease is not None
    await released(backend, lease, AttemptOutcome("transient", aimd_decrease=True))
    stored = client.hgetall(STATE)
    assert (stored["breaker"], stored["failures"], stored["trips"]) == ("open", "0", "1")
    assert float(stored["open_until"]) > 0.0
    assert float(stored["limit"]) < 4.0
    assert "last_decrease" in stored


async def test_an_acquire_reads_the_probes_fields_only_when_a_probe_may_be_due(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """One HMGET while the breaker is closed and no pause waits for its probe; a second
    read of the probes' fields once the breaker is open (the half-open probe decides)."""
    spec = SourceSpec("a", max_concurrency=4, breaker_failures=1, cooldown_s=5.0)
    lease = (await backend.acquire(SCOPE, [spec], ttl_s=30.0)).lease
    assert lease is not None
    before = _calls(client, "hmget")
    second = (await backend.acquire(SCOPE, [spec], ttl_s=30.0)).lease
    assert second is not None
    assert _calls(client, "hmget") == before + 1
    await released(backend, second, AttemptOutcome("transient"))  # trips the breaker
    before = _calls(client, "hmget")
    refused = await backend.acquire(SCOPE, [spec], ttl_s=30.0)
    assert [r.reason for r in refused.rejections] == ["breaker_open"]
    assert _calls(client, "hmget") == before + 2


async def test_a_release_reads_the_failure_fields_only_for_a_failure_or_a_pause(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """A success reads the state once; a failure, or a success that brings a pause, reads
    the breaker's and the pacer's fields too, and acts on them."""
    spec = SourceSpec("a", max_concurrency=4, breaker_failures=2)
    reads = []
    for outcome in (
        AttemptOutcome("success"),
        AttemptOutcome("transient"),
        AttemptOutcome("success", retry_after_s=5.0),
    ):
        lease = (await backend.acquire(SCOPE, [spec], ttl_s=30.0)).lease
        assert lease is not None
        before = _calls(client, "hmget")
        await released(backend, lease, outcome)
        reads.append(_calls(client, "hmget") - before)
    assert reads == [1, 2, 2]
    assert client.hget(STATE, "failures") == "0", "the success after the failure reset it"
    refused = await backend.acquire(SCOPE, [spec], ttl_s=30.0)
    assert [r.reason for r in refused.rejections] == ["paced"]


def _rebuilt_as_a_listpack(client: redis.Redis, expires_at: str) -> None:
    """The state as a listpack, as scripts without the ``encoding`` field left it."""
    fields = client.hgetall(STATE)
    fields.pop("encoding", None)
    fields["expires_at"] = expires_at
    ttl = client.ttl(STATE)
    client.delete(STATE)
    client.hset(STATE, mapping=fields)
    client.expire(STATE, ttl)
    assert client.object("encoding", STATE) == "listpack"


async def test_a_source_state_is_a_hashtable_from_its_first_call(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """A field longer than hash-max-listpack-value keeps the state a hashtable, whose
    fields HMGET reads by hash (research-wiki/designs/script-cost.md, "Hashes as
    hashtables"); a listpack left by older scripts turns one at its lifetime's renewal,
    not before (the field is not written on every call)."""
    assert (await backend.acquire(SCOPE, [PLAIN], ttl_s=30.0)).lease is not None
    assert client.object("encoding", STATE) == "hashtable"
    assert len(client.hget(STATE, "encoding") or "") > 64

    renewal = float(client.hget(STATE, "expires_at") or 0)
    _rebuilt_as_a_listpack(client, repr(renewal))
    assert (await backend.acquire(SCOPE, [PLAIN], ttl_s=30.0)).lease is not None
    assert client.object("encoding", STATE) == "listpack", "no renewal due: nothing written"

    _rebuilt_as_a_listpack(client, "0")  # its lifetime is due for renewal
    assert (await backend.acquire(SCOPE, [PLAIN], ttl_s=30.0)).lease is not None
    assert client.object("encoding", STATE) == "hashtable"


async def test_a_lease_zset_is_a_skiplist_from_its_first_lease_and_stays_one(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """A member longer than zset-max-listpack-value, at -inf, keeps the lease zset a
    skiplist, which adds and counts a lease in O(log n) where a listpack parses every
    lease's score (research-wiki/designs/script-cost.md, "Lease zsets as skiplists"). It is
    no lease: renewals and releases sweep from above -inf and leave it, and the key, behind."""
    lease = (await backend.acquire(SCOPE, [PLAIN], ttl_s=30.0)).lease
    assert lease is not None
    assert client.object("encoding", LEASES) == "skiplist"
    (member,) = client.zrangebyscore(LEASES, "-inf", "-inf")
    assert len(member) > 64
    assert client.zrangebyscore(LEASES, *LEASES_ONLY) == [lease.lease_id]

    assert await backend.renew(lease)
    assert client.zrange(LEASES, 0, -1) == [member, lease.lease_id], "renewing sweeps above it"
    await released(backend, lease, AttemptOutcome("success"))
    assert client.zrange(LEASES, 0, -1) == [member], "the member stays, the lease went"
    assert client.object("encoding", LEASES) == "skiplist"
    assert client.ttl(LEASES) > 0
    again = (await backend.acquire(SCOPE, [PLAIN], ttl_s=30.0)).lease
    assert again is not None
    assert client.zrangebyscore(LEASES, *LEASES_ONLY) == [again.lease_id]


async def test_a_lease_into_a_kept_zset_sets_no_expiry(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """The zset outlives its last lease, so a grant at an idle source finds it with its
    expiry and sets none: EXPIRE runs when a lease makes the key anew, not at every grant
    after an idle moment."""
    for _ in range(2):
        lease = (await backend.acquire(SCOPE, [PLAIN], ttl_s=30.0)).lease
        assert lease is not None
        await released(backend, lease, AttemptOutcome("success"))
    before = _calls(client, "expire")
    lease = (await backend.acquire(SCOPE, [PLAIN], ttl_s=30.0)).lease
    assert lease is not None
    assert _calls(client, "expire") == before


async def test_a_listpack_lease_zset_left_by_older_scripts_turns_a_skiplist_at_its_next_grant(
    backend: RedisBackend, client: redis.Redis
) -> None:
    """A lease zset without the member (a listpack, as older scripts kept it) gets it with
    the next grant, and keeps its live lease counted."""
    first = (await backend.acquire(SCOPE, [PLAIN], ttl_s=30.0)).lease
    assert first is not None
    expiry = client.zscore(LEASES, first.lease_id)
    ttl = client.ttl(LEASES)
    client.delete(LEASES)
    client.zadd(LEASES, {first.lease_id: expiry})
    client.expire(LEASES, ttl)
    assert client.object("encoding", LEASES) == "listpack"

    second = (await backend.acquire(SCOPE, [PLAIN], ttl_s=30.0)).lease
    assert second is not None
    assert client.object("encoding", LEASES) == "skiplist"
    assert sorted(client.zrangebyscore(LEASES, *LEASES_ONLY)) == sorted(
        [first.lease_id, second.lease_id]
    )
    assert 0 < client.ttl(LEASES) <= ttl
