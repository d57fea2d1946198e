"""The httpx transport's shard groups: sizes, least-busy choice, in-flight accounting, closing.

Each shard is an ``httpx.AsyncClient`` built by a recording factory over
``httpx.MockTransport``; handlers block on events the test controls, so the
requests in flight per shard are observable while they are in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from polygateway.config import SourceConfig
from polygateway.transport.http import HttpRequest, TransientError
from polygateway.transport.httpx_client import SHARD_SIZE, HttpxTransport
from polygateway.transport.pool import ShardGroup, shard_plan

URL = "http://upstream.test/v1/chat/completions"
# Bounds the waits of the tests themselves, never a timing under test.
WAIT_S = 5.0


def Source(name: str = "primary", **fields: Any) -> SourceConfig:
    """A source as the transport gets it from settings."""
    return SourceConfig(name=name, protocol="openai", base_url="http://upstream.test/v1", **fields)


def _request(tag: str = "", **overrides: Any) -> HttpRequest:
    base: dict[str, Any] = {
        "source": "primary",
        "url": URL,
        "timeout_s": WAIT_S,
        "idle_timeout_s": WAIT_S,
        "headers": {"Content-Type": "application/json", "X-Tag": tag},
        "json": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }
    base.update(overrides)
    return HttpRequest(**base)


class _Gate(httpx.AsyncByteStream):
    """An event-stream body: one event, then waits for ``opened`` to be set, then [DONE]."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"n": 1}\n\n'
        await self.opened.wait()
        yield b"data: [DONE]\n\n"


class Upstream:
    """A factory of shard clients whose handlers block until the test releases each tag.

    ``served`` records (shard index, tag) as each request reaches its shard;
    a tag's answer is ``status`` with a JSON body once ``release(tag)`` is
    called, or an event stream (``_Gate``) for a tag starting with "stream".
    """

    def __init__(self, *, status: int = 200) -> None:
        self.status = status
        self.built: list[httpx.Limits] = []
        self.clients: list[httpx.AsyncClient] = []
        self.served: list[tuple[int, str]] = []
        self._gates: dict[str, asyncio.Event] = {}
        self.arrived = asyncio.Event()

    def gate(self, tag: str) -> asyncio.Event:
        return self._gates.setdefault(tag, asyncio.Event())

    def release(self, tag: str) -> None:
        self.gate(tag).set()

    def factory(self, *, verify: bool | str, proxy: str, limits: httpx.Limits) -> httpx.AsyncClient:
        index = len(self.clients)

        async def handle(request: httpx.Request) -> httpx.Response:
            tag = request.headers["X-Tag"]
            self.served.append((index, tag))
            self.arrived.set()
            await self.gate(tag).wait()
            if tag.startswith("stream"):
                return httpx.Response(
                    200, headers={"content-type": "text/event-stream"}, stream=_Gate()
                )
            return httpx.Response(self.status, json={"ok": tag})

        client = httpx.AsyncClient(transport=httpx.MockTransport(handle), limits=limits)
        self.built.append(limits)
        self.clients.append(client)
        return client

    def transport(self, max_connections: int) -> HttpxTransport:
        return HttpxTransport(
            [Source()], max_connections=max_connections, client_factory=self.factory
        )

    async def until_served(self, count: int) -> None:
        """Wait until ``count`` requests reached a shard."""
        async with asyncio.timeout(WAIT_S):
            while len(self.served) < count:
                self.arrived.clear()
                await self.arrived.wait()


async def _send_held(upstream: Upstream, transport: HttpxTransport, tag: str) -> asyncio.Task[Any]:
    """Start a send that stays in flight until ``tag`` is released; return its task."""
    before = len(upstream.served)
    task = asyncio.create_task(transport.send(_request(tag)))
    await upstream.until_served(before + 1)
    return task


# --- Sizes ---


@pytest.mark.parametrize(
    ("max_connections", "shards", "per_shard"),
    [(1, 1, 1), (8, 1, 8), (12, 1, 12), (13, 2, 7), (64, 6, 11), (100, 9, 12), (128, 11, 12)],
)
def test_shard_plan_splits_connections_into_shards_of_at_most_shard_size(
    max_connections: int, shards: int, per_shard: int
) -> None:
    """K = ceil(n / SHARD_SIZE) shards of ceil(n / K) each: n <= total < n + K."""
    assert SHARD_SIZE == 12
    assert shard_plan(max_connections, SHARD_SIZE) == (shards, per_shard)
    assert max_connections <= shards * per_shard < max_connections + shards
    assert per_shard <= SHARD_SIZE


