"""Fleet-wide wake-ups: the backend hears on its own channel that a permit is its turn.

Each ``RedisBackend`` has a process id (random, made at construction). While
its waiting room of a scope is not empty, ACQUIRE keeps the id registered in
the scope's waiting set (``scripts.py``), and a RELEASE anywhere in the fleet
that frees a permit wakes the least recently woken registered process by
publishing the scope on ``pgw:wake:<process id>``. This module is the
listening half: one subscription per backend, opened when the first waiting
room subscribes to the backend, through redis-py's ``PubSub`` (rare messages,
no hot path; the pattern ``sentinel.py`` uses for ``+switch-master``). A
message calls the backend's release listeners of its scope, so the head of
that room asks at once. research-wiki/designs/fleet-wakeups.md has the why.

Plain ``PUBLISH`` / ``SUBSCRIBE``, one channel per process whatever the
number of scopes: the subscription is made once, to one server, and every
scope's wake-ups reach it. On one server and behind Sentinel (where a
primary's ``PUBLISH`` reaches its replicas' subscribers too) that server is
the one the backend writes to; in a Cluster any node will do, since the
cluster bus carries a ``PUBLISH`` to every node. Sharded pub/sub
(``SPUBLISH``) would spare the bus but needs a channel per scope and slot and
a subscription per node owning one, followed through every resharding: the
design page says why that waits.

A ``rediss://`` server is subscribed on through the very ``ssl.SSLContext``
the backend's own connections use (``Endpoint.tls``; ``_TLSConnection`` says
how), so the subscription verifies what they verify and fails as they do.

A lost message costs its waiter one poll interval at most: the head of every
room still polls, so this subscription only ever makes waiting shorter. It
is remade after any failure, with a pause; a server that stops answering is
noticed by a ``PING`` the subscription sends when it has been silent for a
while.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Final

import redis.asyncio as aioredis
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from polygateway.backends.redis import codec
from polygateway.backends.redis.endpoint import Endpoint

__all__ = ["CHANNEL_PREFIX", "Wakeups", "pubsub_client"]

logger = logging.getLogger("polygateway.backends.redis")

CHANNEL_PREFIX: Final = "pgw:wake:"
"""A process's channel is this and its id (RELEASE publishes there; ``scripts.py``)."""

_IDLE_PING_S: Final = 10.0
"""A subscription silent this long is asked for a ``PONG``, which must come within the timeout."""

_RETRY_S: Final = 1.0
"""Pause before the subscription is made again after it failed or was lost."""

_TICK_S: Final = 0.25
"""How often the listening loop looks up from its reads: to ping, and to stop when closed.

While it connects it stops on a flag rather than by cancellation: redis-py can
swallow a cancellation that lands while it connects and leave its task waiting
for ever. Once subscribed it only reads, and ``aclose`` cancels the read at
once instead of waiting out the tick.
"""


