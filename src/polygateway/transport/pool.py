"""Pooled HTTP clients keyed by (verify, proxy), the pooling both transport modules share.

Sources that agree on TLS verification and proxy share one pooled client (an
httpx ``AsyncClient`` or an aiohttp ``ClientSession``). Each client is built
on first use (aiohttp needs a running loop for it) and all are closed
together; after that, asking for one is a programming error.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from polygateway.config import SourceConfig

__all__ = ["DEFAULT_KEY", "ClientPools", "PoolKey", "check_pool_size", "ssl_verify"]

PoolKey = tuple[bool | str, str]
"""(verify, proxy): sources that agree on both share one pooled client."""

DEFAULT_KEY: PoolKey = (True, "")
"""The key of a source the transport was not built with: verified TLS, no proxy."""

_C = TypeVar("_C")


def check_pool_size(max_connections: int) -> int:
    """``max_connections`` itself, or ``ValueError``: a pool of no connection serves nothing."""
    if max_connections < 1:
        raise ValueError(f"max_connections must be at least 1, got {max_connections}")
    return max_connections


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
