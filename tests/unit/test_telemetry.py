"""Telemetry: one frozen record per attempt, emitted inside the attempt, through the built-in
emitters (null, logging, Prometheus) and the test kit's Recorder."""

from __future__ import annotations

import dataclasses
import logging
import random
import subprocess
import sys
from typing import Any

import pytest
from _closing import closing
from prometheus_client import CollectorRegistry

from polygateway.backends.base import Lease
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import ConfigError
from polygateway.middleware.attempt import AttemptContext
from polygateway.middleware.telemetry import (
    Emitter,
    Emitters,
    LoggingEmitter,
    NullEmitter,
    PrometheusEmitter,
    attempt_record,
)
from polygateway.models import AttemptRecord, Usage
from polygateway.testing import (
    BoundedSleep,
    Delay,
    FakeClock,
    FakeTransport,
    Recorder,
    TransientError,
    chat_completion,
    gateway_settings,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def record(**changes: Any) -> AttemptRecord:
    """An attempt record with plausible values."""
    base = AttemptRecord(
        call_id="c0ffee",
        scope="chat",
        source="primary",
        attempt=1,
        outcome="success",
        status_code=None,
        latency_s=0.25,
    )
    return dataclasses.replace(base, **changes)


def make_chat(clock: FakeClock, script: Any, emitter: Emitter) -> ChatClient:
    """A chat client with two sources emitting to ``emitter``."""
    return closing(
        ChatClient(
            gateway_settings("a", {"name": "b", "priority": 1}),
            backend=MemoryBackend(now=clock),
            transport=FakeTransport(script, clock=clock),
            now=clock,
            sleep=BoundedSleep(clock),
            rng=random.Random(8),
            emitter=emitter,
        )
    )


class TestRecords:
    """What the loop emits."""

    async def test_one_record_per_attempt_with_the_call_story(self) -> None:
        """A failed then a successful attempt: two records sharing a call id, numbered 1 and 2."""
        clock = FakeClock()
        recorder = Recorder()
        chat = make_chat(
            clock,
            {"a": [Delay(3.0, TransientError(status_code=502))], "b": [chat_completion()]},
            recorder,
        )
        response = await chat.complete(MESSAGES)
        first, second = recorder.records
        assert list(response.attempts) == recorder.records
        assert first.call_id == second.call_id
        assert (first.attempt, second.attempt) == (1, 2)
        assert (first.source, first.outcome, first.status_code) == ("a", "transient", 502)
        assert first.latency_s == pytest.approx(3.0)
        assert first.error is not None
        assert (second.source, second.outcome, second.error) == ("b", "success", None)
        assert second.permit_wait_s == 0  # a permit was free at once
        assert 0 < second.stalled_s <= 0.5  # the back-off: non-productive, the 3 s attempt not
        assert (second.prompt_tokens, second.completion_tokens) == (5, 2)

    def test_record_takes_every_field_from_its_attempt(self) -> None:
        """attempt_record puts each value in its own field (built positionally, so pinned here)."""
        ctx = AttemptContext(
            "call-1",
            2,
            Lease("scope-x", "src-y", "lease-9", 40.0),
            11.0,
            12.0,
            13.0,
            100.0,
            permit_wait_s=0.25,
            stalled_s=0.5,
        )
        ctx.usage = Usage(prompt_tokens=7, completion_tokens=3, total_tokens=10)
        ctx.ttft_s = 0.125
        ctx.response_model = "model-2024"
        ctx.finish_reasons = ("length",)
        made = attempt_record(
            ctx, scope="chat", outcome="transient", status_code=502, error="boom", ended_at=104.0
        )
        assert dataclasses.asdict(made) == {
            "call_id": "call-1",
            "scope": "chat",
            "source": "src-y",
            "attempt": 2,
            "outcome": "transient",
            "status_code": 502,
            "latency_s": 4.0,
            "ttft_s": 0.125,
            "prompt_tokens": 7,
            "completion_tokens": 3,
            "permit_wait_s": 0.25,
            "stalled_s": 0.5,
            "error": "boom",
            "response_model": "model-2024",
            "finish_reasons": ("length",),
        }

    def test_records_are_frozen(self) -> None:
        """User code cannot change what the gateway recorded."""
        with pytest.raises(dataclasses.FrozenInstanceError):
            record().outcome = "tampered"  # type: ignore[misc]

    def test_built_in_emitters_satisfy_the_protocol(self) -> None:
        """Null, logging and Recorder emitters are Emitters."""
        for emitter in (NullEmitter(), LoggingEmitter(), Recorder()):
            assert isinstance(emitter, Emitter)


class TestLoggingEmitter:
    """Structured log lines on the polygateway logger hierarchy."""

    def test_success_logs_at_debug_with_structured_fields(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A success is a DEBUG line carrying the record's fields in ``extra``."""
        with caplog.at_level(logging.DEBUG, logger="polygateway"):
            LoggingEmitter().emit_attempt(record())
        (line,) = caplog.records
        assert line.name == "polygateway.attempts"
        assert line.levelno == logging.DEBUG
        assert line.polygateway["source"] == "primary"  # type: ignore[attr-defined]
        assert "outcome=success" in line.getMessage()

    def test_failure_logs_at_warning(self, caplog: pytest.LogCaptureFixture) -> None:
        """A failed attempt is a WARNING naming its status and error."""
        with caplog.at_level(logging.WARNING, logger="polygateway"):
            LoggingEmitter().emit_attempt(
                record(outcome="transient", status_code=503, error="HTTP 503 from primary")
            )
        (line,) = caplog.records
        assert line.levelno == logging.WARNING
        assert "status=503" in line.getMessage()
        assert "HTTP 503" in line.getMessage()

    def test_nothing_is_formatted_when_the_level_is_off(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Successes cost nothing when DEBUG is off."""
        with caplog.at_level(logging.INFO, logger="polygateway"):
            LoggingEmitter().emit_attempt(record())
        assert caplog.records == []


class TestPrometheusEmitter:
    """Counters and histograms, on the registry given."""

    def test_attempts_are_counted_by_outcome_and_latency_observed(self) -> None:
        """Two successes and a 429 show up in the counter and the latency histogram."""
        registry = CollectorRegistry()
        emitter = PrometheusEmitter(registry)
        emitter.emit_attempt(record())
        emitter.emit_attempt(record(latency_s=1.5, ttft_s=0.2))
        emitter.emit_attempt(record(outcome="rate_limited", status_code=429))
        labels = {"scope": "chat", "source": "primary"}
        value = registry.get_sample_value
        assert value("polygateway_attempts_total", {**labels, "outcome": "success"}) == 2
        assert value("polygateway_attempts_total", {**labels, "outcome": "rate_limited"}) == 1
        assert value("polygateway_attempt_latency_seconds_count", labels) == 3
        assert value("polygateway_attempt_latency_seconds_sum", labels) == pytest.approx(2.0)
        assert value("polygateway_stream_ttft_seconds_count", labels) == 1

    def test_two_emitters_share_one_registry(self) -> None:
        """A second emitter on the same registry reuses the metrics instead of failing."""
        registry = CollectorRegistry()
        PrometheusEmitter(registry).emit_attempt(record())
        PrometheusEmitter(registry).emit_attempt(record())
        labels = {"scope": "chat", "source": "primary", "outcome": "success"}
        assert registry.get_sample_value("polygateway_attempts_total", labels) == 2

    def test_missing_extra_is_a_config_error(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Without prometheus-client the error names the extra to install."""
        monkeypatch.setitem(sys.modules, "prometheus_client", None)
        with pytest.raises(ConfigError, match=r"polygateway\[prometheus\]"):
            PrometheusEmitter(CollectorRegistry())


def test_importing_the_clients_loads_no_optional_extra() -> None:
    """Importing polygateway, its chat client and telemetry loads neither prometheus nor redis."""
    code = (
        "import sys, polygateway, polygateway.chat, polygateway.middleware.telemetry\n"
        "loaded = [m for m in ('prometheus_client', 'redis', 'aiohttp', 'rich') "
        "if m in sys.modules]\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == ""


def test_emitters_record_unless_every_emitter_says_it_keeps_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``recording`` is false only when each emitter's ``is_recording`` says so."""

    class Saying:
        def __init__(self, answer: bool | None) -> None:
            self.answer = answer

        def is_recording(self) -> bool:
            if self.answer is None:
                raise RuntimeError("cannot tell")
            return self.answer

        def emit_attempt(self, record: AttemptRecord) -> None:
            pass

    class Silent:
        def emit_attempt(self, record: AttemptRecord) -> None:
            pass

    assert Emitters([Saying(False), Saying(False)]).recording() is False
    assert Emitters([Saying(False), Saying(True)]).recording() is True
    assert Emitters([Saying(False), Silent()]).recording() is True
    with caplog.at_level(logging.WARNING, logger="polygateway.telemetry"):
        assert Emitters([Saying(None)]).recording() is True
    assert "Saying failed" in caplog.text
