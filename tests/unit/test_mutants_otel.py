"""OpenTelemetry edges that mutation testing found unpinned (research-wiki/MUTATION.md).

Whole exported structures, compared at once: every span's name, kind, parent,
start and end (the wall clock pinned, so a span is dated exactly from its
record), status and full attribute set, for spans made from records and for
live spans (trace propagation), including calls pushed out past the caps;
every instrument's name, unit, description and bucket boundaries; every data
point's attributes and value, gauges included; how often the emitter looks
for an SDK while idle; and its repr and its error without the API.
"""

# Survivors of the run at 4d06f4c these tests kill, all in polygateway.middleware.otel:
#   x__source_attributes__mutmut_6; x__operation__mutmut_6, 10, 11, 12, 13
#   xǁ_Shapeǁ__init____mutmut_4, 5; xǁ_Pendingǁ__init____mutmut_1; xǁ_Liveǁ__init____mutmut_4
#   xǁ_Liveǁend__mutmut_1, 2
#   xǁOpenTelemetryEmitterǁ__init____mutmut_18 to 23, 48, 51, 72, 74 to 76, 79 to 83, 89,
#     91 to 93, 96 to 100, 106, 108 to 110, 113 to 117
#   xǁOpenTelemetryEmitterǁ__repr____mutmut_1 to 8; ǁis_recording__mutmut_2; ǁ_look__mutmut_3, 5
#   xǁOpenTelemetryEmitterǁ_attempt_headers__mutmut_16, 18, 19, 23, 24, 29, 43, 47 to 49,
#     52 to 54
#   xǁOpenTelemetryEmitterǁemit_attempt__mutmut_12, 13, 19, 27, 32 to 36, 38, 39, 48, 52, 53
#   xǁOpenTelemetryEmitterǁemit_call__mutmut_6, 12, 15, 21, 26, 28, 29, 45 to 47, 65, 75 to 79,
#     85 to 89
#   xǁOpenTelemetryEmitterǁ_call_span__mutmut_2, 4, 8, 13, 20, 49
#   xǁOpenTelemetryEmitterǁ_end_call_span__mutmut_1, 5 to 16, 22, 27
#   xǁOpenTelemetryEmitterǁ_call_attributes__mutmut_18; ǁ_attempt_spans__mutmut_22, 25
#   xǁOpenTelemetryEmitterǁ_end_attempt_span__mutmut_2 to 5, 10 to 13, 24 to 33, 42
#     (numbers of the run: the answer's attributes are now `_answer_attributes`)
#   xǁOpenTelemetryEmitterǁbind__mutmut_2
#   xǁOpenTelemetryEmitterǁ_gauges__mutmut_4 to 8, 12 to 16, 18, 20 to 27, 30 to 34, 37, 38,
#     40 to 46, 48 to 53, 60, 61, 69, 70, 73 to 75, 82, 83, 86 to 90
#   xǁOpenTelemetryEmitterǁ_snapshots__mutmut_4, 5, 6, 9, 10, 13 to 20
#   xǁOpenTelemetryEmitterǁ_source_callback__mutmut_7, 8; ǁ_breaker_callback__mutmut_4, 5
#   xǁOpenTelemetryEmitterǁ_waiting_callback__mutmut_4, 5
# and of the run of 2026-12-07 18:32 UTC: xǁOpenTelemetryEmitterǁ_call_shape__mutmut_2, 3, 7

from __future__ import annotations

import logging
import sys
import types
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import opentelemetry.metrics
import opentelemetry.trace
import pytest
from _start_attributes import StartAttributes
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracerProvider, SpanKind, StatusCode

import polygateway.middleware.otel as otel
from polygateway import OpenTelemetryEmitter
from polygateway.backends.base import ScopeSnapshot, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.config import SourceConfig
from polygateway.errors import ConfigError
from polygateway.middleware.telemetry import AttemptStart, ClientInfo
from polygateway.models import AttemptRecord, CallRecord
from polygateway.testing import FakeClock, gateway_settings

NOW = 1_000_000_000_123_456_789
"""The wall clock the emitter reads (ns): far from the real one, so an SDK-dated span shows."""

S = 1_000_000_000
"""Nanoseconds in a second."""

Attrs = dict[str, Any]


def chat_sources() -> tuple[SourceConfig, ...]:
    """An https OpenAI source, an Anthropic one on a port, an http one on the default port."""
    settings = gateway_settings(
        {"name": "primary", "base_url": "https://llm.example.com/v1", "model": "big-1"},
        {
            "name": "backup",
            "protocol": "anthropic",
            "base_url": "http://backup.internal:8080",
            "model": "claude-x",
        },
        {"name": "plain", "base_url": "http://plain.example/v1", "model": "plain-1"},
    )
    return settings.scopes["chat"].sources


def ocr_sources() -> tuple[SourceConfig, ...]:
    """A vision chat model (the OpenAI wire) and a MonkeyOCR server without a model."""
    settings = gateway_settings(
        {"name": "vision", "protocol": "vision_ocr", "base_url": "https://vl.example/v1"},
        {"name": "monkey", "protocol": "monkey_ocr", "base_url": "http://monkey.local:7000"},
        scope="ocr",
        kind="ocr",
    )
    [vision, monkey] = settings.scopes["ocr"].sources
    return (vision.model_copy(update={"model": "vl-1"}), monkey.model_copy(update={"model": ""}))


