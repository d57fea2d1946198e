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

from polygateway.backends.base import AttemptOutcome, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.testing import FakeClock

SCOPE = "writes"
STATE = f"pgw:{{{SCOPE}}}:src:a"
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
    await backend.release(first, AttemptOutcome("success"))
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
