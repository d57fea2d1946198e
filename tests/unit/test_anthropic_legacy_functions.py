"""OpenAI's legacy ``functions`` / ``function_call`` on the Anthropic Messages wire.

The request side: ``functions`` as tools (as a function tool is mapped),
``function_call`` as ``tool_choice`` (one call at most, as the legacy
protocol answers), the legacy follow-up turn as a ``tool_use`` and its
``tool_result`` under an id made from the call's position, and the
combinations OpenAI refuses refused unsent. The answer side: an answer to
``functions`` read back as OpenAI's legacy answer (``function_call`` type and
finish, no id), plain and streamed.
"""

from __future__ import annotations

from typing import Any

import pytest
from _anthropic_source import claude_source

from polygateway.models import ToolCall, ToolCallDelta
from polygateway.testing import TransientError
from polygateway.transport.anthropic import (
    MessagesStreamReader,
    answers_legacy_functions,
    messages_request,
    parse_messages_response,
    streamed_arguments,
)
from polygateway.transport.assembly import assemble_chat

ASK = [{"role": "user", "content": "weather in Paris"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TIME = {"name": "get_time"}


def _body(messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
    request = messages_request(claude_source(), messages, params, stream=False, timeout_s=30.0)
    body: dict[str, Any] = request.json
    return body


def _rejected(messages: list[dict[str, Any]], **params: Any) -> str:
    with pytest.raises(TransientError) as info:
        messages_request(claude_source(), messages, params, stream=False, timeout_s=30.0)
    assert info.value.failure == "request_rejected"
    return str(info.value)


class TestRequest:
    def test_functions_are_tools_mapped_as_function_tools_are(self) -> None:
        """Each function is the tool its ``{"type": "function"}`` tool would be."""
        legacy = _body(ASK, functions=[WEATHER, TIME])
        tools = _body(ASK, tools=[{"type": "function", "function": f} for f in (WEATHER, TIME)])
        assert legacy["tools"] == tools["tools"]
        assert legacy["tools"] == [
            {
                "name": "get_weather",
                "description": "The weather in a city",
                "input_schema": WEATHER["parameters"],
            },
            {"name": "get_time", "input_schema": {"type": "object", "properties": {}}},
        ]
        assert "functions" not in legacy
        assert "function_call" not in legacy

    @pytest.mark.parametrize(
        ("choice", "expected"),
        [
            (None, {"type": "auto", "disable_parallel_tool_use": True}),
            ("auto", {"type": "auto", "disable_parallel_tool_use": True}),
            ("none", {"type": "none"}),
            (
                {"name": "get_time"},
                {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True},
            ),
        ],
    )
    def test_function_call_is_a_tool_choice_of_one_call_at_most(
        self, choice: Any, expected: dict[str, Any]
    ) -> None:
        """auto, none or a name; a legacy answer holds one ``function_call``, so no parallel."""
        body = _body(ASK, functions=[WEATHER, TIME], function_call=choice)
        assert body["tool_choice"] == expected

    def test_parallel_tool_calls_false_beside_functions_keeps_one_flag(self) -> None:
        """The caller's ``parallel_tool_calls=False`` says what the mapping already says."""
        body = _body(ASK, functions=[WEATHER], parallel_tool_calls=False)
        assert body["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}

    @pytest.mark.parametrize(
        ("params", "fragment"),
        [
            ({"functions": "get_weather"}, "functions is not a list"),
            ({"functions": [{"description": "nameless"}]}, "functions[0] has no name"),
            ({"functions": [WEATHER], "function_call": "required"}, "function_call"),
            ({"functions": [WEATHER], "function_call": {"fn": "x"}}, "function_call"),
        ],
    )
    def test_what_openai_refuses_is_refused_unsent(
        self, params: dict[str, Any], fragment: str
    ) -> None:
        """Legacy parameters the Messages API cannot carry: the request's fault.

        What OpenAI itself refuses (legacy beside new parameters, an empty list)
        the chat client refuses before the wire: ``test_params_legacy_functions.py``.
        """
        assert fragment in _rejected(ASK, **params)

    def test_the_legacy_turn_is_a_tool_use_and_its_result(self) -> None:
        """The ``function_call`` and the ``function`` message share an id made from the position."""
        body = _body(
            [
                *ASK,
                {
                    "role": "assistant",
                    "content": None,
                    "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"role": "function", "name": "get_weather", "content": "sunny, 21 C"},
                {"role": "user", "content": "and the time?"},
                {
                    "role": "assistant",
                    "content": "Checking.",
                    "function_call": {"name": "get_time", "arguments": ""},
                },
                {"role": "function", "name": "get_time", "content": None},
            ],
            functions=[WEATHER, TIME],
        )
        assert body["messages"] == [
            {"role": "user", "content": "weather in Paris"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "function_call_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "function_call_1",
                        "content": "sunny, 21 C",
                    },
                    {"type": "text", "text": "and the time?"},
                ],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "function_call_4", "name": "get_time", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "function_call_4"}],
            },
        ]

    def test_the_same_conversation_gets_the_same_ids(self) -> None:
        """Ids depend on positions only: a resent conversation is the same request."""
        turn = [
            *ASK,
            {"role": "assistant", "function_call": {"name": "get_weather", "arguments": "{}"}},
            {"role": "function", "name": "get_weather", "content": "sunny"},
        ]
        assert _body(turn) == _body(list(turn))

    @pytest.mark.parametrize(
        ("messages", "fragment"),
        [
            (
                [*ASK, {"role": "function", "name": "get_weather", "content": "sunny"}],
                "no assistant function_call before it",
            ),
            (
                [
                    *ASK,
                    {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
                    {"role": "function", "name": "f", "content": "one"},
                    {"role": "function", "name": "f", "content": "two"},
                ],
                "no assistant function_call before it",
            ),
            (
                [*ASK, {"role": "assistant", "function_call": {"name": "f", "arguments": "[1]"}}],
                "function_call.arguments is not a JSON object",
            ),
            (
                [*ASK, {"role": "assistant", "function_call": {"arguments": "{}"}}],
                "function_call has no name",
            ),
        ],
    )
    def test_legacy_turns_the_api_cannot_pair_are_refused(
        self, messages: list[dict[str, Any]], fragment: str
    ) -> None:
        """A result answering no call, or a call without a name or object arguments."""
        assert fragment in _rejected(messages)

    def test_only_a_call_offering_functions_answers_legacy(self) -> None:
        """``functions`` set: the answer reads back as a legacy one; tools or nothing: not."""
        assert answers_legacy_functions({"functions": [WEATHER]})
        assert not answers_legacy_functions({"functions": None})
        assert not answers_legacy_functions({"tools": [{"type": "function", "function": WEATHER}]})


def _tool_use_message() -> dict[str, Any]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": [
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "X"}}
        ],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 10, "output_tokens": 8},
    }


