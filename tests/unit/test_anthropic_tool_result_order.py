"""Tool results on the Anthropic wire land where the Messages API wants them.

The API answers 400 (``tool_use ids were found without tool_result blocks
immediately after``) unless every ``tool_use`` block of an assistant turn is
answered by a ``tool_result`` block in the user turn right after it, and it
wants those results first in that turn, before any text. An OpenAI
conversation may hold a user message between an assistant's tool (or legacy
function) call and the message with its result; the mapping moves the result
into the first user turn after its call, ahead of that turn's other content,
losing, duplicating and re-pairing nothing.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from _anthropic_source import claude_source

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.testing import TransientError, gateway_settings
from polygateway.transport.anthropic import messages_request
from polygateway.transport.httpx_client import HttpxTransport

ASK = {"role": "user", "content": "weather in Paris"}
HURRY = {"role": "user", "content": "also, hurry"}


def _blocks(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _assert_anthropic_accepts(turns: list[dict[str, Any]]) -> None:
    """The Messages API's rule: each turn's tool_use ids answered first in the next user turn."""
    for i, turn in enumerate(turns):
        blocks = _blocks(turn["content"])
        kinds = [b.get("type") for b in blocks]
        results = kinds.count("tool_result")
        assert kinds[:results] == ["tool_result"] * results, f"turn {i}: results not first"
        uses = [b["id"] for b in blocks if b.get("type") == "tool_use"]
        if not uses:
            continue
        assert turn["role"] == "assistant"
        assert i + 1 < len(turns), f"turn {i}: tool_use ids {uses} with no turn after"
        after = _blocks(turns[i + 1]["content"])
        answered = [b["tool_use_id"] for b in after if b.get("type") == "tool_result"]
        assert sorted(answered) == sorted(uses), f"turn {i}: {uses} answered by {answered}"


def _body(messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
    request = messages_request(claude_source(), messages, params, stream=False, timeout_s=30.0)
    body: dict[str, Any] = request.json
    _assert_anthropic_accepts(body["messages"])
    return body


def _call(role: str, *names: str) -> dict[str, Any]:
    """An assistant calling ``names``: tool calls ``call_<name>``, or one legacy function call."""
    if role == "function":
        (name,) = names
        return {"role": "assistant", "content": None, "function_call": {"name": name}}
    calls = [
        {"id": f"call_{n}", "type": "function", "function": {"name": n, "arguments": "{}"}}
        for n in names
    ]
    return {"role": "assistant", "content": None, "tool_calls": calls}


def _result(role: str, name: str, content: str) -> dict[str, Any]:
    """The ``tool`` (or legacy ``function``) message answering the call of ``name``."""
    if role == "function":
        return {"role": "function", "name": name, "content": content}
    return {"role": "tool", "tool_call_id": f"call_{name}", "content": content}


def _use(call_id: str, name: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": {}}


def _answer(call_id: str, content: str) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": call_id, "content": content}


def _text(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


ROLES = pytest.mark.parametrize(
    ("role", "call_id"), [("tool", "call_weather"), ("function", "function_call_1")]
)
"""Each test marked so runs with a modern tool call and with a legacy function call."""


@ROLES
def test_a_user_turn_between_a_call_and_its_result_follows_the_result(
    role: str, call_id: str
) -> None:
    """[user, call, user, result]: one user turn after the tool_use, the result first."""
    body = _body([ASK, _call(role, "weather"), HURRY, _result(role, "weather", "sunny")])
    assert body["messages"] == [
        {"role": "user", "content": "weather in Paris"},
        {"role": "assistant", "content": [_use(call_id, "weather")]},
        {"role": "user", "content": [_answer(call_id, "sunny"), _text("also, hurry")]},
    ]


@ROLES
def test_a_result_after_two_user_messages_goes_before_both(role: str, call_id: str) -> None:
    """Two user messages between the call and its result keep their order after the result."""
    body = _body(
        [
            ASK,
            _call(role, "weather"),
            HURRY,
            {"role": "user", "content": [_text("in celsius")]},
            _result(role, "weather", "sunny"),
        ]
    )
    assert body["messages"][2] == {
        "role": "user",
        "content": [_answer(call_id, "sunny"), _text("also, hurry"), _text("in celsius")],
    }
    assert len(body["messages"]) == 3


def test_several_results_around_a_user_turn_all_go_first_in_their_order() -> None:
    """Results before and after an interjection: all of them first, in the order they came."""
    body = _body(
        [
            ASK,
            _call("tool", "weather", "time", "tide"),
            _result("tool", "time", "9:00"),
            HURRY,
            _result("tool", "tide", "low"),
            _result("tool", "weather", "sunny"),
        ]
    )
    assert body["messages"][2] == {
        "role": "user",
        "content": [
            _answer("call_time", "9:00"),
            _answer("call_tide", "low"),
            _answer("call_weather", "sunny"),
            _text("also, hurry"),
        ],
    }
    assert len(body["messages"]) == 3


def test_each_result_goes_to_the_turn_after_its_own_call() -> None:
    """Two rounds of calls, each answered late: each result after its own tool_use turn."""
    body = _body(
        [
            ASK,
            _call("tool", "weather"),
            HURRY,
            _result("tool", "weather", "sunny"),
            {"role": "assistant", "content": "Sunny. Checking the time."},
            _call("tool", "time"),
            {"role": "user", "content": "quickly"},
            _result("tool", "time", "9:00"),
        ]
    )
    assert body["messages"][1:] == [
        {"role": "assistant", "content": [_use("call_weather", "weather")]},
        {"role": "user", "content": [_answer("call_weather", "sunny"), _text("also, hurry")]},
        {
            "role": "assistant",
            "content": [_text("Sunny. Checking the time."), _use("call_time", "time")],
        },
        {"role": "user", "content": [_answer("call_time", "9:00"), _text("quickly")]},
    ]


def test_two_legacy_calls_each_answered_after_a_user_turn() -> None:
    """Legacy turns: each function result pairs with its own call's id, ahead of the text."""
    body = _body(
        [
            ASK,
            _call("function", "weather"),
            HURRY,
            _result("function", "weather", "sunny"),
            _call("function", "time"),
            {"role": "user", "content": "quickly"},
            _result("function", "time", "9:00"),
        ]
    )
    assert body["messages"][1:] == [
        {"role": "assistant", "content": [_use("function_call_1", "weather")]},
        {
            "role": "user",
            "content": [_answer("function_call_1", "sunny"), _text("also, hurry")],
        },
        {"role": "assistant", "content": [_use("function_call_4", "time")]},
        {"role": "user", "content": [_answer("function_call_4", "9:00"), _text("quickly")]},
    ]


