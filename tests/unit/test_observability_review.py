"""Observability edges found in review: what spans say of the answer of a failed attempt or
of a call that was not served, which attempt a call with live spans tried last, and the
gauges of a client built outside any event loop, of a backend whose read fails on the loop, and
of a backend a client binds again on a new loop."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Iterator
from typing import Any

import prometheus_client
import pytest
from _async_only import AsyncOnly
from _closing import closing
from _failover_chat import failover_chat
from _start_attributes import StartAttributes
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from polygateway import OpenTelemetryEmitter
from polygateway.backends.base import (
    SourceSpec,
)
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import StreamInterrupted
from polygateway.middleware.gauges import LiveGauges
from polygateway.middleware.telemetry import AttemptStart, ClientInfo, PrometheusEmitter
from polygateway.models import AttemptRecord, CallRecord
from polygateway.ocr import OcrClient
from polygateway.testing import (
    BoundedSleep,
    FakeClock,
    FakeTransport,
    Recorder,
    StreamScript,
    TransientError,
    chat_chunk_events,
    chat_completion,
    gateway_settings,
    settle,
)

MESSAGES = [{"role": "user", "content": "hi"}]
ANSWER = ("gen_ai.response.model", "gen_ai.response.finish_reasons")


class Spans:
    """An SDK tracer provider exporting to memory."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def finished(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


@pytest.fixture
def spans() -> Iterator[Spans]:
    s = Spans()
    yield s
    s.provider.shutdown()


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def model_events(texts: list[str]) -> list[dict[str, Any]]:
    """A streamed chat answer whose every chunk names the model that answers."""
    events = chat_chunk_events(texts)
    for event in events:
        event["model"] = "big-1-0613"
    return events


async def read_all(chat: ChatClient) -> None:
    """Read a stream of ``chat`` to its end."""
    async with chat.stream(MESSAGES) as stream:
        async for _ in stream:
            pass


@pytest.mark.parametrize("propagate", [False, True], ids=["retroactive", "live"])
async def test_a_stream_cut_after_its_first_chunks_names_no_answer_on_its_spans(
    spans: Spans, propagate: bool
) -> None:
    """Interrupted mid-stream: the failed attempt's and the call's spans name no answer model."""
    clock = FakeClock()
    recorder = Recorder()
    emitter = OpenTelemetryEmitter(tracer_provider=spans.provider, propagate=propagate)
    script = {"primary": [StreamScript(model_events(["a", "b", "c"]), fail_after=2)]}
    chat = failover_chat(clock, FakeTransport(script, clock=clock), recorder, emitter)
    with pytest.raises(StreamInterrupted):
        await read_all(chat)
    [record] = recorder.records
    assert record.outcome == "transient"
    assert record.response_model == "big-1-0613"  # the record keeps what the attempt read
    [attempt] = [s for s in spans.finished() if s.parent is not None]
    [call] = [s for s in spans.finished() if s.parent is None]
    assert attrs(call)["polygateway.outcome"] == "interrupted"
    for span in (attempt, call):
        assert span.status.status_code is StatusCode.ERROR
        assert not [key for key in ANSWER if key in attrs(span)], span.name


async def test_a_stream_closed_early_names_no_answer_on_its_cancelled_spans(spans: Spans) -> None:
    """The consumer stops after one chunk: a cancelled call, whose spans name no answer."""
    clock = FakeClock()
    emitter = OpenTelemetryEmitter(tracer_provider=spans.provider)
    script = {"primary": [StreamScript(model_events(["a", "b"]))]}
    chat = failover_chat(clock, FakeTransport(script, clock=clock), emitter)
    async with chat.stream(MESSAGES) as stream:
        async for _ in stream:
            break
    finished = spans.finished()
    assert [attrs(s)["polygateway.outcome"] for s in finished] == ["cancelled", "cancelled"]
    for span in finished:
        assert not [key for key in ANSWER if key in attrs(span)], span.name


# --- live spans: the attempt a call tried last -------------------------------------------------


def live_emitter(spans: Spans) -> OpenTelemetryEmitter:
    """A propagating emitter that knows the failover pair's sources (``big-1``, ``claude-x``)."""
    emitter = OpenTelemetryEmitter(tracer_provider=spans.provider, propagate=True)
    settings = gateway_settings(
        {"name": "primary", "model": "big-1"},
        {"name": "backup", "protocol": "anthropic", "model": "claude-x"},
    )
    sources = settings.scopes["chat"].sources
    emitter.bind(ClientInfo("chat", "chat", sources, MemoryBackend(), lambda: 0))
    return emitter


