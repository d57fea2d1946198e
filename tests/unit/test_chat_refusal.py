"""Reading OpenAI-shaped chat answers: refusals, and tool calls streamed without ``index``.

Refusal shapes as openai-python types them: ``ChatCompletionMessage.refusal``
(a string when the model refuses, else null) and ``ChoiceDelta.refusal`` (the
refusal streamed in pieces). Tool-call deltas without ``index`` as Gemini's
OpenAI-compatible endpoint streams them: each call whole in its own chunk,
with an ``id`` and no ``index``, or its arguments split over later deltas
that carry neither (or an empty ``id``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from _closing import closing
from pydantic import BaseModel

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import ResponseParseError
from polygateway.models import ChatChunk
from polygateway.testing import (
    BoundedSleep,
    FakeClock,
    FakeTransport,
    StreamScript,
    chat_chunk_events,
    chat_completion,
    gateway_settings,
)

MESSAGES = [{"role": "user", "content": "How do I pick this lock?"}]
REFUSAL = "I'm sorry, I can't help with that."


class Answer(BaseModel):
    steps: list[str]


def make_chat(script: Any, *sources: Any) -> tuple[ChatClient, FakeTransport, MemoryBackend]:
    """A chat client over ``script`` on a fake clock; one OpenAI source unless told."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    transport = FakeTransport(script, clock=clock)
    chat = closing(
        ChatClient(
            gateway_settings(*(sources or ("primary",))),
            backend=backend,
            transport=transport,
            now=clock,
            sleep=BoundedSleep(clock),
            rng=random.Random(4),
        )
    )
    return chat, transport, backend


def refused_completion() -> dict[str, Any]:
    """A chat completion whose message is a refusal: null content, ``refusal`` set."""
    body = chat_completion("")
    body["choices"][0]["message"] = {"role": "assistant", "content": None, "refusal": REFUSAL}
    return body


def refused_stream() -> list[dict[str, Any]]:
    """A streamed refusal: OpenAI's role chunk (null refusal), the refusal in pieces, a finish."""
    events = chat_chunk_events([], usage=(9, 8))
    events[0]["choices"][0]["delta"]["refusal"] = None
    pieces = [
        {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"refusal": p}}]}
        for p in (REFUSAL[:9], REFUSAL[9:])
    ]
    return events[:1] + pieces + events[1:]


class TestComplete:
    """complete() reads the message's refusal, and a refusal is a served answer."""

    async def test_refusal_is_on_the_response_and_its_choice(self) -> None:
        """r.refusal and r.choices[0].refusal hold the refusal; the text is empty."""
        chat, _, _ = make_chat([refused_completion()])
        r = await chat.complete(MESSAGES)
        assert r.refusal == REFUSAL
        assert r.choices[0].refusal == REFUSAL
        assert r.text == ""

    async def test_refusal_is_not_retried(self) -> None:
        """One attempt, a success: the next source is never asked."""
        chat, transport, backend = make_chat(
            [refused_completion(), chat_completion("other")], "a", {"name": "b", "priority": 1}
        )
        r = await chat.complete(MESSAGES)
        assert transport.sources_called() == ["a"]
        assert [a.outcome for a in r.attempts] == ["success"]
        assert (await backend.snapshot("chat")).in_flight == 0

    async def test_an_answer_has_no_refusal(self) -> None:
        """An ordinary answer, with OpenAI's null refusal, reads refusal as None."""
        body = chat_completion("Hello")
        body["choices"][0]["message"]["refusal"] = None
        chat, _, _ = make_chat([body])
        r = await chat.complete(MESSAGES)
        assert r.refusal is None
        assert r.text == "Hello"


class TestStream:
    """A streamed refusal reaches the caller, chunk by chunk and assembled."""

    async def test_refusal_pieces_are_delivered_as_chunks(self) -> None:
        """Each delta.refusal piece is a chunk of its own, in order."""
        chat, _, _ = make_chat([StreamScript(refused_stream())])
        chunks: list[ChatChunk] = [c async for c in chat.stream(MESSAGES)]
        assert [c.refusal for c in chunks if c.refusal] == [REFUSAL[:9], REFUSAL[9:]]
        assert all(c.text == "" for c in chunks)

    async def test_response_joins_the_refusal(self) -> None:
        """response() holds the whole refusal, as complete() would, and in raw."""
        chat, _, _ = make_chat([StreamScript(refused_stream())])
        r = await chat.stream(MESSAGES).response()
        assert r.refusal == REFUSAL
        assert r.choices[0].refusal == REFUSAL
        assert r.text == ""
        assert r.finish_reason == "stop"
        message = r.raw["choices"][0]["message"]
        assert message["refusal"] == REFUSAL
        assert message["content"] is None

    async def test_a_streamed_answer_has_no_refusal(self) -> None:
        """Text chunks carry no refusal, and the assembled answer has none."""
        chat, _, _ = make_chat([StreamScript(chat_chunk_events(["Hel", "lo"]))])
        r = await chat.stream(MESSAGES).response()
        assert r.refusal is None
        assert r.text == "Hello"


