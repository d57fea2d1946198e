"""The Redis backend behind Sentinel (``redis_mode = "sentinel"``), failovers included.

Each test starts its own primary, replica and Sentinel (``redis-sentinel``,
Debian's package, installed by ``make test``) on free loopback ports, with a
short ``down-after-milliseconds``, and stops them all at its end. The
failovers are real: the primary is killed (its connections reset) or frozen
(SIGSTOP: nothing answers, nothing resets), and the Sentinel promotes the
replica. Bounds are generous (a loaded two-core machine); what is pinned is
that the backend reaches the new primary without waiting for the 60 s
silence bound of standalone mode or for a lease to expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import _redis_topologies as topologies
import pytest
from _redis_topologies import SentinelSetup, running

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.errors import GovernanceBackendError
from polygateway.middleware.waiting import room_for

SCOPE = "chat"
SPEC = SourceSpec(name="a", max_concurrency=4)
SUCCESS = AttemptOutcome("success")
TIMEOUT_S = 1.0
LONG_TTL_S = 600.0
"""Leases that would hold their permit for ten minutes if their release were lost."""
FAILOVER_BOUND_S = 45.0
"""Sentinel's own failover (down-after 1 s, then an election) plus ours, on a loaded machine."""
SENTINEL_PASSWORD = "sentinel-pw-SECRET-7c2a"
WRONG_PASSWORD = "wrong-pw-SECRET-0b9d"
SENTINEL_USER = "gateway-SECRET-4f1e"
WRONG_USER = "intruder-SECRET-9d2a"


@pytest.fixture
async def backend(sentinel_setup: SentinelSetup) -> AsyncIterator[RedisBackend]:
    made = RedisBackend(
        "redis:///0",
        mode="sentinel",
        sentinels=sentinel_setup.sentinels,
        sentinel_master=SentinelSetup.MASTER,
        socket_timeout_s=TIMEOUT_S,
    )
    try:
        yield made
    finally:
        await made.aclose()


async def acquire_until_served(backend: RedisBackend, ttl_s: float = 30.0) -> Lease:
    return await topologies.acquire_until_served(backend, SCOPE, SPEC, ttl_s, FAILOVER_BOUND_S)


def replicated(setup: SentinelSetup) -> None:
    """Wait until the replica has everything the primary wrote (a failover without lag)."""
    with setup.primary.client() as client:
        assert client.execute_command("WAIT", 1, 5000) == 1


async def in_flight(backend: RedisBackend) -> int:
    snap = await backend.snapshot(SCOPE)
    return snap.sources[0].in_flight if snap.sources else 0


async def test_the_backend_finds_the_primary_through_the_sentinel(
    sentinel_setup: SentinelSetup, backend: RedisBackend
) -> None:
    """Calls run on the primary the Sentinel names; the replica receives them."""
    lease = await acquire_until_served(backend)
    await backend.release(lease, SUCCESS)
    assert await in_flight(backend) == 0
    assert backend._wire.route(SCOPE).endpoint.port == sentinel_setup.primary.port


async def test_a_killed_primary_is_replaced_and_releases_of_the_gap_are_not_lost(
    sentinel_setup: SentinelSetup, backend: RedisBackend
) -> None:
    """Leases granted, the primary killed, released during the gap: the new primary frees them
    (retried releases), long before their ten-minute TTL."""
    leases = [await acquire_until_served(backend, LONG_TTL_S) for _ in range(SPEC.max_concurrency)]
    replicated(sentinel_setup)
    old_port = sentinel_setup.primary.port
    sentinel_setup.primary.kill()
    for lease in leases:
        with contextlib.suppress(GovernanceBackendError):  # failed now; written again later
            await backend.release(lease, SUCCESS)
    new_primary = await asyncio.to_thread(sentinel_setup.wait_for_failover, old_port)
    deadline = time.monotonic() + FAILOVER_BOUND_S
    while time.monotonic() < deadline:
        try:
            if await in_flight(backend) == 0:
                break
        except GovernanceBackendError:
            pass
        await asyncio.sleep(0.2)
    assert await in_flight(backend) == 0
    assert backend._wire.route(SCOPE).endpoint.port == new_primary.port
    lease = await acquire_until_served(backend)
    await backend.release(lease, SUCCESS)