def shape(source: str | None, operation: str = "chat", scope: str = "chat", **extra: Any) -> Attrs:
    """What every span and data point of ``source`` shares (the bound sources above)."""
    known: dict[str | None, Attrs] = {
        None: {},
        "primary": {
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": "big-1",
            "server.address": "llm.example.com",
            "server.port": 443,
        },
        "backup": {
            "gen_ai.provider.name": "anthropic",
            "gen_ai.request.model": "claude-x",
            "server.address": "backup.internal",
            "server.port": 8080,
        },
        "plain": {
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": "plain-1",
            "server.address": "plain.example",
            "server.port": 80,
        },
        "vision": {
            "gen_ai.provider.name": "openai",
            "gen_ai.request.model": "vl-1",
            "server.address": "vl.example",
            "server.port": 443,
        },
        "monkey": {
            "gen_ai.provider.name": "monkey_ocr",
            "server.address": "monkey.local",
            "server.port": 7000,
        },
    }
    return {
        "gen_ai.operation.name": operation,
        **known.get(source, {}),
        "polygateway.scope": scope,
        **extra,
    }


def attempt(
    call_id: str,
    source: str,
    n: int,
    outcome: str = "success",
    latency_s: float = 1.0,
    scope: str = "chat",
    **fields: Any,
) -> AttemptRecord:
    status = fields.pop("status_code", 200 if outcome == "success" else 503)
    return AttemptRecord(call_id, scope, source, n, outcome, status, latency_s, **fields)


def call(
    call_id: str,
    source: str | None,
    outcome: str = "served",
    *,
    attempts: int = 1,
    duration_s: float = 2.0,
    operation: str = "chat.complete",
    scope: str = "chat",
    **fields: Any,
) -> CallRecord:
    return CallRecord(
        call_id=call_id,
        scope=scope,
        operation=operation,
        outcome=outcome,  # type: ignore[arg-type]
        attempts=attempts,
        source=source,
        duration_s=duration_s,
        waited_s=fields.pop("waited_s", 0.0),
        stalled_s=fields.pop("stalled_s", 0.0),
        **fields,
    )


def attempt_attrs(record: AttemptRecord, operation: str = "chat", **extra: Any) -> Attrs:
    """The full attribute set of an attempt's span, as the guide lists it."""
    out = shape(record.source, operation, record.scope)
    out |= {
        "polygateway.source": record.source,
        "polygateway.call_id": record.call_id,
        "polygateway.attempt": record.attempt,
        "polygateway.outcome": record.outcome,
        "polygateway.permit_wait_s": record.permit_wait_s,
        "polygateway.stalled_s": record.stalled_s,
    }
    if record.status_code is not None:
        out["http.response.status_code"] = record.status_code
    return out | extra


def call_attrs(record: CallRecord, span_source: str | None, operation: str = "chat") -> Attrs:
    """The attributes every call span has: its shape and the call's own."""
    return shape(span_source, operation, record.scope) | {
        "polygateway.operation": record.operation,
        "polygateway.call_id": record.call_id,
        "polygateway.outcome": record.outcome,
        "polygateway.attempts": record.attempts,
        "polygateway.waited_s": record.waited_s,
        "polygateway.stalled_s": record.stalled_s,
    }


class Sdk:
    """SDK providers reading into memory, an emitter on them, the wall clock pinned at NOW."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, propagate: bool = False) -> None:
        monkeypatch.setattr(otel, "time", types.SimpleNamespace(time_ns=lambda: NOW))
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.emitter = OpenTelemetryEmitter(
            tracer_provider=self.tracer_provider,
            meter_provider=self.meter_provider,
            propagate=propagate,
        )
        self.clock = FakeClock()
        self.backend = MemoryBackend(now=self.clock)

    def bind(
        self,
        scope: str = "chat",
        sources: tuple[SourceConfig, ...] = (),
        *,
        kind: str = "chat",
        backend: Any = None,
        waiting: Callable[[], int] = lambda: 0,
    ) -> None:
        backend = self.backend if backend is None else backend
        self.emitter.bind(ClientInfo(kind, scope, sources, backend, waiting))

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def exported(self) -> list[tuple[Any, ...]]:
        """(name, kind, parent's name, start - NOW, end - NOW, status, attributes) of each span."""
        spans = self.spans()
        names = {s.context.span_id: s.name for s in spans if s.context is not None}
        return [
            (
                s.name,
                s.kind,
                None if s.parent is None else names.get(s.parent.span_id, "<outside>"),
                None if s.start_time is None else s.start_time - NOW,
                None if s.end_time is None else s.end_time - NOW,
                s.status.status_code,
                dict(s.attributes or {}),
            )
            for s in spans
        ]

    def metrics(self) -> dict[str, Any]:
        """Every metric collected now, by name."""
        data = self.reader.get_metrics_data()
        assert data is not None
        return {
            m.name: m
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for m in scope.metrics
        }

    def points(self, name: str) -> dict[frozenset[tuple[str, Any]], Any]:
        """The data points of one metric by their attribute set."""
        metric = self.metrics().get(name)
        if metric is None:
            return {}
        return {frozenset(p.attributes.items()): p for p in metric.data.data_points}

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sdk]:
    s = Sdk(monkeypatch)
    s.bind("chat", chat_sources())
    s.bind("ocr", ocr_sources(), kind="ocr")
    yield s
    s.shutdown()


