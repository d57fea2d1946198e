"""ChatStream.response(): the whole answer of a stream, equal to what complete() returns."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import pytest
from _closing import closing

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import AllSourcesExhausted, StreamInterrupted
from polygateway.models import ChatResponse, Choice, ToolCall, Usage
from polygateway.testing import (
    BoundedSleep,
    FakeClock,
    FakeTransport,
    StreamScript,
    TransientError,
    chat_chunk_events,
    chat_completion,
    gateway_settings,
)
from polygateway.transport.openai import parse_chat_response

MESSAGES = [{"role": "user", "content": "what is the weather?"}]
CALLS = [
    {"id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"id": "call_b", "name": "get_time", "arguments": '{"tz": "Europe/Paris"}'},
]


def make_chat(script: Any, *sources: Any) -> tuple[ChatClient, MemoryBackend]:
    """A chat client on a fake clock over ``script``; one OpenAI source unless told."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    chat = closing(
        ChatClient(
            gateway_settings(*(sources or ("primary",))),
            backend=backend,
            transport=FakeTransport(script, clock=clock),
            now=clock,
            sleep=BoundedSleep(clock),
            rng=random.Random(6),
        )
    )
    return chat, backend


def answer(response: ChatResponse[Any]) -> ChatResponse[Any]:
    """A response without what differs between two calls by nature: attempts' timings, raw."""
    return dataclasses.replace(response, attempts=(), raw={})


async def in_flight(backend: MemoryBackend) -> int:
    return (await backend.snapshot("chat")).in_flight


def anthropic_message(text: str, calls: list[dict[str, str]]) -> dict[str, Any]:
    """A Messages API answer: a text block, then a tool_use block per call."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}]
    blocks += [
        {"type": "tool_use", "id": c["id"], "name": c["name"], "input": json.loads(c["arguments"])}
        for c in calls
    ]
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": blocks,
        "stop_reason": "tool_use" if calls else "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 12, "output_tokens": 30},
    }


def anthropic_events(text: str, calls: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The same answer streamed as the Messages API streams it (compact partial JSON)."""
    events: list[dict[str, Any]] = [
        {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": "claude-test",
                "usage": {"input_tokens": 12, "output_tokens": 1},
            },
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
        {"type": "content_block_stop", "index": 0},
    ]
    for i, call in enumerate(calls, start=1):
        compact = json.dumps(json.loads(call["arguments"]), separators=(",", ":"))
        block = {"type": "tool_use", "id": call["id"], "name": call["name"], "input": {}}
        events.append({"type": "content_block_start", "index": i, "content_block": block})
        for piece in ("", compact[:5], compact[5:]):
            delta = {"type": "input_json_delta", "partial_json": piece}
            events.append({"type": "content_block_delta", "index": i, "delta": delta})
        events.append({"type": "content_block_stop", "index": i})
    events += [
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use" if calls else "end_turn"},
            "usage": {"output_tokens": 30},
        },
        {"type": "message_stop"},
    ]
    return events


class TestEqualToComplete:
    """For one scripted answer, response() and complete() give the same ChatResponse."""

    async def test_text_answer_on_the_openai_wire(self) -> None:
        """Text, finish reason, usage, source and the one choice are those complete() returns."""
        chat, _ = make_chat(
            [
                chat_completion("Hello there", prompt_tokens=7, completion_tokens=2),
                StreamScript(chat_chunk_events(["Hel", "lo ", "there"], usage=(7, 2))),
            ]
        )
        completed = await chat.complete(MESSAGES)
        streamed = await chat.stream(MESSAGES).response()
        assert answer(streamed) == answer(completed)
        assert streamed.choices == (Choice(0, "Hello there", (), "stop"),)
        assert [a.outcome for a in streamed.attempts] == ["success"]

    async def test_tool_calls_on_the_openai_wire(self) -> None:
        """Two tool calls streamed in pieces are joined by index into complete()'s tool calls."""
        chat, _ = make_chat(
            [
                chat_completion("", finish_reason="tool_calls", tool_calls=CALLS),
                StreamScript(chat_chunk_events([], "tool_calls", usage=(5, 2), tool_calls=CALLS)),
            ]
        )
        completed = await chat.complete(MESSAGES)
        streamed = await chat.stream(MESSAGES).response()
        assert answer(streamed) == answer(completed)
        assert streamed.tool_calls == (
            ToolCall("call_a", "get_weather", '{"city": "Paris"}'),
            ToolCall("call_b", "get_time", '{"tz": "Europe/Paris"}'),
        )
        assert streamed.finish_reason == "tool_calls"

    async def test_text_and_tool_calls_on_the_anthropic_wire(self) -> None:
        """Compact partial JSON is written as a completion's tool input: equal tool calls."""
        claude = {"name": "claude", "protocol": "anthropic"}
        chat, _ = make_chat(
            [
                anthropic_message("Let me check.", CALLS),
                StreamScript(anthropic_events("Let me check.", CALLS), done=False),
            ],
            claude,
        )
        completed = await chat.complete(MESSAGES)
        streamed = await chat.stream(MESSAGES).response()
        assert answer(streamed) == answer(completed)
        assert streamed.text == "Let me check."
        assert [json.loads(c.arguments) for c in streamed.tool_calls] == [
            {"city": "Paris"},
            {"tz": "Europe/Paris"},
        ]
        assert streamed.usage == Usage(12, 30, 42)

    async def test_interleaved_pieces_are_joined_by_their_index(self) -> None:
        """Pieces of two calls that arrive interleaved still join into two whole calls."""
        head = chat_chunk_events([], None, tool_calls=CALLS[:1])
        other = chat_chunk_events([], None, role_first=False, tool_calls=CALLS[1:])
        for event in other:
            event["choices"][0]["delta"]["tool_calls"][0]["index"] = 1
        # Call 0's name, call 1's name, call 0's first half, call 1's halves, call 0's second half.
        events = [head[0], head[1], other[0], head[2], other[1], other[2], head[3]]
        events += chat_chunk_events([], "tool_calls", role_first=False)
        chat, _ = make_chat([StreamScript(events)])
        streamed = await chat.stream(MESSAGES).response()
        assert [(c.id, c.name, c.arguments) for c in streamed.tool_calls] == [
            (c["id"], c["name"], c["arguments"]) for c in CALLS
        ]

    async def test_usage_the_provider_did_not_send_is_zero(self) -> None:
        """A stream without a usage chunk answers Usage(), as complete() does without usage."""
        chat, _ = make_chat([StreamScript(chat_chunk_events(["ok"]))])
        streamed = await chat.stream(MESSAGES).response()
        assert streamed.usage == Usage()
        assert "usage" not in streamed.raw


