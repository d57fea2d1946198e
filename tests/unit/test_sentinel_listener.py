"""The ``+switch-master`` listener outlives a fault it did not expect.

It runs for the backend's life in a background task nobody awaits: an
exception that escaped it would end failover announcements for good, with
nothing but asyncio's "Task exception was never retrieved" to say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from polygateway.backends.redis import sentinel as sentinel_module
from polygateway.backends.redis.endpoint import Endpoint
from polygateway.backends.redis.sentinel import SentinelPrimary


class _PubSub:
    """One subscription: ``fail`` raises it on subscribe; otherwise it listens until ``done``."""

    def __init__(self, fail: BaseException | None, subscribed: list[str], done: asyncio.Event):
        self._fail = fail
        self._subscribed = subscribed
        self._done = done

    async def __aenter__(self) -> _PubSub:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def subscribe(self, channel: str) -> None:
        if self._fail is not None:
            raise self._fail
        self._subscribed.append(channel)

    async def listen(self) -> AsyncIterator[dict[str, Any]]:
        await self._done.wait()
        return
        yield {}  # an async generator that yields nothing


class _Client:
    def __init__(self, pubsub: _PubSub) -> None:
        self._pubsub = pubsub

    def pubsub(self) -> _PubSub:
        return self._pubsub

    async def aclose(self) -> None:
        return None


async def test_a_fault_of_one_sentinel_round_does_not_end_the_listener(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bug-shaped fault at the first Sentinel is logged; the next Sentinel is subscribed."""
    subscribed: list[str] = []
    done = asyncio.Event()
    faults = [ValueError("unexpected reply shape"), None]

    def client(endpoint: Endpoint, timeout_s: float) -> _Client:
        return _Client(_PubSub(faults.pop(0), subscribed, done))

    monkeypatch.setattr(sentinel_module, "pubsub_client", client)
    primary = SentinelPrimary(
        [("127.0.0.1", 1), ("127.0.0.1", 2)],
        "mymaster",
        Endpoint(),
        late_reply_s=1.0,
        timeout_s=1.0,
    )
    caplog.set_level(logging.WARNING, logger="polygateway")
    task = asyncio.create_task(primary._listen())
    try:
        for _ in range(100):
            if subscribed or task.done():
                break
            await asyncio.sleep(0)
        assert not task.done(), task.exception() if task.done() else None
        assert subscribed == ["+switch-master"]
        assert "unexpected reply shape" in caplog.text
    finally:
        done.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_primary_located_after_aclose_waits_for_the_listener_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Used again after ``aclose``: the first connection waits, as the very first did, until
    the restarted listener is subscribed, so a failover from then on is heard."""
    subscribed: list[str] = []
    done = asyncio.Event()
    gate = asyncio.Event()
    gate.set()

    class _Gated(_PubSub):
        async def subscribe(self, channel: str) -> None:
            await gate.wait()
            await super().subscribe(channel)

    monkeypatch.setattr(
        sentinel_module,
        "pubsub_client",
        lambda endpoint, timeout_s: _Client(_Gated(None, subscribed, done)),
    )

    async def named(self: SentinelPrimary, sentinel: object) -> list[bytes]:
        return [b"127.0.0.1", b"6379"]

    monkeypatch.setattr(SentinelPrimary, "_ask", named)
    primary = SentinelPrimary(
        [("127.0.0.1", 1)], "mymaster", Endpoint(), late_reply_s=1.0, timeout_s=30.0
    )
    try:
        await primary.locate(Endpoint())
        assert subscribed == ["+switch-master"]
        await primary.aclose()
        gate.clear()
        locating = asyncio.ensure_future(primary.locate(Endpoint()))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not locating.done()  # before: located at once, the listener not subscribed yet
        gate.set()
        await locating
        assert subscribed == ["+switch-master", "+switch-master"]
    finally:
        done.set()
        await primary.aclose()
