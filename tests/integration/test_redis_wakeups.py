"""Fleet-wide wake-ups on a real Redis: a release anywhere wakes one waiting process, in turn.

Each ``RedisBackend`` object is a process of the fleet here (its own process
id, its own subscription); the waiting rooms are the loop's own
(``room_for``). research-wiki/designs/fleet-wakeups.md is the design.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from _redis_tls import TLSRedis, tls_files
from _wakeups import BOUND_S, listening, woken_by

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings
from polygateway.errors import GovernanceBackendError
from polygateway.middleware.waiting import WaitingRoom, room_for
from polygateway.simulator import FaultProfile, SimulatedUpstream
from polygateway.testing import FakeClock

SCOPE = "wake"
SUCCESS = AttemptOutcome("success")


def spec(max_concurrency: int) -> SourceSpec:
    return SourceSpec(name="a", max_concurrency=max_concurrency)


@pytest.fixture
async def fleet(redis_url: str) -> AsyncIterator[Callable[..., RedisBackend]]:
    """Backends on one Redis, each a process of the fleet; closed after the test."""
    made: list[RedisBackend] = []

    def make(**kwargs: Any) -> RedisBackend:
        backend = RedisBackend(redis_url, **kwargs)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.aclose()


async def waiting_ids(admin: aioredis.Redis) -> list[str]:
    """The registered processes, least recently woken first."""
    ids: list[str] = await admin.zrange(f"pgw:{{{SCOPE}}}:waiting", 0, -1)
    return ids


async def hold(backend: RedisBackend, n: int, capacity: int) -> list[Lease]:
    """Take ``n`` permits of a source with ``capacity``."""
    leases = []
    for _ in range(n):
        lease = (await backend.acquire(SCOPE, [spec(capacity)], ttl_s=1000.0)).lease
        assert lease is not None
        leases.append(lease)
    return leases


async def refused(backend: RedisBackend, capacity: int) -> None:
    """An acquire refused for concurrency (as a waiting room's head's poll is)."""
    result = await backend.acquire(SCOPE, [spec(capacity)], ttl_s=60.0)
    assert result.lease is None
    assert result.rejections[0].reason == "concurrency"


def queued(backend: RedisBackend) -> WaitingRoom:
    """The backend's room of the scope, with a call waiting in it (so a wake-up is counted)."""
    room = room_for(backend, SCOPE)
    room.enter()
    return room


async def woken(room: WaitingRoom, count: int) -> None:
    async with asyncio.timeout(BOUND_S):
        while room.wakeups < count:
            await asyncio.sleep(0.005)


async def test_a_release_wakes_a_waiter_of_another_process_long_before_its_poll(
    fleet: Callable[..., RedisBackend], admin: aioredis.Redis
) -> None:
    """B's head waits on a 30 s timer; A's release elsewhere wakes it within a second."""
    a, b = fleet(), fleet()
    room_for(a, SCOPE)
    room = room_for(b, SCOPE)
    await listening(admin, 2)
    (lease,) = await hold(a, 1, 1)
    head = room.enter()
    await refused(b, 1)
    await woken_by(room, head, a.release(lease, SUCCESS), within_s=1.0)
    assert room_for(a, SCOPE).wakeups == 0, "A left the permit to B: no second asker"
    room.leave(head)


