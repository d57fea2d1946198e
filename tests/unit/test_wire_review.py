"""Provider wire shapes checked against the providers' own documentation and SDKs.

Each test pins one shape a real provider sends (or is documented to send)
that the wire adapters must read without losing or misreading anything.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from _closing import closing

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import StreamInterrupted
from polygateway.models import ChatChunk, ToolCall, Usage
from polygateway.testing import (
    BoundedSleep,
    FakeClock,
    FakeTransport,
    StreamScript,
    WithHeaders,
    chat_completion,
    gateway_settings,
)
from polygateway.transport.anthropic import MessagesStreamReader, messages_request
from polygateway.transport.hints import ServerHint, read_hint

MESSAGES = [{"role": "user", "content": "What is new in quantum computing?"}]


def _anthropic_chat(clock: FakeClock, script: Any) -> tuple[ChatClient, MemoryBackend]:
    """A chat client with one Anthropic source over a FakeTransport on a fake clock."""
    return _chat(clock, script, {"name": "claude", "protocol": "anthropic"})


def _openai_chat(clock: FakeClock, script: Any) -> tuple[ChatClient, MemoryBackend]:
    """A chat client with one OpenAI source over a FakeTransport on a fake clock."""
    return _chat(clock, script, {"name": "gpt", "protocol": "openai"})


def _chat(
    clock: FakeClock, script: Any, source: dict[str, Any]
) -> tuple[ChatClient, MemoryBackend]:
    """A chat client with the one ``source`` over a FakeTransport on a fake clock."""
    settings = gateway_settings(source)
    backend = MemoryBackend(now=clock)
    chat = closing(
        ChatClient(
            settings,
            backend=backend,
            transport=FakeTransport(script, clock=clock),
            now=clock,
            sleep=BoundedSleep(clock),
            rng=random.Random(3),
        )
    )
    return chat, backend


# The streaming example of Anthropic's web search tool page (server tools stream their
# input as input_json_delta on a server_tool_use block), completed into a whole answer.
WEB_SEARCH_STREAM: list[dict[str, Any]] = [
    {
        "type": "message_start",
        "message": {
            "id": "msg_abc123",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": "claude-test",
            "stop_reason": None,
            "usage": {"input_tokens": 20, "output_tokens": 1},
        },
    },
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "Let me search. "},
    },
    {"type": "content_block_stop", "index": 0},
    {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "server_tool_use", "id": "srvtoolu_xyz789", "name": "web_search"},
    },
    {
        "type": "content_block_delta",
        "index": 1,
        "delta": {
            "type": "input_json_delta",
            "partial_json": '{"query":"latest quantum computing breakthroughs 2025"}',
        },
    },
    {"type": "content_block_stop", "index": 1},
    {
        "type": "content_block_start",
        "index": 2,
        "content_block": {
            "type": "web_search_tool_result",
            "tool_use_id": "srvtoolu_xyz789",
            "content": [
                {
                    "type": "web_search_result",
                    "title": "Quantum Computing Breakthroughs in 2025",
                    "url": "https://example.com",
                }
            ],
        },
    },
    {"type": "content_block_stop", "index": 2},
    {"type": "content_block_start", "index": 3, "content_block": {"type": "text", "text": ""}},
    {
        "type": "content_block_delta",
        "index": 3,
        "delta": {"type": "text_delta", "text": "Error-corrected qubits."},
    },
    {"type": "content_block_stop", "index": 3},
    {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 40, "server_tool_use": {"web_search_requests": 1}},
    },
    {"type": "message_stop"},
]


class TestAnthropicServerTools:
    """Server tools (web search, web fetch, code execution) run at Anthropic, inside the stream."""

    def test_reader_skips_the_input_of_a_server_tool_use_block(self) -> None:
        """A server_tool_use block's input_json_delta is no client tool call and no fault."""
        reader = MessagesStreamReader()
        chunks = [reader.read(event, "claude") for event in WEB_SEARCH_STREAM]
        assert "".join(c.text for c in chunks) == "Let me search. Error-corrected qubits."
        assert [d for c in chunks for d in c.tool_calls] == []
        assert chunks[-2].finish_reason == "stop"
        assert chunks[-2].usage == Usage(20, 40, 60)

    async def test_stream_with_a_server_tool_delivers_the_whole_answer(self) -> None:
        """A streamed answer that used web search reaches the caller whole, as one success."""
        clock = FakeClock()
        chat, backend = _anthropic_chat(clock, [StreamScript(WEB_SEARCH_STREAM, done=False)])
        async with chat.stream(
            MESSAGES, extra_body={"tools": [{"type": "web_search_20250305", "name": "web_search"}]}
        ) as stream:
            chunks = [c async for c in stream]
            final = await stream.response()
        assert "".join(c.text for c in chunks) == "Let me search. Error-corrected qubits."
        assert final.text == "Let me search. Error-corrected qubits."
        assert final.tool_calls == ()
        assert final.finish_reason == "stop"
        assert [a.outcome for a in final.attempts] == ["success"]
        assert (await backend.snapshot("chat")).in_flight == 0


