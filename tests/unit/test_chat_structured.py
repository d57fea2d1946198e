"""complete(response_model=...): the schema each protocol is asked in, r.parsed, and answers
that do not validate (ResponseParseError, no retry, no blame on the source)."""

from __future__ import annotations

import json
import random
from typing import Any, Generic, TypeVar

import pytest
from _closing import closing
from pydantic import BaseModel, Field, RootModel

import polygateway
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import RequestRejected, ResponseParseError
from polygateway.testing import (
    BoundedSleep,
    FakeClock,
    FakeTransport,
    Recorder,
    chat_completion,
    gateway_settings,
)
from polygateway.transport.structured import answer_format, strict_json_schema

MESSAGES = [{"role": "user", "content": "Where is the Eiffel tower?"}]
CLAUDE = {"name": "claude", "protocol": "anthropic"}


class City(BaseModel):
    """A city, as the answer names it."""

    name: str
    country: str


class Answer(BaseModel):
    city: City = Field(description="Where it stands.")
    confidence: float
    sources: list[str]
    note: str | None = None


T = TypeVar("T")


class Wrapper(BaseModel, Generic[T]):
    value: T


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
            emitter=Recorder(),
        )
    )
    return chat, transport, backend


GOOD = {
    "city": {"name": "Paris", "country": "France"},
    "confidence": 0.9,
    "sources": ["memory"],
    "note": None,
}


def anthropic_tool_answer(name: str, value: Any, *, text: str = "") -> dict[str, Any]:
    """A Messages API answer calling tool ``name`` with ``value`` as its input."""
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    content.append({"type": "tool_use", "id": "toolu_1", "name": name, "input": value})
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": content,
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 20, "output_tokens": 15},
    }


class TestStrictSchema:
    """The schema is made strict as openai-python's to_strict_json_schema makes it."""

    def test_every_object_is_closed_and_every_property_required(self) -> None:
        """additionalProperties false and all properties required, nested models included."""
        schema = strict_json_schema(Answer.model_json_schema())
        assert schema["additionalProperties"] is False
        assert schema["required"] == ["city", "confidence", "sources", "note"]
        city = schema["properties"]["city"]
        assert city["additionalProperties"] is False
        assert city["required"] == ["name", "country"]
        assert schema["$defs"]["City"]["additionalProperties"] is False

    def test_ref_beside_a_description_is_inlined(self) -> None:
        """Strict mode refuses keys beside a $ref: the referenced schema is merged in."""
        city = strict_json_schema(Answer.model_json_schema())["properties"]["city"]
        assert "$ref" not in city
        assert city["description"] == "Where it stands."
        assert set(city["properties"]) == {"name", "country"}

    def test_optional_field_admits_null_without_a_null_default(self) -> None:
        """An optional field stays optional by admitting null; its None default is dropped."""
        note = strict_json_schema(Answer.model_json_schema())["properties"]["note"]
        assert {"type": "null"} in note["anyOf"]
        assert "default" not in note

    def test_the_given_schema_is_not_changed(self) -> None:
        """A copy is made strict: the caller's (or pydantic's) schema is left as it was."""
        original = Answer.model_json_schema()
        before = json.dumps(original, sort_keys=True)
        strict_json_schema(original)
        assert json.dumps(original, sort_keys=True) == before


