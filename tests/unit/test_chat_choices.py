"""n > 1: every choice of a completion on r.choices, r.text the first; Anthropic answers one."""

from __future__ import annotations

import random
from typing import Any

import pytest
from _closing import closing

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.models import Choice, ToolCall
from polygateway.testing import (
    BoundedSleep,
    FakeClock,
    FakeTransport,
    TransientError,
    chat_completion,
    gateway_settings,
)
from polygateway.transport.anthropic import parse_messages_response
from polygateway.transport.openai import _walk_chat_response, parse_chat_response

MESSAGES = [{"role": "user", "content": "name a colour"}]


def two_choices() -> dict[str, Any]:
    """A completion answering n=2: a text, then a tool call."""
    body = chat_completion("red", prompt_tokens=4, completion_tokens=6)
    body["choices"].append(
        {
            "index": 1,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_9",
                        "type": "function",
                        "function": {"name": "pick", "arguments": '{"c": "blue"}'},
                    }
                ],
            },
            "finish_reason": "tool_calls",
        }
    )
    return body


def make_chat(script: Any, *sources: Any) -> tuple[ChatClient, FakeTransport]:
    clock = FakeClock()
    transport = FakeTransport(script, clock=clock)
    chat = closing(
        ChatClient(
            gateway_settings(*(sources or ("primary",))),
            backend=MemoryBackend(now=clock),
            transport=transport,
            now=clock,
            sleep=BoundedSleep(clock),
            rng=random.Random(2),
        )
    )
    return chat, transport


class TestOpenAIWire:
    """Both readers of a completion give every choice; the fast one only ever takes n = 1."""

    def test_two_choices_are_read_in_order(self) -> None:
        """Each choice's index, text, tool calls and finish reason; the first is the answer's."""
        parsed = parse_chat_response(two_choices())
        assert parsed.choices == (
            Choice(0, "red", (), "stop"),
            Choice(1, "", (ToolCall("call_9", "pick", '{"c": "blue"}'),), "tool_calls"),
        )
        assert (parsed.text, parsed.tool_calls, parsed.finish_reason) == ("red", (), "stop")

    def test_one_choice_reads_the_same_directly_or_walked(self) -> None:
        """The fast path's one choice equals the walk's."""
        body = chat_completion("hi")
        assert parse_chat_response(body) == _walk_chat_response(body)
        assert parse_chat_response(body).choices == (Choice(0, "hi", (), "stop"),)

    def test_index_is_the_one_sent_or_the_position(self) -> None:
        """An index the provider sends is kept; a missing or odd one is the choice's position."""
        body = two_choices()
        body["choices"][0]["index"] = 7
        del body["choices"][1]["index"]
        assert [c.index for c in parse_chat_response(body).choices] == [7, 1]
        body["choices"][1]["index"] = "1"
        assert [c.index for c in parse_chat_response(body).choices] == [7, 1]

    def test_a_malformed_later_choice_is_a_malformed_body(self) -> None:
        """Every choice is read now: a broken second one names itself."""
        body = two_choices()
        body["choices"][1]["message"] = "nope"
        with pytest.raises(TransientError, match=r"choices\[1\]\.message"):
            parse_chat_response(body)


def test_anthropic_answers_one_choice() -> None:
    """The Messages API has no n: its answer is one choice, the answer itself."""
    parsed = parse_messages_response(
        {
            "type": "message",
            "content": [{"type": "text", "text": "green"}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 1, "output_tokens": 1},
        }
    )
    assert parsed.choices == (Choice(0, "green", (), "stop"),)


class TestThroughTheClient:
    """r.choices on a ChatResponse; r.text stays the first choice."""

    async def test_n_two_gives_two_choices(self) -> None:
        """n=2 is sent; both choices come back, r.text/tool_calls/finish are the first's."""
        chat, transport = make_chat([two_choices()])
        r = await chat.complete(MESSAGES, n=2)
        assert transport.requests[0].json["n"] == 2
        assert len(r.choices) == 2
        assert r.text == r.choices[0].text == "red"
        assert r.finish_reason == "stop"
        assert r.choices[1].tool_calls[0].name == "pick"
        assert r.usage.completion_tokens == 6

    async def test_one_choice_by_default(self) -> None:
        """Without n, one choice equal to the answer's own fields."""
        chat, _ = make_chat([chat_completion("hi")])
        r = await chat.complete(MESSAGES)
        assert r.choices == (Choice(0, r.text, r.tool_calls, r.finish_reason),)