@pytest.fixture
def live(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sdk]:
    s = Sdk(monkeypatch, propagate=True)
    s.bind("chat", chat_sources())
    yield s
    s.shutdown()


CLIENT = SpanKind.CLIENT
UNSET, ERROR = StatusCode.UNSET, StatusCode.ERROR


# --- spans made from records ---------------------------------------------------------------


def test_spans_from_records_carry_exact_names_times_and_attribute_sets(sdk: Sdk) -> None:
    """Each call and attempt span: its name, parent, dates from the record, status and attributes.

    A call served after a failover; an OCR call (``generate_content``, the
    vision source named ``openai``); a failed call named for the last source
    tried; a call that reached no source; a served call without attempt
    records; an embedding call and an unknown operation of unbound scopes.
    """
    failed = attempt("c1", "primary", 1, "transient", 1.0, permit_wait_s=0.25, stalled_s=0.5)
    served = attempt(
        "c1",
        "backup",
        2,
        latency_s=2.0,
        ttft_s=0.3,
        prompt_tokens=11,
        completion_tokens=4,
        response_model="claude-x-2026",
        finish_reasons=("stop",),
    )
    ocr = attempt("c2", "vision", 1, latency_s=1.5, scope="ocr", response_model="vl-1-0613")
    limited = attempt("c3", "plain", 1, "rate_limited", 1.0, status_code=429)
    calls = [
        call(
            "c1",
            "backup",
            attempts=2,
            duration_s=3.5,
            operation="chat.stream",
            waited_s=0.5,
            stalled_s=0.5,
            prompt_tokens=11,
            completion_tokens=4,
        ),
        call("c2", "vision", duration_s=1.5, operation="ocr.recognize_text", scope="ocr"),
        call("c3", None, "retry_exhausted", duration_s=1.0),
        call("c4", None, "no_runnable", attempts=0, duration_s=1.0),
        call("c5", "primary", duration_s=1.0),
        call("c6", None, "no_runnable", attempts=0, duration_s=1.0, operation="embed", scope="e"),
        call("c7", None, "no_runnable", attempts=0, duration_s=1.0, operation="rerank.top.k"),
    ]
    for record in (failed, served, ocr, limited):
        sdk.emitter.emit_attempt(record)
    assert sdk.spans() == []  # kept until their call's record
    for record in calls:
        sdk.emitter.emit_call(record)
    answer = {
        "gen_ai.response.model": "claude-x-2026",
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": 11,
        "gen_ai.usage.output_tokens": 4,
    }
    assert sdk.exported() == [
        (
            "chat big-1",
            CLIENT,
            "chat claude-x",
            -S,
            0,
            ERROR,
            attempt_attrs(failed, **{"error.type": "transient"}),
        ),
        (
            "chat claude-x",
            CLIENT,
            "chat claude-x",
            -2 * S,
            0,
            UNSET,
            attempt_attrs(served, **answer, **{"polygateway.ttft_s": 0.3}),
        ),
        (
            "chat claude-x",
            CLIENT,
            None,
            -3 * S - S // 2,
            0,
            UNSET,
            call_attrs(calls[0], "backup") | {"polygateway.source": "backup"} | answer,
        ),
        (
            "generate_content vl-1",
            CLIENT,
            "generate_content vl-1",
            -S - S // 2,
            0,
            UNSET,
            attempt_attrs(ocr, "generate_content", **{"gen_ai.response.model": "vl-1-0613"}),
        ),
        (
            "generate_content vl-1",
            CLIENT,
            None,
            -S - S // 2,
            0,
            UNSET,
            call_attrs(calls[1], "vision", "generate_content")
            | {"polygateway.source": "vision", "gen_ai.response.model": "vl-1-0613"},
        ),
        (
            "chat plain-1",
            CLIENT,
            "chat plain-1",
            -S,
            0,
            ERROR,
            attempt_attrs(limited, **{"error.type": "rate_limited"}),
        ),
        (
            "chat plain-1",
            CLIENT,
            None,
            -S,
            0,
            ERROR,
            call_attrs(calls[2], "plain") | {"error.type": "retry_exhausted"},
        ),
        (
            "chat",
            CLIENT,
            None,
            -S,
            0,
            ERROR,
            call_attrs(calls[3], None) | {"error.type": "no_runnable"},
        ),
        (
            "chat big-1",
            CLIENT,
            None,
            -S,
            0,
            UNSET,
            call_attrs(calls[4], "primary") | {"polygateway.source": "primary"},
        ),
        (
            "embeddings",
            CLIENT,
            None,
            -S,
            0,
            ERROR,
            call_attrs(calls[5], None, "embeddings") | {"error.type": "no_runnable"},
        ),
        (
            "rerank",
            CLIENT,
            None,
            -S,
            0,
            ERROR,
            call_attrs(calls[6], None, "rerank") | {"error.type": "no_runnable"},
        ),
    ]
    assert {s.instrumentation_scope.name for s in sdk.spans() if s.instrumentation_scope} == {
        "polygateway"
    }


