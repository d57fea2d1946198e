"""research-wiki/guides/observability.md names only the metrics, labels and loggers the code has.

The guide's tables are parsed and compared with what a client actually
exposes after a served call and a served stream: a Prometheus scrape of a
``PrometheusEmitter``'s registry and an OpenTelemetry SDK collection of an
``OpenTelemetryEmitter``'s meter. A metric renamed in the code, or one added
without a row, fails here.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from _closing import closing
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from polygateway import AllSourcesExhausted, LoggingEmitter, OpenTelemetryEmitter, PrometheusEmitter
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.models import CallOutcome, FailureClass
from polygateway.testing import (
    FakeClock,
    FakeTransport,
    StreamScript,
    TransientError,
    chat_chunk_events,
    chat_completion,
    gateway_settings,
)

GUIDE = (Path(__file__).resolve().parents[2] / "research-wiki/guides/observability.md").read_text(
    encoding="utf-8"
)
MESSAGES = [{"role": "user", "content": "hi"}]
SOURCE = {"name": "primary", "rpm": 600, "tpm": 100_000}
"""rpm and tpm set, so the bucket gauges exist too."""


def section(title: str) -> str:
    """The guide's text under the heading ``title``, to the next heading of its level or above."""
    lines = GUIDE.splitlines(keepends=True)
    start = next(
        i for i, line in enumerate(lines) if re.fullmatch(rf"#+ {re.escape(title)}\n", line)
    )
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    fenced = False
    for end in range(start + 1, len(lines)):
        fenced ^= lines[end].startswith("```")
        if not fenced and re.match(rf"#{{1,{level}}} ", lines[end]):
            return "".join(lines[start + 1 : end])
    return "".join(lines[start + 1 :])


def table_rows(text: str) -> list[list[str]]:
    """The body rows of every markdown table in ``text``, as stripped cells."""
    rows = []
    for line in text.splitlines():
        if line.startswith("| ") and not re.match(r"\|[- |]+\|$", line):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return [row for row in rows if not row[0].startswith(("metric", "instrument", "attribute"))]


def names_in(cell: str) -> list[str]:
    """The backticked names of a table cell."""
    return re.findall(r"`([^`]+)`", cell)


def label_set(cell: str) -> frozenset[str]:
    """The labels of a Prometheus row: ``scope, source, state`` as a set."""
    return frozenset(label.strip() for label in cell.split(",") if label.strip())


def documented_prometheus() -> dict[str, frozenset[str]]:
    """Every ``polygateway_*`` metric of the guide's two Prometheus tables, with its labels."""
    documented: dict[str, frozenset[str]] = {}
    for row in table_rows(section("Metrics")):
        (name,) = names_in(row[0])
        # Counters and histograms: | metric | type | labels |; gauges: | metric | labels | unit |.
        labels = row[2] if row[1] in ("counter", "histogram") else row[1]
        documented[name] = label_set(labels)
    return documented


def scraped(registry: CollectorRegistry) -> dict[str, frozenset[str]]:
    """Every metric a scrape shows, named as its rows in the guide name it, with its labels."""
    text = generate_latest(registry).decode()
    found: dict[str, frozenset[str]] = {}
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):
            continue  # prometheus_client's own creation timestamps, not ours
        name = f"{family.name}_total" if family.type == "counter" else family.name
        labels = {label for sample in family.samples for label in sample.labels if label != "le"}
        found[name] = frozenset(labels)
    return found


async def serve_one_call_and_one_stream(emitter: Any, clock: FakeClock) -> ChatClient:
    """A chat client on ``emitter`` that has served a completion and a stream."""
    transport = FakeTransport(
        [chat_completion("ok"), StreamScript(chat_chunk_events(["o", "k"]))], clock=clock
    )
    chat = closing(
        ChatClient(
            gateway_settings(SOURCE),
            backend=MemoryBackend(now=clock),
            transport=transport,
            now=clock,
            sleep=clock.sleep,
            emitter=emitter,
        )
    )
    await chat.complete(MESSAGES)
    async for _ in chat.stream(MESSAGES):
        pass
    return chat


async def test_every_prometheus_metric_of_the_guide_is_exposed_with_its_labels() -> None:
    """The guide's Prometheus tables and a real scrape name the same metrics and labels."""
    registry = CollectorRegistry()
    chat = await serve_one_call_and_one_stream(PrometheusEmitter(registry), FakeClock())
    try:
        assert scraped(registry) == documented_prometheus()
    finally:
        await chat.aclose()


