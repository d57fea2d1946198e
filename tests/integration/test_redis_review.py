"""The Redis backend's Python side against a real server: faults found in review, pinned.

Each test fails on the code before its fix. A backend shared per URL
(``backends/factory.py``) outlives the event loop it was first used in: a
program that calls ``asyncio.run`` more than once uses it from each.
"""

from __future__ import annotations

import asyncio
import gc
import time
import traceback
from collections.abc import Callable
from typing import Any

import _redis_topologies as topologies
import pytest
import redis
import redis.asyncio as aioredis
from _redis_topologies import SentinelSetup
from redis.credentials import CredentialProvider
from redis.exceptions import ConnectionError as RedisConnectionError

from _ports import free_port
from polygateway.backends.base import AttemptOutcome, SourceSpec
from polygateway.backends.redis import RedisBackend, wire
from polygateway.errors import GovernanceBackendError
from polygateway.middleware.waiting import room_for

SCOPE = "chat"
SPEC = SourceSpec(name="a", max_concurrency=2)
SUCCESS = AttemptOutcome("success")
BOUND_S = 5.0


def _clients(url: str) -> int:
    """Connections the server holds open, the inspecting one left out."""
    with redis.Redis.from_url(url) as admin:
        return len(admin.client_list()) - 1


async def _call(backend: RedisBackend) -> float:
    """One governed call's backend work (acquire, release, snapshot); its duration in seconds."""
    started = time.monotonic()
    lease = (await backend.acquire(SCOPE, [SPEC], ttl_s=30)).lease
    assert lease is not None
    await backend.release(lease, SUCCESS)
    assert (await backend.snapshot(SCOPE)).in_flight == 0
    return time.monotonic() - started


@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
def test_a_backend_used_again_in_a_new_event_loop_serves_and_closes(redis_url: str) -> None:
    """A second ``asyncio.run`` gets a connection of its own loop; ``aclose`` in a third works.

    The first loop ended without ``aclose``: its connection cannot be closed by a
    loop that is gone, so the server is told (it drops it) and the collector
    frees the socket, warning as asyncio does for any transport left open.
    """
    backend = RedisBackend(redis_url, socket_timeout_s=2.0)
    assert asyncio.run(_call(backend)) < 1.0
    assert asyncio.run(_call(backend)) < 1.0  # before: no reply within 2 s, every call
    asyncio.run(backend.aclose())
    gc.collect()  # the first loop's transport, while its warning is expected
    deadline = time.monotonic() + BOUND_S
    while _clients(redis_url) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _clients(redis_url) == 0


def test_a_backend_closed_in_a_new_event_loop_closes_its_connection(redis_url: str) -> None:
    """``aclose`` from another loop than the connection's raises nothing and leaves none open."""
    backend = RedisBackend(redis_url, socket_timeout_s=2.0)

    async def use_then_keep_loop_open() -> None:
        await _call(backend)

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(use_then_keep_loop_open())
        asyncio.run(backend.aclose())  # before: RuntimeError (another loop's transport)
        loop.run_until_complete(asyncio.sleep(0.05))  # the first loop closes what it owns
    finally:
        loop.close()
    deadline = time.monotonic() + BOUND_S
    while _clients(redis_url) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _clients(redis_url) == 0


@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
def test_wake_ups_are_subscribed_again_in_a_new_event_loop(redis_url: str) -> None:
    """A backend whose waiting room listened in one loop listens again in the next."""
    backend = RedisBackend(redis_url, socket_timeout_s=2.0)
    channel = f"pgw:wake:{backend._proc}"

    def subscribers() -> int:
        with redis.Redis.from_url(redis_url) as admin:
            return int(dict(admin.pubsub_numsub(channel))[channel.encode()])

    async def listening_call() -> None:
        room_for(backend, SCOPE)
        await _call(backend)
        async with asyncio.timeout(BOUND_S):
            while subscribers() != 1:
                await asyncio.sleep(0.01)

    try:
        asyncio.run(listening_call())
        asyncio.run(listening_call())  # before: never subscribed again (a task of the old loop)
    finally:
        asyncio.run(backend.aclose())
        gc.collect()


