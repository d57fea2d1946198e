"""The governance across every provider wire the simulator plays: real sockets, real clients.

Each wire (``openai``, ``azure``, ``anthropic``, ``litellm``, ``vllm``) is
what that provider sends as its public documentation describes it
(research-wiki/guides/providers.md): the role chunk before the first token,
its own rate-limit headers, its error shapes. The same governance must hold
on each: a slow first token after the role chunk fails over at the TTFT, a
429 or 529 pauses its source for the hint, a window announced spent pauses
its source before any 429, a broken stream is never passed off as whole.
And the answer reads the same on each: a ``response_model`` comes back
parsed, a stream's ``response()`` equals the completion.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Literal

import pytest
from pydantic import BaseModel

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings, ScopeConfig, SourceConfig
from polygateway.errors import StreamInterrupted
from polygateway.simulator import FaultProfile, SimulatedUpstream

Wire = Literal["openai", "azure", "anthropic", "litellm", "vllm"]
WIRES: tuple[Wire, ...] = ("openai", "azure", "anthropic", "litellm", "vllm")
KEY = "sk-wire-Secret-0123456789"
HI = [{"role": "user", "content": "hello there"}]
BOUND_S = 30.0
"""Bounds the tests' own waits, never a timing under test."""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedUpstream]:
    """A simulator with no sources yet; each test adds its own."""
    async with SimulatedUpstream({}) as upstream:
        yield upstream


def profile(wire: Wire, **faults: Any) -> FaultProfile:
    """A source speaking ``wire``, demanding its key, with ``faults``."""
    return FaultProfile(wire=wire, api_key=KEY, **faults)


def source(sim: SimulatedUpstream, name: str, wire: Wire, **fields: Any) -> SourceConfig:
    """A PolyGateway source configured for ``wire`` as a user would configure that provider."""
    config: dict[str, Any] = {
        "name": name,
        "base_url": sim.base_url(name, "openai"),
        "protocol": "openai",
        "model": "sim",
        "api_key": KEY,
        "timeout_s": 5.0,
        "ttft_timeout_s": 0.5,
        "stream_idle_timeout_s": 10.0,
    }
    if wire == "anthropic":
        config.update(protocol="anthropic", base_url=sim.base_url(name, "anthropic"))
    elif wire == "azure":
        config.update(
            base_url=sim.base_url(name, "azure", deployment="gpt-4o"),
            api_key_header="api-key",
            query={"api-version": "2024-10-21"},
        )
    config.update(fields)
    return SourceConfig.model_validate(config)


def chat(sim: SimulatedUpstream, *sources: SourceConfig, **gateway: Any) -> ChatClient:
    """A chat client over ``sources`` (in priority order) on a fresh memory backend."""
    ordered = [s.model_copy(update={"priority": i}) for i, s in enumerate(sources)]
    settings = GatewaySettings(
        _env_file=None,
        poll_interval_s=0.2,
        **gateway,
        scopes={"chat": ScopeConfig(kind="chat", sources=ordered)},
    )
    return ChatClient.from_settings(settings, "chat", backend=MemoryBackend())


@pytest.mark.parametrize("wire", WIRES)
async def test_complete_and_stream_on_every_wire(sim: SimulatedUpstream, wire: Wire) -> None:
    """A plain and a streamed answer, the same types whichever wire served."""
    sim.set_profile("s", profile(wire, stream_chunks=4))
    async with chat(sim, source(sim, "s", wire)) as client:
        plain = await asyncio.wait_for(client.complete(HI, max_tokens=16), BOUND_S)
        async with client.stream(HI, max_tokens=16) as stream:
            chunks = [c async for c in stream]
    assert plain.text
    assert plain.finish_reason == "stop"
    assert plain.usage.completion_tokens > 0
    assert "".join(c.text for c in chunks)
    assert chunks[-1].finish_reason == "stop" or any(c.finish_reason == "stop" for c in chunks)
    assert sim.stats("s").by_status.get(401, 0) == 0


@pytest.mark.parametrize("wire", WIRES)
async def test_slow_first_token_after_the_role_chunk_fails_over_at_the_ttft(
    sim: SimulatedUpstream, wire: Wire
) -> None:
    """The role chunk (message_start, keep-alives) comes at once; the TTFT still bounds content."""
    sim.set_profile("slow", profile(wire, ttft_s=5.0))
    sim.set_profile("fast", profile(wire))
    client = chat(sim, source(sim, "slow", wire), source(sim, "fast", wire))
    async with client, client.stream(HI, max_tokens=8) as stream:
        text = "".join([c.text async for c in stream])
        attempts = stream.attempts
    assert text
    assert [(a.source, a.outcome) for a in attempts] == [("slow", "transient"), ("fast", "success")]
    # Cut at ttft_timeout_s (0.5 s), not at stream_idle_timeout_s (10 s) nor the 5 s token.
    assert attempts[0].latency_s < 2.0


