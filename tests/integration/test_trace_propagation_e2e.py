"""Trace context over real sockets: with ``OpenTelemetryEmitter(propagate=True)`` the simulated
upstream receives, on each attempt's request, the ``traceparent`` of the attempt span exported."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from polygateway import OpenTelemetryEmitter
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings, ScopeConfig, SourceConfig
from polygateway.embedding import EmbeddingClient
from polygateway.simulator import FaultProfile, SimulatedUpstream

KEY = "sk-trace-Secret-0123456789"
HI = [{"role": "user", "content": "hello there"}]
BOUND_S = 30.0
"""Bounds the tests' own waits, never a timing under test."""
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedUpstream]:
    async with SimulatedUpstream({}) as upstream:
        yield upstream


@pytest.fixture
def exporter() -> Iterator[tuple[InMemorySpanExporter, TracerProvider]]:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    yield spans, provider
    provider.shutdown()


def source(sim: SimulatedUpstream, name: str, protocol: str, priority: int) -> SourceConfig:
    return SourceConfig(
        name=name,
        protocol=protocol,
        base_url=sim.base_url(name, protocol),
        model="sim",
        api_key=KEY,
        timeout_s=5.0,
        priority=priority,
    )


def settings(kind: str, *sources: SourceConfig) -> GatewaySettings:
    return GatewaySettings(
        _env_file=None,
        poll_interval_s=0.2,
        backoff_base_s=0.01,
        backoff_cap_s=0.02,
        scopes={kind: ScopeConfig(kind=kind, sources=sources)},
    )


def received(sim: SimulatedUpstream, name: str) -> list[tuple[int, int]]:
    """(trace id, span id) of each traceparent source ``name`` received."""
    out = []
    for header in sim.stats(name).traceparents:
        match = TRACEPARENT.match(header)
        assert match is not None, header
        out.append((int(match[1], 16), int(match[2], 16)))
    return out


def attempt_spans(spans: InMemorySpanExporter) -> list[ReadableSpan]:
    return sorted(
        (s for s in spans.get_finished_spans() if "polygateway.attempt" in (s.attributes or {})),
        key=lambda s: (s.attributes or {})["polygateway.attempt"],
    )


def ids(span: ReadableSpan) -> tuple[int, int]:
    return span.context.trace_id, span.context.span_id


async def test_each_upstream_receives_the_traceparent_of_its_attempt_span(
    sim: SimulatedUpstream, exporter: tuple[InMemorySpanExporter, TracerProvider]
) -> None:
    """A 5xx on the OpenAI wire, then the Anthropic wire serves: each got its own attempt's id."""
    spans, provider = exporter
    sim.set_profile("down", FaultProfile(wire="openai", api_key=KEY, rate_5xx=1.0))
    sim.set_profile("up", FaultProfile(wire="anthropic", api_key=KEY))
    emitter = OpenTelemetryEmitter(tracer_provider=provider, propagate=True)
    client = ChatClient.from_settings(
        settings("chat", source(sim, "down", "openai", 0), source(sim, "up", "anthropic", 1)),
        "chat",
        backend=MemoryBackend(),
        emitter=emitter,
    )
    async with client:
        with provider.get_tracer("app").start_as_current_span("handle request") as outer:
            answer = await asyncio.wait_for(client.complete(HI, max_tokens=8), BOUND_S)
    assert answer.source == "up"
    failed, served = attempt_spans(spans)
    assert received(sim, "down") == [ids(failed)]
    assert received(sim, "up") == [ids(served)]
    assert failed.context.span_id != served.context.span_id
    [call] = [
        s for s in spans.get_finished_spans() if s.parent is not None and s not in (failed, served)
    ]
    assert call.parent is not None
    assert call.parent.span_id == outer.get_span_context().span_id
    assert failed.parent is not None
    assert failed.parent.span_id == call.context.span_id
    assert (served.attributes or {})["gen_ai.response.model"] == "sim"
    assert sim.stats("up").by_status.get(401, 0) == 0  # the key went through untouched


@pytest.mark.parametrize("kind", ["chat.stream", "embed"])
async def test_streams_and_embeddings_send_the_traceparent(
    sim: SimulatedUpstream, exporter: tuple[InMemorySpanExporter, TracerProvider], kind: str
) -> None:
    """The other request shapes carry it too, over the same sockets."""
    spans, provider = exporter
    sim.set_profile("s", FaultProfile(wire="openai", api_key=KEY, stream_chunks=3))
    emitter = OpenTelemetryEmitter(tracer_provider=provider, propagate=True)
    client: Any
    if kind == "chat.stream":
        client = ChatClient.from_settings(
            settings("chat", source(sim, "s", "openai", 0)),
            "chat",
            backend=MemoryBackend(),
            emitter=emitter,
        )
        async with client, client.stream(HI, max_tokens=8) as stream:
            assert [c async for c in stream]
    else:
        client = EmbeddingClient.from_settings(
            settings("embed", source(sim, "s", "openai", 0)),
            "embed",
            backend=MemoryBackend(),
            emitter=emitter,
        )
        async with client:
            await asyncio.wait_for(client.embed(["one", "two"]), BOUND_S)
    [attempt] = attempt_spans(spans)
    assert received(sim, "s") == [ids(attempt)]
    assert sim.stats("s").by_status.get(200, 0) == 1