TOOL_STREAM: list[dict[str, Any]] = [
    {"type": "message_start", "message": {"usage": {"input_tokens": 10, "output_tokens": 1}}},
    {"type": "ping"},
    {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {}},
    },
    {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "input_json_delta", "partial_json": ""},
    },
    {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "input_json_delta", "partial_json": '{"city":'},
    },
    {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "input_json_delta", "partial_json": ' "X"}'},
    },
    {"type": "content_block_stop", "index": 0},
    {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 8}},
    {"type": "message_stop"},
]


class TestAnswer:
    def test_a_tool_use_answering_functions_is_a_legacy_call(self) -> None:
        """Type and finish ``function_call``, no id: what an OpenAI source answers."""
        parsed = parse_messages_response(_tool_use_message(), legacy=True)
        assert parsed.tool_calls == (
            ToolCall(id="", name="get_weather", arguments='{"city": "X"}', type="function_call"),
        )
        assert parsed.finish_reason == "function_call"
        assert parsed.choices[0].tool_calls == parsed.tool_calls
        assert parsed.choices[0].finish_reason == "function_call"

    def test_a_tool_use_answering_tools_is_unchanged(self) -> None:
        """Without ``legacy`` the answer is a tool call with Anthropic's id, as before."""
        parsed = parse_messages_response(_tool_use_message())
        assert parsed.tool_calls == (
            ToolCall(id="toolu_01", name="get_weather", arguments='{"city": "X"}'),
        )
        assert parsed.finish_reason == "tool_calls"

    def test_a_text_answer_to_functions_finishes_as_stop(self) -> None:
        """Only a call's stop reason is the legacy one: text ends in ``stop``."""
        body = {**_tool_use_message(), "content": [{"type": "text", "text": "hi"}]}
        body["stop_reason"] = "end_turn"
        assert parse_messages_response(body, legacy=True).finish_reason == "stop"

    def test_a_streamed_legacy_answer_reads_as_the_plain_one(self) -> None:
        """Every piece typed ``function_call``, no id; assembled, the plain call and finish."""
        reader = MessagesStreamReader(legacy=True)
        chunks = [reader.read(event, "claude") for event in TOOL_STREAM]
        deltas = [d for c in chunks for d in c.tool_calls]
        assert deltas == [
            ToolCallDelta(0, name="get_weather", arguments="", type="function_call"),
            ToolCallDelta(0, arguments="", type="function_call"),
            ToolCallDelta(0, arguments='{"city":', type="function_call"),
            ToolCallDelta(0, arguments=' "X"}', type="function_call"),
        ]
        streamed = assemble_chat(chunks, arguments=streamed_arguments)
        plain = parse_messages_response(_tool_use_message(), legacy=True)
        assert streamed.tool_calls == plain.tool_calls
        assert streamed.finish_reason == plain.finish_reason == "function_call"
        assert streamed.usage == plain.usage
        message = streamed.raw["choices"][0]["message"]
        assert message["function_call"] == {"name": "get_weather", "arguments": '{"city": "X"}'}
        assert "tool_calls" not in message

    def test_a_stream_answering_tools_keeps_its_ids(self) -> None:
        """Without ``legacy`` the stream is read as before: Anthropic's id, untyped pieces."""
        reader = MessagesStreamReader()
        deltas = [d for e in TOOL_STREAM for d in reader.read(e, "claude").tool_calls]
        assert deltas[0] == ToolCallDelta(0, id="toolu_01", name="get_weather", arguments="")
        assert {d.type for d in deltas} == {None}
