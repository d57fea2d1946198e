"""Every key the Redis scripts write expires (research-wiki/guides/redis-fleet.md, keys).

A scope's state outlives its last use by ``_STATE_TTL_S`` (one day), or by the
longest breaker cool-down when that is longer, so an open breaker is never
forgotten while it is open; lease keys live at least as long as their
longest lease. Only a real server shows TTLs, so this file has no memory twin.
Millisecond TTLs (``PTTL``) tell a second off either way from the figure.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis

from polygateway.backends.base import AttemptOutcome, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.backends.redis.limiter import _STATE_TTL_S
from polygateway.testing import FakeClock

SCOPE = "chat"
DAY_MS = _STATE_TTL_S * 1000
LONG_COOLDOWN_S = _STATE_TTL_S + 13_599.5  # ceil + 1 = one day + 13,601 s
LONG_COOLDOWN_MS = (_STATE_TTL_S + 13_601) * 1000


@pytest.fixture
async def backend(redis_url: str) -> AsyncIterator[RedisBackend]:
    """A RedisBackend on a fake clock (lease expiries), the server's clock for key TTLs."""
    b = RedisBackend(redis_url, now=FakeClock())
    yield b
    await b.aclose()


def _pttl(redis_url: str, key: str) -> int:
    with redis.Redis.from_url(redis_url) as client:
        return int(client.pttl(f"pgw:{{{SCOPE}}}:{key}"))


def _within_a_second_below(pttl: int, expected_ms: int) -> bool:
    return expected_ms - 1000 < pttl <= expected_ms


async def test_an_acquire_sets_a_day_on_every_key_it_writes(
    backend: RedisBackend, redis_url: str
) -> None:
    """Sources, source state and both lease keys expire a day after the acquire."""
    result = await backend.acquire(SCOPE, [SourceSpec("a", max_concurrency=2)], ttl_s=30.0)
    assert result.lease is not None
    for key in ("sources", "src:a", "leases:a", "lease_meta:a"):
        assert _within_a_second_below(_pttl(redis_url, key), DAY_MS), key


async def test_a_cool_down_longer_than_a_day_keeps_the_source_state_that_long(
    backend: RedisBackend, redis_url: str
) -> None:
    """cooldown_max_s past a day: the state lives ceil(cooldown_max_s) + 1 s, after acquire
    and after release."""
    spec = SourceSpec("a", max_concurrency=2, cooldown_max_s=LONG_COOLDOWN_S)
    result = await backend.acquire(SCOPE, [spec], ttl_s=30.0)
    assert result.lease is not None
    assert _within_a_second_below(_pttl(redis_url, "src:a"), LONG_COOLDOWN_MS)
    with redis.Redis.from_url(redis_url) as client:
        client.expire(f"pgw:{{{SCOPE}}}:src:a", 60)
    await backend.release(result.lease, AttemptOutcome("success"))
    assert _within_a_second_below(_pttl(redis_url, "src:a"), LONG_COOLDOWN_MS)


async def test_lease_keys_outlive_their_longest_lease(
    backend: RedisBackend, redis_url: str
) -> None:
    """A lease longer than a day stretches its keys to ceil(ttl) + 1 s; a later short one
    does not shorten them."""
    spec = SourceSpec("a", max_concurrency=2)
    assert (await backend.acquire(SCOPE, [spec], ttl_s=LONG_COOLDOWN_S)).lease is not None
    assert (await backend.acquire(SCOPE, [spec], ttl_s=1.0)).lease is not None
    for key in ("leases:a", "lease_meta:a"):
        assert _within_a_second_below(_pttl(redis_url, key), LONG_COOLDOWN_MS), key


async def test_a_release_sets_the_source_state_a_day_again(
    backend: RedisBackend, redis_url: str
) -> None:
    """With a short cool-down, a release gives the source state a full day once more."""
    result = await backend.acquire(SCOPE, [SourceSpec("a", max_concurrency=2)], ttl_s=30.0)
    assert result.lease is not None
    with redis.Redis.from_url(redis_url) as client:
        client.expire(f"pgw:{{{SCOPE}}}:src:a", 60)
    await backend.release(result.lease, AttemptOutcome("success"))
    assert _within_a_second_below(_pttl(redis_url, "src:a"), DAY_MS)


async def test_a_source_whose_state_expired_is_left_out_of_the_snapshot(
    backend: RedisBackend, redis_url: str
) -> None:
    """Still listed in the scope but its state gone: the snapshot skips it, others read right."""
    for name in ("a", "b"):
        granted = await backend.acquire(SCOPE, [SourceSpec(name, max_concurrency=2)], ttl_s=30.0)
        assert granted.lease is not None
    with redis.Redis.from_url(redis_url) as client:
        client.delete(f"pgw:{{{SCOPE}}}:src:a")
    snap = await backend.snapshot(SCOPE)
    assert [s.name for s in snap.sources] == ["b"]
    [b] = snap.sources
    assert (b.in_flight, b.breaker, b.limit, b.consecutive_failures) == (1, "closed", 2.0, 0)