async def test_a_frozen_primary_is_abandoned_after_the_socket_timeout(
    sentinel_setup: SentinelSetup, backend: RedisBackend
) -> None:
    """Frozen without a reset: the first call after the failover fails within the socket
    timeout, and the next ones reach the new primary, not after the 60 s silence bound."""
    lease = await acquire_until_served(backend)
    await backend.release(lease, SUCCESS)
    replicated(sentinel_setup)
    old_port = sentinel_setup.primary.port
    sentinel_setup.primary.pause()
    try:
        new_primary = await asyncio.to_thread(sentinel_setup.wait_for_failover, old_port)
        started = time.monotonic()
        lease = await acquire_until_served(backend)
        took = time.monotonic() - started
        await backend.release(lease, SUCCESS)
        assert backend._wire.route(SCOPE).endpoint.port == new_primary.port
        assert took < 30.0  # a socket timeout and a Sentinel round; far below the 60 s bound
    finally:
        sentinel_setup.primary.resume()


async def test_a_demoted_primary_that_comes_back_is_left_for_the_new_one(
    sentinel_setup: SentinelSetup, backend: RedisBackend
) -> None:
    """The old primary thawed after the failover answers as a replica (READONLY): the backend
    goes to the primary the Sentinel names instead."""
    lease = await acquire_until_served(backend)
    await backend.release(lease, SUCCESS)
    replicated(sentinel_setup)
    old_port = sentinel_setup.primary.port
    sentinel_setup.primary.pause()
    try:
        new_primary = await asyncio.to_thread(sentinel_setup.wait_for_failover, old_port)
    finally:
        sentinel_setup.primary.resume()
    # Sentinel's announcement, or the old primary's READONLY once demoted, moves the backend.
    deadline = time.monotonic() + FAILOVER_BOUND_S
    while backend._wire.route(SCOPE).endpoint.port != new_primary.port:
        assert time.monotonic() < deadline, "still on the old primary"
        lease = await acquire_until_served(backend)
        await backend.release(lease, SUCCESS)
        await asyncio.sleep(0.05)
    lease = await acquire_until_served(backend)
    await backend.release(lease, SUCCESS)
    assert await in_flight(backend) == 0


async def test_no_sentinel_answering_fails_closed(tmp_path: Path) -> None:
    """Sentinels that are all down: the call fails closed, naming the operation."""
    backend = RedisBackend(
        "redis:///0",
        mode="sentinel",
        sentinels=["127.0.0.1:1"],
        sentinel_master="mymaster",
        socket_timeout_s=TIMEOUT_S,
    )
    try:
        with pytest.raises(GovernanceBackendError, match="no Sentinel named the primary"):
            await backend.acquire(SCOPE, [SPEC], ttl_s=30)
    finally:
        await backend.aclose()


@pytest.fixture
def guarded_setup(tmp_path: Path) -> Iterator[SentinelSetup]:
    """A primary, a replica and a Sentinel that requires SENTINEL_PASSWORD."""
    yield from running(SentinelSetup(tmp_path, sentinel_password=SENTINEL_PASSWORD))


async def test_the_backend_finds_the_primary_through_a_password_protected_sentinel(
    guarded_setup: SentinelSetup,
) -> None:
    """With the Sentinel's password, the primary is found, the failover listener and the
    wake-up subscription (which asks the Sentinel where the primary is) both log in."""
    backend = RedisBackend(
        "redis:///0",
        mode="sentinel",
        sentinels=guarded_setup.sentinels,
        sentinel_master=SentinelSetup.MASTER,
        sentinel_password=SENTINEL_PASSWORD,
        socket_timeout_s=TIMEOUT_S,
    )
    try:
        room_for(backend, SCOPE)  # a waiting room: the wake-up subscription opens
        lease = await acquire_until_served(backend)
        await backend.release(lease, SUCCESS)
        assert await in_flight(backend) == 0
        assert backend._wire.route(SCOPE).endpoint.port == guarded_setup.primary.port
        async with asyncio.timeout(FAILOVER_BOUND_S):
            await backend._wakeups.subscribed.wait()
            while await asyncio.to_thread(topologies.sentinel_subscribers, guarded_setup) < 1:
                await asyncio.sleep(0.05)
    finally:
        await backend.aclose()


