"""A tool result sent after a user message, served by an Anthropic source over real sockets.

The simulator's ``anthropic`` wire refuses, as the Messages API does (400,
``tool_use ids were found without tool_result blocks immediately after``), a
``tool_use`` that the next message does not answer first. An OpenAI
conversation with a user message between the call and its result, tool or
legacy function, is mapped so that the simulator serves it; the same turns
with the result after the text, as they were mapped before, are refused.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from _legacy_functions import ASK, WEATHER, legacy_chat, source
from polygateway.simulator import FaultProfile, SimulatedUpstream

KEY = "sk-ant-order-Fn-0123456789"
HURRY = {"role": "user", "content": "also, hurry"}
TOOL_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ],
}
FUNCTION_CALL = {
    "role": "assistant",
    "content": None,
    "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedUpstream]:
    """One Anthropic source."""
    profiles = {"claude": FaultProfile(wire="anthropic", api_key=KEY, stream_chunks=4)}
    async with SimulatedUpstream(profiles) as upstream:
        yield upstream


@pytest.mark.parametrize(
    ("turn", "params"),
    [
        (
            [*ASK, TOOL_CALL, HURRY, {"role": "tool", "tool_call_id": "call_1", "content": "sun"}],
            {"tools": [{"type": "function", "function": WEATHER}], "tool_choice": "none"},
        ),
        (
            [
                *ASK,
                FUNCTION_CALL,
                HURRY,
                {"role": "function", "name": "get_weather", "content": "sun"},
            ],
            {"functions": [WEATHER], "function_call": "none"},
        ),
    ],
    ids=["tool", "function"],
)
async def test_a_result_after_a_user_message_is_served(
    sim: SimulatedUpstream, transport: str, turn: list[dict[str, Any]], params: dict[str, Any]
) -> None:
    """[user, call, user, result]: plain and streamed, the Anthropic source answers 200."""
    async with legacy_chat([source(sim, "claude", KEY)], transport) as client:
        answer = await client.complete(turn, **params)
        async with client.stream(turn, **params) as stream:
            streamed = await stream.response()
    for reply in (answer, streamed):
        assert reply.finish_reason == "stop"
        assert reply.text.startswith("Simulated reply from claude.")
    assert sim.stats("claude").by_status == {200: 2}


async def test_a_result_behind_the_text_is_refused_as_the_api_does(
    sim: SimulatedUpstream,
) -> None:
    """The turns as mapped before the fix: 400 naming the unanswered tool_use id."""
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 64,
        "messages": [
            {"role": "user", "content": "weather in Paris"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "call_1", "name": "f", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "also, hurry"},
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "sun"},
                ],
            },
        ],
    }
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    async with httpx.AsyncClient(timeout=10.0) as http:
        refused = await http.post(
            f"{sim.base_url('claude', 'anthropic')}/messages", json=body, headers=headers
        )
        body["messages"][2]["content"].reverse()
        served = await http.post(
            f"{sim.base_url('claude', 'anthropic')}/messages", json=body, headers=headers
        )
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(
        "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after:"
        " call_1."
    )
    assert served.status_code == 200