# A completion of a GPT-5 model called with a custom (free-form) tool: the tool call carries
# ``custom: {name, input}`` in place of ``function`` (openai-python's
# ChatCompletionMessageCustomToolCall), and the input is plain text, not JSON.
CUSTOM_TOOL_COMPLETION: dict[str, Any] = {
    "id": "chatcmpl-custom",
    "object": "chat.completion",
    "model": "gpt-5",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "tool_calls": [
                    {
                        "id": "call_abc",
                        "type": "custom",
                        "custom": {"name": "code_exec", "input": "print('hello world')"},
                    }
                ],
            },
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52},
}


class TestOpenAICustomToolCalls:
    """Custom tools answer with ``custom: {name, input}`` tool calls, not ``function`` ones."""

    async def test_complete_reads_a_custom_tool_call(self) -> None:
        """A custom tool call is read as the call it is, in one successful attempt."""
        clock = FakeClock()
        chat, backend = _openai_chat(clock, [CUSTOM_TOOL_COMPLETION])
        tools = [{"type": "custom", "custom": {"name": "code_exec"}}]
        response = await chat.complete(MESSAGES, tools=tools)
        assert response.tool_calls == (
            ToolCall(
                id="call_abc", name="code_exec", arguments="print('hello world')", type="custom"
            ),
        )
        assert response.finish_reason == "tool_calls"
        assert [a.outcome for a in response.attempts] == ["success"]
        assert (await backend.snapshot("chat")).in_flight == 0


WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


def _messages_body(**params: Any) -> dict[str, Any]:
    """The Messages API body an Anthropic source is sent for ``params``."""
    source = gateway_settings({"name": "claude", "protocol": "anthropic"}).scopes["chat"].sources[0]
    body: dict[str, Any] = messages_request(
        source, MESSAGES, params, stream=False, timeout_s=30.0
    ).json
    return body


