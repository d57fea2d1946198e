"""Every key the Redis scripts write expires (research-wiki/guides/redis-fleet.md, keys).

A source's keys (and its scope's list of sources) outlive their last use by
between half their life and their life: a day (``_STATE_TTL_S``), or twice
the longest lease or breaker cool-down when that is longer, so that an open
breaker is never forgotten while it is open and lease keys live as long as
their leases. ACQUIRE sets them to expire only once half their life is gone
(the state's ``expires_at``), not at every call
(research-wiki/designs/script-cost.md). Only a real server shows TTLs, so
this file has no memory twin. The scripts run on a fake clock (``expires_at``
and lease expiries); the server's TTLs run on its own, so millisecond TTLs
(``PTTL``) tell a second off either way from the figure.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis
from _behind import released
from _leases import LEASES_ONLY

from polygateway.backends.base import AttemptOutcome, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.backends.redis.limiter import _STATE_TTL_S
from polygateway.testing import FakeClock

SCOPE = "chat"
DAY_MS = _STATE_TTL_S * 1000
HALF_DAY_S = _STATE_TTL_S / 2
LONG_S = _STATE_TTL_S + 13_599.5  # ceil + 1 = one day + 13,601 s
LONG_LIFE_MS = 2 * (_STATE_TTL_S + 13_601) * 1000
SOURCE_KEYS = ("sources", "src:a", "leases:a")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def backend(redis_url: str, clock: FakeClock) -> AsyncIterator[RedisBackend]:
    """A RedisBackend on a fake clock (lease expiries), the server's clock for key TTLs."""
    b = RedisBackend(redis_url, now=clock)
    yield b
    await b.aclose()


def _key(name: str) -> str:
    return f"pgw:{{{SCOPE}}}:{name}"


def _pttl(redis_url: str, key: str) -> int:
    with redis.Redis.from_url(redis_url) as client:
        return int(client.pttl(_key(key)))


def _shorten(redis_url: str, *keys: str) -> None:
    """Set the keys to expire in a minute: a TTL the scripts did not set, to see if they do."""
    with redis.Redis.from_url(redis_url) as client:
        for key in keys:
            client.expire(_key(key), 60)


def _within_a_second_below(pttl: int, expected_ms: float) -> bool:
    return expected_ms - 1000 < pttl <= expected_ms


async def _lease(backend: RedisBackend, spec: SourceSpec | None = None, ttl_s: float = 30.0):  # type: ignore[no-untyped-def]
    result = await backend.acquire(SCOPE, [spec or SourceSpec("a", max_concurrency=4)], ttl_s=ttl_s)
    assert result.lease is not None
    return result.lease


async def test_an_acquire_sets_a_day_on_every_key_it_writes(
    backend: RedisBackend, redis_url: str
) -> None:
    """Sources, source state and lease keys expire a day after the first acquire."""
    await _lease(backend)
    for key in SOURCE_KEYS:
        assert _within_a_second_below(_pttl(redis_url, key), DAY_MS), key


async def test_acquires_set_the_lifetimes_again_only_once_half_of_it_is_gone(
    backend: RedisBackend, redis_url: str, clock: FakeClock
) -> None:
    """Half a day after the first acquire, exactly, nothing is set; a moment later all is."""
    await _lease(backend)
    clock.advance(HALF_DAY_S - 200)
    await _lease(backend, ttl_s=3600.0)  # live at half a day: the lease key is not made anew
    _shorten(redis_url, *SOURCE_KEYS)
    clock.advance(200.0)
    await _lease(backend)
    for key in SOURCE_KEYS:
        assert _within_a_second_below(_pttl(redis_url, key), 60_000), key
    clock.advance(0.001)
    await _lease(backend)
    for key in SOURCE_KEYS:
        assert _within_a_second_below(_pttl(redis_url, key), DAY_MS), key


async def test_setting_the_lifetimes_again_keeps_the_order_of_first_sight(
    backend: RedisBackend, clock: FakeClock
) -> None:
    """a first, then b; past half their life a is acquired again, which sets its keys and
    the scope's list to expire again: the snapshot still lists a before b."""
    await _lease(backend, SourceSpec("a", max_concurrency=4))
    await _lease(backend, SourceSpec("b", max_concurrency=4))
    clock.advance(HALF_DAY_S + 1.0)
    await _lease(backend, SourceSpec("a", max_concurrency=4))
    assert [s.name for s in (await backend.snapshot(SCOPE)).sources] == ["a", "b"]


async def test_a_refused_acquire_sets_the_lifetimes_too(
    backend: RedisBackend, redis_url: str, clock: FakeClock
) -> None:
    """A source refused (its one permit held) past half its keys' life sets them again."""
    spec = SourceSpec("a", max_concurrency=1)
    await released(backend, await _lease(backend, spec), AttemptOutcome("success"))
    clock.advance(HALF_DAY_S - 200)
    await _lease(backend, spec, ttl_s=3600.0)
    _shorten(redis_url, *SOURCE_KEYS)
    clock.advance(201.0)
    refused = await backend.acquire(SCOPE, [spec], ttl_s=30.0)
    assert refused.lease is None
    for key in SOURCE_KEYS:
        assert _within_a_second_below(_pttl(redis_url, key), DAY_MS), key


