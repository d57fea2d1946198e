"""ChatClient.stream over real sockets, both transports: every way a stream is left or broken.

A raw HTTP/1.1 upstream on 127.0.0.1 plays exactly what the wire does
(a socket closed without the body's last chunk, a stall, each byte its own
TCP segment) and the simulator plays its fault profiles. Each test checks
the four things a caller relies on: the permit comes back exactly once, the
attempt's outcome is the right one, the connection is closed (the upstream
sees the client hang up), and the caller gets a typed error, never a bare
httpx or aiohttp exception, without the key in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest
from pydantic import SecretStr

from _cancel import cancel_twice
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings, ScopeConfig, SourceConfig
from polygateway.errors import AllSourcesExhausted, GatewayError, StreamInterrupted
from polygateway.middleware.lifecycle import _default_transport
from polygateway.simulator import FaultProfile, SimulatedUpstream
from polygateway.testing import Recorder, chat_chunk_events, chat_completion
from polygateway.transport.http import HttpRequest

KEY = "sk-review-SECRET-42"
HI = [{"role": "user", "content": "hi"}]
IDLE_S = 0.3
# Bounds the tests' own waits, never a timing under test.
BOUND_S = 10.0

Play = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def sse(payload: Any, nl: str = "\n") -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}{nl}{nl}".encode()


@dataclass
class Upstream:
    """One scripted event stream per connection; counts connections still open."""

    play: Play | None = None
    open: int = 0
    requests: int = 0
    hung_up: asyncio.Event = field(default_factory=asyncio.Event)
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.requests += 1
        try:
            await answer_head(reader, writer)
            assert self.play is not None
            await self.play(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open -= 1
            with contextlib.suppress(ConnectionError, OSError):
                writer.close()
            self.hung_up.set()


async def answer_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read one request (head and body), answer the head of a chunked event stream."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.decode("latin-1").split("\r\n"):
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    await reader.readexactly(length)
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )


async def chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    await writer.drain()


async def end_body(writer: asyncio.StreamWriter) -> None:
    writer.write(b"0\r\n\r\n")
    await writer.drain()


async def until_hang_up(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(ConnectionError):
        while await reader.read(1024):
            pass


@pytest.fixture(params=["httpx", "aiohttp"])
def kind(request: pytest.FixtureRequest) -> str:
    """Each transport in turn."""
    name: str = request.param
    return name


class _Served(Protocol):
    port: int

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None: ...


S = TypeVar("S", bound=_Served)


@contextlib.asynccontextmanager
async def serving(up: S) -> AsyncIterator[S]:
    """``up`` serving on a free loopback port (set as ``up.port``) until the block ends."""
    server = await asyncio.start_server(up.handle, "127.0.0.1", 0)
    up.port = server.sockets[0].getsockname()[1]
    try:
        yield up
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    async with serving(Upstream()) as up:
        yield up


@dataclass
class Rig:
    chat: ChatClient
    backend: MemoryBackend
    recorder: Recorder

    async def permits(self) -> int:
        return (await self.backend.snapshot("chat")).in_flight

    async def assert_released_once(self, outcome: str) -> None:
        """No permit held, and the one attempt released as ``outcome``."""
        assert await self.permits() == 0
        assert self.recorder.outcomes() == [outcome]


def settings(kind: str, base_url: str, *, max_concurrency: int | None = None) -> GatewaySettings:
    """One source ``p`` at ``base_url`` over ``kind``; its pool holds ``max_concurrency``."""
    limits = {} if max_concurrency is None else {"max_concurrency": max_concurrency}
    source = SourceConfig(
        name="p",
        protocol="openai",
        base_url=base_url,
        model="m",
        api_key=SecretStr(KEY),
        timeout_s=2.0,
        ttft_timeout_s=2.0,
        stream_idle_timeout_s=IDLE_S,
        connect_timeout_s=2.0,
        **limits,
    )
    return GatewaySettings(
        _env_file=None,
        scopes={"chat": ScopeConfig(kind="chat", sources=(source,))},
        transport=kind,
        max_attempts=1,
        stall_window_s=5.0,
    )


def new_rig(kind: str, upstream: Upstream) -> Rig:
    """A chat client of ``upstream``'s one source over ``kind``, a memory backend, a recorder."""
    backend, recorder = MemoryBackend(), Recorder()
    chat = ChatClient(
        settings(kind, f"http://127.0.0.1:{upstream.port}/v1"),
        "chat",
        backend=backend,
        emitter=recorder,
    )
    return Rig(chat, backend, recorder)