class TestAnthropicParallelToolCalls:
    """``parallel_tool_calls`` in Anthropic's words: ``tool_choice.disable_parallel_tool_use``.

    The Messages API refuses a top-level field it does not know (400 "Extra
    inputs are not permitted"), so the OpenAI name must never be sent as is.
    """

    @pytest.mark.parametrize(
        ("tool_choice", "expected"),
        [
            (None, {"type": "auto", "disable_parallel_tool_use": True}),
            ("auto", {"type": "auto", "disable_parallel_tool_use": True}),
            ("required", {"type": "any", "disable_parallel_tool_use": True}),
            (
                {"type": "function", "function": {"name": "get_weather"}},
                {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            ),
            ("none", {"type": "none"}),
        ],
    )
    def test_parallel_tool_calls_false_disables_parallel_tool_use(
        self, tool_choice: Any, expected: dict[str, Any]
    ) -> None:
        """False asks for one tool call at most; tool_choice none takes no such flag."""
        body = _messages_body(
            tools=[WEATHER_TOOL], tool_choice=tool_choice, parallel_tool_calls=False
        )
        assert "parallel_tool_calls" not in body
        assert body["tool_choice"] == expected

    def test_parallel_tool_calls_true_or_without_tools_is_not_sent(self) -> None:
        """True is the Messages API's default, and without tools there is nothing to limit."""
        allowed = _messages_body(tools=[WEATHER_TOOL], parallel_tool_calls=True)
        assert "parallel_tool_calls" not in allowed
        assert "tool_choice" not in allowed
        toolless = _messages_body(parallel_tool_calls=False)
        assert "parallel_tool_calls" not in toolless
        assert "tool_choice" not in toolless


class TestUnreadableLimitHeaders:
    """A limit header no number can hold is ignored, as any unreadable one is, never a crash."""

    @pytest.mark.parametrize("digits", [400, 5000])
    def test_a_remaining_count_too_long_to_read_is_ignored(self, digits: int) -> None:
        """Past a float's range, or past Python's int-from-text limit: the header is skipped."""
        headers = {"x-ratelimit-remaining-requests": "9" * digits, "retry-after": "2"}
        assert read_hint(headers, 0.0) == ServerHint(retry_after_s=2.0)

    async def test_an_answer_with_such_a_header_is_still_served(self) -> None:
        """The answer the header came with reaches the caller."""
        clock = FakeClock()
        answer = WithHeaders({"x-ratelimit-remaining-tokens": "9" * 400}, chat_completion("hi"))
        chat, _ = _openai_chat(clock, [answer])
        response = await chat.complete(MESSAGES)
        assert response.text == "hi"
        assert [a.outcome for a in response.attempts] == ["success"]


def _openai_chunk(content: str, finish_reason: str | None) -> dict[str, Any]:
    """An OpenAI-compatible chunk of ``content`` with the given ``finish_reason``."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "mistral:latest",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish_reason}],
    }


async def _read_stream(chat: ChatClient, into: list[ChatChunk]) -> None:
    """Stream ``MESSAGES`` from ``chat``, appending each chunk to ``into`` as it comes."""
    async with chat.stream(MESSAGES) as stream:
        async for chunk in stream:
            into.append(chunk)


class TestEmptyFinishReason:
    """An empty ``finish_reason`` (older Ollama sends ``""`` on every chunk) is no finish reason."""

    async def test_stream_cut_after_empty_finish_reasons_is_interrupted(self) -> None:
        """A stream cut before its real finish is a failure, not a whole answer."""
        clock = FakeClock()
        events = [_openai_chunk("Hello", ""), _openai_chunk(" there", "")]
        chat, backend = _openai_chat(clock, [StreamScript(events, done=False)])
        chunks: list[ChatChunk] = []
        with pytest.raises(StreamInterrupted):
            await _read_stream(chat, chunks)
        assert [c.text for c in chunks] == ["Hello", " there"]
        assert [c.finish_reason for c in chunks] == [None, None]
        assert (await backend.snapshot("chat")).in_flight == 0

    async def test_stream_ends_on_its_real_finish_reason(self) -> None:
        """The chunk with a real reason finishes the answer, whatever came before."""
        clock = FakeClock()
        events = [_openai_chunk("Hello", ""), _openai_chunk("", "stop")]
        chat, _ = _openai_chat(clock, [StreamScript(events)])
        async with chat.stream(MESSAGES) as stream:
            chunks = [c async for c in stream]
            final = await stream.response()
        assert [c.finish_reason for c in chunks] == [None, "stop"]
        assert final.finish_reason == "stop"

    async def test_completion_with_an_empty_finish_reason_has_none(self) -> None:
        """complete() reads an empty reason as a stream's response() does: as none."""
        clock = FakeClock()
        chat, _ = _openai_chat(clock, [chat_completion("hi", finish_reason="")])
        response = await chat.complete(MESSAGES)
        assert response.finish_reason is None
        assert response.choices[0].finish_reason is None