@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
def test_sentinel_failovers_are_listened_for_again_in_a_new_event_loop(
    sentinel_setup: SentinelSetup,
) -> None:
    """The ``+switch-master`` listener of a backend is made again in the next loop."""
    backend = RedisBackend(
        "redis:///0",
        mode="sentinel",
        sentinels=sentinel_setup.sentinels,
        sentinel_master=SentinelSetup.MASTER,
        socket_timeout_s=1.0,
    )

    async def listened_call() -> None:
        lease = await topologies.acquire_until_served(backend, SCOPE, SPEC, 30.0, BOUND_S)
        await backend.release(lease, SUCCESS)
        async with asyncio.timeout(BOUND_S):
            while await asyncio.to_thread(topologies.sentinel_subscribers, sentinel_setup) < 1:
                await asyncio.sleep(0.02)

    try:
        asyncio.run(listened_call())
        asyncio.run(listened_call())  # before: no listener (the first loop's task, ended)
    finally:
        asyncio.run(backend.aclose())
        gc.collect()


class _FailingCredentials(CredentialProvider):
    """A credential provider whose store is down (a vault, a token service)."""

    def get_credentials(self) -> tuple[str, str]:
        raise RuntimeError("credential store unreachable")

    async def get_credentials_async(self) -> tuple[str, str]:
        raise RuntimeError("credential store unreachable")


async def test_a_failing_credential_provider_fails_closed_typed(redis_url: str) -> None:
    """An injected client's credential provider that raises: ``GovernanceBackendError``."""
    client = aioredis.Redis.from_url(redis_url, credential_provider=_FailingCredentials())
    backend = RedisBackend(redis_url, client=client, socket_timeout_s=2.0)
    try:
        with pytest.raises(GovernanceBackendError, match="credential store unreachable") as caught:
            await backend.acquire(SCOPE, [SPEC], ttl_s=30)  # before: the RuntimeError itself
        assert caught.value.operation == "acquire"
        assert caught.value.scope == SCOPE
        assert isinstance(caught.value.__cause__, RuntimeError)
    finally:
        await backend.aclose()
        await client.aclose()


async def test_a_release_failed_by_aclose_is_not_written_again_after_it(
    make_redis_server: Callable[..., Any],
) -> None:
    """A release still due when ``aclose`` gives up on a frozen server opens no new connection.

    ``aclose`` stops the retries of failed releases (their leases expire); a
    release that its own closing failed must not reconnect the closed backend.
    """
    server = make_redis_server()
    backend = RedisBackend(server.url, socket_timeout_s=0.3)
    try:
        lease = (await backend.acquire(SCOPE, [SPEC], ttl_s=30)).lease
        assert lease is not None
        server.pause()
        await backend.release(lease, SUCCESS)  # written behind; its reply never comes
        await backend.aclose()  # waits one socket timeout, then the release fails
        server.resume()
        await asyncio.sleep(0.5)  # a retry would have come (first after 0.05 s) and connected
        assert _clients(server.url) == 0  # before: 1, the retry's connection
    finally:
        server.resume()
        await backend.aclose()


async def test_a_connection_lost_while_the_primary_is_located_again_fails_what_was_queued(
    make_redis_server: Callable[..., Any],
) -> None:
    """Lost between its login and the second ``locate``: the queued command is not left hanging.

    Behind Sentinel the wire asks where the primary is once more after
    connecting; a connection the server drops meanwhile must not be written to
    (the write would be dropped and its reply never come, so the callback of
    a release written again after a failover would never run).
    """
    server = make_redis_server()
    endpoint = wire.Endpoint.from_url(server.url, connect_timeout_s=2.0)
    located = 0

    async def locate() -> wire.Endpoint:
        nonlocal located
        located += 1
        if located == 2:  # connected: the server drops the connection now
            with server.client() as admin:
                admin.client_kill_filter(_type="normal", skipme=True)
            await asyncio.sleep(0.2)  # its end of file reaches the event loop
        return endpoint

    link = wire.Wire(endpoint, late_reply_s=5.0, locate=locate)
    reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    link.send(wire.command("SET", "lost-test", "written"), reply.set_result)
    try:
        async with asyncio.timeout(BOUND_S):
            got = await reply  # before: never called back
    finally:
        await link.aclose()
    assert isinstance(got, RedisConnectionError)
    assert "lost" in str(got)


