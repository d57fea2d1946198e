"""Legacy function calling (``functions`` / ``function_call``) over real sockets, end to end.

OpenAI's deprecated protocol, still served by OpenAI and Azure: a request
offering ``functions`` is answered with the message's ``function_call``
(``{"name", "arguments"}``, no id) and ``finish_reason: "function_call"``;
streamed, as ``delta.function_call`` pieces, the name first with empty
arguments, then the arguments (openai-python's ``FunctionCall`` and
``ChoiceDeltaFunctionCall``; research-wiki/guides/providers.md, "OpenAI").
``function_call`` is ``"auto"`` (the default), ``"none"`` (answer in text) or
``{"name": ...}`` (call that one); a name not among ``functions`` is a 400.

The library passes both parameters through as given (they are checked
parameters of the chat completions API) and reads the answer as one tool
call of type ``function_call`` with an empty id, plain and streamed alike;
the follow-up turn (the assistant's ``function_call`` and a ``function``
message with the result) is sent as given. Forcing by name and ``"none"``
run on an Anthropic source too, where the wire maps the pair onto tools
(``test_anthropic_legacy_functions_e2e.py`` holds the rest of that mapping).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Literal

import pytest

from _legacy_functions import ASK, TIME, WEATHER, answered, legacy_chat, result_turn, source
from polygateway.chat import ChatClient
from polygateway.errors import RequestRejected
from polygateway.simulator import FaultProfile, SimulatedUpstream

KEY = "sk-legacy-Fn-0123456789"
BOUND_S = 30.0
"""Bounds the tests' own waits, never a timing under test."""
Wire = Literal["openai", "azure", "anthropic"]
SOURCE_OF: dict[Wire, str] = {"openai": "gpt", "azure": "az", "anthropic": "claude"}


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedUpstream]:
    """One source of each wire that serves legacy functions (Anthropic's as mapped tools)."""
    profiles = {
        "gpt": FaultProfile(wire="openai", api_key=KEY, stream_chunks=4),
        "az": FaultProfile(wire="azure", api_key=KEY, stream_chunks=4),
        "claude": FaultProfile(wire="anthropic", api_key=KEY, stream_chunks=4),
    }
    async with SimulatedUpstream(profiles) as upstream:
        yield upstream


def _chat(sim: SimulatedUpstream, wire: Wire, transport: str = "httpx") -> ChatClient:
    """A chat client over the source of ``wire``, configured as a user configures it."""
    return legacy_chat([source(sim, SOURCE_OF[wire], KEY)], transport)


@pytest.mark.parametrize("wire", ["openai", "azure"])
async def test_functions_are_answered_with_a_function_call_plain_and_streamed(
    sim: SimulatedUpstream, wire: Wire, transport: str
) -> None:
    """One ``function_call`` tool call, no id, arguments of the schema; the stream's the same."""
    async with _chat(sim, wire, transport) as client:
        plain, chunks, streamed = await answered(client, BOUND_S, functions=[WEATHER])
    (call,) = plain.tool_calls
    assert (call.type, call.id, call.name) == ("function_call", "", "get_weather")
    assert json.loads(call.arguments) == {"city": "lorem"}
    assert plain.finish_reason == "function_call"
    assert plain.text == ""
    assert plain.raw["choices"][0]["message"]["function_call"]["name"] == "get_weather"
    assert "tool_calls" not in plain.raw["choices"][0]["message"]
    deltas = [d for c in chunks for d in c.tool_calls]
    assert [d.type for d in deltas] == ["function_call", "function_call"]
    assert [d.name for d in deltas] == ["get_weather", None]
    assert {d.index for d in deltas} == {0}
    assert "".join(c.text for c in chunks) == ""
    assert streamed.tool_calls == plain.tool_calls
    assert streamed.finish_reason == "function_call"
    assert streamed.usage == plain.usage
    assert streamed.raw["choices"][0]["message"]["function_call"] == {
        "name": "get_weather",
        "arguments": call.arguments,
    }


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
async def test_function_call_by_name_calls_that_function(
    sim: SimulatedUpstream, wire: Wire
) -> None:
    """``function_call={"name": ...}`` forces the named one, not the first offered."""
    async with _chat(sim, wire) as client:
        forced = await client.complete(
            ASK, functions=[WEATHER, TIME], function_call={"name": "get_time"}
        )
        auto = await client.complete(ASK, functions=[WEATHER, TIME], function_call="auto")
    assert [(c.name, c.type) for c in forced.tool_calls] == [("get_time", "function_call")]
    assert json.loads(forced.tool_calls[0].arguments) == {"zone": "lorem", "hours": 1}
    assert [c.name for c in auto.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("wire", ["openai", "anthropic"])
async def test_function_call_none_answers_in_text(sim: SimulatedUpstream, wire: Wire) -> None:
    """``function_call="none"``: text and ``stop``, no call, plain and streamed."""
    async with _chat(sim, wire) as client:
        plain = await client.complete(ASK, functions=[WEATHER], function_call="none")
        async with client.stream(ASK, functions=[WEATHER], function_call="none") as stream:
            streamed = await stream.response()
    for answer in (plain, streamed):
        assert answer.text.startswith(f"Simulated reply from {SOURCE_OF[wire]}.")
        assert answer.tool_calls == ()
        assert answer.finish_reason == "stop"


async def test_the_function_result_turn_goes_back_as_sent(sim: SimulatedUpstream) -> None:
    """The assistant's ``function_call`` and the ``function`` message answer it: text comes back."""
    async with _chat(sim, "openai") as client:
        first = await client.complete(ASK, functions=[WEATHER])
        call = first.tool_calls[0]
        turn = result_turn(call.name, call.arguments)
        answer = await client.complete(turn, functions=[WEATHER], function_call="none")
    assert answer.finish_reason == "stop"
    assert "sunny," in answer.text
    assert sim.stats("gpt").by_status == {200: 2}


async def test_function_call_naming_no_offered_function_is_rejected(
    sim: SimulatedUpstream,
) -> None:
    """The provider's 400 is the request's fault: ``RequestRejected``, once, not retried."""
    async with _chat(sim, "openai") as client:
        with pytest.raises(RequestRejected) as caught:
            await client.complete(ASK, functions=[WEATHER], function_call={"name": "nope"})
    assert "400" in str(caught.value)
    assert sim.stats("gpt").requests == 1


async def test_tool_choice_none_answers_in_text_as_function_call_none_does(
    sim: SimulatedUpstream,
) -> None:
    """Offered tools with ``tool_choice="none"``: text and ``stop``, as OpenAI answers."""
    tool = {"type": "function", "function": WEATHER}
    async with _chat(sim, "openai") as client:
        answer = await client.complete(ASK, tools=[tool], tool_choice="none")
    assert answer.text.startswith("Simulated reply from gpt.")
    assert (answer.tool_calls, answer.finish_reason) == ((), "stop")
