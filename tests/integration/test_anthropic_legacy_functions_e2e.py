"""Legacy function calling (``functions`` / ``function_call``) served by an Anthropic source.

A chat client speaks the OpenAI API whichever source serves: the Anthropic
wire writes ``functions`` as Messages API tools and ``function_call`` as its
``tool_choice``, and the legacy follow-up turn (the assistant's
``function_call`` and the ``function`` message with the result) as a
``tool_use`` block and its ``tool_result``. Over real sockets against the
simulator's ``anthropic`` wire, which refuses the OpenAI names as extra
inputs as the Messages API does, and in a scope that mixes an Anthropic and
an OpenAI source, where the Anthropic one serves.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from _legacy_functions import ASK, TIME, WEATHER, answered, legacy_chat, result_turn, source
from polygateway.chat import ChatClient
from polygateway.errors import RequestRejected
from polygateway.simulator import FaultProfile, SimulatedUpstream

KEY = "sk-ant-legacy-Fn-0123456789"
BOUND_S = 30.0
"""Bounds the tests' own waits, never a timing under test."""


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedUpstream]:
    """An Anthropic source and an OpenAI one."""
    profiles = {
        "claude": FaultProfile(wire="anthropic", api_key=KEY, stream_chunks=4),
        "gpt": FaultProfile(wire="openai", api_key=KEY, stream_chunks=4),
    }
    async with SimulatedUpstream(profiles) as upstream:
        yield upstream


def _chat(sim: SimulatedUpstream, *, mixed: bool = False, transport: str = "httpx") -> ChatClient:
    """A chat client over the Anthropic source (first), and the OpenAI one when ``mixed``."""
    sources = [source(sim, "claude", KEY)]
    if mixed:
        sources.append(source(sim, "gpt", KEY, priority=1))
    return legacy_chat(sources, transport)


async def test_functions_are_answered_with_one_call_plain_and_streamed(
    sim: SimulatedUpstream, transport: str
) -> None:
    """The offered function is called with arguments of its schema; the stream reads the same."""
    async with _chat(sim, transport=transport) as client:
        plain, chunks, streamed = await answered(client, BOUND_S, functions=[WEATHER])
    (call,) = plain.tool_calls
    assert (call.type, call.id, call.name) == ("function_call", "", "get_weather")
    assert plain.finish_reason == "function_call"
    assert streamed.tool_calls == plain.tool_calls
    assert streamed.raw["choices"][0]["message"]["function_call"] == {
        "name": "get_weather",
        "arguments": call.arguments,
    }
    assert [d.type for d in (d for c in chunks for d in c.tool_calls)] == ["function_call"] * 4
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "lorem"}
    assert plain.text == ""
    assert plain.source == "claude"
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas[0].name == "get_weather"
    assert {d.index for d in deltas} == {0}
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == [(call.name, call.arguments)]
    assert streamed.finish_reason == plain.finish_reason
    assert streamed.usage == plain.usage
    assert sim.stats("claude").by_status == {200: 2}


async def test_the_function_result_turn_is_served(sim: SimulatedUpstream, transport: str) -> None:
    """The assistant's ``function_call`` and the ``function`` message answering it: text back."""
    async with _chat(sim, transport=transport) as client:
        first = await client.complete(ASK, functions=[WEATHER])
        call = first.tool_calls[0]
        turn = [
            *result_turn(call.name, call.arguments),
            {"role": "user", "content": "and tomorrow"},
        ]
        answer = await client.complete(turn, functions=[WEATHER], function_call="none")
        async with client.stream(turn, functions=[WEATHER], function_call="none") as stream:
            streamed = await stream.response()
    for reply in (answer, streamed):
        assert reply.finish_reason == "stop"
        assert reply.text.startswith("Simulated reply from claude. weather in Paris and tomorrow")
    assert sim.stats("claude").by_status == {200: 3}


async def test_mixed_scope_serves_functions_from_the_anthropic_source(
    sim: SimulatedUpstream,
) -> None:
    """[claude, gpt]: the Anthropic source serves a ``functions`` call, with no 400 anywhere."""
    async with _chat(sim, mixed=True) as client:
        plain = await client.complete(ASK, functions=[WEATHER, TIME])
        async with client.stream(ASK, functions=[WEATHER, TIME]) as stream:
            streamed = await stream.response()
            served_by = stream.source
    assert (plain.source, served_by) == ("claude", "claude")
    assert [c.name for c in plain.tool_calls] == ["get_weather"]
    assert [c.name for c in streamed.tool_calls] == ["get_weather"]
    assert sim.stats("claude").by_status == {200: 2}
    assert sim.stats("gpt").requests == 0


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"functions": [WEATHER], "tools": [{"type": "function", "function": TIME}]}, "tools"),
        ({"functions": [WEATHER], "function_call": "auto", "tool_choice": "auto"}, "tool_choice"),
    ],
)
async def test_legacy_and_tool_parameters_together_are_rejected_unsent(
    sim: SimulatedUpstream, params: dict[str, Any], named: str
) -> None:
    """OpenAI refuses ``functions`` beside ``tools`` (and their choices): refused, never sent."""
    async with _chat(sim) as client:
        with pytest.raises(RequestRejected) as caught:
            await client.complete(ASK, **params)
    assert named in str(caught.value)
    assert sim.stats("claude").requests == 0


async def test_tool_choice_none_answers_in_text_on_the_anthropic_wire(
    sim: SimulatedUpstream,
) -> None:
    """Offered tools with ``tool_choice="none"`` (``{"type": "none"}`` on the wire): text, stop."""
    tool = {"type": "function", "function": WEATHER}
    async with _chat(sim) as client:
        answer = await client.complete(ASK, tools=[tool], tool_choice="none")
    assert answer.text.startswith("Simulated reply from claude.")
    assert (answer.tool_calls, answer.finish_reason) == ((), "stop")