def test_shard_plan_refuses_empty_pools_and_shards() -> None:
    """Zero connections or a zero shard size is a construction error."""
    with pytest.raises(ValueError, match="max_connections"):
        shard_plan(0, SHARD_SIZE)
    with pytest.raises(ValueError, match="shard_size"):
        shard_plan(8, 0)


@pytest.mark.parametrize(
    ("max_connections", "shards", "per_shard"), [(1, 1, 1), (8, 1, 8), (64, 6, 11), (100, 9, 12)]
)
async def test_transport_builds_its_shards_lazily_with_per_shard_limits(
    max_connections: int, shards: int, per_shard: int
) -> None:
    """One request in flight per shard builds every shard, each with its share of connections."""
    upstream = Upstream()
    transport = upstream.transport(max_connections)
    try:
        upstream.release("warm")
        await transport.send(_request("warm"))
        assert len(upstream.built) == 1
        tasks = [await _send_held(upstream, transport, f"t{i}") for i in range(shards)]
        assert transport.in_flight("primary") == (1,) * shards
        limits = httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
        assert upstream.built == [limits] * shards
        for i in range(shards):
            upstream.release(f"t{i}")
        await asyncio.gather(*tasks)
        assert transport.in_flight("primary") == (0,) * shards
    finally:
        await transport.aclose()


# --- Which shard ---


async def test_sequential_requests_all_reuse_shard_zero() -> None:
    """A lone caller always gets the first shard: its keep-alive connection stays warm."""
    upstream = Upstream()
    transport = upstream.transport(64)
    try:
        for i in range(5):
            upstream.release(f"s{i}")
            assert await transport.send(_request(f"s{i}")) == {"ok": f"s{i}"}
    finally:
        await transport.aclose()
    assert [shard for shard, _ in upstream.served] == [0] * 5
    assert len(upstream.built) == 1


async def test_request_goes_to_least_busy_shard_and_ties_go_to_the_first() -> None:
    """Busy shards are skipped; among the least busy, the lowest index wins."""
    upstream = Upstream()
    transport = upstream.transport(36)  # 3 shards of 12
    try:
        a = await _send_held(upstream, transport, "a")
        b = await _send_held(upstream, transport, "b")
        c = await _send_held(upstream, transport, "c")
        assert upstream.served == [(0, "a"), (1, "b"), (2, "c")]
        assert transport.in_flight("primary") == (1, 1, 1)
        upstream.release("b")
        await b
        assert transport.in_flight("primary") == (1, 0, 1)
        d = await _send_held(upstream, transport, "d")
        assert upstream.served[-1] == (1, "d")
        e = await _send_held(upstream, transport, "e")
        assert upstream.served[-1] == (0, "e")  # all at 1: the first
        assert transport.in_flight("primary") == (2, 1, 1)
        for tag in ("a", "c"):
            upstream.release(tag)
        await asyncio.gather(a, c)
        assert transport.in_flight("primary") == (1, 1, 0)
        f = await _send_held(upstream, transport, "f")
        assert upstream.served[-1] == (2, "f")
        for tag in ("d", "e", "f"):
            upstream.release(tag)
        await asyncio.gather(d, e, f)
        assert transport.in_flight("primary") == (0, 0, 0)
    finally:
        await transport.aclose()


async def test_sources_with_another_proxy_get_their_own_shard_group() -> None:
    """Groups are per (verify, proxy): a busy group does not steer the other's choice."""
    upstream = Upstream()
    sources = [Source("primary"), Source("proxied", proxy="http://127.0.0.1:3128")]
    transport = HttpxTransport(sources, max_connections=24, client_factory=upstream.factory)
    try:
        held = await _send_held(upstream, transport, "x")
        before = len(upstream.served)
        other = asyncio.create_task(transport.send(_request("y", source="proxied")))
        await upstream.until_served(before + 1)
        # Client 1 is the proxied group's first shard, built for it; not primary's second.
        assert upstream.served == [(0, "x"), (1, "y")]
        assert transport.in_flight("primary") == (1, 0)
        assert transport.in_flight("proxied") == (1, 0)
        upstream.release("x")
        upstream.release("y")
        await asyncio.gather(held, other)
        assert transport.in_flight("primary") == (0, 0)
        assert transport.in_flight("proxied") == (0, 0)
    finally:
        await transport.aclose()


# --- Counts always return to zero ---