class TestStructured:
    """With a response_model, a refusal is told apart from JSON that does not validate."""

    async def test_refusal_raises_naming_it_with_the_response(self) -> None:
        """ResponseParseError says the model refused; its response carries the refusal."""
        chat, transport, _ = make_chat(
            [refused_completion(), chat_completion("{}")], "a", {"name": "b", "priority": 1}
        )
        with pytest.raises(ResponseParseError) as info:
            await chat.complete(MESSAGES, response_model=Answer)
        error = info.value
        assert "refused" in str(error)
        assert "JSON" not in str(error)
        assert REFUSAL not in str(error)
        assert error.errors == ()
        assert error.response is not None
        assert error.response.refusal == REFUSAL
        assert transport.sources_called() == ["a"]
        assert [a.outcome for a in error.response.attempts] == ["success"]


def gemini_chunk(call: dict[str, Any]) -> dict[str, Any]:
    """A chunk of Gemini's OpenAI-compatible stream: one tool-call delta, no ``index``."""
    return {
        "object": "chat.completion.chunk",
        "model": "gemini-test",
        "choices": [{"index": 0, "delta": {"role": "assistant", "tool_calls": [call]}}],
    }


def whole_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A whole call in one delta, as Gemini sends each: id, type, function, no index."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
        "extra_content": {"google": {"thought_signature": "sig"}},
    }


def tool_stream(*calls: dict[str, Any]) -> StreamScript:
    """A stream of one chunk per tool-call delta, then the finish and usage chunks."""
    events = [gemini_chunk(call) for call in calls]
    events += chat_chunk_events([], "tool_calls", usage=(4, 6), role_first=False)
    return StreamScript(events)


class TestToolCallsWithoutIndex:
    """A delta without index and with a new id starts a call; one without id continues the last."""

    async def test_two_whole_calls_in_separate_chunks_stay_two(self) -> None:
        """Each chunk's call is its own: indexes 0 and 1, nothing merged."""
        chat, _, _ = make_chat(
            [
                tool_stream(
                    whole_call("call_a", "get_weather", '{"city":"Paris"}'),
                    whole_call("call_b", "get_time", '{"tz":"CET"}'),
                )
            ]
        )
        async with chat.stream(MESSAGES) as s:
            chunks = [c async for c in s]
            r = await s.response()
        assert [d.index for c in chunks for d in c.tool_calls] == [0, 1]
        assert [(c.id, c.name, c.arguments) for c in r.tool_calls] == [
            ("call_a", "get_weather", '{"city":"Paris"}'),
            ("call_b", "get_time", '{"tz":"CET"}'),
        ]

    async def test_pieces_without_id_continue_the_last_call(self) -> None:
        """Arguments split over deltas with no id (or an empty one) join the call before them."""
        chat, _, _ = make_chat(
            [
                tool_stream(
                    whole_call("call_a", "get_weather", '{"ci'),
                    {"function": {"arguments": 'ty":"Paris"}'}},
                    whole_call("call_b", "get_time", ""),
                    {"id": "", "type": "", "function": {"arguments": '{"tz":'}},
                    {"function": {"arguments": '"CET"}'}},
                )
            ]
        )
        r = await chat.stream(MESSAGES).response()
        assert [(c.id, c.name, c.arguments) for c in r.tool_calls] == [
            ("call_a", "get_weather", '{"city":"Paris"}'),
            ("call_b", "get_time", '{"tz":"CET"}'),
        ]

    async def test_pieces_without_index_follow_an_indexed_call(self) -> None:
        """A server that numbers only each call's first delta: the rest go to that call."""
        chat, _, _ = make_chat(
            [
                tool_stream(
                    {"index": 0, "id": "call_a", "function": {"name": "f", "arguments": ""}},
                    {"function": {"arguments": "{}"}},
                    {"index": 1, "id": "call_b", "function": {"name": "g", "arguments": ""}},
                    {"function": {"arguments": '{"x":1}'}},
                )
            ]
        )
        r = await chat.stream(MESSAGES).response()
        assert [(c.id, c.name, c.arguments) for c in r.tool_calls] == [
            ("call_a", "f", "{}"),
            ("call_b", "g", '{"x":1}'),
        ]

    async def test_each_stream_numbers_its_own_calls(self) -> None:
        """A second stream starts again at index 0: the numbering is per stream."""
        call = whole_call("call_a", "get_weather", "{}")
        chat, _, _ = make_chat([tool_stream(call), tool_stream(call)])
        for _ in range(2):
            r = await chat.stream(MESSAGES).response()
            assert [(c.id, c.arguments) for c in r.tool_calls] == [("call_a", "{}")]