@pytest.mark.parametrize("given", [WRONG_PASSWORD, None], ids=["wrong", "missing"])
async def test_a_sentinel_refusing_the_password_fails_closed_without_it(
    guarded_setup: SentinelSetup, given: str | None
) -> None:
    """A wrong or missing Sentinel password: GovernanceBackendError within a few socket
    timeouts, naming the Sentinel and the failed authentication, never a password."""
    error, backend_repr = await _refused_login(guarded_setup, sentinel_password=given)
    message = str(error)
    assert guarded_setup.sentinel.address in message
    assert "authentication failed" in message
    for shown in (message, repr(error), backend_repr):
        assert WRONG_PASSWORD not in shown
        assert SENTINEL_PASSWORD not in shown
    assert error.operation == "acquire"


async def _refused_login(
    setup: SentinelSetup, **credentials: str | None
) -> tuple[GovernanceBackendError, str]:
    """An acquire through ``setup``'s Sentinel with these credentials, which it refuses: the
    typed failure (within a few socket timeouts, never a hang) and the backend's repr; the
    backend is closed on return, so its failover listener's attempts are logged by then."""
    backend = RedisBackend(
        "redis:///0",
        mode="sentinel",
        sentinels=setup.sentinels,
        sentinel_master=SentinelSetup.MASTER,
        socket_timeout_s=TIMEOUT_S,
        **credentials,
    )
    try:
        async with asyncio.timeout(5 * TIMEOUT_S):
            with pytest.raises(GovernanceBackendError) as info:
                await backend.acquire(SCOPE, [SPEC], ttl_s=30)
        return info.value, repr(backend)
    finally:
        await backend.aclose()


@pytest.fixture
def acl_setup(tmp_path: Path) -> Iterator[SentinelSetup]:
    """A Sentinel whose only user is SENTINEL_USER (ACL, ``default`` off), with its primary."""
    yield from running(
        SentinelSetup(
            tmp_path, sentinel_password=SENTINEL_PASSWORD, sentinel_username=SENTINEL_USER
        )
    )


async def test_the_backend_finds_the_primary_and_hears_failovers_as_a_sentinel_acl_user(
    acl_setup: SentinelSetup,
) -> None:
    """Logged in as the Sentinel's ACL user: the primary is found, the +switch-master
    subscription is made, and a killed primary is followed to the promoted replica."""
    backend = RedisBackend(
        "redis:///0",
        mode="sentinel",
        sentinels=acl_setup.sentinels,
        sentinel_master=SentinelSetup.MASTER,
        sentinel_password=SENTINEL_PASSWORD,
        sentinel_username=SENTINEL_USER,
        socket_timeout_s=TIMEOUT_S,
    )
    try:
        got = await backend.acquire(SCOPE, [SPEC], ttl_s=30)  # at once: no retry needed
        assert got.lease is not None, got.rejections
        await backend.release(got.lease, SUCCESS)
        assert backend._wire.route(SCOPE).endpoint.port == acl_setup.primary.port
        async with asyncio.timeout(FAILOVER_BOUND_S):  # the failover listener logged in
            while await asyncio.to_thread(topologies.sentinel_subscribers, acl_setup) < 1:
                await asyncio.sleep(0.05)
        replicated(acl_setup)
        old_port = acl_setup.primary.port
        acl_setup.primary.kill()
        new_primary = await asyncio.to_thread(acl_setup.wait_for_failover, old_port)
        lease = await acquire_until_served(backend)
        await backend.release(lease, SUCCESS)
        assert backend._wire.route(SCOPE).endpoint.port == new_primary.port
    finally:
        await backend.aclose()


@pytest.mark.parametrize(
    ("user", "password"),
    [(WRONG_USER, SENTINEL_PASSWORD), (SENTINEL_USER, WRONG_PASSWORD)],
    ids=["wrong-user", "wrong-password"],
)
async def test_a_sentinel_refusing_the_acl_user_fails_closed_without_its_secrets(
    acl_setup: SentinelSetup, user: str, password: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A user the Sentinel does not know, or the wrong password: GovernanceBackendError within
    a few socket timeouts, naming the Sentinel and the failed authentication, showing neither
    the user name nor any password, in the error, its repr, the backend's or the logs."""
    caplog.set_level(logging.DEBUG)
    error, backend_repr = await _refused_login(
        acl_setup, sentinel_password=password, sentinel_username=user
    )
    message = str(error)
    assert acl_setup.sentinel.address in message
    assert "authentication failed with the Sentinel user and password" in message
    for shown in (message, repr(error), backend_repr, caplog.text):
        for secret in (WRONG_USER, SENTINEL_USER, WRONG_PASSWORD, SENTINEL_PASSWORD):
            assert secret not in shown
    assert error.operation == "acquire"
