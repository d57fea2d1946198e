"""Pooled HTTP clients keyed by (verify, proxy), the pooling both transport modules share.

Sources that agree on TLS verification and proxy share one pooled client (an
httpx ``AsyncClient`` or an aiohttp ``ClientSession``). Each client is built
on first use (aiohttp needs a running loop for it) and all are closed
together; after that, asking for one is a programming error.

``ShardGroup`` splits one such pool into several smaller clients, for an HTTP
client whose pool costs more per request the more requests it holds (httpx).

A stream read to ``[DONE]`` goes back to its pool only if its body is read to
the end, which (OpenAI's last chunk, the chunked body's terminator) usually
comes a moment after ``[DONE]``: both transports read on for at most
``STREAM_DRAIN_S`` (``ends_stream`` tells the marker), and close the
connection if the end has not come by then. A stream left before ``[DONE]``
is closed, never pooled: its unread answer would be the next call's.
"""

from __future__ import annotations

import importlib
import math
import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Generic, Literal, TypeVar

from polygateway.errors import ConfigError
from polygateway.transport.http import DONE

if TYPE_CHECKING:
    from polygateway.config import SourceConfig

__all__ = [
    "DEFAULT_KEY",
    "STREAM_DRAIN_S",
    "ClientPools",
    "PoolKey",
    "ShardGroup",
    "check_pool_size",
    "check_proxies",
    "ends_stream",
    "shard_plan",
    "ssl_verify",
]

PoolKey = tuple[bool | str, str]
"""(verify, proxy): sources that agree on both share one pooled client."""

DEFAULT_KEY: PoolKey = (True, "")
"""The key of a source the transport was not built with: verified TLS, no proxy."""

STREAM_DRAIN_S = 0.1
"""Longest wait, after ``[DONE]``, for the end of a stream's body (then its connection is pooled).

Reusing the connection saves the next call a TCP and TLS handshake (tens
to hundreds of milliseconds to a distant provider); a body that has not
ended this long after its last event costs its caller no more than this
before the connection is closed instead.
"""

_C = TypeVar("_C")


def ends_stream(data: str) -> bool:
    """Whether an event's data is the ``[DONE]`` marker (one character looked at for a chunk)."""
    return data[:1] != "{" and data.strip() == DONE


def check_pool_size(max_connections: int) -> int:
    """``max_connections`` itself, or ``ValueError``: a pool of no connection serves nothing."""
    if max_connections < 1:
        raise ValueError(f"max_connections must be at least 1, got {max_connections}")
    return max_connections


def check_proxies(sources: Sequence[SourceConfig], library: Literal["httpx", "aiohttp"]) -> None:
    """Refuse, as the transport is built, a proxy its HTTP library cannot use.

    Settings accept ``socks5://`` proxies; httpx speaks SOCKS only with
    ``socksio`` installed, aiohttp not at all. Found at the first request,
    either would escape a call as a bare ``ImportError`` or ``ValueError``.
    The message names the source, never the proxy URL (it may hold a password).
    """
    for source in sources:
        if not source.proxy.lower().startswith(("socks5://", "socks5h://")):
            continue
        if library == "aiohttp":
            raise ConfigError(
                f"source {source.name!r}: a socks5:// proxy is not supported by the aiohttp "
                "transport (HTTP proxies only); use the httpx transport",
                field="proxy",
                sources=(source.name,),
            )
        try:
            importlib.import_module("socksio")
        except ImportError:
            raise ConfigError(
                f"source {source.name!r}: a socks5:// proxy needs socksio: "
                "pip install 'polygateway[socks]'",
                field="proxy",
                sources=(source.name,),
            ) from None


def ssl_verify(verify: bool | str) -> bool | ssl.SSLContext:
    """A source's ``verify`` as both libraries take it: a CA bundle path becomes a context."""
    if isinstance(verify, str):
        return ssl.create_default_context(cafile=verify)
    return verify