async def test_a_lease_key_made_anew_gets_what_the_state_has_left(
    backend: RedisBackend, redis_url: str, clock: FakeClock
) -> None:
    """The source's last lease gone, its key stays (its SKIPLIST member) with its expiry; a
    key lost anyway (evicted, say) is made again by the next lease, and expires with the
    source's state (a day from the first acquire), not never."""
    lease = await _lease(backend)
    await released(backend, lease, AttemptOutcome("success"))
    with redis.Redis.from_url(redis_url) as client:
        assert client.zcount(_key("leases:a"), *LEASES_ONLY) == 0
        assert _within_a_second_below(_pttl(redis_url, "leases:a"), DAY_MS)
        client.delete(_key("leases:a"))
    clock.advance(1000.0)
    await _lease(backend)
    assert _within_a_second_below(_pttl(redis_url, "leases:a"), DAY_MS - 1_000_000)


async def test_a_cool_down_longer_than_a_day_keeps_the_source_state_twice_that_long(
    backend: RedisBackend, redis_url: str
) -> None:
    """cooldown_max_s past a day: the keys live twice ceil(cooldown_max_s) + 1 s."""
    await _lease(backend, SourceSpec("a", max_concurrency=2, cooldown_max_s=LONG_S))
    for key in SOURCE_KEYS:
        assert _within_a_second_below(_pttl(redis_url, key), LONG_LIFE_MS), key


async def test_lease_keys_outlive_their_longest_lease(
    backend: RedisBackend, redis_url: str
) -> None:
    """A lease longer than a day stretches the keys to twice ceil(ttl) + 1 s; a later short
    one does not shorten them."""
    await _lease(backend, ttl_s=LONG_S)
    await _lease(backend, ttl_s=1.0)
    for key in SOURCE_KEYS:
        assert _within_a_second_below(_pttl(redis_url, key), LONG_LIFE_MS), key


async def test_a_release_late_in_the_states_life_keeps_a_cool_down_time_to_run(
    backend: RedisBackend, redis_url: str
) -> None:
    """Leases renewed until their keys have only a cool-down (300 s by default) plus 1 s
    left: a release then sets nothing; with a second less, it sets the state and lease keys
    a day again, so that a breaker it trips is not forgotten while open."""
    first, second = await _lease(backend, ttl_s=3600.0), await _lease(backend, ttl_s=3600.0)
    await _lease(backend, ttl_s=3600.0)  # still held at the end: the lease key stays
    _shorten(redis_url, "src:a", "leases:a")
    with redis.Redis.from_url(redis_url) as client:
        now = float(client.hget(_key("src:a"), "expires_at") or 0) - _STATE_TTL_S
        client.hset(_key("src:a"), "expires_at", repr(now + 301))
    await released(backend, first, AttemptOutcome("success"))
    for key in ("src:a", "leases:a"):
        assert _within_a_second_below(_pttl(redis_url, key), 60_000), key
    with redis.Redis.from_url(redis_url) as client:
        client.hset(_key("src:a"), "expires_at", repr(now + 300))
    await released(backend, second, AttemptOutcome("transient"))
    for key in ("src:a", "leases:a"):
        assert _within_a_second_below(_pttl(redis_url, key), DAY_MS), key


async def test_a_renewal_late_in_the_states_life_keeps_the_lease_its_time(
    backend: RedisBackend, redis_url: str
) -> None:
    """The lease's TTL (600 s) plus 1 s left of its keys' life: a renewal sets nothing; a
    second less, and it sets them a day again."""
    lease = await _lease(backend, ttl_s=600.0)
    _shorten(redis_url, "src:a", "leases:a")
    with redis.Redis.from_url(redis_url) as client:
        now = float(client.hget(_key("src:a"), "expires_at") or 0) - _STATE_TTL_S
        client.hset(_key("src:a"), "expires_at", repr(now + 601))
    assert await backend.renew(lease)
    for key in ("src:a", "leases:a"):
        assert _within_a_second_below(_pttl(redis_url, key), 60_000), key
    with redis.Redis.from_url(redis_url) as client:
        client.hset(_key("src:a"), "expires_at", repr(now + 600))
    assert await backend.renew(lease)
    for key in ("src:a", "leases:a"):
        assert _within_a_second_below(_pttl(redis_url, key), DAY_MS), key


async def test_late_in_a_long_life_a_release_and_a_renewal_set_twice_their_need(
    backend: RedisBackend, redis_url: str
) -> None:
    """A cool-down (release) or a lease TTL (renewal) past half a day: when less than it is
    left, the keys are set to twice it plus 2 s, not to a day."""
    spec = SourceSpec("a", max_concurrency=4, cooldown_max_s=LONG_S)
    lease = await _lease(backend, spec, ttl_s=LONG_S)
    await _lease(backend, spec, ttl_s=3600.0)  # held to the end: the lease key stays
    with redis.Redis.from_url(redis_url) as client:
        now = float(client.hget(_key("src:a"), "expires_at") or 0) - LONG_LIFE_MS / 1000
        client.hset(_key("src:a"), "expires_at", repr(now + 600))
    _shorten(redis_url, "src:a", "leases:a")
    assert await backend.renew(lease)
    for key in ("src:a", "leases:a"):
        assert _within_a_second_below(_pttl(redis_url, key), LONG_LIFE_MS), key
    _shorten(redis_url, "src:a", "leases:a")
    await released(backend, lease, AttemptOutcome("transient"))
    for key in ("src:a", "leases:a"):
        assert _within_a_second_below(_pttl(redis_url, key), LONG_LIFE_MS), key


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
