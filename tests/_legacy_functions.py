"""The legacy ``functions`` a call offers in the legacy function-calling e2e tests.

Shared by ``tests/integration/test_legacy_functions_e2e.py`` (OpenAI and
Azure wires) and ``tests/integration/test_anthropic_legacy_functions_e2e.py``,
so that both ask the same question with the same functions, of sources
configured alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings, ScopeConfig, SourceConfig
from polygateway.models import ChatChunk, ChatResponse
from polygateway.simulator import SimulatedUpstream

__all__ = ["ASK", "TIME", "WEATHER", "answered", "legacy_chat", "result_turn", "source"]

ASK = [{"role": "user", "content": "weather in Paris"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME = {
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string"}, "hours": {"type": "integer"}},
        "required": ["zone", "hours"],
    },
}


def result_turn(name: str, arguments: str, result: str = "sunny, 21 C") -> list[dict[str, Any]]:
    """``ASK``, the assistant's legacy call of ``name``, and the ``function`` message answering."""
    return [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": name, "arguments": arguments},
        },
        {"role": "function", "name": name, "content": result},
    ]


def source(sim: SimulatedUpstream, name: str, key: str, *, priority: int = 0) -> SourceConfig:
    """The simulator's source ``name`` (``gpt``, ``az`` on Azure, ``claude``) as a user sets it."""
    if name == "az":
        return SourceConfig(
            name="az",
            base_url=sim.base_url("az", "azure", deployment="gpt-4o"),
            protocol="openai",
            model="gpt-4o",
            api_key=key,
            api_key_header="api-key",
            query={"api-version": "2024-10-21"},
            timeout_s=5.0,
            priority=priority,
        )
    if name == "claude":
        return SourceConfig(
            name="claude",
            base_url=sim.base_url("claude", "anthropic"),
            protocol="anthropic",
            model="claude-sonnet-4-5",
            api_key=key,
            timeout_s=5.0,
            priority=priority,
        )
    return SourceConfig(
        name=name,
        base_url=sim.base_url(name),
        protocol="openai",
        model="gpt-4o",
        api_key=key,
        timeout_s=5.0,
        priority=priority,
    )


def legacy_chat(sources: Sequence[SourceConfig], transport: str = "httpx") -> ChatClient:
    """A chat client of one scope over ``sources``, on a memory backend."""
    settings = GatewaySettings(
        _env_file=None,
        transport=transport,
        scopes={"chat": ScopeConfig(kind="chat", sources=list(sources))},
    )
    return ChatClient.from_settings(settings, "chat", backend=MemoryBackend())


async def answered(
    client: ChatClient, bound_s: float, **params: Any
) -> tuple[ChatResponse[Any], list[ChatChunk], ChatResponse[Any]]:
    """``ASK`` answered plain (within ``bound_s``), then streamed: the answer, the stream's
    chunks and the streamed answer."""
    plain = await asyncio.wait_for(client.complete(ASK, **params), bound_s)
    async with client.stream(ASK, **params) as stream:
        chunks = [c async for c in stream]
        streamed = await stream.response()
    return plain, chunks, streamed