class TestRequests:
    """Each protocol is asked for the schema in its documented way."""

    async def test_openai_gets_a_strict_json_schema_response_format(self) -> None:
        """response_format json_schema with name, schema and strict: true, as parse() sends."""
        chat, transport, _ = make_chat([chat_completion(json.dumps(GOOD))])
        await chat.complete(MESSAGES, response_model=Answer)
        sent = transport.requests[0].json["response_format"]
        assert sent == {
            "type": "json_schema",
            "json_schema": {
                "name": "Answer",
                "schema": strict_json_schema(Answer.model_json_schema()),
                "strict": True,
            },
        }

    async def test_anthropic_gets_a_forced_tool_carrying_the_schema(self) -> None:
        """A tool whose input_schema is the schema, forced by tool_choice; no response_format."""
        chat, transport, _ = make_chat([anthropic_tool_answer("Answer", GOOD)], CLAUDE)
        await chat.complete(MESSAGES, response_model=Answer)
        body = transport.requests[0].json
        assert body["tool_choice"] == {"type": "tool", "name": "Answer"}
        [tool] = body["tools"]
        assert tool["name"] == "Answer"
        assert tool["input_schema"] == strict_json_schema(Answer.model_json_schema())
        assert "response_format" not in body

    async def test_anthropic_keeps_the_callers_tools_and_forces_the_answer(self) -> None:
        """The caller's tools stay declared (translated); the forced tool is the answer's."""
        weather = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
        chat, transport, _ = make_chat([anthropic_tool_answer("Answer", GOOD)], CLAUDE)
        await chat.complete(MESSAGES, response_model=Answer, tools=[weather], tool_choice="auto")
        body = transport.requests[0].json
        assert [t["name"] for t in body["tools"]] == ["get_weather", "Answer"]
        assert body["tool_choice"] == {"type": "tool", "name": "Answer"}

    async def test_generic_model_names_are_made_valid_names(self) -> None:
        """A name both APIs accept ([A-Za-z0-9_-], at most 64) whatever the class is called."""
        fmt = answer_format(Wrapper[int], {}, "chat")
        assert fmt.name == "Wrapper_int_"
        chat, transport, _ = make_chat([chat_completion('{"value": 3}')])
        r = await chat.complete(MESSAGES, response_model=Wrapper[int])
        assert r.parsed == Wrapper[int](value=3)
        assert transport.requests[0].json["response_format"]["json_schema"]["name"] == fmt.name

    async def test_one_format_per_model_class(self) -> None:
        """The schema is built once per model class and shared by its calls."""
        assert answer_format(Answer, {}, "chat") is answer_format(Answer, {}, "other")


class TestParsed:
    """r.parsed is the answer as an instance of the model, whichever protocol served."""

    async def test_openai_answer_is_parsed(self) -> None:
        """The message content, JSON text, validates into r.parsed; r.text keeps the text."""
        text = json.dumps(GOOD)
        chat, _, _ = make_chat([chat_completion(text)])
        r = await chat.complete(MESSAGES, response_model=Answer)
        assert r.parsed == Answer.model_validate(GOOD)
        assert r.text == text
        assert r.choices[0].text == text

    async def test_anthropic_answer_reads_as_an_openai_one(self) -> None:
        """The forced tool's input is the text; no tool call and a 'stop' finish are left."""
        chat, _, _ = make_chat([anthropic_tool_answer("Answer", GOOD)], CLAUDE)
        r = await chat.complete(MESSAGES, response_model=Answer)
        assert r.parsed == Answer.model_validate(GOOD)
        assert json.loads(r.text) == GOOD
        assert r.tool_calls == ()
        assert r.finish_reason == "stop"
        assert r.choices[0].text == r.text
        assert r.usage.completion_tokens == 15

    async def test_without_response_model_parsed_is_none(self) -> None:
        """A plain call has parsed None and sends no response_format."""
        chat, transport, _ = make_chat([chat_completion("hi")])
        r = await chat.complete(MESSAGES)
        assert r.parsed is None
        assert "response_format" not in transport.requests[0].json

    async def test_with_n_above_one_the_first_choice_is_parsed(self) -> None:
        """n > 1: r.parsed is the first choice's answer; every choice's text is on r.choices."""
        body = chat_completion(json.dumps(GOOD))
        second = {**GOOD, "confidence": 0.1}
        body["choices"].append(
            {
                "index": 1,
                "message": {"role": "assistant", "content": json.dumps(second)},
                "finish_reason": "stop",
            }
        )
        chat, _, _ = make_chat([body])
        r = await chat.complete(MESSAGES, response_model=Answer, n=2)
        assert r.parsed is not None
        assert r.parsed.confidence == 0.9
        assert [json.loads(c.text)["confidence"] for c in r.choices] == [0.9, 0.1]