def test_a_call_span_is_a_child_of_the_context_of_its_first_attempt_record(sdk: Sdk) -> None:
    """The caller's span current when the first attempt record came parents the call's span."""
    app = sdk.tracer_provider.get_tracer("app")
    with app.start_as_current_span("handler"):
        sdk.emitter.emit_attempt(attempt("c1", "primary", 1))
    with app.start_as_current_span("elsewhere"):
        sdk.emitter.emit_call(call("c1", "primary"))
    handler = next(s for s in sdk.spans() if s.name == "handler")
    [call_span] = [s for s in sdk.spans() if "polygateway.operation" in (s.attributes or {})]
    assert call_span.parent is not None
    assert handler.context is not None
    assert (call_span.parent.span_id, call_span.parent.trace_id) == (
        handler.context.span_id,
        handler.context.trace_id,
    )


def test_attempts_of_calls_pushed_out_are_named_for_their_scope_and_keep_their_parent(
    sdk: Sdk, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the cap the oldest call's attempts are exported: its scope's operation, its context.

    A scope never bound counts as chat. (Each call here is pushed out by one of its own scope.)
    """
    monkeypatch.setattr(otel, "_MAX_PENDING_CALLS", 1)
    sdk.bind("emb", (), kind="embed")
    app = sdk.tracer_provider.get_tracer("app")
    records = [
        attempt("c1", "primary", 1),
        attempt("c2", "primary", 1),
        attempt("c3", "v", 1, scope="emb"),
        attempt("c4", "v", 1, scope="emb"),
        attempt("c5", "x", 1, scope="unbound"),
        attempt("c6", "x", 1, scope="unbound"),
    ]
    with app.start_as_current_span("handler"):
        sdk.emitter.emit_attempt(records[0])
    for record in records[1:]:
        sdk.emitter.emit_attempt(record)
        if record.call_id in ("c2", "c4"):
            sdk.emitter.emit_call(call(record.call_id, None, "no_runnable", scope=record.scope))
    lost = [span for span in sdk.exported() if span[6].get("polygateway.call_id") in LOST]
    assert lost == [
        ("chat big-1", CLIENT, "handler", -S, 0, UNSET, attempt_attrs(records[0])),
        ("embeddings", CLIENT, None, -S, 0, UNSET, attempt_attrs(records[2], "embeddings")),
        ("chat", CLIENT, None, -S, 0, UNSET, attempt_attrs(records[4])),
    ]


LOST = ("c1", "c3", "c5")


def test_a_call_record_with_no_attempts_among_pending_ones_is_its_own_span(sdk: Sdk) -> None:
    """A call ending while another call's attempts wait gets its span; the other keeps waiting."""
    sdk.emitter.emit_attempt(attempt("c1", "primary", 1))
    sdk.emitter.emit_call(call("c2", None, "no_runnable", attempts=0))
    assert [s.name for s in sdk.spans()] == ["chat"]
    sdk.emitter.emit_call(call("c1", "primary"))
    assert [(name, parent) for name, _, parent, *_ in sdk.exported()] == [
        ("chat", None),
        ("chat big-1", "chat big-1"),
        ("chat big-1", None),
    ]


# --- live spans (trace propagation) ---------------------------------------------------------


def start(call_id: str, source: str, n: int, elapsed_s: float = 0.0) -> AttemptStart:
    return AttemptStart(call_id, "chat", "chat.complete", source, n, elapsed_s)


def hook(sdk: Sdk) -> Callable[[AttemptStart], Any]:
    headers = sdk.emitter.attempt_headers
    assert headers is not None
    return headers


def test_live_spans_of_a_failover_are_dated_named_and_attributed_in_full(live: Sdk) -> None:
    """The call's span dates from the call's start; each attempt's from its own, with its shape."""
    first = hook(live)(start("c1", "primary", 1, elapsed_s=1.0))
    failed = attempt("c1", "primary", 1, "transient")
    live.emitter.emit_attempt(failed)
    second = hook(live)(start("c1", "backup", 2, elapsed_s=3.0))
    served = attempt("c1", "backup", 2, response_model="claude-x-2026", prompt_tokens=3)
    live.emitter.emit_attempt(served)
    record = call("c1", "backup", attempts=2, prompt_tokens=3)
    live.emitter.emit_call(record)
    assert live.exported() == [
        (
            "chat big-1",
            CLIENT,
            "chat claude-x",
            0,
            0,
            ERROR,
            attempt_attrs(failed, **{"error.type": "transient"}),
        ),
        (
            "chat claude-x",
            CLIENT,
            "chat claude-x",
            0,
            0,
            UNSET,
            attempt_attrs(
                served,
                **{"gen_ai.response.model": "claude-x-2026", "gen_ai.usage.input_tokens": 3},
            ),
        ),
        (
            "chat claude-x",
            CLIENT,
            None,
            -S,
            0,
            UNSET,
            call_attrs(record, "backup")
            | {
                "polygateway.source": "backup",
                "gen_ai.response.model": "claude-x-2026",
                "gen_ai.usage.input_tokens": 3,
            },
        ),
    ]
    ids = [f"{s.context.span_id:016x}" for s in live.spans()[:2] if s.context is not None]
    assert [first["traceparent"].split("-")[2], second["traceparent"].split("-")[2]] == ids


def test_each_live_call_span_starts_with_its_own_scope_and_operation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shape a call's span starts with is per (scope, operation), a source unbound too."""
    seen = StartAttributes()
    monkeypatch.setattr(otel, "time", types.SimpleNamespace(time_ns=lambda: NOW))
    emitter = OpenTelemetryEmitter(
        tracer_provider=TracerProvider(sampler=seen),
        meter_provider=MeterProvider(metric_readers=[InMemoryMetricReader()]),
        propagate=True,
    )
    backend = MemoryBackend(now=FakeClock())
    emitter.bind(ClientInfo("chat", "chat", chat_sources(), backend, lambda: 0))
    emitter.bind(ClientInfo("ocr", "ocr", ocr_sources(), backend, lambda: 0))
    hook = emitter.attempt_headers
    assert hook is not None
    hook(AttemptStart("c1", "chat", "chat.complete", "primary", 1, 0.0))
    hook(AttemptStart("c2", "ocr", "ocr.recognize_text", "vision", 1, 0.0))
    hook(AttemptStart("c3", "chat", "embed.embed", "primary", 1, 0.0))
    hook(AttemptStart("c4", "unbound", "chat.complete", "elsewhere", 1, 0.0))
    calls = [attrs for _, attrs in seen.seen[0::2]]  # each call's span, then its attempt's
    assert [(a["polygateway.scope"], a["gen_ai.operation.name"]) for a in calls] == [
        ("chat", "chat"),
        ("ocr", "generate_content"),
        ("chat", "embeddings"),
        ("unbound", "chat"),
    ]


def test_a_failed_live_call_is_named_for_the_last_source_tried_and_marked_an_error(
    live: Sdk,
) -> None:
    """No source served: the call's span takes the last attempt's source, and ``error.type``."""
    hook(live)(start("c1", "primary", 1, elapsed_s=1.0))
    live.emitter.emit_attempt(attempt("c1", "primary", 1, "transient"))
    record = call("c1", None, "retry_exhausted")
    live.emitter.emit_call(record)
    [_, call_span] = live.exported()
    assert call_span == (
        "chat big-1",
        CLIENT,
        None,
        -S,
        0,
        ERROR,
        call_attrs(record, "primary") | {"error.type": "retry_exhausted"},
    )


def test_live_calls_pushed_out_past_the_cap_end_at_once_as_they_began(
    live: Sdk, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the cap the oldest live call's spans end now, named and shaped as they began."""
    monkeypatch.setattr(otel, "_MAX_PENDING_CALLS", 1)
    hook(live)(start("c1", "primary", 1, elapsed_s=2.0))
    hook(live)(start("c2", "backup", 1))
    assert live.exported() == [
        ("chat big-1", CLIENT, "chat big-1", 0, 0, UNSET, shape("primary")),
        ("chat big-1", CLIENT, None, -2 * S, 0, UNSET, shape("primary")),
    ]


def test_attempts_recorded_without_a_live_span_go_beneath_the_live_call(live: Sdk) -> None:
    """An attempt with no live span (begun before an SDK) is kept, then exported under the call.

    The call's answer comes from its live serving attempt, not from the
    record kept aside.
    """
    hook(live)(start("c1", "backup", 2, elapsed_s=2.0))
    early = attempt("c1", "primary", 1, "transient")
    live.emitter.emit_attempt(early)
    assert [s.name for s in live.spans()] == []
    served = attempt("c1", "backup", 2, response_model="claude-x-2026")
    live.emitter.emit_attempt(served)
    record = call("c1", "backup", attempts=2)
    live.emitter.emit_call(record)
    assert live.exported() == [
        (
            "chat claude-x",
            CLIENT,
            "chat claude-x",
            0,
            0,
            UNSET,
            attempt_attrs(served, **{"gen_ai.response.model": "claude-x-2026"}),
        ),
        (
            "chat big-1",
            CLIENT,
            "chat claude-x",
            -S,
            0,
            ERROR,
            attempt_attrs(early, **{"error.type": "transient"}),
        ),
        (
            "chat claude-x",
            CLIENT,
            None,
            -2 * S,
            0,
            UNSET,
            call_attrs(record, "backup")
            | {"polygateway.source": "backup", "gen_ai.response.model": "claude-x-2026"},
        ),
    ]


def test_a_live_call_without_a_served_live_attempt_takes_its_answer_from_the_kept_one(
    live: Sdk,
) -> None:
    """The kept attempt record answers for the call; a live attempt never recorded ends with it."""
    hook(live)(start("c1", "primary", 2, elapsed_s=1.0))
    kept = attempt("c1", "primary", 1, response_model="big-1-0613")
    live.emitter.emit_attempt(kept)
    record = call("c1", "primary")
    live.emitter.emit_call(record)
    assert live.exported() == [
        (
            "chat big-1",
            CLIENT,
            "chat big-1",
            -S,
            0,
            UNSET,
            attempt_attrs(kept, **{"gen_ai.response.model": "big-1-0613"}),
        ),
        ("chat big-1", CLIENT, "chat big-1", 0, 0, UNSET, shape("primary")),
        (
            "chat big-1",
            CLIENT,
            None,
            -S,
            0,
            UNSET,
            call_attrs(record, "primary")
            | {"polygateway.source": "primary", "gen_ai.response.model": "big-1-0613"},
        ),
    ]


def test_records_of_other_calls_leave_a_live_call_open(live: Sdk) -> None:
    """A call record for a call not live, while another is, gets its span; the live one stays."""
    hook(live)(start("c1", "primary", 1))
    live.emitter.emit_call(call("c2", None, "no_runnable", attempts=0))
    assert [s.name for s in live.spans()] == ["chat"]
    live.emitter.emit_attempt(attempt("c1", "primary", 1))
    live.emitter.emit_call(call("c1", "primary"))
    assert [(name, parent) for name, _, parent, *_ in live.exported()] == [
        ("chat", None),
        ("chat big-1", "chat big-1"),
        ("chat big-1", None),
    ]


# --- metrics ---------------------------------------------------------------------------------


DURATION_BUCKETS = (
    0.01,
    0.02,
    0.04,
    0.08,
    0.16,
    0.32,
    0.64,
    1.28,
    2.56,
    5.12,
    10.24,
    20.48,
    40.96,
    81.92,
)
TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))


