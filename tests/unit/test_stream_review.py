"""ChatStream under the ways real consumers leave a stream: the permit comes back once,
the backend hears the right outcome, the connection closes, the caller gets a typed error."""

from __future__ import annotations

import asyncio
import gc
import logging
import warnings
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from _chat_clients import in_flight as permits
from _chat_clients import make_chat as chat_client
from _closing import closing

from _cancel import cancel_twice
from polygateway.backends.base import Lease
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import GovernanceBackendError, StreamInterrupted
from polygateway.testing import (
    CountingBackend,
    FakeClock,
    FakeTimers,
    FakeTransport,
    Recorder,
    StreamScript,
    TransientError,
    chat_chunk_events,
    gateway_settings,
    settle,
)
from polygateway.transport.httpx_client import HttpxTransport

MESSAGES = [{"role": "user", "content": "hi"}]


def make_chat(
    clock: FakeClock,
    script: Any,
    *,
    timers: FakeTimers | None = None,
    backend: Any = None,
    **gateway: Any,
) -> tuple[ChatClient, FakeTransport, Any, Recorder]:
    """A chat client on a fake clock and a scripted transport, with a telemetry recorder."""
    sleep = timers.sleep if timers is not None else None
    recorder = Recorder()
    chat, transport, backend = chat_client(
        clock,
        script,
        backend=backend,
        sleep=sleep,
        transport_sleep=sleep,
        emitter=recorder,
        **gateway,
    )
    return chat, transport, backend, recorder


async def assert_released_once(
    backend: Any, transport: FakeTransport, recorder: Recorder, outcome: str
) -> None:
    """No permit held, no stream open, and the one attempt released as ``outcome``."""
    assert await permits(backend) == 0
    assert transport.open_streams == 0
    assert recorder.outcomes() == [outcome]


class TestConnectionEndsAfterTheFinish:
    """After a finish_reason the answer is whole, however the connection then ends."""

    @pytest.mark.parametrize(
        "error",
        [
            TransientError("connection reset at primary: RemoteProtocolError"),
            TransientError("connection broken at primary: ClientPayloadError"),
        ],
        ids=["reset", "broken"],
    )
    async def test_connection_lost_after_finish_reason_is_a_clean_end(
        self, error: TransientError
    ) -> None:
        """A socket closed without its last chunk (no [DONE]) after the finish is a success."""
        clock = FakeClock()
        events = chat_chunk_events(["Hel", "lo"])
        chat, transport, backend, recorder = make_chat(
            clock, [StreamScript(events, fail_after=len(events), error=error)]
        )
        async with chat.stream(MESSAGES) as stream:
            chunks = [c async for c in stream]
            response = await stream.response()
        assert "".join(c.text for c in chunks) == "Hello"
        assert response.finish_reason == "stop"
        await assert_released_once(backend, transport, recorder, "success")

    async def test_connection_lost_before_the_finish_is_still_interrupted(self) -> None:
        """Without a finish_reason the same loss is a StreamInterrupted and a transient attempt."""
        clock = FakeClock()
        events = chat_chunk_events(["Hel", "lo"], finish_reason=None)
        chat, transport, backend, recorder = make_chat(
            clock, [StreamScript(events, fail_after=len(events))]
        )
        with pytest.raises(StreamInterrupted, match="after 2 chunks"):
            _ = [c async for c in chat.stream(MESSAGES)]
        await assert_released_once(backend, transport, recorder, "transient")

    async def test_idle_timeout_after_the_finish_is_still_a_timeout(self) -> None:
        """A source that stalls after its finish still fails as a timeout: it held the caller."""
        clock = FakeClock()
        events = chat_chunk_events(["a"])
        chat, _, backend, recorder = make_chat(
            clock, [StreamScript(events, hang_after=len(events))]
        )
        with pytest.raises(StreamInterrupted, match="stream idle"):
            _ = [c async for c in chat.stream(MESSAGES)]
        assert recorder.outcomes() == ["transient"]
        assert await permits(backend) == 0


def slow_stream(words: list[str]) -> tuple[ChatClient, FakeTransport, Any, Recorder]:
    """A chat whose one stream sends ``words`` 5 s apart on virtual time: readers wait on it."""
    clock = FakeClock()
    script = [StreamScript(chat_chunk_events(words, role_first=False), gap_s=5.0)]
    return make_chat(clock, script, timers=FakeTimers(clock))


