"""ChatClient.stream: one attempt from request to close, failover before the first chunk,
StreamInterrupted after it, and a permit that is always given back."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from _chat_clients import in_flight, make_chat

from polygateway.backends.memory import MemoryBackend
from polygateway.errors import (
    AllSourcesExhausted,
    GatewayError,
    RequestRejected,
    StreamInterrupted,
)
from polygateway.models import ChatChunk
from polygateway.testing import (
    CountingBackend,
    FakeClock,
    FakeTimers,
    Recorder,
    StreamScript,
    TransientError,
    chat_chunk_events,
    settle,
)

MESSAGES = [{"role": "user", "content": "hi"}]
TWO_SOURCES = ("a", {"name": "b", "priority": 1})


def texts(chunks: list[ChatChunk]) -> str:
    return "".join(c.text for c in chunks)


class TestCleanStreams:
    """A stream that ends cleanly is one successful attempt."""

    async def test_bare_async_for_yields_the_chunks_and_releases(self) -> None:
        """Iterating to the end delivers every content chunk and frees the permit."""
        clock = FakeClock()
        recorder = Recorder()
        events = chat_chunk_events(["Hel", "lo"], usage=(7, 2))
        chat, _, backend = make_chat(clock, [StreamScript(events)], emitter=recorder)
        chunks = [c async for c in chat.stream(MESSAGES)]
        assert texts(chunks) == "Hello"
        assert chunks[-2].finish_reason == "stop"
        assert chunks[-1].usage is not None
        assert {c.source for c in chunks} == {"primary"}
        assert await in_flight(backend) == 0
        assert recorder.outcomes() == ["success"]
        record = recorder.records[0]
        assert record.ttft_s is not None
        assert (record.prompt_tokens, record.completion_tokens) == (7, 2)

    async def test_async_with_releases_at_the_end_of_iteration(self) -> None:
        """Inside async with, the permit is held while reading and free once iteration ends."""
        clock = FakeClock()
        chat, _, backend = make_chat(clock, [StreamScript(chat_chunk_events(["a", "b", "c"]))])
        async with chat.stream(MESSAGES) as stream:
            assert await in_flight(backend) == 1
            assert stream.source == "primary"
            chunks = [c async for c in stream]
            assert await in_flight(backend) == 0
        assert texts(chunks) == "abc"
        assert [a.outcome for a in stream.attempts] == ["success"]

    async def test_truncation_after_a_finish_reason_is_a_clean_end(self) -> None:
        """A connection closed after finish_reason but before [DONE] is still a success."""
        clock = FakeClock()
        recorder = Recorder()
        chat, _, backend = make_chat(
            clock,
            [StreamScript(chat_chunk_events(["x"]), done=False)],
            emitter=recorder,
        )
        chunks = [c async for c in chat.stream(MESSAGES)]
        assert texts(chunks) == "x"
        assert recorder.outcomes() == ["success"]
        assert await in_flight(backend) == 0

    async def test_stream_is_consumed_once(self) -> None:
        """Iterating one ChatStream twice is a programming error."""
        clock = FakeClock()
        chat, _, _ = make_chat(clock, [StreamScript(chat_chunk_events(["x"]))])
        stream = chat.stream(MESSAGES)
        _ = [c async for c in stream]
        with pytest.raises(RuntimeError):
            stream.__aiter__()

    async def test_lease_is_renewed_every_third_of_its_ttl_not_per_chunk(self) -> None:
        """A long stream renews its lease as chunks arrive, one backend call per TTL/3."""
        clock = FakeClock()
        backend = CountingBackend(MemoryBackend(now=clock))
        words = [f"w{i}" for i in range(30)]
        chat, _, _ = make_chat(
            clock,
            [StreamScript(chat_chunk_events(words), gap_s=5.0)],
            backend=backend,
            sources=({"name": "primary", "ttft_timeout_s": 10, "stream_idle_timeout_s": 10},),
            lease_grace_s=10,
        )
        # TTL = TTFT + 2 x idle + grace = 40 s; the stream lasts ~150 s.
        chunks = [c async for c in chat.stream(MESSAGES)]
        assert len(chunks) == 31
        renewals = backend.calls.get("renew", 0)
        assert 3 <= renewals <= 12
        assert renewals < len(chunks)
        assert await in_flight(backend) == 0


class TestFailoverBeforeTheFirstChunk:
    """Until a chunk reaches the caller, a failed stream is an ordinary transient failure."""

    async def test_ttft_timeout_fails_over_to_another_source(self) -> None:
        """No first chunk within ttft_timeout_s at a: the stream comes from b."""
        clock = FakeClock()
        chat, transport, backend = make_chat(
            clock,
            {
                "a": [StreamScript([], hang_before_first=True)],
                "b": [StreamScript(chat_chunk_events(["from b"]))],
            },
            sources=({"name": "a", "ttft_timeout_s": 4}, {"name": "b", "priority": 1}),
        )
        started = clock()
        chunks = [c async for c in chat.stream(MESSAGES)]
        assert texts(chunks) == "from b"
        assert {c.source for c in chunks} == {"b"}
        assert transport.sources_called() == ["a", "b"]
        assert transport.requests[0].timeout_s == 4
        assert clock() - started >= 4
        assert await in_flight(backend) == 0

    async def test_error_at_open_fails_over(self) -> None:
        """A 503 when the stream opens moves on to the next source."""
        clock = FakeClock()
        chat, transport, _ = make_chat(
            clock,
            {
                "a": [TransientError(status_code=503)],
                "b": [StreamScript(chat_chunk_events(["ok"]))],
            },
            sources=TWO_SOURCES,
        )
        chunks = [c async for c in chat.stream(MESSAGES)]
        assert texts(chunks) == "ok"
        assert transport.sources_called() == ["a", "b"]

    async def test_stream_cut_before_any_content_fails_over(self) -> None:
        """Only a role announcement, then the connection drops: not a chunk yet, so fail over."""
        clock = FakeClock()
        role_only = chat_chunk_events([], finish_reason=None)
        chat, transport, _ = make_chat(
            clock,
            {
                "a": [StreamScript(role_only, done=False)],
                "b": [StreamScript(chat_chunk_events(["ok"]))],
            },
            sources=TWO_SOURCES,
        )
        chunks = [c async for c in chat.stream(MESSAGES)]
        assert texts(chunks) == "ok"
        assert transport.sources_called() == ["a", "b"]

    async def test_every_source_failing_before_a_chunk_exhausts_the_call(self) -> None:
        """Streams that never start end the call like any other: AllSourcesExhausted."""
        clock = FakeClock()
        chat, transport, backend = make_chat(clock, [StreamScript([], hang_before_first=True)] * 3)
        with pytest.raises(AllSourcesExhausted) as caught:
            _ = [c async for c in chat.stream(MESSAGES)]
        assert caught.value.reason == "retry_exhausted"
        assert len(transport.requests) == 3
        assert await in_flight(backend) == 0

    async def test_rejected_stream_request_raises_at_once(self) -> None:
        """A 400 when the stream opens raises RequestRejected: one attempt, no other source."""
        clock = FakeClock()
        chat, transport, backend = make_chat(
            clock,
            {"a": [TransientError(status_code=400)], "b": [StreamScript(chat_chunk_events(["x"]))]},
            sources=TWO_SOURCES,
        )
        with pytest.raises(RequestRejected):
            async with chat.stream(MESSAGES):
                pass
        assert transport.sources_called() == ["a"]
        assert await in_flight(backend) == 0


class TestFailureAfterChunks:
    """Once a chunk reached the caller, a failure is StreamInterrupted, never retried."""

    async def test_reset_after_chunks_raises_stream_interrupted(self) -> None:
        """A reset after two chunks raises StreamInterrupted; the permit is free, no retry."""
        clock = FakeClock()
        recorder = Recorder()
        events = chat_chunk_events(["one", "two", "three"])
        chat, transport, backend = make_chat(
            clock,
            [StreamScript(events, fail_after=3)],  # role chunk + two texts, then a reset
            sources=TWO_SOURCES,
            emitter=recorder,
        )
        received: list[str] = []

        async def consume() -> None:
            async for chunk in chat.stream(MESSAGES):
                received.append(chunk.text)

        with pytest.raises(StreamInterrupted) as caught:
            await consume()
        assert received == ["one", "two"]
        assert caught.value.chunks_delivered == 2
        assert caught.value.sources == ("a",)
        assert len(transport.requests) == 1
        assert recorder.outcomes() == ["transient"]
        assert await in_flight(backend) == 0
        snap = (await backend.snapshot("chat")).source("a")
        assert snap is not None
        assert snap.consecutive_failures == 1

    async def test_truncation_without_finish_reason_after_chunks_is_interrupted(self) -> None:
        """A stream that ends without [DONE] and without finish_reason is a failure."""
        clock = FakeClock()
        events = chat_chunk_events(["partial"], finish_reason=None)
        chat, _, backend = make_chat(clock, [StreamScript(events, done=False)])
        with pytest.raises(StreamInterrupted):
            async with chat.stream(MESSAGES) as stream:
                _ = [c async for c in stream]
        assert await in_flight(backend) == 0

    async def test_idle_timeout_after_chunks_is_interrupted(self) -> None:
        """A stream that goes quiet past the idle timeout after a chunk raises StreamInterrupted."""
        clock = FakeClock()
        events = chat_chunk_events(["a", "b"])
        chat, _, backend = make_chat(
            clock,
            [StreamScript(events, hang_after=2)],
            sources=({"name": "primary", "stream_idle_timeout_s": 7},),
        )
        started = clock()
        with pytest.raises(StreamInterrupted):
            _ = [c async for c in chat.stream(MESSAGES)]
        assert clock() - started >= 7
        assert await in_flight(backend) == 0


class TestEarlyExit:
    """A consumer that stops early never leaves a permit held."""

    async def test_bare_async_for_break_releases_within_a_few_loop_turns(self) -> None:
        """Breaking out of a bare async for after 3 chunks frees the permit once the loop turns."""
        clock = FakeClock()
        recorder = Recorder()
        words = [f"w{i}" for i in range(10)]
        chat, _, backend = make_chat(
            clock, [StreamScript(chat_chunk_events(words))], emitter=recorder
        )
        count = 0
        async for _chunk in chat.stream(MESSAGES):
            count += 1
            if count == 3:
                break
        for _ in range(5):
            await asyncio.sleep(0)
        assert await in_flight(backend) == 0
        assert recorder.outcomes() == ["cancelled"]

    async def test_async_with_break_releases_at_once(self) -> None:
        """Breaking inside async with frees the permit at context exit, no loop turn needed."""
        clock = FakeClock()
        words = [f"w{i}" for i in range(10)]
        chat, transport, backend = make_chat(clock, [StreamScript(chat_chunk_events(words))])
        async with chat.stream(MESSAGES) as stream:
            async for _chunk in stream:
                break
        assert await in_flight(backend) == 0
        assert transport.open_streams == 0

    async def test_aclose_releases_the_permit(self) -> None:
        """aclose() on an open stream frees its permit and closes its connection."""
        clock = FakeClock()
        chat, transport, backend = make_chat(clock, [StreamScript(chat_chunk_events(["a"]))])
        stream = chat.stream(MESSAGES)
        await stream.__aenter__()
        assert await in_flight(backend) == 1
        await stream.aclose()
        assert await in_flight(backend) == 0
        assert transport.open_streams == 0

    async def test_cancel_during_stream_read_frees_the_permit(self) -> None:
        """Cancelled while waiting for the next chunk: the permit is free right after."""
        clock = FakeClock()
        timers = FakeTimers(clock)
        words = [f"w{i}" for i in range(5)]
        chat, transport, backend = make_chat(
            clock,
            [StreamScript(chat_chunk_events(words, role_first=False), gap_s=5.0)],
            transport_sleep=timers.sleep,
            sleep=timers.sleep,
        )
        received: list[str] = []

        async def consume() -> None:
            async for chunk in chat.stream(MESSAGES):
                received.append(chunk.text)

        task = asyncio.create_task(consume())
        await settle()
        assert received == ["w0"]  # the next read waits 5 s of fake time
        assert await in_flight(backend) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await in_flight(backend) == 0
        assert transport.open_streams == 0


class TestStreamCalls:
    """Stream calls share the loop's per-call options and checks."""

    async def test_deadline_clips_the_ttft_timeout(self) -> None:
        """With deadline_s=3 the stream's TTFT timeout is at most 3 s."""
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, [StreamScript(chat_chunk_events(["x"]))])
        _ = [c async for c in chat.stream(MESSAGES, deadline_s=3)]
        assert transport.requests[0].timeout_s == pytest.approx(3)
        assert transport.requests[0].idle_timeout_s == pytest.approx(3)

    async def test_stream_request_asks_for_a_stream_with_usage(self) -> None:
        """The body says stream=true and asks for usage in the last chunk; params pass through."""
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, [StreamScript(chat_chunk_events(["x"]))])
        _ = [c async for c in chat.stream(MESSAGES, temperature=0.2)]
        body = transport.requests[0].json
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0.2

    async def test_stream_on_a_closed_client_is_refused(self) -> None:
        """A closed client refuses new streams with GatewayError("client closed")."""
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, [])
        await chat.aclose()
        with pytest.raises(GatewayError, match="client closed"):
            chat.stream(MESSAGES)
        assert transport.requests == []

    @pytest.mark.parametrize("options", [b"bytes", "text", 3, [("include_usage", True)]])
    async def test_stream_options_that_are_not_an_object_are_rejected_at_once(
        self, options: Any
    ) -> None:
        """stream_options must be an object: anything else is RequestRejected, nothing sent."""
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, [StreamScript(chat_chunk_events(["x"]))])
        with pytest.raises(RequestRejected, match="stream_options must be an object") as caught:
            chat.stream(MESSAGES, stream_options=options)
        assert caught.value.scope == "chat"
        assert transport.requests == []

    async def test_caller_stream_options_are_kept_beside_include_usage(self) -> None:
        """An object of stream_options passes through, with include_usage added unless set."""
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, [StreamScript(chat_chunk_events(["x"]))])
        _ = [c async for c in chat.stream(MESSAGES, stream_options={"x": 1})]
        assert transport.requests[0].json["stream_options"] == {"x": 1, "include_usage": True}


