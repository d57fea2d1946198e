"""``_Slot``: which connection a response left behind is closed, and which is left alone.

The end-to-end case (a read cancelled twice over real sockets) is in
``tests/integration/test_stream_review_sockets.py``; here, each condition of
the rule on its own, with a stand-in for httpcore's connection.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx
import pytest

from polygateway.transport.httpx_client import _Slot


@dataclass
class _Http11:
    _request_count: int


@dataclass
class _Connection:
    """httpcore's ``AsyncHTTPConnection``, as far as ``_Slot`` reads it."""

    _connection: _Http11
    closed: bool = False
    idle: bool = False
    closes: list[int] = field(default_factory=list)

    def is_closed(self) -> bool:
        return self.closed

    def is_idle(self) -> bool:
        return self.idle

    async def aclose(self) -> None:
        self.closes.append(1)
        self.closed = True


async def _reclaimed(connection: _Connection, requests_then: int) -> bool:
    _Slot(connection, requests_then).reclaim()
    for _ in range(3):
        await asyncio.sleep(0)
    return bool(connection.closes)


async def test_an_active_connection_that_started_nothing_since_is_closed() -> None:
    assert await _reclaimed(_Connection(_Http11(3)), 3)


@pytest.mark.parametrize(
    ("connection", "why"),
    [
        (_Connection(_Http11(3), idle=True), "back in the pool, reusable"),
        (_Connection(_Http11(3), closed=True), "closed already"),
        (_Connection(_Http11(4)), "serving the next request"),
    ],
)
async def test_a_connection_in_use_or_done_is_left_alone(connection: _Connection, why: str) -> None:
    assert not await _reclaimed(connection, 3), why


def test_a_response_not_from_an_http11_pool_has_no_slot() -> None:
    """MockTransport's responses (no pool) and HTTP/2 ones (multiplexed) are never touched."""
    plain = httpx.Response(200, content=b"{}")
    assert _Slot.of(plain) is None
    h2 = httpx.Response(200, content=b"{}", extensions={"http_version": b"HTTP/2"})
    assert _Slot.of(h2) is None