class TestCloseFromAnotherTask:
    """aclose() while another task waits for the next chunk (a "stop" button)."""

    async def test_aclose_while_another_task_reads_ends_that_iteration_quietly(self) -> None:
        """The reader's loop ends without an error; the attempt is released once, as cancelled."""
        words = [f"w{i}" for i in range(5)]
        chat, transport, backend, recorder = slow_stream(words)
        received: list[str] = []
        async with chat.stream(MESSAGES) as stream:

            async def read() -> None:
                async for chunk in stream:
                    received.append(chunk.text)

            reader = asyncio.create_task(read())
            await settle()
            assert received == ["w0"]  # the reader now waits 5 s of fake time
            await stream.aclose()
            assert await permits(backend) == 0
            assert transport.open_streams == 0
            await reader  # ends, raises nothing
            assert not reader.cancelled()
        assert received == ["w0"]
        assert recorder.outcomes() == ["cancelled"]
        with pytest.raises(RuntimeError, match="did not reach its end"):
            await stream.response()

    async def test_aclose_from_another_task_leaves_the_reader_task_uncancelled(self) -> None:
        """The reader task can go on awaiting after its stream was stopped under it."""
        chat, _, _, _ = slow_stream(["a", "b"])
        after: list[str] = []
        async with chat.stream(MESSAGES) as stream:

            async def read() -> None:
                async for _chunk in stream:
                    pass
                await asyncio.sleep(0)
                after.append("went on")

            reader = asyncio.create_task(read())
            await settle()
            await stream.aclose()
            await reader
        assert after == ["went on"]
        assert reader.cancelling() == 0

    async def test_aclose_stops_a_bare_async_for_in_another_task(self) -> None:
        """Without async with too: the bare loop ends, the permit and connection come back."""
        chat, transport, backend, recorder = slow_stream(["a", "b"])
        stream = chat.stream(MESSAGES)
        received: list[str] = []

        async def read() -> None:
            async for chunk in stream:
                received.append(chunk.text)

        reader = asyncio.create_task(read())
        await settle()
        await stream.aclose()
        await reader
        assert received == ["a"]
        await assert_released_once(backend, transport, recorder, "cancelled")

    async def test_caller_cancelling_the_reader_still_gets_cancelled_error(self) -> None:
        """A real cancellation of the reader passes through as CancelledError, released once."""
        chat, transport, backend, recorder = slow_stream(["a", "b"])
        async with chat.stream(MESSAGES) as stream:

            async def read() -> None:
                async for _chunk in stream:
                    pass

            reader = asyncio.create_task(read())
            await settle()
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            await stream.aclose()
        await assert_released_once(backend, transport, recorder, "cancelled")


class TestAbandonedStreams:
    """Streams dropped without a close give their permit back, once."""

    async def test_iterator_dropped_after_one_chunk_releases_once(self) -> None:
        """A bare iterator collected mid-stream releases as cancelled when the loop finalizes it."""
        clock = FakeClock()
        chat, transport, backend, recorder = make_chat(
            clock, [StreamScript(chat_chunk_events(["a", "b", "c"]))]
        )
        iterator = aiter(chat.stream(MESSAGES))
        first = await anext(iterator)
        assert first.text == "a"
        assert await permits(backend) == 1
        del iterator
        gc.collect()
        for _ in range(5):
            await asyncio.sleep(0)
        await assert_released_once(backend, transport, recorder, "cancelled")

    async def test_stream_never_iterated_sends_nothing_and_holds_nothing(self) -> None:
        """A ChatStream made and dropped costs no request and no permit."""
        clock = FakeClock()
        chat, transport, backend, _ = make_chat(clock, [])
        stream = chat.stream(MESSAGES)
        del stream
        gc.collect()
        assert transport.requests == []
        assert await permits(backend) == 0

    async def test_response_without_iterating_releases_once_as_success(self) -> None:
        """await stream.response() alone reads the stream, releases it once as a success."""
        clock = FakeClock()
        chat, transport, backend, recorder = make_chat(
            clock, [StreamScript(chat_chunk_events(["a", "b"]))]
        )
        response = await chat.stream(MESSAGES).response()
        assert response.text == "ab"
        await assert_released_once(backend, transport, recorder, "success")

    async def test_response_cancelled_while_waiting_for_the_first_chunk(self) -> None:
        """Cancelled inside response() before any chunk: released as cancelled, connection shut."""
        clock = FakeClock()
        timers = FakeTimers(clock)
        chat, transport, backend, recorder = make_chat(
            clock,
            [StreamScript(chat_chunk_events(["a"]), hang_before_first=True)],
            timers=timers,
        )
        task = asyncio.create_task(chat.stream(MESSAGES).response())
        await settle()
        assert await permits(backend) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await assert_released_once(backend, transport, recorder, "cancelled")