class TestInvalidAnswers:
    """An answer that does not validate raises ResponseParseError; the source is not blamed."""

    async def test_wrong_shape_raises_with_text_and_errors(self) -> None:
        """The text as received and pydantic's errors (loc, type) are on the error."""
        text = json.dumps({"city": {"name": "Paris"}, "confidence": "high", "sources": []})
        chat, _, _ = make_chat([chat_completion(text)])
        with pytest.raises(ResponseParseError) as info:
            await chat.complete(MESSAGES, response_model=Answer)
        error = info.value
        assert isinstance(error, polygateway.GatewayError)
        assert error.text == text
        assert {(tuple(e["loc"]), e["type"]) for e in error.errors} == {
            (("city", "country"), "missing"),
            (("confidence",), "float_parsing"),
        }
        assert error.response is not None
        assert error.response.text == text
        assert error.response.parsed is None
        assert error.sources == ("primary",)
        assert "not a valid Answer" in str(error)

    async def test_cut_json_raises_and_the_message_never_holds_the_answer(self) -> None:
        """An answer cut at max_tokens: invalid JSON, a message naming the fault, not the text."""
        text = '{"city": {"name": "Secret-Island-Base", "coun'
        chat, _, _ = make_chat([chat_completion(text, finish_reason="length")])
        with pytest.raises(ResponseParseError) as info:
            await chat.complete(MESSAGES, response_model=Answer)
        assert info.value.errors[0]["type"] == "json_invalid"
        assert info.value.response is not None
        assert info.value.response.finish_reason == "length"
        assert "Secret-Island-Base" not in str(info.value)
        assert "Secret-Island-Base" not in repr(info.value)

    async def test_not_retried_and_released_as_a_success(self) -> None:
        """One attempt, released as a success: no other source asked, no breaker failure."""
        chat, transport, backend = make_chat(
            [chat_completion("no JSON here"), chat_completion(json.dumps(GOOD))],
            "a",
            {"name": "b", "priority": 1},
        )
        with pytest.raises(ResponseParseError) as info:
            await chat.complete(MESSAGES, response_model=Answer)
        assert transport.sources_called() == ["a"]
        assert info.value.response is not None
        assert [a.outcome for a in info.value.response.attempts] == ["success"]
        snap = (await backend.snapshot("chat")).source("a")
        assert snap is not None
        assert snap.consecutive_failures == 0
        assert (await backend.snapshot("chat")).in_flight == 0

    async def test_anthropic_answer_without_the_forced_call_is_invalid(self) -> None:
        """Prose where the tool call should be: the prose is the text that fails validation."""
        prose = {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-test",
            "content": [{"type": "text", "text": "It is in Paris."}],
            "stop_reason": "end_turn",
            "usage": {"input_tokens": 3, "output_tokens": 4},
        }
        chat, _, _ = make_chat([prose], CLAUDE)
        with pytest.raises(ResponseParseError) as info:
            await chat.complete(MESSAGES, response_model=Answer)
        assert info.value.text == "It is in Paris."


class TestRefusedUpFront:
    """A response_model that cannot be asked for is RequestRejected before anything is sent."""

    async def test_with_response_format_too(self) -> None:
        """response_model and response_format together: the shape asked twice."""
        chat, transport, _ = make_chat([chat_completion("{}")])
        with pytest.raises(RequestRejected, match="response_format"):
            await chat.complete(
                MESSAGES, response_model=Answer, response_format={"type": "json_object"}
            )
        assert transport.requests == []

    @pytest.mark.parametrize("model", [dict, "Answer", Answer(**GOOD), RootModel[list[int]]])
    async def test_not_a_model_of_fields(self, model: Any) -> None:
        """Not a pydantic model class, or one whose schema is not an object."""
        chat, transport, _ = make_chat([chat_completion("{}")])
        with pytest.raises(RequestRejected, match="response_model"):
            await chat.complete(MESSAGES, response_model=model)
        assert transport.requests == []