async def test_every_instrument_has_its_documented_name_unit_description_and_buckets(
    sdk: Sdk,
) -> None:
    """The full list of (name, unit, description) of the instruments; the histograms' buckets."""
    spec = SourceSpec("primary", 1, rpm=60, tpm=600)
    await sdk.backend.acquire("chat", [spec], cost_tokens=1, ttl_s=30)
    sdk.emitter.emit_attempt(attempt("c1", "primary", 1, ttft_s=0.2))
    sdk.emitter.emit_call(call("c1", "primary", prompt_tokens=5))
    metrics = sdk.metrics()
    assert {(m.name, m.unit, m.description) for m in metrics.values()} == {
        (
            "gen_ai.client.operation.duration",
            "s",
            "GenAI operation duration: a call, start to end, waiting included.",
        ),
        (
            "gen_ai.client.token.usage",
            "{token}",
            "Number of input and output tokens used, per call.",
        ),
        (
            "gen_ai.client.operation.time_to_first_chunk",
            "s",
            "Time from a streamed attempt's request to its first chunk.",
        ),
        ("polygateway.source.permits.in_use", "{permit}", "Permits held at a source."),
        (
            "polygateway.source.limit",
            "{permit}",
            "The source's current concurrency limit (AIMD).",
        ),
        (
            "polygateway.source.paused",
            "s",
            "Seconds until the source's pacing pause ends (0: not paused).",
        ),
        (
            "polygateway.source.breaker.reopen",
            "s",
            "Seconds until an open breaker lets a probe through (0: not open).",
        ),
        (
            "polygateway.source.breaker.state",
            "1",
            "1 for the breaker's current state (closed, half_open, open), else 0.",
        ),
        ("polygateway.source.rpm_tokens", "{request}", "Requests left in the source's rpm bucket."),
        ("polygateway.source.tpm_tokens", "{token}", "Tokens left in the source's tpm bucket."),
        (
            "polygateway.scope.calls.waiting",
            "{call}",
            "Calls of the scope waiting in this process.",
        ),
    }
    buckets = {
        name: {tuple(p.explicit_bounds) for p in metrics[name].data.data_points}
        for name in (
            "gen_ai.client.operation.duration",
            "gen_ai.client.token.usage",
            "gen_ai.client.operation.time_to_first_chunk",
        )
    }
    assert buckets == {
        "gen_ai.client.operation.duration": {DURATION_BUCKETS},
        "gen_ai.client.token.usage": {TOKEN_BUCKETS},
        "gen_ai.client.operation.time_to_first_chunk": {DURATION_BUCKETS},
    }
    data = sdk.reader.get_metrics_data()
    assert data is not None
    assert {s.scope.name for r in data.resource_metrics for s in r.scope_metrics} == {"polygateway"}


