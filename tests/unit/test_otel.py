"""OpenTelemetry: a CLIENT span per call with a child per attempt (GenAI conventions), the GenAI
client metrics, live gauges from the backend, and nothing of a prompt, completion or key."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _failover_chat import failover_chat
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import polygateway.middleware.otel as otel
from polygateway import OpenTelemetryEmitter
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import AllSourcesExhausted
from polygateway.middleware.telemetry import ClientInfo
from polygateway.models import AttemptRecord
from polygateway.testing import (
    Delay,
    FakeClock,
    FakeTransport,
    StreamScript,
    TransientError,
    anthropic_message,
    chat_chunk_events,
    chat_completion,
)

PROMPT = "tell me the launch codes, please"
COMPLETION = "the codes are under the mat"
MESSAGES = [{"role": "user", "content": PROMPT}]
SECRETS = ("sk-test-primary-secret", "sk-test-backup-secret")


class Otel:
    """An SDK tracer and meter provider reading into memory, and an emitter on them."""

    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.emitter = OpenTelemetryEmitter(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider
        )

    def finished(self) -> tuple[ReadableSpan, ...]:
        return tuple(self.spans.get_finished_spans())

    def points(self) -> dict[str, list[Any]]:
        """Every data point collected now, by metric name."""
        out: dict[str, list[Any]] = {}
        data = self.reader.get_metrics_data()
        assert data is not None
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    out.setdefault(metric.name, []).extend(metric.data.data_points)
        return out

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@pytest.fixture
def sdk() -> Iterator[Otel]:
    o = Otel()
    yield o
    o.shutdown()


def make_chat(clock: FakeClock, script: Any, emitter: Any, **gateway: Any) -> ChatClient:
    """The failover pair on a fake clock, answering from ``script``."""
    return failover_chat(clock, FakeTransport(script, clock=clock), emitter, **gateway)


def attribute_values(spans: tuple[ReadableSpan, ...], points: dict[str, list[Any]]) -> list[str]:
    """Every attribute value of every span and data point, and every span name, as text."""
    values = [span.name for span in spans]
    for span in spans:
        values += [str(v) for v in (span.attributes or {}).values()]
        values.append(str(span.status.description))
    for series in points.values():
        for point in series:
            values += [str(v) for v in point.attributes.values()]
    return values


async def test_a_call_that_fails_over_once_is_one_span_with_two_attempt_children(sdk: Otel) -> None:
    """Primary fails, backup serves: a CLIENT call span with two attempt spans beneath it."""
    clock = FakeClock()
    chat = make_chat(
        clock,
        {
            "primary": [Delay(1.0, TransientError(status_code=503))],
            "backup": [Delay(2.0, anthropic_message(COMPLETION))],
        },
        sdk.emitter,
    )
    app = sdk.tracer_provider.get_tracer("app")
    with app.start_as_current_span("handle request") as outer:
        r = await chat.complete(MESSAGES)
    assert r.text == COMPLETION
    spans = {s.name: s for s in sdk.finished()}
    call = spans["chat claude-x"]
    children = sorted(
        (s for s in sdk.finished() if s.parent and s.parent.span_id == call.context.span_id),
        key=lambda s: (s.attributes or {})["polygateway.attempt"],
    )
    assert [s.name for s in children] == ["chat big-1", "chat claude-x"]
    assert call.kind is SpanKind.CLIENT
    assert all(s.kind is SpanKind.CLIENT for s in children)
    assert call.parent is not None
    assert call.parent.span_id == outer.get_span_context().span_id
    assert call.context.trace_id == outer.get_span_context().trace_id
    assert call.status.status_code is StatusCode.UNSET
    attrs = dict(call.attributes or {})
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.provider.name"] == "anthropic"
    assert attrs["gen_ai.request.model"] == "claude-x"
    assert (attrs["server.address"], attrs["server.port"]) == ("backup.internal", 8080)
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (11, 4)
    assert attrs["polygateway.scope"] == "chat"
    assert attrs["polygateway.source"] == "backup"
    assert attrs["polygateway.outcome"] == "served"
    assert attrs["polygateway.attempts"] == 2
    assert attrs["polygateway.operation"] == "chat.complete"
    assert "polygateway.waited_s" in attrs
    assert "polygateway.stalled_s" in attrs
    assert "error.type" not in attrs
    assert call.end_time is not None
    assert call.start_time is not None
    assert (call.end_time - call.start_time) / 1e9 >= 3.0  # two attempts and a back-off
    failed, served = (dict(s.attributes or {}) for s in children)
    assert failed["gen_ai.provider.name"] == "openai"
    assert (failed["server.address"], failed["server.port"]) == ("llm.example.com", 443)
    assert failed["error.type"] == failed["polygateway.outcome"] != "success"
    assert failed["http.response.status_code"] == 503
    assert children[0].status.status_code is StatusCode.ERROR
    assert served["polygateway.outcome"] == "success"
    assert "error.type" not in served
    assert children[1].end_time is not None
    assert children[1].start_time is not None
    assert (children[1].end_time - children[1].start_time) / 1e9 == pytest.approx(2.0, abs=0.01)
    values = attribute_values(sdk.finished(), sdk.points())
    for needle in (PROMPT, COMPLETION, *SECRETS):
        assert not any(needle in v for v in values), needle


async def test_an_error_call_carries_error_type_and_no_echoed_prompt(sdk: Otel) -> None:
    """Every source fails (one echoing the prompt in its error): error.type is the reason."""
    clock = FakeClock()
    echo = TransientError(f"400? no, 500: could not handle {PROMPT!r}", status_code=500)
    chat = make_chat(
        clock,
        {"primary": [echo], "backup": [TransientError(status_code=502)]},
        sdk.emitter,
        max_attempts=2,
    )
    with pytest.raises(AllSourcesExhausted) as caught:
        await chat.complete(MESSAGES, fail_fast=True)
    [call] = [s for s in sdk.finished() if s.parent is None]
    attrs = dict(call.attributes or {})
    assert attrs["error.type"] == caught.value.reason == "retry_exhausted"
    assert call.status.status_code is StatusCode.ERROR
    assert "polygateway.source" not in attrs  # none served
    assert call.name == "chat claude-x"  # the last source tried
    attempts = [s for s in sdk.finished() if s.parent is not None]
    assert len(attempts) == 2
    assert all("error.type" in (s.attributes or {}) for s in attempts)
    [duration] = sdk.points()["gen_ai.client.operation.duration"]
    assert duration.attributes["error.type"] == "retry_exhausted"
    # The record's error does quote the prompt: the spans must not have taken it.
    assert any(PROMPT in (a.error or "") for a in caught.value.attempts)
    values = attribute_values(sdk.finished(), sdk.points())
    for needle in (PROMPT, *SECRETS):
        assert not any(needle in v for v in values), needle


async def test_a_call_that_never_reaches_a_source_is_a_span_without_children(sdk: Otel) -> None:
    """Behind an open breaker a fail_fast call still yields its span (no_runnable), no model."""
    clock = FakeClock()
    chat = make_chat(
        clock,
        {"primary": [TransientError(status_code=500)], "backup": [TransientError(status_code=500)]},
        sdk.emitter,
        max_attempts=2,
    )
    for _ in range(2):
        with pytest.raises(AllSourcesExhausted):
            await chat.complete(MESSAGES, fail_fast=True)
    last = [s for s in sdk.finished() if s.parent is None][-1]
    assert (last.attributes or {})["error.type"] == "no_runnable"
    assert last.name == "chat"
    assert not [s for s in sdk.finished() if s.parent and s.parent.span_id == last.context.span_id]


async def test_the_genai_client_metrics_are_recorded(sdk: Otel) -> None:
    """Duration per call, tokens by type, and time to first chunk of a streamed attempt."""
    clock = FakeClock()
    chat = make_chat(
        clock,
        {
            "primary": [
                chat_completion(COMPLETION, prompt_tokens=7, completion_tokens=3),
                StreamScript(chat_chunk_events(["a", "b"])),
            ]
        },
        sdk.emitter,
    )
    await chat.complete(MESSAGES)
    async with chat.stream(MESSAGES) as stream:
        assert [c.text async for c in stream]
    points = sdk.points()
    durations = points["gen_ai.client.operation.duration"]
    assert sum(p.count for p in durations) == 2
    assert all(p.attributes["gen_ai.operation.name"] == "chat" for p in durations)
    assert all(p.attributes["gen_ai.provider.name"] == "openai" for p in durations)
    tokens = {p.attributes["gen_ai.token.type"]: p.sum for p in points["gen_ai.client.token.usage"]}
    assert tokens["input"] >= 7
    assert tokens["output"] >= 3
    [ttfc] = points["gen_ai.client.operation.time_to_first_chunk"]
    assert ttfc.count == 1
    assert ttfc.attributes["gen_ai.request.model"] == "big-1"


async def test_the_gauges_read_the_memory_backend(sdk: Otel) -> None:
    """Bound to a client, the gauges show its sources' permits, limit and breaker state."""
    clock = FakeClock()
    chat = make_chat(
        clock,
        {"primary": [TransientError(status_code=500)], "backup": [anthropic_message("ok")]},
        sdk.emitter,
    )
    await chat.complete(MESSAGES)
    points = sdk.points()
    breaker = {
        (p.attributes["polygateway.source"], p.attributes["polygateway.breaker.state"]): p.value
        for p in points["polygateway.source.breaker.state"]
    }
    assert breaker[("primary", "open")] == 1
    assert breaker[("primary", "closed")] == 0
    assert breaker[("backup", "closed")] == 1
    in_use = {
        p.attributes["polygateway.source"]: p.value
        for p in points["polygateway.source.permits.in_use"]
    }
    assert in_use == {"primary": 0, "backup": 0}
    limits = {p.attributes["polygateway.source"] for p in points["polygateway.source.limit"]}
    assert limits == {"primary", "backup"}
    [waiting] = points["polygateway.scope.calls.waiting"]
    assert (waiting.attributes["polygateway.scope"], waiting.value) == ("chat", 0)
    reopen = {
        p.attributes["polygateway.source"]: p.value
        for p in points["polygateway.source.breaker.reopen"]
    }
    assert reopen["primary"] > 0