class _FailingRenewals(CountingBackend):
    """A backend whose lease renewals fail (or find the lease gone); everything else works."""

    __slots__ = ("alive",)

    def __init__(self, inner: Any, *, alive: bool | None = None) -> None:
        super().__init__(inner)
        self.alive = alive
        """``None``: renewals raise; else what they answer."""

    async def renew(self, lease: Lease) -> bool:
        self._count("renew")
        if self.alive is None:
            raise GovernanceBackendError(
                "redis renew failed at redis://***@cache:6379/0: timeout", operation="renew"
            )
        return self.alive


class TestLeaseRenewalFailing:
    """A renewal that fails while the stream runs neither breaks the stream nor frees twice."""

    @pytest.mark.parametrize("alive", [None, False], ids=["raises", "lease-gone"])
    async def test_stream_runs_on_and_releases_once(
        self, alive: bool | None, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Every chunk arrives, the attempt is a success, one release, nothing secret logged."""
        clock = FakeClock()
        backend = _FailingRenewals(MemoryBackend(now=clock), alive=alive)
        words = [f"w{i}" for i in range(6)]
        chat, transport, _, recorder = make_chat(
            clock,
            [StreamScript(chat_chunk_events(words, role_first=False), gap_s=20.0)],
            backend=backend,
        )
        with caplog.at_level(logging.DEBUG, logger="polygateway"):
            chunks = [c async for c in chat.stream(MESSAGES)]
        assert "".join(c.text for c in chunks) == "".join(words)
        assert backend.calls["renew"] >= 2
        assert backend.calls["release"] == 1
        await assert_released_once(backend, transport, recorder, "success")
        assert "renew" in caplog.text or "expired" in caplog.text
        assert "secret" not in caplog.text


class TestEnteredStreamCollected:
    """A stream entered (``__aenter__``) and dropped without its exit."""

    async def test_collected_open_stream_warns_and_releases_once(self) -> None:
        """A ResourceWarning names it, and its permit and connection come back, as cancelled."""
        clock = FakeClock()
        chat, transport, backend, recorder = make_chat(
            clock, [StreamScript(chat_chunk_events(["a", "b"]))]
        )
        stream = chat.stream(MESSAGES)
        await stream.__aenter__()
        assert await permits(backend) == 1
        # Reachable only from a garbage cycle, so it goes at the collection below.
        cycle: list[Any] = [stream]
        cycle.append(cycle)
        del stream, cycle
        with pytest.warns(ResourceWarning, match="unclosed ChatStream"):
            gc.collect()
        for _ in range(5):
            await asyncio.sleep(0)
        await assert_released_once(backend, transport, recorder, "cancelled")

    async def test_closed_or_unopened_streams_are_collected_silently(self) -> None:
        """Never entered, or exited: collecting it warns nothing."""
        clock = FakeClock()
        chat, _, _, _ = make_chat(clock, [StreamScript(chat_chunk_events(["a"]))])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            unopened = chat.stream(MESSAGES)
            del unopened
            async with chat.stream(MESSAGES) as stream:
                pass
            del stream
            gc.collect()


class _SlowToClose(httpx.AsyncByteStream):
    """An endless event stream whose close takes a few loop turns, as a socket's does."""

    def __init__(self) -> None:
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n'
        await asyncio.Event().wait()  # then silence, until the stream is closed
        yield b""  # pragma: no cover - never reached

    async def aclose(self) -> None:
        for _ in range(3):
            await asyncio.sleep(0)
        self.closed = True


class TestCancelledTwice:
    """A second cancellation while the stream closes must not leave its connection open."""

    @pytest.mark.parametrize("turns", [0, 1, 2, 3])
    async def test_connection_closes_however_soon_the_second_cancel_comes(self, turns: int) -> None:
        """Cancelled mid-read, again ``turns`` loop turns later: closed, released once."""
        body = _SlowToClose()
        settings = gateway_settings("primary")
        transport = HttpxTransport(
            settings.scopes["chat"].sources,
            max_connections=1,
            mock_transport=httpx.MockTransport(
                lambda request: httpx.Response(
                    200, headers={"content-type": "text/event-stream"}, stream=body
                )
            ),
        )
        backend = MemoryBackend()
        recorder = Recorder()
        chat = closing(ChatClient(settings, backend=backend, transport=transport, emitter=recorder))

        async def consume() -> None:
            async for _chunk in chat.stream(MESSAGES):
                pass

        task = asyncio.create_task(consume())
        while await permits(backend) == 0 or not transport.in_flight("primary")[0]:
            await asyncio.sleep(0)
        for _ in range(3):
            await asyncio.sleep(0)
        await cancel_twice(task, turns)
        for _ in range(10):
            await asyncio.sleep(0)
        assert body.closed
        assert transport.in_flight("primary") == (0,)
        assert await permits(backend) == 0
        assert recorder.outcomes() == ["cancelled"]
        await transport.aclose()