async def test_a_client_waiting_with_a_30s_poll_is_served_at_the_next_release_elsewhere(
    redis_url: str,
) -> None:
    """Two clients, two backends, one permit: B's call is served right after A's, not at 15-30 s."""
    async with SimulatedUpstream({"a": FaultProfile(latency_s=0.5)}) as sim:
        source = {
            "name": "a",
            "protocol": "openai",
            "base_url": sim.base_url("a"),
            "model": "sim",
            "api_key": "sk-wake-0123456789",
            "max_concurrency": 1,
        }
        settings = GatewaySettings(
            _env_file=None,
            backend="redis",
            redis_url=redis_url,
            poll_interval_s=30.0,
            scopes={SCOPE: {"kind": "chat", "sources": [source]}},
        )
        backends = (RedisBackend(redis_url), RedisBackend(redis_url))
        clients = [ChatClient(settings, SCOPE, backend=b) for b in backends]
        try:
            messages = [{"role": "user", "content": "hi"}]
            first = asyncio.ensure_future(clients[0].complete(messages, max_tokens=4))
            await asyncio.sleep(0.2)  # A holds the one permit
            began = time.monotonic()
            async with asyncio.timeout(BOUND_S):
                await clients[1].complete(messages, max_tokens=4)
                await first
            assert time.monotonic() - began < 2.0
            assert sim.stats("a").max_concurrent == 1
        finally:
            for client in clients:
                await client.aclose()
            for backend in backends:
                await backend.aclose()


async def test_releases_wake_waiting_processes_in_turn_least_recently_woken_first(
    fleet: Callable[..., RedisBackend], admin: aioredis.Redis
) -> None:
    """Three waiting processes, four releases elsewhere: each woken once, then the first again."""
    holder = fleet()
    waiters = [fleet() for _ in range(3)]
    rooms = [queued(w) for w in waiters]
    await listening(admin, 3)
    leases = await hold(holder, 4, 4)
    for waiter in waiters:
        await refused(waiter, 4)
    assert len(await waiting_ids(admin)) == 3
    for i, lease in enumerate(leases[:3]):
        await holder.release(lease, SUCCESS)
        await woken(rooms[i], 1)
    assert [room.wakeups for room in rooms] == [1, 1, 1]
    await holder.release(leases[3], SUCCESS)
    await woken(rooms[0], 2)
    await asyncio.sleep(0.1)
    assert [room.wakeups for room in rooms] == [2, 1, 1]


async def test_an_expired_registration_is_skipped_and_dropped(
    fleet: Callable[..., RedisBackend], admin: aioredis.Redis
) -> None:
    """A process not heard from for the registration TTL gets no wake-up; the next one does."""
    clock = FakeClock()
    holder, gone, alive = fleet(now=clock), fleet(now=clock), fleet(now=clock)
    rooms = [queued(gone), queued(alive)]
    await listening(admin, 2)
    (lease,) = await hold(holder, 1, 1)
    await refused(gone, 1)
    clock.advance(50.0)
    await refused(alive, 1)
    clock.advance(20.0)  # gone's registration (60 s) has lapsed; alive's has not
    await holder.release(lease, SUCCESS)
    await woken(rooms[1], 1)
    assert rooms[0].wakeups == 0
    assert len(await waiting_ids(admin)) == 1


async def test_a_registered_process_that_stopped_listening_is_skipped_at_once(
    fleet: Callable[..., RedisBackend], admin: aioredis.Redis
) -> None:
    """On one server a wake-up nobody hears unregisters its process and goes to the next."""
    holder, gone, alive = fleet(), fleet(), fleet()
    queued(gone)
    room = queued(alive)
    await listening(admin, 2)
    (lease,) = await hold(holder, 1, 1)
    await refused(gone, 1)
    await refused(alive, 1)
    await gone.aclose()  # its registration stays behind, as a killed process's would
    async with asyncio.timeout(BOUND_S):
        while len(await admin.pubsub_channels("pgw:wake:*")) > 1:
            await asyncio.sleep(0.01)
    assert len(await waiting_ids(admin)) == 2
    await holder.release(lease, SUCCESS)
    await woken(room, 1)
    assert len(await waiting_ids(admin)) == 1


async def test_a_grant_unregisters_and_a_call_that_never_waits_registers_nothing(
    fleet: Callable[..., RedisBackend], admin: aioredis.Redis
) -> None:
    """Only a refusal registers a process; its next grant takes it off the waiting set."""
    holder, waiter = fleet(), fleet()
    room_for(waiter, SCOPE)
    await listening(admin, 1)
    (lease,) = await hold(holder, 1, 1)
    assert await waiting_ids(admin) == []
    await refused(waiter, 1)
    assert len(await waiting_ids(admin)) == 1
    await holder.release(lease, SUCCESS)
    await hold(waiter, 1, 1)
    assert await waiting_ids(admin) == []


