"""A legacy ``function_call`` answer (the request's ``functions``), plain and streamed.

OpenAI's deprecated function calling, still served by OpenAI and by the
servers that copy its API, answers ``message.function_call = {name,
arguments}``, or streams ``delta.function_call`` pieces (openai-python's
``ChoiceDeltaFunctionCall``: a name, then argument fragments), with
``finish_reason`` ``function_call``. It is read as a tool call of type
``function_call`` (no id: the legacy protocol has none), in both paths alike.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from _closing import closing

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.models import ChatResponse, ToolCall, ToolCallDelta
from polygateway.testing import (
    BoundedSleep,
    FakeClock,
    FakeTransport,
    StreamScript,
    gateway_settings,
)
from polygateway.transport.assembly import assemble_chat
from polygateway.transport.openai import (
    ChatChunkReader,
    chunk_has_content,
    parse_chat_chunk,
    parse_chat_response,
)

MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]
FUNCTIONS = [
    {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
ARGUMENTS = '{"city": "Paris"}'
CALL = ToolCall(id="", name="get_weather", arguments=ARGUMENTS, type="function_call")


def legacy_completion() -> dict[str, Any]:
    """A non-streamed answer to a request with ``functions``, as OpenAI sends it."""
    return {
        "id": "chatcmpl-legacy",
        "object": "chat.completion",
        "model": "gpt-3.5-turbo-0613",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "function_call": {"name": "get_weather", "arguments": ARGUMENTS},
                },
                "finish_reason": "function_call",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16},
    }


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-legacy",
        "object": "chat.completion.chunk",
        "model": "gpt-3.5-turbo-0613",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def legacy_chunks() -> list[dict[str, Any]]:
    """The same answer streamed: role and name, then the arguments in pieces, then finish."""
    return [
        _chunk(
            {
                "role": "assistant",
                "content": None,
                "function_call": {"name": "get_weather", "arguments": ""},
            }
        ),
        _chunk({"function_call": {"arguments": '{"ci'}}),
        _chunk({"function_call": {"arguments": 'ty": "Paris"}'}}),
        _chunk({}, "function_call"),
        {
            "id": "chatcmpl-legacy",
            "object": "chat.completion.chunk",
            "choices": [],
            "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16},
        },
    ]


def make_chat(script: Any) -> ChatClient:
    """A chat client on a fake clock over ``script``, one OpenAI source."""
    clock = FakeClock()
    return closing(
        ChatClient(
            gateway_settings("primary"),
            backend=MemoryBackend(now=clock),
            transport=FakeTransport(script, clock=clock),
            now=clock,
            sleep=BoundedSleep(clock),
            rng=random.Random(3),
        )
    )


def answer(response: ChatResponse[Any]) -> ChatResponse[Any]:
    """A response without what differs between two calls by nature: attempts, raw."""
    return dataclasses.replace(response, attempts=(), raw={})


def test_completion_reads_the_function_call_as_a_tool_call() -> None:
    """``message.function_call`` is the answer's one tool call, typed ``function_call``."""
    parsed = parse_chat_response(legacy_completion())
    assert parsed.tool_calls == (CALL,)
    assert parsed.choices[0].tool_calls == (CALL,)
    assert parsed.finish_reason == "function_call"
    assert parsed.text == ""


def test_chunks_read_the_function_call_pieces_as_deltas_of_call_zero() -> None:
    """Each ``delta.function_call`` piece is a delta of call 0: the name first, then arguments."""
    reader = ChatChunkReader()
    chunks = [reader.read(event) for event in legacy_chunks()]
    assert chunks[0].tool_calls == (
        ToolCallDelta(index=0, name="get_weather", arguments="", type="function_call"),
    )
    assert chunks[1].tool_calls == (ToolCallDelta(index=0, arguments='{"ci', type="function_call"),)
    assert parse_chat_chunk(legacy_chunks()[2]).tool_calls == (
        ToolCallDelta(index=0, arguments='ty": "Paris"}', type="function_call"),
    )
    assert all(chunk_has_content(event) for event in legacy_chunks()[1:4])


def test_assembly_joins_the_pieces_into_the_completions_call() -> None:
    """The pieces join into the call ``parse_chat_response`` reads from the completion."""
    reader = ChatChunkReader()
    assembled = assemble_chat(reader.read(event) for event in legacy_chunks())
    assert assembled.tool_calls == parse_chat_response(legacy_completion()).tool_calls
    assert assembled.finish_reason == "function_call"


def test_assembled_raw_holds_the_function_call_where_the_completion_does() -> None:
    """``raw`` says ``message.function_call``, as the completion did, and reads back the same."""
    reader = ChatChunkReader()
    assembled = assemble_chat(reader.read(event) for event in legacy_chunks())
    message = assembled.raw["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": None,
        "function_call": {"name": "get_weather", "arguments": ARGUMENTS},
    }
    assert parse_chat_response(assembled.raw).tool_calls == (CALL,)


async def test_stream_yields_the_call_and_its_response_equals_complete() -> None:
    """Through ChatClient: the stream's chunks carry the call, response() equals complete()."""
    chat = make_chat([legacy_completion(), StreamScript(legacy_chunks())])
    completed = await chat.complete(MESSAGES, functions=FUNCTIONS)
    async with chat.stream(MESSAGES, functions=FUNCTIONS) as stream:
        chunks = [chunk async for chunk in stream]
        streamed = await stream.response()
    pieces = [d for chunk in chunks for d in chunk.tool_calls]
    assert "".join(d.arguments or "" for d in pieces) == ARGUMENTS
    assert {d.name for d in pieces} - {None} == {"get_weather"}
    assert completed.tool_calls == (CALL,)
    assert answer(streamed) == answer(completed)