def begin(emitter: OpenTelemetryEmitter, source: str, n: int) -> None:
    """The attempt ``n`` of call ``c1`` begins at ``source``: its live span starts."""
    hook = emitter.attempt_headers
    assert hook is not None
    assert hook(AttemptStart("c1", "chat", "chat.complete", source, n, 0.0))


def attempt(source: str, n: int, outcome: str = "transient", **fields: Any) -> AttemptRecord:
    status = 200 if outcome == "success" else 503
    return AttemptRecord("c1", "chat", source, n, outcome, status, 0.5, **fields)


def call(source: str | None, outcome: Any = "served") -> CallRecord:
    return CallRecord("c1", "chat", "chat.complete", outcome, 2, source, 2.0, 0.0, 0.0)


def test_a_failed_live_call_is_named_for_its_last_attempt_not_one_kept_aside(
    spans: Spans,
) -> None:
    """Attempt 1 had no live span (an SDK installed mid-call), attempt 2 had: named for 2."""
    emitter = live_emitter(spans)
    emitter.emit_attempt(attempt("primary", 1))
    begin(emitter, "backup", 2)
    emitter.emit_attempt(attempt("backup", 2))
    emitter.emit_call(call(None, "retry_exhausted"))
    [call_span] = [s for s in spans.finished() if s.parent is None]
    assert call_span.name == "chat claude-x"
    assert attrs(call_span)["gen_ai.request.model"] == "claude-x"


def test_a_live_call_served_by_an_attempt_without_a_live_span_names_its_answer(
    spans: Spans,
) -> None:
    """Attempt 1 had a live span, the serving attempt 2 none (its hook failed): 2's answer shows."""
    emitter = live_emitter(spans)
    begin(emitter, "primary", 1)
    emitter.emit_attempt(attempt("primary", 1))
    served = attempt(
        "backup", 2, "success", response_model="claude-x-2026", finish_reasons=("stop",)
    )
    emitter.emit_attempt(served)
    emitter.emit_call(call("backup"))
    [call_span] = [s for s in spans.finished() if s.parent is None]
    assert call_span.name == "chat claude-x"
    assert attrs(call_span)["gen_ai.response.model"] == "claude-x-2026"
    assert attrs(call_span)["gen_ai.response.finish_reasons"] == ("stop",)


# --- live spans: the source a call span names -------------------------------------------------


SOURCE_KEYS = (
    "gen_ai.request.model",
    "gen_ai.provider.name",
    "server.address",
    "server.port",
    "polygateway.source",
)


def source_attrs(span: ReadableSpan) -> dict[str, Any]:
    return {key: value for key, value in attrs(span).items() if key in SOURCE_KEYS}