@pytest.fixture
async def rig(kind: str, upstream: Upstream) -> AsyncIterator[Rig]:
    made = new_rig(kind, upstream)
    async with made.chat:
        yield made


async def hung_up(upstream: Upstream) -> None:
    """Wait until the upstream has seen every connection closed by the client."""
    async with asyncio.timeout(BOUND_S):
        while upstream.open:
            upstream.hung_up.clear()
            await upstream.hung_up.wait()


def assert_typed(err: BaseException) -> None:
    """A PolyGateway error, its chain free of the key."""
    assert isinstance(err, GatewayError)
    seen: BaseException | None = err
    while seen is not None:
        assert KEY not in str(seen)
        assert KEY not in repr(seen)
        seen = seen.__cause__ or seen.__context__


async def read_all(chat: ChatClient, got: list[str]) -> None:
    """Iterate one stream to its end (bounded), keeping the text of each chunk."""
    async with asyncio.timeout(BOUND_S):
        async for c in chat.stream(HI):
            got.append(c.text)


async def read_interrupted(chat: ChatClient, match: str) -> list[str]:
    """Read one stream until it fails with a typed StreamInterrupted matching ``match``;
    the text of the chunks read before."""
    got: list[str] = []
    with pytest.raises(StreamInterrupted, match=match) as info:
        await read_all(chat, got)
    assert_typed(info.value)
    return got


