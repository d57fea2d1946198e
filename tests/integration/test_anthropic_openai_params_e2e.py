"""OpenAI chat parameters sent to an Anthropic source, over real sockets.

The simulator's ``anthropic`` wire refuses what the Messages API refuses: a
field it does not define ("``seed``: Extra inputs are not permitted"), a
``metadata`` field other than ``user_id``, a ``temperature`` above 1. A chat
client speaks the OpenAI API whichever source serves: the OpenAI parameters
without a Messages API field are left out, ``temperature`` is capped, and
the call is served, alone or first in a scope that mixes an Anthropic and an
OpenAI source (which no 400 then ends before the OpenAI source is tried).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from _legacy_functions import ASK, legacy_chat, source
from polygateway.errors import RequestRejected
from polygateway.simulator import FaultProfile, SimulatedUpstream

KEY = "sk-ant-openai-Params-0123456789"
BOUND_S = 30.0
"""Bounds the tests' own waits, never a timing under test."""

OPENAI_ONLY: dict[str, Any] = {
    "seed": 42,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.1,
    "logprobs": True,
    "top_logprobs": 2,
    "logit_bias": {"50256": -100},
    "response_format": {"type": "text"},
    "store": False,
    "metadata": {"user_id": "u-1", "purpose": "eval"},
    "temperature": 1.5,
}


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedUpstream]:
    """An Anthropic source and an OpenAI one."""
    profiles = {
        "claude": FaultProfile(wire="anthropic", api_key=KEY),
        "gpt": FaultProfile(wire="openai", api_key=KEY),
    }
    async with SimulatedUpstream(profiles) as upstream:
        yield upstream


async def test_the_simulator_refuses_what_the_messages_api_refuses(sim: SimulatedUpstream) -> None:
    """The wire under the library's requests answers as the Messages API does."""
    url = sim.base_url("claude", "anthropic").rstrip("/") + "/messages"
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    base = {"model": "claude-sonnet-4-5", "max_tokens": 20, "messages": ASK}
    async with httpx.AsyncClient(timeout=BOUND_S) as http:
        for extra, message in [
            ({"seed": 42}, "seed: Extra inputs are not permitted"),
            ({"metadata": {"purpose": "x"}}, "metadata.purpose: Extra inputs are not permitted"),
            ({"temperature": 1.5}, "temperature: Input should be less than or equal to 1"),
        ]:
            refused = await http.post(url, json={**base, **extra}, headers=headers)
            assert refused.status_code == 400
            assert refused.json()["error"]["message"] == message
        served = await http.post(
            url, json={**base, "temperature": 1, "metadata": {"user_id": "u"}}, headers=headers
        )
        assert served.status_code == 200


async def test_openai_parameters_are_served_by_an_anthropic_source(
    sim: SimulatedUpstream, transport: str
) -> None:
    async with legacy_chat([source(sim, "claude", KEY)], transport) as client:
        plain = await asyncio.wait_for(client.complete(ASK, **OPENAI_ONLY), BOUND_S)
        async with client.stream(ASK, **OPENAI_ONLY) as stream:
            streamed = "".join([c.text async for c in stream])
    assert plain.source == "claude"
    assert plain.text
    assert streamed
    assert sim.stats("claude").requests == 2


async def test_a_mixed_scope_serves_them_on_its_anthropic_source(sim: SimulatedUpstream) -> None:
    sources = [source(sim, "claude", KEY), source(sim, "gpt", KEY, priority=1)]
    async with legacy_chat(sources) as client:
        # OpenAI's own tier, which the table of a mixed scope takes, is no Messages API one.
        params = {**OPENAI_ONLY, "service_tier": "flex"}
        response = await asyncio.wait_for(client.complete(ASK, **params), BOUND_S)
    assert response.source == "claude"
    assert sim.stats("gpt").requests == 0


PDF_PART = {
    "type": "file",
    "file": {"file_data": "data:application/pdf;base64,JVBERi0xLjQK", "filename": "a.pdf"},
}


async def test_a_pdf_file_part_is_read_by_an_anthropic_source(
    sim: SimulatedUpstream, transport: str
) -> None:
    """The simulator refuses OpenAI's part as the Messages API does; the document is served."""
    url = sim.base_url("claude", "anthropic").rstrip("/") + "/messages"
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    raw = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": [PDF_PART]}]}
    async with httpx.AsyncClient(timeout=BOUND_S) as http:
        refused = await http.post(url, json=raw, headers=headers)
    assert refused.status_code == 400
    assert "Input tag 'file'" in refused.json()["error"]["message"]
    messages = [{"role": "user", "content": [PDF_PART, {"type": "text", "text": "Summarize."}]}]
    async with legacy_chat([source(sim, "claude", KEY)], transport) as client:
        response = await asyncio.wait_for(client.complete(messages), BOUND_S)
    assert response.source == "claude"
    assert response.text
    assert sim.stats("claude").requests == 2


async def test_several_choices_are_refused_on_an_anthropic_source(sim: SimulatedUpstream) -> None:
    async with legacy_chat([source(sim, "claude", KEY)]) as client:
        with pytest.raises(RequestRejected, match="n must be 1") as caught:
            await asyncio.wait_for(client.complete(ASK, n=2), BOUND_S)
    assert KEY not in str(caught.value)
    assert sim.stats("claude").requests == 0