class ClientPools(Generic[_C]):
    """One pooled client per distinct (verify, proxy) of the sources, built on first use.

    Args:
        sources: the sources served; their ``verify`` and ``proxy`` pick the client.
        build: makes the client of one key.
        close: closes one client.
    """

    __slots__ = ("_build", "_clients", "_close", "_closed", "_keys")

    def __init__(
        self,
        sources: Sequence[SourceConfig],
        *,
        build: Callable[[PoolKey], _C],
        close: Callable[[_C], Awaitable[object]],
    ) -> None:
        self._build = build
        self._close = close
        self._keys: dict[str, PoolKey] = {s.name: (s.verify, s.proxy or "") for s in sources}
        self._clients: dict[PoolKey, _C] = {}
        self._closed = False

    def get(self, source: str) -> tuple[_C, PoolKey]:
        """The pooled client of a source and the key it was built for."""
        if self._closed:
            raise RuntimeError("transport is closed")
        key = self._keys.get(source, DEFAULT_KEY)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = self._build(key)
        return client, key

    async def aclose(self) -> None:
        """Close every client built so far; idempotent."""
        self._closed = True
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await self._close(client)


def shard_plan(max_connections: int, shard_size: int) -> tuple[int, int]:
    """(shards, connections per shard) that split ``max_connections`` into shards of ``shard_size``.

    ``shards = ceil(max_connections / shard_size)`` and each shard gets
    ``ceil(max_connections / shards)``: never fewer connections than asked in
    total, at most ``shards - 1`` more, and no shard larger than ``shard_size``.
    """
    check_pool_size(max_connections)
    if shard_size < 1:
        raise ValueError(f"shard_size must be at least 1, got {shard_size}")
    shards = math.ceil(max_connections / shard_size)
    return shards, math.ceil(max_connections / shards)


class ShardGroup(Generic[_C]):
    """One pool split into ``count`` clients; each request goes to the least busy one.

    ``acquire`` picks the shard with the fewest requests in flight (ties: the
    lowest index, so a lone caller keeps reusing shard 0's warm connections)
    and counts the request; the caller must ``release`` that shard exactly
    once, in a ``finally``. Shards are built on first pick: shard ``i`` only
    once ``i + 1`` requests were in flight at the same time.

    While the requests in flight number at most the group's total connections
    ``count * per_shard``, least-busy keeps every shard within its own
    ``per_shard`` (a shard at ``c`` is picked only when all are at ``c`` or
    more), so no request waits for a connection while another shard has one.

    Args:
        count: the number of shards (at least 1).
        build: makes one shard's client.
        close: closes one client.
    """

    __slots__ = ("_build", "_clients", "_close", "_in_flight")

    def __init__(
        self,
        count: int,
        *,
        build: Callable[[], _C],
        close: Callable[[_C], Awaitable[object]],
    ) -> None:
        if count < 1:
            raise ValueError(f"a shard group needs at least 1 shard, got {count}")
        self._build = build
        self._close = close
        self._clients: list[_C | None] = [None] * count
        self._in_flight = [0] * count

    @property
    def in_flight(self) -> tuple[int, ...]:
        """Requests in flight per shard (tests and diagnostics)."""
        return tuple(self._in_flight)

    @property
    def built(self) -> int:
        """How many shards have a client so far."""
        return sum(client is not None for client in self._clients)

    def acquire(self) -> tuple[int, _C]:
        """The least busy shard (its index and client), counted as one more request in flight."""
        counts = self._in_flight
        # Two C-level passes: cheaper than a Python loop for any realistic count.
        index = counts.index(min(counts))
        client = self._clients[index]
        if client is None:
            # Built before counting: a build that raises leaves no count behind.
            client = self._clients[index] = self._build()
        counts[index] += 1
        return index, client

    def release(self, index: int) -> None:
        """One request of shard ``index`` is no longer in flight."""
        self._in_flight[index] -= 1

    async def aclose(self) -> None:
        """Close every shard built so far; idempotent."""
        clients = [client for client in self._clients if client is not None]
        self._clients = [None] * len(self._clients)
        for client in clients:
            await self._close(client)