def flowing(words: list[str], *, gap_s: float = 0.01) -> Play:
    """A healthy stream: each chunk after ``gap_s``, then [DONE] and the body's end."""

    async def play(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for payload in chat_chunk_events(words):
            await chunk(writer, sse(payload))
            await asyncio.sleep(gap_s)
        await chunk(writer, sse("[DONE]"))
        await end_body(writer)

    return play


async def stall_after_a(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One chunk ("a"), then silence until the client hangs up."""
    await chunk(writer, sse(chat_chunk_events(["a"], role_first=False)[0]))
    await until_hang_up(reader)


def dropping(words: list[str], *, finish_reason: str | None = "stop") -> Play:
    """The chunks of ``words`` (a finish chunk unless ``finish_reason`` is None), then the
    socket closes without [DONE] nor the body's last chunk."""

    async def play(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for payload in chat_chunk_events(words, finish_reason=finish_reason):
            await chunk(writer, sse(payload))

    return play


async def test_break_from_a_bare_async_for_hangs_up_and_releases_once(
    rig: Rig, upstream: Upstream
) -> None:
    """Break after 2 chunks: the connection closes and the attempt is released as cancelled."""
    upstream.play = flowing([f"w{i}" for i in range(50)])
    count = 0
    async for _chunk in rig.chat.stream(HI):
        count += 1
        if count == 2:
            break
    await hung_up(upstream)
    for _ in range(5):
        await asyncio.sleep(0)
    await rig.assert_released_once("cancelled")


async def test_iterator_collected_mid_stream_hangs_up_and_releases_once(
    rig: Rig, upstream: Upstream
) -> None:
    """An iterator dropped after one chunk is finalized by the loop: closed, released once."""
    upstream.play = flowing([f"w{i}" for i in range(50)])
    iterator = aiter(rig.chat.stream(HI))
    await anext(iterator)
    del iterator
    gc.collect()
    await hung_up(upstream)
    for _ in range(5):
        await asyncio.sleep(0)
    await rig.assert_released_once("cancelled")


async def test_cancelled_while_waiting_for_the_first_chunk(rig: Rig, upstream: Upstream) -> None:
    """Cancelled during the TTFT wait: CancelledError, connection closed, released as cancelled."""

    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await writer.drain()
        await until_hang_up(reader)

    upstream.play = mute
    task = asyncio.create_task(rig.chat.stream(HI).response())
    async with asyncio.timeout(BOUND_S):
        while upstream.requests == 0 or await rig.permits() == 0:
            await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await hung_up(upstream)
    await rig.assert_released_once("cancelled")


async def test_stall_mid_stream_is_a_stream_interrupted_naming_the_idle_timeout(
    rig: Rig, upstream: Upstream
) -> None:
    """Silence past the idle timeout after a chunk: StreamInterrupted, transient, hung up."""
    upstream.play = stall_after_a
    assert await read_interrupted(rig.chat, "stream idle") == ["a"]
    await hung_up(upstream)
    await rig.assert_released_once("transient")


async def test_socket_closed_after_the_finish_without_done_is_a_whole_answer(
    rig: Rig, upstream: Upstream
) -> None:
    """The finish chunk, then the socket closes mid-body (no [DONE]): a success, not an error."""
    upstream.play = dropping(["Hel", "lo"])
    async with asyncio.timeout(BOUND_S):
        response = await rig.chat.stream(HI).response()
    assert (response.text, response.finish_reason) == ("Hello", "stop")
    await rig.assert_released_once("success")


async def test_socket_closed_before_the_finish_is_interrupted(rig: Rig, upstream: Upstream) -> None:
    """Chunks, then the socket closes with no finish and no [DONE]: StreamInterrupted, typed."""
    upstream.play = dropping(["Hel", "lo"], finish_reason=None)
    assert await read_interrupted(rig.chat, "after 2 chunks") == ["Hel", "lo"]
    await rig.assert_released_once("transient")


async def test_aclose_from_another_task_stops_the_reader_quietly(
    rig: Rig, upstream: Upstream
) -> None:
    """A "stop" from another task: aclose() returns, the reader's loop ends, released once."""
    upstream.play = stall_after_a
    got: list[str] = []
    async with asyncio.timeout(BOUND_S), rig.chat.stream(HI) as stream:

        async def read() -> None:
            async for c in stream:
                got.append(c.text)

        reader = asyncio.create_task(read())
        while not got:
            await asyncio.sleep(0.01)
        await stream.aclose()
        assert await rig.permits() == 0
        await reader
    assert got == ["a"]
    await hung_up(upstream)
    assert rig.recorder.outcomes() == ["cancelled"]


async def test_every_byte_its_own_segment_with_crlf_comments_and_fields(
    rig: Rig, upstream: Upstream
) -> None:
    """Each byte sent alone; CRLF ends, a BOM, comments, event/id/retry and multi-line data."""
    events = chat_chunk_events(["Hé", "llo", " ✓"])
    body = "\ufeff: ping\r\nretry: 100\r\n"
    for i, payload in enumerate(events):
        text = json.dumps(payload, indent=1, ensure_ascii=False)
        body += f"event: message\r\nid: {i}\r\n: keep-alive\r\n"
        body += "".join(f"data: {line}\r\n" for line in text.split("\n")) + "\r\n"
    raw = (body + "data: [DONE]\r\n\r\n").encode()

    async def bytewise(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for i in range(len(raw)):
            await chunk(writer, raw[i : i + 1])
            if i % 16 == 0:
                await asyncio.sleep(0.001)
        await end_body(writer)

    upstream.play = bytewise
    async with asyncio.timeout(BOUND_S):
        response = await rig.chat.stream(HI).response()
    assert response.text == "Héllo ✓"
    assert rig.recorder.outcomes() == ["success"]
    assert await rig.permits() == 0


# --- The simulator's fault profiles ---------------------------------------------------


@pytest.fixture
async def sim_rig(kind: str) -> AsyncIterator[tuple[SimulatedUpstream, Rig]]:
    async with SimulatedUpstream({"p": FaultProfile(stream_chunks=6)}, seed=1) as sim:
        backend, recorder = MemoryBackend(), Recorder()
        chat = ChatClient(
            settings(kind, sim.base_url("p")), "chat", backend=backend, emitter=recorder
        )
        async with chat:
            yield sim, Rig(chat, backend, recorder)


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        (FaultProfile(rate_truncate=1.0, stream_chunks=6), "stream ended without"),
        (FaultProfile(rate_reset=1.0, stream_chunks=6), "failed after"),
    ],
    ids=["truncate", "reset"],
)
async def test_simulated_broken_streams_are_typed_and_release_once(
    sim_rig: tuple[SimulatedUpstream, Rig],
    profile: FaultProfile,
    expected: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stream cut without its finish: a typed error, one transient release, no key logged."""
    sim, rig = sim_rig
    sim.state.set_profile("p", profile)
    with (
        caplog.at_level(logging.DEBUG),
        pytest.raises((StreamInterrupted, AllSourcesExhausted)) as info,
    ):
        await read_all(rig.chat, [])
    assert expected in str(info.value)
    assert_typed(info.value)
    await rig.assert_released_once("transient")
    assert KEY not in caplog.text


async def test_simulated_hang_cancelled_before_the_first_chunk(
    sim_rig: tuple[SimulatedUpstream, Rig],
) -> None:
    """A hanging source, the caller cancelled while waiting: released as cancelled."""
    sim, rig = sim_rig
    sim.state.set_profile("p", FaultProfile(rate_hang=1.0))
    task = asyncio.create_task(rig.chat.stream(HI).response())
    async with asyncio.timeout(BOUND_S):
        while await rig.permits() == 0:
            await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await rig.assert_released_once("cancelled")


# --- Connections after a stream -------------------------------------------------------


@dataclass
class KeepAlive:
    """An upstream answering any number of streams per connection; counts connections."""

    connections: int = 0
    trailing: bytes = b""
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                await answer_head(reader, writer)
                for payload in chat_chunk_events(["a", "b"]):
                    await chunk(writer, sse(payload))
                await chunk(writer, sse("[DONE]"))
                await asyncio.sleep(0.01)  # the body's end comes in a segment of its own
                if self.trailing:
                    await chunk(writer, self.trailing)
                await end_body(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(ConnectionError, OSError):
                writer.close()


@pytest.fixture
async def keep_alive() -> AsyncIterator[KeepAlive]:
    async with serving(KeepAlive()) as up:
        yield up


@pytest.mark.parametrize("trailing", [b"", b": bye\n\n"], ids=["bare-end", "comment-after-done"])
async def test_a_stream_ended_at_done_leaves_its_connection_to_the_next_call(
    kind: str, keep_alive: KeepAlive, trailing: bytes
) -> None:
    """Streams read to [DONE] one after another reuse one connection, as plain calls do."""
    keep_alive.trailing = trailing
    chat = ChatClient(
        settings(kind, f"http://127.0.0.1:{keep_alive.port}/v1"), "chat", backend=MemoryBackend()
    )
    async with chat:
        for _ in range(3):
            async with asyncio.timeout(BOUND_S):
                assert (await chat.stream(HI).response()).text == "ab"
    assert keep_alive.connections == 1


async def test_a_stream_left_early_does_not_go_back_to_the_pool(
    kind: str, keep_alive: KeepAlive
) -> None:
    """A stream broken off before [DONE] closes its connection: the next call opens another."""
    chat = ChatClient(
        settings(kind, f"http://127.0.0.1:{keep_alive.port}/v1"), "chat", backend=MemoryBackend()
    )
    async with chat:
        for _ in range(2):
            async with asyncio.timeout(BOUND_S), chat.stream(HI) as stream:
                async for _chunk in stream:
                    break
    assert keep_alive.connections == 2


@pytest.mark.parametrize("reading", [False, True], ids=["between-chunks", "inside-a-read"])
async def test_client_closed_under_an_open_stream(
    kind: str, upstream: Upstream, reading: bool
) -> None:
    """Client closed while a stream is open: GatewayError for its reader, released, hung up."""
    upstream.play = flowing([f"w{i}" for i in range(100)], gap_s=0.05)
    backend, recorder = MemoryBackend(), Recorder()
    closing = settings(kind, f"http://127.0.0.1:{upstream.port}/v1").model_copy(
        update={"close_grace_s": 0.2}
    )
    chat = ChatClient(closing, "chat", backend=backend, emitter=recorder)
    got: list[str] = []
    with pytest.raises(GatewayError, match="client closed") as info:
        await _read_across_a_client_close(chat, got, reading=reading)
    assert got
    assert_typed(info.value)
    await hung_up(upstream)
    assert (await backend.snapshot("chat")).in_flight == 0
    assert recorder.outcomes() == ["cancelled"]


async def _read_across_a_client_close(chat: ChatClient, got: list[str], *, reading: bool) -> None:
    async with asyncio.timeout(BOUND_S), chat.stream(HI) as stream:
        iterator = aiter(stream)
        got.append((await anext(iterator)).text)
        if not reading:
            await chat.aclose()
            async for c in iterator:
                got.append(c.text)
            return
        reader = asyncio.create_task(_drain_into(iterator, got))
        await asyncio.sleep(0.1)
        await chat.aclose()
        await reader


async def _drain_into(iterator: AsyncIterator[Any], got: list[str]) -> None:
    async for c in iterator:
        got.append(c.text)


# --- Mixed abandonment against the simulator as a user runs it ------------------------

# The e2e suite's helpers: ``polygateway simulate`` in a subprocess, as a user starts it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from cli_run import serve_simulator  # noqa: E402


@pytest.fixture(scope="module")
def flaky_simulator() -> Iterator[str]:
    """``polygateway simulate --profile flaky`` with sources a and b: its root URL."""
    yield from serve_simulator("--profile", "flaky", "--sources", "a,b", "--seed", "11")


async def _one_stream(chat: ChatClient, mode: int) -> str:
    """One stream, left in one of five ways; what became of it."""
    try:
        async with asyncio.timeout(BOUND_S):
            if mode == 0:
                return (await chat.stream(HI).response()).finish_reason or "none"
            if mode == 1:
                async for _chunk in chat.stream(HI):
                    break
                return "broke"
            async with chat.stream(HI) as stream:
                if mode == 2:
                    return "entered"
                reader = asyncio.create_task(_drain_into(aiter(stream), []))
                await asyncio.sleep(0.01)
                if mode == 3:
                    await stream.aclose()
                    await reader
                    return "stopped"
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
                return "cancelled"
    except GatewayError as exc:
        assert_typed(exc)
        return type(exc).__name__


async def test_mixed_abandonment_on_a_flaky_simulator_leaves_no_permit(
    kind: str, flaky_simulator: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Sixty streams read, broken, stopped or cancelled amid faults: no permit left, typed only."""
    sources = tuple(
        SourceConfig(
            name=name,
            protocol="openai",
            base_url=f"{flaky_simulator}/{name}/v1",
            model="m",
            api_key=SecretStr(KEY),
            timeout_s=1.0,
            ttft_timeout_s=0.5,
            stream_idle_timeout_s=0.5,
            connect_timeout_s=1.0,
            max_concurrency=4,
            priority=priority,
        )
        for priority, name in enumerate(("a", "b"))
    )
    flaky = GatewaySettings(
        _env_file=None,
        scopes={"chat": ScopeConfig(kind="chat", sources=sources)},
        transport=kind,
        max_attempts=3,
        stall_window_s=2.0,
        backoff_base_s=0.01,
        backoff_cap_s=0.05,
    )
    backend = MemoryBackend()
    ends: list[str] = []
    with caplog.at_level(logging.DEBUG):
        async with ChatClient(flaky, "chat", backend=backend) as chat:

            async def worker(first: int) -> None:
                for i in range(first, 60, 4):
                    ends.append(await _one_stream(chat, i % 5))

            await asyncio.gather(*(worker(k) for k in range(4)))
            for _ in range(5):
                await asyncio.sleep(0)
            assert (await backend.snapshot("chat")).in_flight == 0
    assert len(ends) == 60
    assert {"stop", "broke", "entered", "stopped", "cancelled"} <= set(ends)
    assert KEY not in caplog.text


@pytest.mark.parametrize("turns", [1, 2, 3, 4])
async def test_cancelled_again_while_closing_between_chunks_leaves_no_connection(
    kind: str, upstream: Upstream, turns: int
) -> None:
    """Cancelled between chunks inside async with, again while the exit closes: all closed."""
    upstream.play = flowing([f"w{i}" for i in range(100)], gap_s=0.02)
    made = new_rig(kind, upstream)
    async with made.chat as chat:
        got: list[str] = []
        pause = asyncio.Event()

        async def consume() -> None:
            async with chat.stream(HI) as stream:
                async for c in stream:
                    got.append(c.text)
                    if len(got) == 2:
                        await pause.wait()  # the caller is busy between two chunks

        task = asyncio.create_task(consume())
        async with asyncio.timeout(BOUND_S):
            while len(got) < 2:
                await asyncio.sleep(0.01)
        await cancel_twice(task, turns)
        await hung_up(upstream)
        await made.assert_released_once("cancelled")


async def test_reads_cancelled_twice_leave_the_pool_its_connections(
    kind: str, upstream: Upstream
) -> None:
    """A read cancelled, then cancelled again while it unwinds, must not keep its pool slot.

    httpcore 1.0.9 marks a response closed before its close has finished, so a
    second cancellation landing in that close leaves the connection counted as
    active for good (encode/httpcore#1115). With a pool of one connection, the
    next stream would then wait for a slot until its first-chunk deadline.
    """
    words = [f"w{i}" for i in range(40)]
    upstream.play = flowing(words, gap_s=0.05)
    url = f"http://127.0.0.1:{upstream.port}/v1"
    chat = ChatClient(settings(kind, url, max_concurrency=1), "chat", backend=MemoryBackend())
    async with chat:
        for turns in range(5):
            got: list[str] = []

            async def consume(got: list[str] = got) -> None:
                async for c in chat.stream(HI):
                    got.append(c.text)

            task = asyncio.create_task(consume())
            async with asyncio.timeout(BOUND_S):
                while len(got) < 2:
                    await asyncio.sleep(0.005)
            await asyncio.sleep(0.01)  # waiting on the socket for the next chunk
            await cancel_twice(task, turns)
            await hung_up(upstream)
        async with asyncio.timeout(BOUND_S):
            text = "".join([c.text async for c in chat.stream(HI)])
        assert text == "".join(words)


@dataclass
class Trickled:
    """A chat completion answered in full, its body one byte every 2 ms (about half a second)."""

    port: int = 0
    body: bytes = json.dumps(chat_completion("hello")).encode()
    open: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            await self._answer(reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()
            self.open -= 1

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            head = await reader.readuntil(b"\r\n\r\n")
            fields = dict(
                line.lower().split(":", 1) for line in head.decode("latin-1").split("\r\n")[1:-2]
            )
            await reader.readexactly(int(fields["content-length"]))
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(self.body)}\r\n\r\n".encode()
            )
            for i in range(len(self.body)):
                writer.write(self.body[i : i + 1])
                await writer.drain()
                await asyncio.sleep(0.002)


async def test_requests_cancelled_twice_leave_the_pool_its_connections(kind: str) -> None:
    """A whole-body call cancelled twice while it reads the body keeps no pool slot either."""
    async with serving(Trickled()) as up:
        url = f"http://127.0.0.1:{up.port}/v1"
        chat = ChatClient(settings(kind, url, max_concurrency=1), "chat", backend=MemoryBackend())
        async with chat:
            for turns in range(5):
                task = asyncio.create_task(chat.complete(HI))
                await asyncio.sleep(0.05)  # the body is arriving
                await cancel_twice(task, turns)
            async with asyncio.timeout(BOUND_S):
                answer = await chat.complete(HI)
        assert answer.text == "hello"
        async with asyncio.timeout(BOUND_S):
            while up.open:  # every connection hung up, its handler done
                await asyncio.sleep(0.01)


# Bounds the wait of a request queued for the pool's one connection: far below its own
# first-event deadline (BOUND_S), the stream's only bound, since it has no pool timeout.
PROMPT_S = 2.0


def slow_then_quick(upstream: Upstream, words: list[str]) -> Play:
    """The first connection streams ``words`` slowly; every later one ``["b"]`` at once."""
    slow, quick = flowing(words, gap_s=0.05), flowing(["b"], gap_s=0)

    async def play(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await (slow if upstream.requests == 1 else quick)(reader, writer)

    return play


def stream_request(upstream: Upstream) -> HttpRequest:
    """A chat stream request to ``upstream``'s source ``p``, bounded by BOUND_S alone."""
    return HttpRequest(
        source="p",
        url=f"http://127.0.0.1:{upstream.port}/v1/chat/completions",
        timeout_s=BOUND_S,
        idle_timeout_s=BOUND_S,
        connect_timeout_s=BOUND_S,
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": "m", "messages": HI, "stream": True},
    )


@pytest.mark.parametrize("turns", range(5))
async def test_a_stream_queued_behind_a_read_cancelled_twice_gets_its_slot(
    kind: str, upstream: Upstream, turns: int
) -> None:
    """A request queued for the pool's one connection is served once a read cancelled twice ends.

    The pool is sized as a client sizes it, to its one source's concurrency of 1.
    A second stream asks for a connection while the first holds it, so it waits in
    the pool. The first read is then cancelled twice (encode/httpcore#1115): with
    httpcore 1.0.9 the connection is left counted as active and is closed from
    outside, which does not hand the pool's freed slot to the request queued there.
    """
    words = [f"w{i}" for i in range(40)]
    upstream.play = slow_then_quick(upstream, words)
    client = settings(kind, f"http://127.0.0.1:{upstream.port}/v1", max_concurrency=1)
    transport = _default_transport(client, client.scopes["chat"].sources)
    request = stream_request(upstream)
    first: list[Any] = []
    second: list[Any] = []

    async def read(into: list[Any]) -> None:
        async with transport.stream(request) as events:
            async for event in events:
                into.append(event)

    try:
        reading = asyncio.create_task(read(first))
        async with asyncio.timeout(BOUND_S):
            while len(first) < 2:
                await asyncio.sleep(0.005)
        queued = asyncio.create_task(read(second))
        await asyncio.sleep(0.01)  # the first read waits on its socket, the second for the pool
        assert upstream.requests == 1
        await cancel_twice(reading, turns)
        async with asyncio.timeout(PROMPT_S):
            await queued
        assert second == chat_chunk_events(["b"])
        await hung_up(upstream)
    finally:
        await transport.aclose()