def test_attempts_of_a_lost_call_are_bounded_and_still_exported(
    sdk: Otel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attempts whose call record never comes are kept for a bounded number of calls only."""
    monkeypatch.setattr(otel, "_MAX_PENDING_CALLS", 3)
    for i in range(10):
        sdk.emitter.emit_attempt(
            AttemptRecord(
                call_id=f"c{i}",
                scope="chat",
                source="primary",
                attempt=1,
                outcome="success",
                status_code=200,
                latency_s=0.1,
            )
        )
    assert len(sdk.emitter._pending) == 3
    assert len(sdk.finished()) == 7  # the attempts of the calls pushed out, without a parent


def test_without_an_sdk_nothing_is_kept_per_call() -> None:
    """On the API's no-op providers (no SDK installed) records are taken and nothing is kept."""
    emitter = OpenTelemetryEmitter()
    for i in range(300):
        emitter.emit_attempt(
            AttemptRecord(f"c{i}", "chat", "primary", 1, "success", 200, 0.1, ttft_s=0.05)
        )
    assert len(emitter._pending) == 0


def test_on_the_no_op_providers_the_emitter_says_it_records_nothing() -> None:
    """Without an SDK the emitter is idle, so the loop builds no records for it."""
    assert OpenTelemetryEmitter().is_recording() is False


def test_an_sdk_for_spans_or_for_metrics_alone_makes_the_emitter_record(sdk: Otel) -> None:
    """Spans to an SDK, or metrics to one, are records kept: either makes the emitter record."""
    assert OpenTelemetryEmitter(tracer_provider=sdk.tracer_provider).is_recording() is True
    assert OpenTelemetryEmitter(meter_provider=sdk.meter_provider).is_recording() is True


async def test_an_idle_emitter_is_handed_no_record_by_the_loop() -> None:
    """The loop asks ``is_recording`` and hands records only while the emitter keeps them."""

    class Idle:
        def __init__(self) -> None:
            self.recording = False
            self.attempts: list[AttemptRecord] = []
            self.calls: list[Any] = []

        def is_recording(self) -> bool:
            return self.recording

        def emit_attempt(self, record: AttemptRecord) -> None:
            self.attempts.append(record)

        def emit_call(self, record: Any) -> None:
            self.calls.append(record)

    clock = FakeClock()
    idle = Idle()
    chat = make_chat(clock, [chat_completion("one"), chat_completion("two")], idle)
    await chat.complete(MESSAGES)
    assert (idle.attempts, idle.calls) == ([], [])
    idle.recording = True
    await chat.complete(MESSAGES)
    assert [r.outcome for r in idle.attempts] == ["success"]
    assert [r.outcome for r in idle.calls] == ["served"]


def test_a_global_sdk_installed_after_the_client_is_picked_up() -> None:
    """An SDK set as the global providers after the emitter is built is found again.

    In a child interpreter: a global provider can be set once per process.
    """
    script = """
import asyncio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from polygateway import OpenTelemetryEmitter
from polygateway.middleware.otel import _RECHECK_EVERY
from polygateway.middleware.telemetry import Emitters

emitter = OpenTelemetryEmitter()
fan_out = Emitters([emitter])
assert not fan_out.recording()
spans = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(spans))
trace.set_tracer_provider(provider)
looks = 0
while not fan_out.recording():
    looks += 1
    assert looks <= _RECHECK_EVERY, looks
print(looks)
"""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert 0 < int(done.stdout) <= otel._RECHECK_EVERY


def test_attempts_pushed_out_are_named_for_their_own_scope(
    sdk: Otel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat call's attempts pushed out by an embedding call's keep the chat operation."""
    monkeypatch.setattr(otel, "_MAX_PENDING_CALLS", 1)
    for kind, scope in (("chat", "talk"), ("embed", "vectors")):
        sdk.emitter.bind(ClientInfo(kind, scope, (), MemoryBackend(now=FakeClock()), lambda: 0))
    for call_id, scope in (("c1", "talk"), ("c2", "vectors")):
        sdk.emitter.emit_attempt(AttemptRecord(call_id, scope, "primary", 1, "success", 200, 0.1))
    [span] = sdk.finished()
    assert span.attributes is not None
    assert span.attributes["gen_ai.operation.name"] == "chat"
    assert span.attributes["polygateway.scope"] == "talk"


def test_the_emitter_holds_a_bound_clients_backend_weakly(sdk: Otel) -> None:
    """A client's backend that is gone is neither kept alive nor read by the gauges."""
    import gc
    import weakref

    backend = MemoryBackend(now=FakeClock())
    sdk.emitter.bind(ClientInfo("chat", "talk", (), backend, lambda: 0))
    gone = weakref.ref(backend)
    del backend
    gc.collect()
    assert gone() is None
    assert sdk.reader.get_metrics_data() is None  # nothing alive to read: no gauge has a point