def test_call_metrics_carry_the_shape_and_error_type_only_when_not_served(sdk: Sdk) -> None:
    """Duration and token points of served and failed calls; TTFT points of streamed attempts."""
    sdk.emitter.emit_attempt(attempt("c1", "primary", 1, ttft_s=0.25))
    sdk.emitter.emit_attempt(attempt("c2", "backup", 1, "transient", ttft_s=0.5))
    sdk.emitter.emit_call(
        call("c1", "primary", duration_s=1.0, prompt_tokens=7, completion_tokens=3)
    )
    sdk.emitter.emit_call(
        call("c2", None, "retry_exhausted", duration_s=2.0, prompt_tokens=5, completion_tokens=2)
    )

    def summary(name: str) -> dict[frozenset[tuple[str, Any]], tuple[int, float]]:
        return {k: (p.count, p.sum) for k, p in sdk.points(name).items()}

    failed = {"error.type": "retry_exhausted"}
    assert summary("gen_ai.client.operation.duration") == {
        frozenset(shape("primary").items()): (1, 1.0),
        frozenset(shape("backup", **failed).items()): (1, 2.0),
    }
    assert summary("gen_ai.client.token.usage") == {
        frozenset(shape("primary", **{"gen_ai.token.type": "input"}).items()): (1, 7),
        frozenset(shape("primary", **{"gen_ai.token.type": "output"}).items()): (1, 3),
        frozenset(shape("backup", **{"gen_ai.token.type": "input"}, **failed).items()): (1, 5),
        frozenset(shape("backup", **{"gen_ai.token.type": "output"}, **failed).items()): (1, 2),
    }
    assert summary("gen_ai.client.operation.time_to_first_chunk") == {
        frozenset(shape("primary").items()): (1, 0.25),
        frozenset(shape("backup").items()): (1, 0.5),
    }


# --- gauges ----------------------------------------------------------------------------------