@pytest.mark.parametrize("propagate", [False, True], ids=["retroactive", "live"])
async def test_an_ocr_call_failed_over_to_a_source_without_a_model_names_no_model(
    propagate: bool,
) -> None:
    """Vision (``vl-1``) fails, MonkeyOCR (no model) serves: the call span names MonkeyOCR only.

    A live call span starts before the call knows its source, so it starts
    with what every source of the scope shares (here the operation and the
    scope: what a sampler sees) and takes the serving source's attributes
    from the call's record; each attempt span keeps its own source's.
    """
    exporter = InMemorySpanExporter()
    sampler = StartAttributes()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    emitter = OpenTelemetryEmitter(tracer_provider=provider, propagate=propagate)
    clock = FakeClock()
    settings = gateway_settings(
        {
            "name": "vision",
            "protocol": "vision_ocr",
            "base_url": "https://vl.example/v1",
            "model": "vl-1",
        },
        {
            "name": "monkey",
            "protocol": "monkey_ocr",
            "base_url": "http://monkey.local:7000",
            "model": "",
            "priority": 1,
        },
        scope="ocr",
        kind="ocr",
        breaker_failures=1,
    )
    monkey_answer = {"success": True, "task_type": "text", "content": "TEXT", "message": "ok"}
    script: dict[str, Any] = {
        "vision": [TransientError(status_code=503)],
        "monkey": [monkey_answer],
    }
    ocr = closing(
        OcrClient(
            settings,
            "ocr",
            backend=MemoryBackend(now=clock),
            transport=FakeTransport(script, clock=clock),
            now=clock,
            sleep=BoundedSleep(clock, max_calls=200),
            rng=random.Random(3),
            emitter=emitter,
        )
    )
    try:
        assert (await ocr.recognize_text(b"\x89PNG\r\n\x1a\n" + b"\x00" * 64)).text == "TEXT"
    finally:
        provider.shutdown()
    finished = list(exporter.get_finished_spans())
    [call_span] = [s for s in finished if s.parent is None]
    failed, served = sorted(
        (s for s in finished if s.parent is not None),
        key=lambda s: attrs(s)["polygateway.attempt"],
    )
    monkey = {
        "gen_ai.provider.name": "monkey_ocr",
        "server.address": "monkey.local",
        "server.port": 7000,
        "polygateway.source": "monkey",
    }
    assert call_span.name == "generate_content"
    assert source_attrs(call_span) == monkey
    assert served.name == "generate_content"
    assert source_attrs(served) == monkey
    assert failed.name == "generate_content vl-1"
    assert source_attrs(failed) == {
        "gen_ai.request.model": "vl-1",
        "gen_ai.provider.name": "openai",
        "server.address": "vl.example",
        "server.port": 443,
        "polygateway.source": "vision",
    }
    if propagate:
        # Started first, before its attempts: the call span as a sampler saw it.
        assert sampler.seen[0] == (
            "generate_content",
            {"gen_ai.operation.name": "generate_content", "polygateway.scope": "ocr"},
        )


def test_a_live_call_span_starts_with_the_attributes_its_scope_s_sources_share() -> None:
    """Two sources of one provider and model on two hosts: a sampler sees the model, no host."""
    sampler = StartAttributes()
    provider = TracerProvider(sampler=sampler)
    emitter = OpenTelemetryEmitter(tracer_provider=provider, propagate=True)
    settings = gateway_settings(
        {"name": "a", "base_url": "https://a.example/v1", "model": "big-1"},
        {"name": "b", "base_url": "https://b.example/v1", "model": "big-1"},
    )
    sources = settings.scopes["chat"].sources
    emitter.bind(ClientInfo("chat", "chat", sources, MemoryBackend(), lambda: 0))
    hook = emitter.attempt_headers
    assert hook is not None
    assert hook(AttemptStart("c1", "chat", "chat.complete", "a", 1, 0.0))
    provider.shutdown()
    assert sampler.seen[0] == (
        "chat big-1",
        {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": "big-1",
            "server.port": 443,
            "polygateway.scope": "chat",
        },
    )


# --- the gauges of a client built outside any loop ---------------------------------------------


def limits(reader: InMemoryMetricReader) -> dict[str, float]:
    """The ``polygateway.source.limit`` points collected now, by source."""
    data = reader.get_metrics_data()
    points: list[Any] = [
        point
        for resource in (data.resource_metrics if data is not None else ())
        for scope in resource.scope_metrics
        for metric in scope.metrics
        if metric.name == "polygateway.source.limit"
        for point in metric.data.data_points
    ]
    return {str(point.attributes["polygateway.source"]): point.value for point in points}


async def test_otel_gauges_of_a_client_built_outside_any_loop_read_it_after_its_first_call() -> (
    None
):
    """Built in a thread without a loop, the client's loop is learnt from its first call."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    clock = FakeClock()

    def build() -> ChatClient:
        return closing(
            ChatClient(
                gateway_settings({"name": "primary", "max_concurrency": 4}),
                backend=AsyncOnly(MemoryBackend(now=clock)),
                transport=FakeTransport([chat_completion("ok")], clock=clock),
                now=clock,
                sleep=BoundedSleep(clock),
                rng=random.Random(3),
                emitter=OpenTelemetryEmitter(meter_provider=provider),
            )
        )

    try:
        chat = await asyncio.to_thread(build)
        assert await asyncio.to_thread(limits, reader) == {}  # no loop known: nothing to read
        await chat.complete(MESSAGES)
        assert await asyncio.to_thread(limits, reader) == {"primary": 4}
    finally:
        provider.shutdown()


def limit_sample(registry: CollectorRegistry) -> float | None:
    """``polygateway_source_limit`` of the chat scope's ``primary`` source, scraped now."""
    text = generate_latest(registry).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "polygateway_source_limit":
                return sample.value
    return None


