"""Pick a transport by name: httpx (default) or aiohttp (an extra, imported only on request)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from polygateway.transport.http import Transport

if TYPE_CHECKING:
    from polygateway.config import SourceConfig

__all__ = ["TransportKind", "make_transport"]

TransportKind = Literal["httpx", "aiohttp"]


def make_transport(
    kind: TransportKind, sources: Sequence[SourceConfig], *, max_connections: int
) -> Transport:
    """The transport ``kind`` for ``sources``, its pool sized to ``max_connections``.

    Raises:
        ImportError: ``"aiohttp"`` without aiohttp installed, naming the extra to install.
        ValueError: an unknown ``kind``.
    """
    if kind == "httpx":
        from polygateway.transport.httpx_client import HttpxTransport

        return HttpxTransport(sources, max_connections=max_connections)
    if kind == "aiohttp":
        # Imported here only: `import polygateway` must never load aiohttp.
        from polygateway.transport.aiohttp_client import AiohttpTransport

        return AiohttpTransport(sources, max_connections=max_connections)
    raise ValueError(f"unknown transport {kind!r}; expected 'httpx' or 'aiohttp'")