def _tool_call_chunk() -> dict[str, Any]:
    """A chunk carrying only the start of a tool call (no text)."""
    call = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}],
    }


_USAGE_ONLY = {
    "id": "chatcmpl-fake",
    "object": "chat.completion.chunk",
    "choices": [],
    "usage": {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3},
}

_SLOW_IDLE = (
    {"name": "a", "ttft_timeout_s": 4, "stream_idle_timeout_s": 30},
    {"name": "b", "priority": 1},
)


class TestTtftCountsToTheFirstContent:
    """The TTFT runs from the request to the first content, not to a role or usage chunk."""

    async def test_role_chunk_then_hang_fails_over_after_the_ttft_not_the_idle_timeout(
        self,
    ) -> None:
        """A role announcement, then silence: a is abandoned at its 4 s TTFT and b serves."""
        clock = FakeClock()
        recorder = Recorder()
        role_only = chat_chunk_events([], finish_reason=None)
        chat, transport, backend = make_chat(
            clock,
            {
                "a": [StreamScript(role_only, hang_after=1)],
                "b": [StreamScript(chat_chunk_events(["from b"]))],
            },
            sources=_SLOW_IDLE,
            emitter=recorder,
        )
        chunks = [c async for c in chat.stream(MESSAGES)]
        assert texts(chunks) == "from b"
        assert transport.sources_called() == ["a", "b"]
        assert recorder.outcomes() == ["transient", "success"]
        first = recorder.records[0]
        assert first.latency_s == pytest.approx(4.0)
        assert first.error is not None
        assert "no first content" in first.error
        assert await in_flight(backend) == 0

    async def test_usage_only_chunk_does_not_end_the_ttft(self) -> None:
        """Role and usage-only chunks, then silence: still the TTFT, still a failover to b."""
        clock = FakeClock()
        recorder = Recorder()
        preamble = [*chat_chunk_events([], finish_reason=None), _USAGE_ONLY]
        chat, transport, backend = make_chat(
            clock,
            {
                "a": [StreamScript(preamble, hang_after=2)],
                "b": [StreamScript(chat_chunk_events(["from b"]))],
            },
            sources=_SLOW_IDLE,
            emitter=recorder,
        )
        chunks = [c async for c in chat.stream(MESSAGES)]
        assert texts(chunks) == "from b"
        assert {c.source for c in chunks} == {"b"}
        assert transport.sources_called() == ["a", "b"]
        assert recorder.records[0].latency_s == pytest.approx(4.0)
        assert await in_flight(backend) == 0

    async def test_tool_call_delta_ends_the_ttft(self) -> None:
        """A tool-call delta is content: it reaches the caller and later gaps are idle-timed."""
        clock = FakeClock()
        events = [*chat_chunk_events([], finish_reason=None), _tool_call_chunk()]
        chat, transport, backend = make_chat(
            clock,
            [StreamScript(events, hang_after=2)],
            sources=({"name": "a", "ttft_timeout_s": 4, "stream_idle_timeout_s": 7},),
        )
        received: list[ChatChunk] = []

        async def consume() -> None:
            async for chunk in chat.stream(MESSAGES):
                received.append(chunk)

        started = clock()
        with pytest.raises(StreamInterrupted) as caught:
            await consume()
        assert [c.tool_calls[0].name for c in received] == ["f"]
        assert caught.value.chunks_delivered == 1
        assert "stream idle" in str(caught.value)
        assert clock() - started == pytest.approx(7.0)
        assert transport.sources_called() == ["a"]
        assert await in_flight(backend) == 0

    async def test_first_text_after_a_slow_preamble_within_the_ttft_is_served(self) -> None:
        """A role chunk, then the first token 3 s later (idle 1 s, TTFT 4 s): no timeout."""
        clock = FakeClock()
        chat, transport, _ = make_chat(
            clock,
            [StreamScript(chat_chunk_events(["late", "r"]), gap_s=0.5)],
            sources=({"name": "a", "ttft_timeout_s": 4, "stream_idle_timeout_s": 1},),
        )
        chunks = [c async for c in chat.stream(MESSAGES)]
        assert texts(chunks) == "later"
        assert transport.sources_called() == ["a"]

    async def test_stream_requests_carry_the_content_predicate(self) -> None:
        """The chat stream's request tells content from the preamble; a plain call's does not."""
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, [StreamScript(chat_chunk_events(["x"]))])
        _ = [c async for c in chat.stream(MESSAGES)]
        is_content = transport.requests[0].is_content
        assert is_content is not None
        assert is_content(chat_chunk_events(["x"])[0]) is False
        assert is_content(chat_chunk_events(["x"])[1]) is True