class Wakeups:
    """One backend's subscription to its own wake-up channel.

    Args:
        channel: ``pgw:wake:<process id>``.
        where: the server to subscribe on, asked before each connection.
        woken: called with each wake-up's message: its scope (and its priority class).
        timeout_s: bounds connecting, subscribing and each ``PONG``.
    """

    __slots__ = (
        "_channel",
        "_closing",
        "_listening",
        "_timeout_s",
        "_where",
        "_woken",
        "subscribed",
    )

    def __init__(
        self,
        channel: str,
        where: Callable[[], Awaitable[Endpoint]],
        woken: Callable[[str], None],
        *,
        timeout_s: float,
    ) -> None:
        self._channel = channel
        self._where = where
        self._woken = woken
        self._timeout_s = timeout_s
        self._listening: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self.subscribed = asyncio.Event()
        """Set while the subscription is confirmed by the server (tests wait for it)."""

    @property
    def started(self) -> bool:
        """Whether the subscription was started in the running event loop (once per loop)."""
        listening = self._listening
        return listening is not None and listening.get_loop() is asyncio.get_running_loop()

    def start(self) -> None:
        """Start listening in the background (in the running event loop).

        Started anew after ``aclose`` (a backend used again, whose wire
        reconnects as well) and in a loop other than the last one's (a backend
        shared across ``asyncio.run`` calls: a task of a loop that ended never
        runs again, and its events may be bound to that loop). Each start has
        its own events, so a listener still stopping keeps seeing its own
        ``closing`` flag set.
        """
        loop = asyncio.get_running_loop()
        listening = self._listening
        if listening is not None and listening.get_loop() is loop:
            return
        if listening is not None or self._closing.is_set():
            self._closing, self.subscribed = asyncio.Event(), asyncio.Event()
        self._listening = loop.create_task(self._listen(self._closing, self.subscribed))

    async def _listen(self, closing: asyncio.Event, subscribed: asyncio.Event) -> None:
        """Subscribe, hand each message's scope to ``woken``; remake it after any failure."""
        while not closing.is_set():
            try:
                endpoint = await self._where()
                client = pubsub_client(endpoint, self._timeout_s)
            except (RedisError, OSError, ValueError) as exc:
                logger.debug("wake-up subscription: no server to subscribe on: %s", exc)
            else:
                try:
                    await self._session(client, closing, subscribed)
                except (RedisError, OSError, TimeoutError) as exc:
                    # Waiters poll meanwhile; the next attempt is a pause away.
                    # redis-py's words name the server and the reason, never a credential.
                    logger.debug("wake-up subscription lost: %s: %s", type(exc).__name__, exc)
                except Exception as exc:
                    # Not redis-py's: an injected credential provider's own failure (a token
                    # service down) reaches us as it raised it. Remade all the same, as the
                    # module promises, and said louder: it may be a fault of ours as well.
                    logger.warning("wake-up subscription failed: %s: %s", type(exc).__name__, exc)
                finally:
                    subscribed.clear()
                    with contextlib.suppress(RedisError, OSError):
                        await client.aclose()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_RETRY_S):
                    await closing.wait()

    async def _session(
        self, client: aioredis.Redis, closing: asyncio.Event, subscribed: asyncio.Event
    ) -> None:
        async with client.pubsub() as pubsub:
            async with asyncio.timeout(self._timeout_s):
                await pubsub.subscribe(self._channel)
                while await pubsub.get_message(timeout=self._timeout_s) is None:
                    pass  # the subscription's confirmation
            subscribed.set()
            loop = asyncio.get_running_loop()
            pinged_at: float | None = None
            heard_at = loop.time()
            while not closing.is_set():
                message = await pubsub.get_message(timeout=_TICK_S)
                now = loop.time()
                if message is not None:
                    heard_at, pinged_at = now, None
                    self._handle(message)
                elif pinged_at is not None and now - pinged_at > self._timeout_s:
                    raise TimeoutError("no PONG on the wake-up subscription")
                elif pinged_at is None and now - heard_at > _IDLE_PING_S:
                    pinged_at = now
                    await pubsub.ping()

    def _handle(self, message: dict[str, Any]) -> None:
        if message.get("type") != "message":
            return  # a PONG, a subscription's confirmation
        self._woken(codec.text(message.get("data", b"")))

    async def aclose(self) -> None:
        """Stop listening and close the subscription's connection (``start`` listens again)."""
        self._closing.set()
        listening, self._listening = self._listening, None
        if listening is None or listening.done():
            return
        if listening.get_loop() is asyncio.get_running_loop():
            if self.subscribed.is_set():
                listening.cancel()  # reading a connection made: no reason to wait (_TICK_S)
            # A connection under way is given its timeout to stop by itself (see _TICK_S).
            await asyncio.wait({listening}, timeout=self._timeout_s + _TICK_S)
        if not listening.done() and not listening.get_loop().is_closed():
            listening.cancel()


def pubsub_client(endpoint: Endpoint, timeout_s: float) -> aioredis.Redis:
    """A redis-py client for ``endpoint``'s server, login and TLS context, without retries.

    For subscriptions (rare messages, no hot path): this module's, and the
    ``+switch-master`` listener of ``sentinel.py``.
    """
    common: dict[str, Any] = {
        "username": endpoint.username,
        "password": endpoint.password,
        "credential_provider": endpoint.credential_provider,
        "client_name": endpoint.client_name,
        "socket_connect_timeout": endpoint.connect_timeout_s or timeout_s,
        "retry": Retry(NoBackoff(), 0),  # a failure ends the session; _listen remakes it
    }
    if endpoint.path is not None:
        return aioredis.Redis(unix_socket_path=endpoint.path, **common)
    if endpoint.tls is None:
        return aioredis.Redis(host=endpoint.host, port=endpoint.port, **common)
    # redis-py's Redis takes no connection class, so the pool is made here and the client
    # owns it (closed with it, as Redis.from_pool sets); the client is told the credential
    # provider as well, as Redis(...) above is, to re-authenticate with a streaming one.
    pool = aioredis.ConnectionPool(
        connection_class=_TLSConnection,
        tls=endpoint.tls,
        host=endpoint.host,
        port=endpoint.port,
        **common,
    )
    client = aioredis.Redis(connection_pool=pool, credential_provider=endpoint.credential_provider)
    client.auto_close_connection_pool = True
    return client


class _TLSConnection(SSLConnection):
    """redis-py's TLS connection, made with the backend's own ``ssl.SSLContext``.

    redis-py builds an ``SSLConnection``'s context from settings
    (``RedisSSLContext.get``); an ``Endpoint`` keeps only the context built
    (from a URL or an injected client's settings, ``endpoint.py``), which
    cannot be read back into settings. ``get`` returns the ``context`` it
    holds once one is set, so setting ours there makes every connection verify
    exactly what the wire's do: the same CA, client certificate, verification
    mode and host-name check, with the server's host as ``server_hostname``
    (asyncio's default, as for the wire). All else about connecting stays
    redis-py's own (``Connection``): the connect timeout, ``TCP_NODELAY``,
    keepalive. Were a later redis-py to stop reading ``context``, the
    connection would still be TLS with redis-py's default verification, never
    plaintext; and the TLS wake-up tests, whose CA is not the system's, would
    fail.
    """

    def __init__(self, *, tls: ssl.SSLContext, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ssl_context.context = tls