def documented_otel() -> set[str]:
    """The instruments of the guide's OpenTelemetry metrics table."""
    table = GUIDE.split("**Metrics**, through the meter:", 1)[1].split("\n\n", 2)[1]
    return {name for row in table_rows(table) for name in names_in(row[0])}


async def test_every_opentelemetry_instrument_of_the_guide_is_collected() -> None:
    """The guide's OpenTelemetry metrics table and an SDK collection name the same instruments."""
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    tracers = TracerProvider()
    emitter = OpenTelemetryEmitter(tracer_provider=tracers, meter_provider=meters)
    chat = await serve_one_call_and_one_stream(emitter, FakeClock())
    try:
        data = reader.get_metrics_data()
        assert data is not None
        collected = {
            metric.name
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
        }
        assert collected == documented_otel()
    finally:
        await chat.aclose()
        tracers.shutdown()
        meters.shutdown()


def documented_span_attributes() -> set[str]:
    """The attributes of the guide's span table (its first column, the span name aside)."""
    table = GUIDE.split("**Spans**", 1)[1].split("\n\n", 2)[1]
    return {name for row in table_rows(table) for name in names_in(row[0])}


async def test_every_span_attribute_of_the_guide_is_set() -> None:
    """The guide's span table and the spans of a served call and stream name the same attributes
    (``error.type`` and ``http.response.status_code`` are set only on a failure)."""
    spans = InMemorySpanExporter()
    tracers = TracerProvider()
    tracers.add_span_processor(SimpleSpanProcessor(spans))
    emitter = OpenTelemetryEmitter(tracer_provider=tracers, meter_provider=MeterProvider())
    chat = await serve_one_call_and_one_stream(emitter, FakeClock())
    try:
        seen = {key for span in spans.get_finished_spans() for key in span.attributes or {}}
        failure_only = {"error.type", "http.response.status_code"}
        assert seen | failure_only == documented_span_attributes()
    finally:
        await chat.aclose()
        tracers.shutdown()


def test_the_outcomes_listed_are_the_codes_outcomes() -> None:
    """The rows of ``calls_total``, ``attempts_total`` and ``error.type`` list every outcome."""
    outcomes = set(CallOutcome.__args__)
    rows = {names_in(r[0])[0]: r for r in table_rows(section("Metrics"))}
    assert set(names_in(rows["polygateway_calls_total"][3])) == outcomes
    attempt_outcomes = {"success", "cancelled", *FailureClass.__args__}
    assert set(names_in(rows["polygateway_attempts_total"][3])) == attempt_outcomes
    error_row = next(r for r in table_rows(GUIDE) if r[0] == "`error.type`")
    assert set(names_in(error_row[2])) == outcomes - {"served"}


async def test_the_log_line_shown_is_what_logging_emitter_writes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The logger named, the call line's shape and the ``extra`` key are the emitter's."""
    logger = re.search(r"on the `([a-z.]+)` logger", section("Logging"))
    assert logger is not None
    clock = FakeClock()
    with caplog.at_level(logging.DEBUG, logger=logger.group(1)):
        chat = await serve_one_call_and_one_stream(LoggingEmitter(), clock)
        await chat.aclose()
    line = next(r for r in caplog.records if r.getMessage().startswith("call "))
    shown = re.search(r"```\n(WARNING call .*)\n```", section("Logging"))
    assert shown is not None
    shape = re.sub(r"=\S+", "=", shown.group(1).removeprefix("WARNING ").split(" ", 2)[2])
    assert re.sub(r"=\S+", "=", line.getMessage().split(" ", 2)[2]) == shape
    assert "call_id" in line.polygateway  # type: ignore[attr-defined]


async def test_the_outage_example_is_what_the_defaults_do() -> None:
    """One source failing hard, ``fail_fast=True``, default settings: 50 calls end as the guide
    says, 1 ``retry_exhausted`` and 49 ``no_runnable``."""
    said = re.search(r"50 calls end\nas 1 `retry_exhausted` and 49 `no_runnable`", GUIDE)
    assert said is not None
    clock = FakeClock()
    transport = FakeTransport(default=TransientError(status_code=503), clock=clock)
    chat = closing(
        ChatClient(
            gateway_settings("bad"),
            backend=MemoryBackend(now=clock),
            transport=transport,
            now=clock,
            sleep=clock.sleep,
        )
    )
    reasons: Counter[str] = Counter()
    for _ in range(50):
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES, fail_fast=True)
        reasons[caught.value.reason] += 1
    assert reasons == {"retry_exhausted": 1, "no_runnable": 49}