async def test_a_grant_with_calls_still_waiting_keeps_the_process_registered_at_the_back(
    fleet: Callable[..., RedisBackend], admin: aioredis.Redis
) -> None:
    """Two calls of W wait: the grant of one keeps W registered, behind O, never out of turn.

    Unregistered until its next call's refusal, W would miss any release in
    between: under load those turns went to the processes that happened to be
    registered (research-wiki/designs/fleet-wakeups.md, "The mechanism").
    """
    holder, w, o = fleet(), fleet(), fleet()
    w_room = queued(w)
    w_room.enter()  # a second call of W waits behind the one that asks
    o_room = queued(o)
    await listening(admin, 2)
    leases = await hold(holder, 2, 2)
    await refused(w, 2)
    await refused(o, 2)
    w_id, o_id = await waiting_ids(admin)
    await holder.release(leases[0], SUCCESS)
    await woken(w_room, 1)
    granted = await w.acquire(SCOPE, [spec(2)], ttl_s=60.0)
    assert granted.lease is not None
    assert await waiting_ids(admin) == [o_id, w_id], "kept, behind O"
    w_room.leave(w_room.head(), granted=True)  # type: ignore[arg-type]
    await holder.release(leases[1], SUCCESS)
    await woken(o_room, 1)
    assert (await o.acquire(SCOPE, [spec(2)], ttl_s=60.0)).lease is not None
    assert await waiting_ids(admin) == [w_id], "O's only call was granted: O is off"
    await w.release(granted.lease, SUCCESS)  # W's own turn: its next call is told
    await woken(w_room, 2)


async def test_a_releasing_process_leaves_the_turn_to_the_one_woken(
    fleet: Callable[..., RedisBackend], admin: aioredis.Redis
) -> None:
    """The turn is another process's: the releasing process's own waiters are not told.

    Its head would otherwise ask at once, behind its release on the same
    connection, and win the permit the woken process was promised.
    """
    holder, other = fleet(), fleet()
    own, theirs = queued(holder), queued(other)
    await listening(admin, 2)
    (lease,) = await hold(holder, 1, 1)
    await refused(other, 1)  # registered first: the turn is theirs
    await refused(holder, 1)
    await holder.release(lease, SUCCESS)
    await woken(theirs, 1)
    await asyncio.sleep(0.1)
    assert (own.wakeups, theirs.wakeups) == (0, 1)


async def test_a_registration_expires_with_its_keys(
    fleet: Callable[..., RedisBackend], admin: aioredis.Redis
) -> None:
    """The registry's two keys carry a TTL: an abandoned registry is collected by Redis."""
    holder, waiter = fleet(), fleet()
    room_for(waiter, SCOPE)
    await listening(admin, 1)
    await hold(holder, 1, 1)
    await refused(waiter, 1)
    for key in ("waiting", "waiting_until"):
        assert await admin.pttl(f"pgw:{{{SCOPE}}}:{key}") > 0, key


async def test_a_refusal_by_time_alone_registers_nothing(
    fleet: Callable[..., RedisBackend], admin: aioredis.Redis
) -> None:
    """A refusal that only time ends (rpm here) does not register: no release would help it.

    The head's own timer wakes it at the reopen time
    (research-wiki/designs/fleet-wakeups.md, "The mechanism").
    """
    waiter = fleet()
    room_for(waiter, SCOPE)
    await listening(admin, 1)
    limited = SourceSpec(name="a", max_concurrency=4, rpm=1, rpm_burst=1)
    assert (await waiter.acquire(SCOPE, [limited], ttl_s=60.0)).lease is not None
    result = await waiter.acquire(SCOPE, [limited], ttl_s=60.0)
    assert result.lease is None
    assert result.rejections[0].reason == "rpm"
    assert await waiting_ids(admin) == []