async def test_a_backend_used_again_after_aclose_writes_a_failed_release_again(
    make_redis_server: Callable[..., Any],
) -> None:
    """Closed, then used again: a release refused by a server in transition is written again.

    ``aclose`` gives up only on the releases written before it; the server
    turned replica for a moment answers ``READONLY``, and the release must
    free its permit once it is a primary again, not at lease expiry.
    """
    server = make_redis_server()
    backend = RedisBackend(server.url, socket_timeout_s=0.5)
    try:
        await backend.progress_age_s(SCOPE)
        await backend.aclose()
        lease = (await backend.acquire(SCOPE, [SPEC], ttl_s=30)).lease
        assert lease is not None
        with server.client() as admin:
            admin.replicaof("127.0.0.1", str(free_port()))  # READONLY, its data kept
            await backend.release(lease, SUCCESS)
            await asyncio.sleep(0.2)
            admin.replicaof("no", "one")
        async with asyncio.timeout(BOUND_S):
            while (await backend.snapshot(SCOPE)).in_flight:  # before: held for 30 s
                await asyncio.sleep(0.05)
    finally:
        await backend.aclose()


@pytest.mark.filterwarnings("ignore:unclosed:ResourceWarning")
def test_a_grant_whose_reply_outlived_its_event_loop_is_given_back_in_the_next(
    make_redis_server: Callable[..., Any],
) -> None:
    """An acquire granted after its loop ended (reply never read) frees its permit in the next.

    Its caller is gone with the loop; the reply sits unread in a connection
    only that loop could read. The next loop leaves the connection and takes
    the acquire as unanswered, so its lease id is released on its candidate.
    """
    server = make_redis_server()
    backend = RedisBackend(server.url, socket_timeout_s=2.0)

    async def acquire_in_flight_as_the_loop_ends() -> None:
        await backend.progress_age_s(SCOPE)  # connected
        server.pause()
        asyncio.get_running_loop().create_task(backend.acquire(SCOPE, [SPEC], ttl_s=30))
        await asyncio.sleep(0.05)  # written; asyncio.run cancels the caller when this returns

    async def in_flight() -> int:
        return (await backend.snapshot(SCOPE)).in_flight

    try:
        asyncio.run(acquire_in_flight_as_the_loop_ends())
        server.resume()
        with server.client() as admin:
            deadline = time.monotonic() + BOUND_S
            while not admin.exists(f"pgw:{{{SCOPE}}}:leases:a") and time.monotonic() < deadline:
                time.sleep(0.01)  # the server ran the acquire: granted
        assert asyncio.run(in_flight()) == 0  # before: 1, held until its lease expires
    finally:
        server.resume()
        asyncio.run(backend.aclose())
        gc.collect()


HELLO_PASSWORD = "hello-pw-FAKE-5d1e"


@pytest.mark.parametrize("injected", [False, True], ids=["url", "client"])
async def test_a_server_refusing_hello_never_shows_the_password(
    make_redis_server: Callable[..., Any], injected: bool
) -> None:
    """A server without ``HELLO`` (before Redis 6, or the command renamed away) echoes its
    arguments, password included, in its error: neither the error nor its causes show it."""
    server = make_redis_server("--rename-command", "HELLO", "", password=HELLO_PASSWORD)
    client = aioredis.Redis(port=server.port, password=HELLO_PASSWORD) if injected else None
    url = f"redis://127.0.0.1:{server.port}/0" if injected else server.url
    backend = RedisBackend(url, client=client, socket_timeout_s=2.0)
    try:
        with pytest.raises(GovernanceBackendError, match="unknown command 'HELLO'") as caught:
            await backend.progress_age_s(SCOPE)
        shown = "".join(traceback.format_exception(caught.value))
        assert HELLO_PASSWORD not in shown  # before: in the message (client) and its cause
    finally:
        await backend.aclose()
        if client is not None:
            await client.aclose()


class _FlakyCredentials(CredentialProvider):
    """A password from a store that fails its first ``failures`` asks, then answers."""

    def __init__(self, password: str, failures: int) -> None:
        self.password = password
        self.failures = failures

    def get_credentials(self) -> tuple[str]:
        raise NotImplementedError("asyncio only")

    async def get_credentials_async(self) -> tuple[str]:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("credential store unreachable")
        return (self.password,)


async def test_the_wake_up_subscription_is_remade_after_a_credential_failure(
    make_redis_server: Callable[..., Any],
) -> None:
    """The subscription's login failing with the provider's own error is retried, not fatal."""
    server = make_redis_server(password=HELLO_PASSWORD)
    client = aioredis.Redis(
        port=server.port, credential_provider=_FlakyCredentials(HELLO_PASSWORD, failures=1)
    )
    backend = RedisBackend(f"redis://127.0.0.1:{server.port}/0", client=client)
    try:
        room_for(backend, SCOPE)  # the subscription starts: the first to ask for credentials
        async with asyncio.timeout(BOUND_S):
            await backend._wakeups.subscribed.wait()  # before: never (its task died)
    finally:
        await backend.aclose()
        await client.aclose()