class TestWhenCalled:
    """Instead of iterating, after it, or in the middle of it; and when it cannot answer."""

    async def test_instead_of_iterating_it_reads_the_stream_and_releases(self) -> None:
        """On a fresh stream it consumes the stream itself; the permit is back, one success."""
        chat, backend = make_chat([StreamScript(chat_chunk_events(["a", "b"]))])
        stream = chat.stream(MESSAGES)
        streamed = await stream.response()
        assert streamed.text == "ab"
        assert await in_flight(backend) == 0
        assert [a.outcome for a in stream.attempts] == ["success"]

    async def test_first_thing_inside_async_with(self) -> None:
        """Inside async with, before any chunk, it reads the whole stream."""
        chat, backend = make_chat([StreamScript(chat_chunk_events(["a", "b"]))])
        async with chat.stream(MESSAGES) as stream:
            assert await in_flight(backend) == 1
            streamed = await stream.response()
            assert await in_flight(backend) == 0
        assert streamed.text == "ab"

    async def test_after_iterating_it_assembles_what_was_delivered(self) -> None:
        """After a full iteration it reads nothing more; it returns the same object every time."""
        chat, _ = make_chat([StreamScript(chat_chunk_events(["x", "y", "z"], usage=(3, 3)))])
        async with chat.stream(MESSAGES) as stream:
            chunks = [c async for c in stream]
        first = await stream.response()
        assert first.text == "".join(c.text for c in chunks) == "xyz"
        assert first.usage == Usage(3, 3, 6)
        assert await stream.response() is first

    async def test_in_the_middle_of_iterating_it_reads_the_rest(self) -> None:
        """After some chunks inside async with, it reads the rest; the whole text is assembled."""
        chat, backend = make_chat([StreamScript(chat_chunk_events(["1", "2", "3", "4"]))])
        async with chat.stream(MESSAGES) as stream:
            async for chunk in stream:
                assert chunk.text == "1"
                streamed = await stream.response()
                break
        assert streamed.text == "1234"
        assert await in_flight(backend) == 0
        assert [a.outcome for a in stream.attempts] == ["success"]

    async def test_after_an_early_close_it_refuses(self) -> None:
        """A stream closed before its end has no whole answer: RuntimeError, permit already back."""
        chat, backend = make_chat([StreamScript(chat_chunk_events(["1", "2", "3"]))])
        async with chat.stream(MESSAGES) as stream:
            async for _ in stream:
                break
            await stream.aclose()
        with pytest.raises(RuntimeError, match="did not reach its end"):
            await stream.response()
        assert await in_flight(backend) == 0

    async def test_the_loop_error_surfaces_from_it(self) -> None:
        """Read by response(), a stream that never opens raises the loop's error there."""
        # As many failures as the default max_attempts allows.
        chat, backend = make_chat([TransientError(status_code=503)] * 3)
        with pytest.raises(AllSourcesExhausted) as info:
            await chat.stream(MESSAGES).response()
        assert info.value.reason == "retry_exhausted"
        assert await in_flight(backend) == 0

    async def test_an_interrupted_stream_raises_there_then_refuses(self) -> None:
        """A failure after the first chunk: StreamInterrupted from response(), then RuntimeError."""
        chat, backend = make_chat([StreamScript(chat_chunk_events(["a", "b", "c"]), fail_after=2)])
        stream = chat.stream(MESSAGES)
        with pytest.raises(StreamInterrupted):
            await stream.response()
        with pytest.raises(RuntimeError):
            await stream.response()
        assert await in_flight(backend) == 0


class TestRaw:
    """``raw`` of a streamed response is a chat.completion built from the assembled answer."""

    async def test_raw_reads_back_as_the_same_answer(self) -> None:
        """The synthesized completion parses (OpenAI reader) into the response's own fields."""
        chat, _ = make_chat(
            [
                StreamScript(
                    chat_chunk_events(["so: "], "tool_calls", usage=(4, 9), tool_calls=CALLS)
                )
            ]
        )
        streamed = await chat.stream(MESSAGES).response()
        assert streamed.raw["object"] == "chat.completion"
        again = parse_chat_response(streamed.raw)
        assert (again.text, again.tool_calls, again.finish_reason, again.usage) == (
            streamed.text,
            streamed.tool_calls,
            streamed.finish_reason,
            streamed.usage,
        )

    async def test_raw_of_an_anthropic_stream_has_the_openai_shape(self) -> None:
        """Whichever protocol served, raw has one shape: OpenAI's chat.completion."""
        claude = {"name": "claude", "protocol": "anthropic"}
        chat, _ = make_chat([StreamScript(anthropic_events("hi", []), done=False)], claude)
        streamed = await chat.stream(MESSAGES).response()
        assert streamed.raw["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
        assert streamed.raw["choices"][0]["finish_reason"] == "stop"