# --- rediss://: the subscription connects with the backend's own TLS context ----------------


@pytest.fixture
async def tls_admin(tls_redis: TLSRedis) -> AsyncIterator[aioredis.Redis]:
    """A client of the TLS server's plain port, to watch its subscriptions."""
    server = tls_redis.server
    client = aioredis.Redis(port=server.port, password=tls_redis.password, decode_responses=True)
    yield client
    await client.aclose()


async def test_a_rediss_waiter_is_woken_by_a_release_elsewhere_long_before_its_poll(
    tls_redis: TLSRedis, tls_admin: aioredis.Redis
) -> None:
    """Over TLS (the server's own CA) B subscribes, registers and is woken, not polled at 30 s."""
    a, b = RedisBackend(tls_redis.url()), RedisBackend(tls_redis.url())
    try:
        room_for(a, SCOPE)
        room = room_for(b, SCOPE)
        await listening(tls_admin, 2)
        (lease,) = await hold(a, 1, 1)
        head = room.enter()
        await refused(b, 1)
        assert len(await waiting_ids(tls_admin)) == 1, "B registered as waiting"
        await woken_by(room, head, a.release(lease, SUCCESS), within_s=2.0)
        room.leave(head)
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.parametrize("wrong", ["ca", "host name"])
async def test_a_rediss_subscription_that_fails_verification_fails_closed_without_a_secret(
    tls_redis: TLSRedis,
    tls_admin: aioredis.Redis,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    wrong: str,
) -> None:
    """A wrong CA or host name fails each subscription attempt in TLS, as calls fail; no secret."""
    if wrong == "ca":
        (tmp_path / "other").mkdir()
        other_ca, _, _ = tls_files(tmp_path / "other")
        url = tls_redis.url(ca=other_ca)
    else:  # the certificate names 127.0.0.1 only
        url = tls_redis.url().replace("@127.0.0.1:", "@localhost:")
    backend = RedisBackend(url)
    caplog.set_level(logging.DEBUG, logger="polygateway.backends.redis")

    def failures() -> list[str]:
        return [r.getMessage() for r in caplog.records if "wake-up subscription" in r.getMessage()]

    try:
        room_for(backend, SCOPE)
        with pytest.raises(GovernanceBackendError, match="CERTIFICATE_VERIFY_FAILED"):
            await backend.acquire(SCOPE, [spec(1)], ttl_s=60.0)
        async with asyncio.timeout(BOUND_S):
            while len(failures()) < 2:  # the first attempt, and the one remade after a pause
                await asyncio.sleep(0.01)
    finally:
        await backend.aclose()
    # Plaintext to a TLS port would fail otherwise (a reset, a timeout), the password sent.
    assert all("CERTIFICATE_VERIFY_FAILED" in failure for failure in failures())
    assert await tls_admin.pubsub_channels("pgw:wake:*") == []
    assert await waiting_ids(tls_admin) == []
    assert tls_redis.password not in caplog.text


async def test_closing_a_subscribed_backend_does_not_wait_for_the_listeners_tick(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listener reads with a timeout (its tick) to ping and to look at its flag; a
    close while it reads cancels the read instead of waiting out the tick (here 30 s)."""
    monkeypatch.setattr("polygateway.backends.redis.wakeups._TICK_S", 30.0)
    backend = RedisBackend(redis_url, socket_timeout_s=1.0)
    room_for(backend, SCOPE)  # a room subscribes the backend to its channel
    wakeups = backend._wakeups
    wakeups.start()
    async with asyncio.timeout(BOUND_S):
        await wakeups.subscribed.wait()
    async with asyncio.timeout(5.0):
        await backend.aclose()
    assert not wakeups.subscribed.is_set(), "the subscription was closed"
