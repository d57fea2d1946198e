"""Where attempt records go: an ``Emitter`` protocol and three built-in emitters.

Every real attempt emits one frozen ``AttemptRecord`` (research-wiki/ARCHITECTURE.md §6)
from inside ``StallClock.attempting()``, so the time telemetry takes counts
as productive and can never push a call over its stall window. Emitters run
on the hot path: they must be quick and must not raise.

- ``NullEmitter``: the default; drops records.
- ``LoggingEmitter``: one structured log line per attempt on the
  ``polygateway.attempts`` logger; records hold names, classes, status codes
  and timings, never a secret.
- ``PrometheusEmitter``: counters and a latency histogram; ``prometheus_client``
  is imported only when one is built (the ``prometheus`` extra).
"""

from __future__ import annotations

import importlib
import logging
import weakref
from dataclasses import asdict
from typing import Any, Protocol, runtime_checkable

from polygateway.errors import ConfigError
from polygateway.middleware.attempt import AttemptContext
from polygateway.models import AttemptRecord

__all__ = ["Emitter", "LoggingEmitter", "NullEmitter", "PrometheusEmitter", "attempt_record"]


def attempt_record(
    ctx: AttemptContext,
    *,
    scope: str,
    outcome: str,
    status_code: int | None,
    error: str | None,
    ended_at: float,
) -> AttemptRecord:
    """The record of one attempt, from what its context collected; ``error`` already scrubbed."""
    usage = ctx.usage
    return AttemptRecord(
        call_id=ctx.call_id,
        scope=scope,
        source=ctx.lease.source,
        attempt=ctx.attempt,
        outcome=outcome,
        status_code=status_code,
        latency_s=max(0.0, ended_at - ctx.started_at),
        ttft_s=ctx.ttft_s,
        prompt_tokens=usage.prompt_tokens if usage is not None else 0,
        completion_tokens=usage.completion_tokens if usage is not None else 0,
        permit_wait_s=ctx.permit_wait_s,
        stalled_s=ctx.stalled_s,
        error=error,
    )


@runtime_checkable
class Emitter(Protocol):
    """Receives one record per attempt; called inside the attempt, so it must be quick."""

    def emit_attempt(self, record: AttemptRecord) -> None:
        """Take one attempt's record."""
        ...


class NullEmitter:
    """Drops every record: the default when telemetry is not wanted."""

    __slots__ = ()

    def emit_attempt(self, record: AttemptRecord) -> None:
        """Do nothing."""


class LoggingEmitter:
    """One structured log line per attempt: DEBUG for successes, WARNING for failures.

    The record's fields travel in ``extra={"polygateway": {...}}`` for
    structured handlers; the message itself is a short human line.
    """

    __slots__ = ("_failure_level", "_logger", "_success_level")

    def __init__(
        self,
        logger: logging.Logger | None = None,
        *,
        success_level: int = logging.DEBUG,
        failure_level: int = logging.WARNING,
    ) -> None:
        self._logger = logger if logger is not None else logging.getLogger("polygateway.attempts")
        self._success_level = success_level
        self._failure_level = failure_level

    def emit_attempt(self, record: AttemptRecord) -> None:
        """Log the record, skipping the formatting when the level is off."""
        level = self._success_level if record.outcome == "success" else self._failure_level
        if not self._logger.isEnabledFor(level):
            return
        status = f" status={record.status_code}" if record.status_code is not None else ""
        error = f" error={record.error}" if record.error else ""
        self._logger.log(
            level,
            "attempt scope=%s source=%s n=%d outcome=%s%s latency=%.3fs%s",
            record.scope,
            record.source,
            record.attempt,
            record.outcome,
            status,
            record.latency_s,
            error,
            extra={"polygateway": asdict(record)},
        )


_METRICS: weakref.WeakKeyDictionary[Any, tuple[Any, Any, Any]] = weakref.WeakKeyDictionary()
"""Metrics already registered per registry: a registry refuses the same name twice."""


class PrometheusEmitter:
    """Prometheus counters of attempts and histograms of latency and TTFT.

    Metrics (prefix ``polygateway_``): ``attempts_total{scope,source,outcome}``,
    ``attempt_latency_seconds{scope,source}`` and ``stream_ttft_seconds{scope,source}``.
    Several emitters on one registry share the same metrics.
    """

    __slots__ = ("_attempts", "_latency", "_ttft")

    def __init__(self, registry: Any = None) -> None:
        try:
            prometheus = importlib.import_module("prometheus_client")
        except ImportError as exc:
            raise ConfigError(
                "PrometheusEmitter needs prometheus-client: install polygateway[prometheus]"
            ) from exc
        if registry is None:
            registry = prometheus.REGISTRY
        metrics = _METRICS.get(registry)
        if metrics is None:
            metrics = (
                prometheus.Counter(
                    "polygateway_attempts",
                    "Real attempts, by scope, source and outcome.",
                    ("scope", "source", "outcome"),
                    registry=registry,
                ),
                prometheus.Histogram(
                    "polygateway_attempt_latency_seconds",
                    "Duration of each attempt, request to release.",
                    ("scope", "source"),
                    registry=registry,
                ),
                prometheus.Histogram(
                    "polygateway_stream_ttft_seconds",
                    "Time from a stream's request to its first chunk.",
                    ("scope", "source"),
                    registry=registry,
                ),
            )
            _METRICS[registry] = metrics
        self._attempts, self._latency, self._ttft = metrics

    def emit_attempt(self, record: AttemptRecord) -> None:
        """Count the attempt and observe its latency (and TTFT for streams)."""
        self._attempts.labels(record.scope, record.source, record.outcome).inc()
        self._latency.labels(record.scope, record.source).observe(record.latency_s)
        if record.ttft_s is not None:
            self._ttft.labels(record.scope, record.source).observe(record.ttft_s)