class Counting(MemoryBackend):
    """A memory backend that counts its synchronous reads, by scope."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(now=clock)
        self.reads: Counter[str] = Counter()

    def snapshot_now(self, scope: str) -> ScopeSnapshot:
        self.reads[scope] += 1
        return super().snapshot_now(scope)


class Broken(MemoryBackend):
    """A memory backend whose synchronous read fails."""

    def snapshot_now(self, scope: str) -> ScopeSnapshot:
        raise RuntimeError("boom")


class NoSync:
    """A backend that cannot be read without I/O (no ``snapshot_now``), like Redis."""


GAUGES = (
    "polygateway.source.permits.in_use",
    "polygateway.source.limit",
    "polygateway.source.paused",
    "polygateway.source.breaker.reopen",
    "polygateway.source.rpm_tokens",
    "polygateway.source.tpm_tokens",
    "polygateway.source.breaker.state",
    "polygateway.scope.calls.waiting",
)


def gauge_values(o: Sdk) -> dict[tuple[str, frozenset[tuple[str, Any]]], Any]:
    """Every gauge point now, by metric name and attribute set."""
    metrics = o.metrics()
    return {
        (name, frozenset(p.attributes.items())): p.value
        for name in GAUGES
        if name in metrics
        for p in metrics[name].data.data_points
    }


async def test_the_gauges_observe_every_field_of_each_source_with_scope_and_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each gauge's points, whole: unpaused and closed read 0, bucket gauges only with a limit.

    Waiting calls add up over the clients of one scope.
    """
    o = Sdk(monkeypatch)
    try:
        await o.backend.acquire(
            "chat", [SourceSpec("p", 4, rpm=60, tpm=6000)], cost_tokens=10, ttl_s=30
        )
        await o.backend.acquire("chat", [SourceSpec("q", 2)], ttl_s=30)
        o.bind("chat", waiting=lambda: 3)
        o.bind("chat", waiting=lambda: 4)
        o.bind("other", waiting=lambda: 2)

        def at(source: str, **extra: str) -> frozenset[tuple[str, Any]]:
            return frozenset(
                {"polygateway.scope": "chat", "polygateway.source": source, **extra}.items()
            )

        expected: dict[tuple[str, frozenset[tuple[str, Any]]], Any] = {}
        for source, limit in (("p", 4.0), ("q", 2.0)):
            expected |= {
                ("polygateway.source.permits.in_use", at(source)): 1,
                ("polygateway.source.limit", at(source)): limit,
                ("polygateway.source.paused", at(source)): 0.0,
                ("polygateway.source.breaker.reopen", at(source)): 0.0,
            }
            for state in ("closed", "open", "half_open"):
                key = at(source, **{"polygateway.breaker.state": state})
                expected[("polygateway.source.breaker.state", key)] = int(state == "closed")
        expected |= {
            ("polygateway.source.rpm_tokens", at("p")): 0.0,
            ("polygateway.source.tpm_tokens", at("p")): 90.0,
            ("polygateway.scope.calls.waiting", frozenset({("polygateway.scope", "chat")})): 7,
            ("polygateway.scope.calls.waiting", frozenset({("polygateway.scope", "other")})): 2,
        }
        assert gauge_values(o) == expected
    finally:
        o.shutdown()


async def test_each_scope_of_each_backend_is_read_once_per_gauge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Clients sharing a scope and backend are read once; a backend without sync reads is skipped.

    Scopes bound after a duplicate or a skipped backend are still read; a
    scope is read from the first backend bound for it (``LiveReader``), so
    the same scope on another backend is not read again.
    """
    o = Sdk(monkeypatch)
    first, second = Counting(o.clock), Counting(o.clock)
    try:
        await first.acquire("a", [SourceSpec("x", 1)], ttl_s=30)
        await first.acquire("b", [SourceSpec("y", 1)], ttl_s=30)
        await second.acquire("a", [SourceSpec("z", 1)], ttl_s=30)
        o.bind("a", backend=first)
        o.bind("a", backend=first)
        o.bind("n", backend=NoSync())
        o.bind("b", backend=first)
        o.bind("a", backend=second)
        first.reads.clear()
        second.reads.clear()
        in_use = {
            (dict(k)["polygateway.scope"], dict(k)["polygateway.source"]): p.value
            for k, p in o.points("polygateway.source.permits.in_use").items()
        }
        assert in_use == {("a", "x"): 1, ("b", "y"): 1}
        readers = 7  # six source gauges and the breaker state
        assert (first.reads, second.reads) == (Counter({"a": readers, "b": readers}), Counter())
    finally:
        o.shutdown()


async def test_a_scope_whose_read_fails_is_skipped_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A failing read costs its scope's points only, with a debug line naming scope and error."""
    o = Sdk(monkeypatch)
    try:
        await o.backend.acquire("good", [SourceSpec("p", 1)], ttl_s=30)
        broken = Broken(now=o.clock)  # held: the emitter holds backends weakly
        o.bind("bad", backend=broken)
        o.bind("good")
        with caplog.at_level(logging.DEBUG, logger="polygateway.telemetry"):
            points = o.points("polygateway.source.permits.in_use")
        assert [dict(k) for k in points] == [
            {"polygateway.scope": "good", "polygateway.source": "p"}
        ]
        assert set(caplog.messages) == {
            "live gauges of scope bad: read failed: RuntimeError('boom')"
        }
    finally:
        o.shutdown()


# --- looking for an SDK, repr, the API missing ----------------------------------------------


