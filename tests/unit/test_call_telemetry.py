"""The built-in emitters' call records: the logging line, the Prometheus series, the fan-out's
log of a failing emitter, and which emitters a client ends up with."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from polygateway.middleware.telemetry import (
    Emitters,
    LoggingEmitter,
    NullEmitter,
    PrometheusEmitter,
    emitters_of,
)
from polygateway.models import CallRecord
from polygateway.testing import Recorder


def call(**changes: Any) -> CallRecord:
    """A call record with plausible values."""
    base = CallRecord(
        call_id="c0ffee",
        scope="chat",
        operation="chat.complete",
        outcome="served",
        attempts=2,
        source="primary",
        duration_s=1.5,
        waited_s=0.25,
        stalled_s=0.125,
        prompt_tokens=7,
        completion_tokens=3,
    )
    return dataclasses.replace(base, **changes)


class TestLoggingEmitter:
    """One line per call: DEBUG when served, WARNING otherwise, every figure in it."""

    def test_a_served_call_is_one_debug_line_with_its_figures(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The line names the call, scope, operation, outcome, attempts, source and times."""
        with caplog.at_level(logging.DEBUG, logger="polygateway.attempts"):
            LoggingEmitter().emit_call(call())
        [line] = caplog.records
        assert line.levelno == logging.DEBUG
        assert line.getMessage() == (
            "call c0ffee scope=chat op=chat.complete outcome=served attempts=2 source=primary "
            "duration=1.500s waited=0.250s stalled=0.125s"
        )
        assert line.polygateway == dataclasses.asdict(call())  # type: ignore[attr-defined]

    def test_a_failed_call_is_a_warning_and_names_no_source(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A call that ended otherwise than served is a WARNING; no source shows as "-"."""
        with caplog.at_level(logging.DEBUG, logger="polygateway.attempts"):
            LoggingEmitter().emit_call(call(outcome="no_runnable", attempts=0, source=None))
        [line] = caplog.records
        assert line.levelno == logging.WARNING
        assert "outcome=no_runnable attempts=0 source=-" in line.getMessage()

    def test_nothing_is_formatted_when_the_level_is_off(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Below the logger's level no line is made at all."""
        logger = logging.getLogger("polygateway.test.quiet")
        logger.setLevel(logging.ERROR)
        LoggingEmitter(logger).emit_call(call())
        LoggingEmitter(logger).emit_call(call(outcome="stalled"))
        assert caplog.records == []

    def test_levels_are_the_emitters_own(self, caplog: pytest.LogCaptureFixture) -> None:
        """success_level and failure_level choose the two levels."""
        logger = logging.getLogger("polygateway.test.levels")
        emitter = LoggingEmitter(logger, success_level=logging.INFO, failure_level=logging.ERROR)
        with caplog.at_level(logging.DEBUG, logger="polygateway.test.levels"):
            emitter.emit_call(call())
            emitter.emit_call(call(outcome="deadline"))
        assert [r.levelno for r in caplog.records] == [logging.INFO, logging.ERROR]


def _samples(registry: CollectorRegistry, family: str) -> dict[tuple[str, ...], float]:
    found: dict[tuple[str, ...], float] = {}
    for metrics in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in metrics.samples:
            if sample.name == family:
                found[tuple(sorted(sample.labels.items()))] = sample.value  # type: ignore[arg-type]
    return found


class TestPrometheusCalls:
    """calls_total by scope, operation and outcome; call_duration_seconds by scope, operation."""

    def test_calls_are_counted_and_timed_by_their_labels(self) -> None:
        """Two served and one stalled call: the counter and the histogram's count and sum."""
        registry = CollectorRegistry()
        emitter = PrometheusEmitter(registry)
        emitter.emit_call(call())
        emitter.emit_call(call(duration_s=0.5))
        emitter.emit_call(call(outcome="stalled", operation="embed", scope="emb"))
        counted = _samples(registry, "polygateway_calls_total")
        assert counted == {
            (("operation", "chat.complete"), ("outcome", "served"), ("scope", "chat")): 2.0,
            (("operation", "embed"), ("outcome", "stalled"), ("scope", "emb")): 1.0,
        }
        durations = _samples(registry, "polygateway_call_duration_seconds_sum")
        assert durations == {
            (("operation", "chat.complete"), ("scope", "chat")): 2.0,
            (("operation", "embed"), ("scope", "emb")): 1.5,
        }

    def test_the_series_are_on_the_registry_given(self) -> None:
        """A registry passed in gets the series; the global one is not touched."""
        registry = CollectorRegistry()
        PrometheusEmitter(registry).emit_call(call())
        assert "polygateway_calls_total" in generate_latest(registry).decode()


class TestFanOut:
    """Emitters: which are kept, and the log line of one that fails."""

    def test_no_emitter_or_only_null_ones_is_none(self) -> None:
        """Nothing to call: the loop gets None and builds no call record."""
        assert emitters_of(None, None) is None
        assert emitters_of(NullEmitter(), [NullEmitter()]) is None

    def test_null_emitters_are_dropped_and_the_others_kept_in_order(self) -> None:
        """``emitter`` first, then ``emitters``, without the null ones."""
        first, second = Recorder(), Recorder()
        group = emitters_of(first, [NullEmitter(), second])
        assert group is not None
        assert group.emitters == (first, second)
        assert repr(group) == f"Emitters({[first, second]!r})"

    def test_a_failing_emitter_is_named_with_its_exception(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The warning names the emitter's class and the exception it raised, then goes on."""

        class Flaky:
            def emit_attempt(self, record: Any) -> None:
                raise ValueError("sink full")

            def emit_call(self, record: Any) -> None:
                raise ValueError("sink full")

        after = Recorder()
        group = Emitters([Flaky(), after])
        with caplog.at_level(logging.DEBUG, logger="polygateway.telemetry"):
            group.emit_call(call())
            group.emit_call(call())
        assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.DEBUG]
        assert caplog.records[0].getMessage() == (
            "telemetry emitter Flaky failed (skipped, the call goes on): ValueError('sink full')"
        )
        assert len(after.calls) == 2

    def test_a_failing_plain_function_emitter_is_named_too(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A callable without an owner object is named by its own type."""

        def sink(record: Any) -> None:
            raise RuntimeError("x")

        group = Emitters([])
        with caplog.at_level(logging.WARNING, logger="polygateway.telemetry"):
            group._failure(sink, RuntimeError("x"))
        assert "emitter function failed" in caplog.records[0].getMessage()