async def test_a_refresh_on_the_loop_failing_from_a_bug_withdraws_the_snapshot_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Scraped on the loop, a read that raises a bug is no stale reading, and is logged."""
    clock = FakeClock()
    registry = CollectorRegistry()
    gauges = LiveGauges(prometheus_client, now=clock)
    registry.register(gauges)
    backend = AsyncOnly(MemoryBackend(now=clock))
    await backend.acquire("chat", [SourceSpec("primary", 4)], ttl_s=60.0)
    settings = gateway_settings({"name": "primary", "max_concurrency": 4})
    gauges.bind(ClientInfo("chat", "chat", settings.scope("chat").sources, backend, lambda: 0))
    limit_sample(registry)  # starts the first refresh
    await settle()
    assert limit_sample(registry) == 4.0
    await settle()
    backend.error = RuntimeError("a bug in a backend")
    with caplog.at_level(logging.DEBUG, logger="polygateway"):
        limit_sample(registry)  # the latest snapshot; its refresh fails
        await settle()
        assert limit_sample(registry) is None
        await settle()
    assert any(
        record.levelno == logging.WARNING
        and record.getMessage()
        == "live gauges of scope chat: refresh failed: RuntimeError('a bug in a backend')"
        for record in caplog.records
    ), caplog.messages


async def _after_an_earlier_run() -> tuple[Callable[[], ChatClient], CollectorRegistry]:
    """Clients sharing one backend and emitter, one of which served in an ended ``asyncio.run``.

    Returns the factory of further clients and the emitter's registry.
    """
    clock = FakeClock()
    registry = CollectorRegistry()
    emitter = PrometheusEmitter(registry)
    backend = AsyncOnly(MemoryBackend(now=clock))

    def build() -> ChatClient:
        return ChatClient(
            gateway_settings({"name": "primary", "max_concurrency": 4}),
            backend=backend,
            transport=FakeTransport([chat_completion("ok")], clock=clock),
            now=clock,
            sleep=BoundedSleep(clock),
            rng=random.Random(3),
            emitter=emitter,
        )

    async def earlier_run() -> None:
        async with build() as chat:
            await chat.complete(MESSAGES)

    await asyncio.to_thread(asyncio.run, earlier_run())
    return build, registry


async def test_a_backend_bound_again_on_a_new_loop_is_read_through_that_loop() -> None:
    """A client of an earlier ``asyncio.run`` is gone; one on this loop shares its backend."""
    build, registry = await _after_an_earlier_run()
    chat = closing(build())
    await chat.complete(MESSAGES)
    assert await asyncio.to_thread(limit_sample, registry) == 4.0


async def test_a_backend_bound_again_outside_any_loop_is_read_through_its_first_call_s() -> None:
    """The earlier run's loop is gone; a client built in a thread learns this loop when called."""
    build, registry = await _after_an_earlier_run()
    chat = closing(await asyncio.to_thread(build))
    await chat.complete(MESSAGES)
    assert await asyncio.to_thread(limit_sample, registry) == 4.0


# --- one emitter given twice -------------------------------------------------------------------


async def test_an_emitter_given_as_emitter_and_among_emitters_gets_each_record_once(
    spans: Spans,
) -> None:
    """Passed both ways, an emitter is one emitter: one record each, and every span ended."""
    clock = FakeClock()
    recorder = Recorder()
    emitter = OpenTelemetryEmitter(tracer_provider=spans.provider, propagate=True)
    chat = closing(
        ChatClient(
            gateway_settings("primary"),
            backend=MemoryBackend(now=clock),
            transport=FakeTransport([chat_completion("ok")], clock=clock),
            now=clock,
            sleep=BoundedSleep(clock),
            rng=random.Random(3),
            emitter=recorder,
            emitters=[emitter, recorder, emitter],
        )
    )
    await chat.complete(MESSAGES)
    assert (recorder.outcomes(), recorder.call_outcomes()) == (["success"], ["served"])
    finished = spans.finished()
    assert [s.parent is None for s in finished] == [False, True]
    [attempt, call] = finished
    assert attempt.parent is not None
    assert attempt.parent.span_id == call.context.span_id