async def test_in_flight_returns_to_zero_after_a_classified_failure() -> None:
    """A 500 is raised as transient and its shard is counted free."""
    upstream = Upstream(status=500)
    transport = upstream.transport(24)
    try:
        held = await _send_held(upstream, transport, "h")
        assert transport.in_flight("primary") == (1, 0)
        upstream.release("h")
        with pytest.raises(TransientError) as info:
            await held
        assert transport.in_flight("primary") == (0, 0)
    finally:
        await transport.aclose()
    assert info.value.status_code == 500


async def test_in_flight_returns_to_zero_after_a_network_failure() -> None:
    """A connect error, translated to a transient failure, frees its shard."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    transport = HttpxTransport(
        [Source()], max_connections=24, mock_transport=httpx.MockTransport(refuse)
    )
    try:
        with pytest.raises(TransientError, match="connect error"):
            await transport.send(_request("x"))
        assert transport.in_flight("primary") == (0, 0)
    finally:
        await transport.aclose()


async def test_in_flight_returns_to_zero_after_cancellation_mid_request() -> None:
    """A send cancelled while its request waits upstream frees its shard; the cancel propagates."""
    upstream = Upstream()
    transport = upstream.transport(24)
    try:
        held = await _send_held(upstream, transport, "never")
        other = await _send_held(upstream, transport, "other")
        assert transport.in_flight("primary") == (1, 1)
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held
        assert transport.in_flight("primary") == (0, 1)
        upstream.release("other")
        await other
        assert transport.in_flight("primary") == (0, 0)
    finally:
        await transport.aclose()


async def test_stream_counts_as_in_flight_until_its_context_exits() -> None:
    """An open stream holds its shard after its answer started, and frees it on context exit."""
    upstream = Upstream()
    upstream.release("stream")
    transport = upstream.transport(24)
    try:
        async with transport.stream(_request("stream")) as events:
            assert await anext(events) == {"n": 1}
            assert transport.in_flight("primary") == (1, 0)
            # A request made while the stream is open goes to the other shard.
            held = await _send_held(upstream, transport, "t")
            assert upstream.served[-1] == (1, "t")
            upstream.release("t")
            await held
            assert transport.in_flight("primary") == (1, 0)
        assert transport.in_flight("primary") == (0, 0)
    finally:
        await transport.aclose()
    assert [shard for shard, _ in upstream.served] == [0, 1]


async def test_stream_that_fails_to_open_frees_its_shard() -> None:
    """A non-2xx answer to a stream raises before any event and frees its shard."""
    upstream = Upstream(status=503)
    upstream.release("refused")
    transport = upstream.transport(24)
    try:
        with pytest.raises(TransientError) as info:
            async with transport.stream(_request("refused")):
                pass
        assert transport.in_flight("primary") == (0, 0)
    finally:
        await transport.aclose()
    assert info.value.status_code == 503


async def test_stream_cancelled_while_reading_frees_its_shard() -> None:
    """A consumer cancelled mid-stream frees the shard as the context unwinds."""
    upstream = Upstream()
    upstream.release("stream")
    transport = upstream.transport(24)
    first = asyncio.Event()

    async def consume() -> None:
        async with transport.stream(_request("stream")) as events:
            async for event in events:
                assert event == {"n": 1}
                first.set()

    try:
        task = asyncio.create_task(consume())
        async with asyncio.timeout(WAIT_S):
            await first.wait()
        assert transport.in_flight("primary") == (1, 0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert transport.in_flight("primary") == (0, 0)
    finally:
        await transport.aclose()


# --- Closing ---


async def test_aclose_closes_every_shard_once_and_is_idempotent() -> None:
    """Every built shard of every group is closed; a second aclose is harmless; sends refuse."""
    upstream = Upstream()
    transport = upstream.transport(36)
    tasks = [await _send_held(upstream, transport, f"t{i}") for i in range(3)]
    for i in range(3):
        upstream.release(f"t{i}")
    await asyncio.gather(*tasks)
    assert len(upstream.clients) == 3
    assert not any(c.is_closed for c in upstream.clients)
    await transport.aclose()
    assert all(c.is_closed for c in upstream.clients)
    await transport.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await transport.send(_request("late"))


async def test_shard_group_build_failure_leaves_no_count_behind() -> None:
    """A shard whose client cannot be built raises and is not counted in flight."""
    closed: list[str] = []

    def build() -> str:
        raise FileNotFoundError("no CA bundle")

    async def close(client: str) -> None:
        closed.append(client)

    group: ShardGroup[str] = ShardGroup(2, build=build, close=close)
    with pytest.raises(FileNotFoundError):
        group.acquire()
    assert group.in_flight == (0, 0)
    assert group.built == 0
    await group.aclose()
    assert closed == []