@pytest.mark.parametrize("wire", WIRES)
async def test_429_pauses_its_source_for_the_hint_on_every_wire(
    sim: SimulatedUpstream, wire: Wire
) -> None:
    """A 429 with the wire's back-off headers pauses its source; the other serves meanwhile."""
    sim.set_profile("limited", profile(wire, rate_429=1.0, retry_after_s=2.0))
    sim.set_profile("spare", profile(wire))
    backend_client = chat(sim, source(sim, "limited", wire), source(sim, "spare", wire))
    async with backend_client as client:
        first = await asyncio.wait_for(client.complete(HI, max_tokens=4), BOUND_S)
        snap = (await client.backend.snapshot("chat")).source("limited")
        for _ in range(4):
            again = await asyncio.wait_for(client.complete(HI, max_tokens=4), BOUND_S)
            assert [a.source for a in again.attempts] == ["spare"]
    assert [(a.source, a.outcome) for a in first.attempts] == [
        ("limited", "rate_limited"),
        ("spare", "success"),
    ]
    assert snap is not None
    assert snap.paced_for_s is not None
    assert 1.0 < snap.paced_for_s <= 2.0
    assert sim.stats("limited").requests == 1


@pytest.mark.parametrize("wire", ["openai", "anthropic", "litellm"])
async def test_window_announced_spent_pauses_before_any_429(
    sim: SimulatedUpstream, wire: Wire
) -> None:
    """Remaining requests reaching 0 (2 s window): nothing reaches the source until the reset."""
    sim.set_profile("limited", profile(wire, request_limit=3, request_window_s=2.0))
    sim.set_profile("spare", profile(wire))
    async with chat(sim, source(sim, "limited", wire), source(sim, "spare", wire)) as client:
        served = []
        deadline = asyncio.get_running_loop().time() + 4.5
        while asyncio.get_running_loop().time() < deadline:
            response = await asyncio.wait_for(client.complete(HI, max_tokens=4), BOUND_S)
            served.append(response.source)
            await asyncio.sleep(0.05)
    stats = sim.stats("limited")
    assert stats.by_status.get(429, 0) == 0, "no 429 was provoked"
    assert "spare" in served, "calls went elsewhere while the window was spent"
    assert stats.requests >= 4, "the source served again once its window reset"
    # Never more than the window's 3 requests inside any 2 s.
    assert stats.max_in_window(1.99) <= 3


async def test_anthropic_tool_use_complete_and_stream(sim: SimulatedUpstream) -> None:
    """Tool use on the Anthropic wire reads as an OpenAI tool call, plain and streamed."""
    sim.set_profile("claude", profile("anthropic"))
    async with chat(sim, source(sim, "claude", "anthropic")) as client:
        plain = await client.complete(HI, tools=[WEATHER], max_tokens=64)
        async with client.stream(HI, tools=[WEATHER], max_tokens=64) as stream:
            chunks = [c async for c in stream]
    assert plain.finish_reason == "tool_calls"
    assert [c.name for c in plain.tool_calls] == ["get_weather"]
    assert plain.raw["type"] == "message"
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas
    assert deltas[0].name == "get_weather"
    assert any(c.finish_reason == "tool_calls" for c in chunks)


async def test_anthropic_529_fails_over_to_an_openai_source(sim: SimulatedUpstream) -> None:
    """An overloaded Anthropic source (529 with Retry-After) hands the call to an OpenAI one."""
    sim.set_profile(
        "claude",
        profile(
            "anthropic",
            rate_5xx=1.0,
            statuses_5xx=(529,),
            retry_after_s=3.0,
            retry_after_on_5xx=True,
        ),
    )
    sim.set_profile("gpt", profile("openai"))
    async with chat(
        sim, source(sim, "claude", "anthropic"), source(sim, "gpt", "openai")
    ) as client:
        plain = await client.complete(HI, max_tokens=8)
        async with client.stream(HI, max_tokens=8) as stream:
            text = "".join([c.text async for c in stream])
            streamed_on = stream.source
        snap = (await client.backend.snapshot("chat")).source("claude")
    assert [(a.source, a.status_code, a.outcome) for a in plain.attempts] == [
        ("claude", 529, "transient"),
        ("gpt", None, "success"),
    ]
    assert text
    assert streamed_on == "gpt"
    assert snap is not None
    assert snap.paced_for_s is not None
    assert 2.0 < snap.paced_for_s <= 3.0
    assert sim.stats("claude").requests == 1


