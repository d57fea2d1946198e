"""Calls waiting and permits in use per priority class, as telemetry and status show them:
OpenTelemetry gauges, the status table and JSON of a process that owns its memory backend,
and the note a Redis status prints instead (it reads the backend from outside any process)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import pytest
from _closing import closing
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.cli import commands, render
from polygateway.cli.watch import WAITING_NOTE
from polygateway.config import GatewaySettings
from polygateway.middleware.otel import OpenTelemetryEmitter
from polygateway.middleware.telemetry import PrometheusEmitter
from polygateway.middleware.waiting import room_for
from polygateway.testing import (
    BoundedSleep,
    FakeClock,
    FakeTransport,
    Gate,
    chat_completion,
    settle,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def _settings(**gateway: Any) -> GatewaySettings:
    return GatewaySettings(
        **gateway,
        scopes={
            "chat": {
                "kind": "chat",
                "priority_classes": {
                    "interactive": {"share": 9, "reserved": 1},
                    "batch": {"share": 1},
                },
                "default_priority_class": "batch",
                "sources": [
                    {
                        "name": "primary",
                        "protocol": "openai",
                        "base_url": "http://127.0.0.1:9/primary",
                        "model": "m",
                        "api_key": "sk-test-primary-secret",
                        "max_concurrency": 1,
                    }
                ],
            }
        },
    )


def _chat(
    settings: GatewaySettings, clock: FakeClock, backend: Any, script: Any, **parts: Any
) -> ChatClient:
    return closing(
        ChatClient(
            settings,
            backend=backend,
            transport=FakeTransport(script, clock=clock),
            now=clock,
            sleep=BoundedSleep(clock),
            rng=random.Random(5),
            **parts,
        )
    )


async def _one_in_use_one_waiting(chat: ChatClient, gate: Gate) -> tuple[Any, Any]:
    """An interactive call holds the one permit; a batch call waits behind it."""
    held = asyncio.create_task(chat.complete(MESSAGES, priority_class="interactive"))
    await gate.wait_entered(1)
    queued = asyncio.create_task(chat.complete(MESSAGES))
    await settle()
    return held, queued


@pytest.fixture
def reader() -> Iterator[tuple[InMemoryMetricReader, MeterProvider]]:
    metrics = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[metrics])
    yield metrics, provider
    provider.shutdown()


def _points(metrics: InMemoryMetricReader, name: str) -> dict[str, float]:
    """The data points of gauge ``name`` by priority class (scope ``chat`` only)."""
    out: dict[str, float] = {}
    data = metrics.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == name:
                    for point in metric.data.data_points:
                        assert point.attributes["polygateway.scope"] == "chat"
                        out[str(point.attributes["polygateway.priority_class"])] = point.value
    return out


async def test_otel_gauges_show_waiting_and_in_use_per_class_once_per_scope(
    reader: tuple[InMemoryMetricReader, MeterProvider],
) -> None:
    """Two clients of the scope share one waiting room: one series per class, counted there."""
    metrics, provider = reader
    emitter = OpenTelemetryEmitter(meter_provider=provider)
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    gate = Gate(chat_completion("ok"))
    settings = _settings()
    chat = _chat(settings, clock, backend, [gate, chat_completion("ok")], emitter=emitter)
    _chat(settings, clock, backend, [], emitter=emitter)  # a second client of the scope
    held, queued = await _one_in_use_one_waiting(chat, gate)
    assert _points(metrics, "polygateway.scope.calls.waiting_by_class") == {
        "interactive": 0,
        "batch": 1,
    }
    assert _points(metrics, "polygateway.scope.permits.in_use") == {"interactive": 1, "batch": 0}
    gate.open()
    await asyncio.gather(held, queued)
    assert _points(metrics, "polygateway.scope.permits.in_use") == {"interactive": 0, "batch": 0}
    assert _points(metrics, "polygateway.scope.calls.waiting_by_class") == {
        "interactive": 0,
        "batch": 0,
    }


def _scrape(registry: CollectorRegistry, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of ``name`` as a Prometheus server parses the exposition, by sorted labels."""
    text = generate_latest(registry).decode()
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def _by_class(samples: dict[tuple[tuple[str, str], ...], float]) -> dict[str, float]:
    return {dict(labels)["priority_class"]: v for labels, v in samples.items()}


async def test_the_prometheus_scrape_shows_waiting_and_in_use_per_class() -> None:
    """Parsed back: per class waiting and in use, the scope's total waiting unchanged."""
    registry = CollectorRegistry()
    emitter = PrometheusEmitter(registry=registry)
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    gate = Gate(chat_completion("ok"))
    settings = _settings()
    chat = _chat(settings, clock, backend, [gate, chat_completion("ok")], emitter=emitter)
    _chat(settings, clock, backend, [], emitter=emitter)  # a second client: one room, one count
    held, queued = await _one_in_use_one_waiting(chat, gate)
    waiting = _scrape(registry, "polygateway_scope_calls_waiting_by_class")
    assert {dict(labels)["scope"] for labels in waiting} == {"chat"}
    assert _by_class(waiting) == {"interactive": 0.0, "batch": 1.0}
    in_use = _scrape(registry, "polygateway_scope_permits_in_use")
    assert _by_class(in_use) == {"interactive": 1.0, "batch": 0.0}
    assert _scrape(registry, "polygateway_scope_calls_waiting") == {(("scope", "chat"),): 1.0}
    gate.open()
    await asyncio.gather(held, queued)
    assert _by_class(_scrape(registry, "polygateway_scope_permits_in_use")) == {
        "interactive": 0.0,
        "batch": 0.0,
    }


async def test_a_memory_backends_status_shows_waiting_and_in_use_per_class() -> None:
    """The table and JSON of the process that owns the backend (the demo's --status-every)."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    gate = Gate(chat_completion("ok"))
    chat = _chat(_settings(), clock, backend, [gate, chat_completion("ok")])
    held, queued = await _one_in_use_one_waiting(chat, gate)
    snap = await backend.snapshot("chat")
    by_class = room_for(backend, "chat").by_class()
    table = render.scope_status_table(snap, {"primary": 1}, by_class)
    assert table.title is not None
    assert "this process: interactive 0 waiting, 1 in use; batch 1 waiting, 0 in use" in str(
        table.title
    )
    shown = render.snapshot_json(snap, {"primary": 1}, by_class)
    assert shown["this_process"] == {
        "interactive": {"waiting": 0, "in_use": 1},
        "batch": {"waiting": 1, "in_use": 0},
    }
    assert "this_process" not in render.snapshot_json(snap, {"primary": 1})
    gate.open()
    await asyncio.gather(held, queued)


def test_a_redis_status_names_the_gauges_that_count_per_class(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Read from outside every process, status cannot count per class: it says where to look."""
    settings = _settings(backend="redis")
    snap = asyncio.run(MemoryBackend(now=FakeClock()).snapshot("chat"))
    commands._print_status(settings, [snap], False)
    out = " ".join(capsys.readouterr().out.split())
    assert " ".join(WAITING_NOTE.split()) in out
    assert "polygateway_scope_permits_in_use" in WAITING_NOTE
