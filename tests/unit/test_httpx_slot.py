"""``_Slot``: which connection a response left behind is closed, and which is left alone.

The end-to-end cases (a read cancelled twice over real sockets, and a request
queued behind it) are in ``tests/integration/test_stream_review_sockets.py``;
here, each condition of the rule on its own, with stand-ins for httpcore's
connection and pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from polygateway.transport.httpx_client import _RECLAIMS, _Slot


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


async def _reclaimed(connection: _Connection, requests_then: int, pool: Any = None) -> bool:
    """Whether the slot closed ``connection``; its close task must end without error."""
    before = set(_RECLAIMS)
    _Slot(connection, requests_then, pool).reclaim()
    for task in _RECLAIMS - before:
        await task
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


@dataclass
class _Lock:
    held: bool = False

    def __enter__(self) -> None:
        self.held = True

    def __exit__(self, *exc: object) -> None:
        self.held = False


@dataclass
class _Pool:
    """httpcore's ``AsyncConnectionPool``, as far as the slot's reassignment reads it."""

    connection: _Connection
    _optional_thread_lock: _Lock = field(default_factory=_Lock)
    dropped: list[object] = field(default_factory=lambda: [object()])
    steps: list[str] = field(default_factory=list)

    def _assign_requests_to_connections(self) -> list[object]:
        assert self._optional_thread_lock.held
        assert self.connection.closed  # the slot is free when the pool looks
        self.steps.append("assign")
        return self.dropped

    async def _close_connections(self, closing: list[object]) -> None:
        assert not self._optional_thread_lock.held
        assert closing is self.dropped
        self.steps.append("close")


async def test_the_pool_hands_the_freed_slot_on_once_the_orphan_is_closed() -> None:
    """A request queued in the pool is assigned by the pool's own step, under its lock."""
    connection = _Connection(_Http11(3))
    pool = _Pool(connection)
    assert await _reclaimed(connection, 3, pool)
    assert pool.steps == ["assign", "close"]


class _Bare:
    """A pool of another httpcore: none of the private attributes the slot reads."""


def _without(name: str) -> _Pool:
    pool = _Pool(_Connection(_Http11(3)))
    setattr(pool, name, None)
    return pool


@pytest.mark.parametrize(
    "pool",
    [
        None,
        _Bare(),
        _without("_optional_thread_lock"),
        _without("_assign_requests_to_connections"),
        _without("_close_connections"),
    ],
    ids=["no-pool", "bare", "no-lock", "no-assign", "no-close"],
)
async def test_a_pool_without_httpcore_internals_is_left_alone(pool: Any) -> None:
    """Missing private attributes: the orphan is still closed, nothing else runs or raises."""
    connection = _Connection(_Http11(3))
    assert await _reclaimed(connection, 3, pool)
    if isinstance(pool, _Pool):
        assert pool.steps == []