@pytest.mark.parametrize("wire", WIRES)
async def test_truncated_stream_is_never_passed_off_as_whole(
    sim: SimulatedUpstream, wire: Wire
) -> None:
    """A stream cut halfway, after content reached the caller, raises StreamInterrupted."""
    sim.set_profile("s", profile(wire, rate_truncate=1.0, stream_chunks=8))
    received: list[str] = []

    async def read(client: ChatClient) -> None:
        async with client.stream(HI, max_tokens=16) as stream:
            async for chunk in stream:
                received.append(chunk.text)

    async with chat(sim, source(sim, "s", wire)) as client:
        with pytest.raises(StreamInterrupted):
            await read(client)
    assert "".join(received)


async def test_litellm_in_band_error_interrupts_the_stream(sim: SimulatedUpstream) -> None:
    """LiteLLM's ``data: {"error": ...}`` on a 200 stream is a failure, not an answer."""
    sim.set_profile("proxy", profile("litellm", rate_error_body=1.0, stream_chunks=8))

    async def read(client: ChatClient) -> None:
        async with client.stream(HI, max_tokens=16) as stream:
            async for _ in stream:
                pass

    async with chat(sim, source(sim, "proxy", "litellm")) as client:
        with pytest.raises(StreamInterrupted):
            await read(client)


async def test_azure_window_announced_spent_without_reset_pauses_the_default(
    sim: SimulatedUpstream,
) -> None:
    """Azure sends remaining counts but no reset: a spent window pauses 1 s by default."""
    sim.set_profile("limited", profile("azure", request_limit=3, request_window_s=2.0))
    sim.set_profile("spare", profile("azure"))
    async with chat(sim, source(sim, "limited", "azure"), source(sim, "spare", "azure")) as client:
        for _ in range(4):
            await asyncio.wait_for(client.complete(HI, max_tokens=4), BOUND_S)
        snap = (await client.backend.snapshot("chat")).source("limited")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 4.0
        while loop.time() < deadline:
            await asyncio.wait_for(client.complete(HI, max_tokens=4), BOUND_S)
            await asyncio.sleep(0.05)
    assert snap is not None
    assert snap.paced_for_s is not None
    assert 0.5 < snap.paced_for_s <= 1.0
    stats = sim.stats("limited")
    # The 429 that a too-early retry may meet carries Retry-After, which then governs.
    assert stats.by_status.get(429, 0) <= 2
    assert stats.max_in_window(1.99) <= 4


class Place(BaseModel):
    """An answer of plain fields, nested and optional ones too."""

    class Where(BaseModel):
        country: str
        capital: bool

    city: str
    population: int
    area_km2: float
    where: Where
    tags: list[str]
    note: str | None = None


@pytest.mark.parametrize("wire", WIRES)
async def test_response_model_round_trip_on_every_wire(sim: SimulatedUpstream, wire: Wire) -> None:
    """The schema goes out in the wire's way; the simulator's JSON answer comes back parsed."""
    sim.set_profile("s", profile(wire))
    async with chat(sim, source(sim, "s", wire)) as client:
        r = await asyncio.wait_for(
            client.complete(HI, response_model=Place, max_tokens=64), BOUND_S
        )
    assert isinstance(r.parsed, Place)
    assert r.parsed == Place.model_validate_json(r.text)
    assert isinstance(r.parsed.where, Place.Where)
    assert (r.tool_calls, r.finish_reason) == ((), "stop")
    assert [a.outcome for a in r.attempts] == ["success"]


@pytest.mark.parametrize("wire", WIRES)
async def test_stream_response_equals_complete_on_every_wire(
    sim: SimulatedUpstream, wire: Wire
) -> None:
    """Text, tool calls, finish reason and usage of response() are those of complete()."""
    sim.set_profile("s", profile(wire, stream_chunks=4))
    async with chat(sim, source(sim, "s", wire)) as client:
        for tools in ([], [WEATHER_REQUIRED]):
            params: dict[str, Any] = {"max_tokens": 16, "tools": tools or None}
            plain = await asyncio.wait_for(client.complete(HI, **params), BOUND_S)
            streamed = await asyncio.wait_for(client.stream(HI, **params).response(), BOUND_S)
            assert streamed.text == plain.text
            # Call ids are numbered per request by the simulator: compare the calls themselves.
            assert [(c.name, c.arguments) for c in streamed.tool_calls] == [
                (c.name, c.arguments) for c in plain.tool_calls
            ]
            assert (streamed.finish_reason, streamed.usage) == (plain.finish_reason, plain.usage)
            assert streamed.source == plain.source == "s"
    assert plain.tool_calls[0].arguments == '{"city": "lorem"}'


WEATHER_REQUIRED = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
"""A tool whose argument is required: the simulator's call fills it in."""