class Looks:
    """A stand-in for the API's global provider getters that notes when each is asked."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tick = 0
        self.tracer: list[int] = []
        self.meter: list[int] = []
        monkeypatch.setattr(opentelemetry.trace, "get_tracer_provider", self._tracer_provider)
        monkeypatch.setattr(opentelemetry.metrics, "get_meter_provider", self._meter_provider)

    def _tracer_provider(self) -> Any:
        self.tracer.append(self.tick)
        return NoOpTracerProvider()

    def _meter_provider(self) -> Any:
        self.meter.append(self.tick)
        return opentelemetry.metrics.NoOpMeterProvider()

    def run(self, check: Callable[[], object], times: int) -> None:
        """Call ``check`` ``times`` times, numbering the calls from 1; forget earlier looks."""
        self.tracer.clear()
        self.meter.clear()
        for self.tick in range(1, times + 1):
            check()


def test_an_idle_emitter_looks_for_an_sdk_on_its_first_record_then_every_256th(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the no-op providers both are asked again at records 1, 257 and 513, not between."""
    looks = Looks(monkeypatch)
    emitter = OpenTelemetryEmitter()
    looks.run(emitter.is_recording, 513)
    assert (looks.tracer, looks.meter) == ([1, 257, 513], [1, 257, 513])


def test_metrics_kept_do_not_stop_the_looks_for_a_tracer_sdk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With an SDK for metrics only, ``is_recording`` still looks for a tracer every 256th call."""
    looks = Looks(monkeypatch)
    meters = MeterProvider()
    try:
        emitter = OpenTelemetryEmitter(meter_provider=meters)
        looks.run(emitter.is_recording, 257)
        assert looks.tracer == [1, 257]
        assert emitter.is_recording() is True
    finally:
        meters.shutdown()


def test_without_the_api_private_proxy_only_its_no_op_counts_as_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An API without ``_ProxyMeterProvider``: the global stand-in then counts as recording."""
    monkeypatch.delattr("opentelemetry.metrics._internal._ProxyMeterProvider")
    assert OpenTelemetryEmitter().is_recording() is True


def test_the_repr_counts_the_clients_and_says_when_it_propagates(sdk: Sdk) -> None:
    """``clients=`` the clients bound, and ``propagate=True`` only with a header hook."""
    assert repr(sdk.emitter) == "OpenTelemetryEmitter(clients=2)"
    propagating = OpenTelemetryEmitter(
        tracer_provider=sdk.tracer_provider, meter_provider=sdk.meter_provider, propagate=True
    )
    assert repr(propagating) == "OpenTelemetryEmitter(clients=0, propagate=True)"


def test_without_opentelemetry_api_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No ``opentelemetry`` package: a ConfigError naming the extra, from the ImportError."""
    monkeypatch.setitem(sys.modules, "opentelemetry.trace", None)
    with pytest.raises(ConfigError) as caught:
        OpenTelemetryEmitter()
    assert str(caught.value) == (
        "OpenTelemetryEmitter needs opentelemetry-api: install polygateway[otel]"
    )
    assert isinstance(caught.value.__cause__, ImportError)


def test_the_gen_ai_operation_is_the_first_dotted_part_mapped_else_kept() -> None:
    """``chat.*`` is chat, ``embed`` embeddings, ``ocr.*`` generate_content; others keep it."""
    assert [
        otel._operation(name)
        for name in ("chat.stream", "embed", "ocr.recognize_text", "ocr.a.b", "rerank.top.k")
    ] == ["chat", "embeddings", "generate_content", "generate_content", "rerank"]


async def test_the_per_class_gauges_have_their_names_units_and_descriptions(sdk: Sdk) -> None:
    """Calls waiting and permits in use per class: name, unit, description and points."""
    sdk.emitter.bind(
        ClientInfo("chat", "chat", (), sdk.backend, lambda: 0, by_class=lambda: {"b": (2, 1)})
    )
    metrics = sdk.metrics()
    described = {
        name: (metrics[name].unit, metrics[name].description)
        for name in ("polygateway.scope.calls.waiting_by_class", "polygateway.scope.permits.in_use")
    }
    assert described == {
        "polygateway.scope.calls.waiting_by_class": (
            "{call}",
            "Calls of the scope waiting in this process, per priority class.",
        ),
        "polygateway.scope.permits.in_use": (
            "{permit}",
            "Permits the scope's calls hold in this process, per priority class.",
        ),
    }
    attrs = frozenset({("polygateway.scope", "chat"), ("polygateway.priority_class", "b")})
    assert sdk.points("polygateway.scope.calls.waiting_by_class")[attrs].value == 2
    assert sdk.points("polygateway.scope.permits.in_use")[attrs].value == 1


async def test_a_count_that_fails_skips_the_gauges_reading_with_a_debug_line(
    sdk: Sdk, caplog: pytest.LogCaptureFixture
) -> None:
    """A client's waiting count that raises: no source points this time, and one debug line."""

    def broken() -> int:
        raise RuntimeError("no count")

    await sdk.backend.acquire("chat", [SourceSpec("primary", 1)], ttl_s=30)
    sdk.emitter.bind(ClientInfo("chat", "chat", (), sdk.backend, broken))
    with caplog.at_level(logging.DEBUG, logger="polygateway.telemetry"):
        data = sdk.reader.get_metrics_data()
    assert data is None  # every gauge needs the count: none has a point
    assert "gauge snapshots skipped: RuntimeError('no count')" in caplog.messages