def test_a_result_after_a_later_assistant_turn_moves_back_to_its_call() -> None:
    """A result sent after a later assistant message still answers right after its tool_use."""
    body = _body(
        [
            ASK,
            _call("tool", "weather"),
            HURRY,
            {"role": "assistant", "content": "Still waiting."},
            _result("tool", "weather", "sunny"),
        ]
    )
    assert body["messages"][1:] == [
        {"role": "assistant", "content": [_use("call_weather", "weather")]},
        {"role": "user", "content": [_answer("call_weather", "sunny"), _text("also, hurry")]},
        {"role": "assistant", "content": "Still waiting."},
    ]


@ROLES
def test_results_already_in_place_are_unchanged(role: str, call_id: str) -> None:
    """[user, call, result, user]: the mapping as before, the result first then the text."""
    body = _body([ASK, _call(role, "weather"), _result(role, "weather", "sunny"), HURRY])
    assert body["messages"] == [
        {"role": "user", "content": "weather in Paris"},
        {"role": "assistant", "content": [_use(call_id, "weather")]},
        {"role": "user", "content": [_answer(call_id, "sunny"), _text("also, hurry")]},
    ]


def test_parallel_results_already_in_place_are_unchanged() -> None:
    """Results right after their calls, in any order, stay in that order; nothing else moves."""
    body = _body(
        [
            ASK,
            _call("tool", "weather", "time"),
            _result("tool", "time", "9:00"),
            _result("tool", "weather", "sunny"),
        ]
    )
    assert body["messages"][1:] == [
        {
            "role": "assistant",
            "content": [_use("call_weather", "weather"), _use("call_time", "time")],
        },
        {
            "role": "user",
            "content": [_answer("call_time", "9:00"), _answer("call_weather", "sunny")],
        },
    ]


def test_a_tool_result_answering_no_call_stays_where_it_stands() -> None:
    """A tool_call_id no call made: the result is mapped in place, as before; the API judges it."""
    request = messages_request(
        claude_source(), [ASK, _result("tool", "nothing", "x")], {}, stream=False, timeout_s=30.0
    )
    assert request.json["messages"] == [
        {"role": "user", "content": [_text("weather in Paris"), _answer("call_nothing", "x")]}
    ]


def test_a_function_result_answering_no_call_is_still_refused() -> None:
    """A function message with no function_call before it: request_rejected, as before."""
    with pytest.raises(TransientError) as info:
        messages_request(
            claude_source(),
            [ASK, HURRY, _result("function", "weather", "x")],
            {},
            stream=False,
            timeout_s=30.0,
        )
    assert info.value.failure == "request_rejected"
    assert "no assistant function_call before it" in str(info.value)


async def test_the_body_sent_over_http_answers_the_call_first() -> None:
    """Through the chat client and HttpxTransport: the bytes sent carry the result first."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            200,
            json={
                "id": "msg_01",
                "type": "message",
                "role": "assistant",
                "model": "claude-test",
                "content": [_text("Sunny.")],
                "stop_reason": "end_turn",
                "usage": {"input_tokens": 5, "output_tokens": 2},
            },
        )

    settings = gateway_settings({"name": "claude", "protocol": "anthropic"})
    transport = HttpxTransport(
        settings.scope("chat").sources,
        max_connections=2,
        mock_transport=httpx.MockTransport(handle),
    )
    async with ChatClient(settings, transport=transport, backend=MemoryBackend()) as chat:
        answer = await chat.complete(
            [ASK, _call("tool", "weather"), HURRY, _result("tool", "weather", "sunny")]
        )
    await transport.aclose()
    assert answer.text == "Sunny."
    sent = json.loads(seen[0].content)["messages"]
    _assert_anthropic_accepts(sent)
    assert sent[2] == {
        "role": "user",
        "content": [_answer("call_weather", "sunny"), _text("also, hurry")],
    }
