"""Where telemetry records go: an ``Emitter`` protocol, built-in emitters, and a fan-out.

Every real attempt emits one frozen ``AttemptRecord`` from inside the
attempt, so the time telemetry takes counts as productive and can never
push a call over its stall window; every call through the loop emits one
``CallRecord`` when it ends, however it ends (research-wiki/ARCHITECTURE.md
§6). Emitters run on the hot path: they must be quick. One that raises is
logged and skipped (``Emitters``); it never fails a call.

- ``NullEmitter``: the default; drops records.
- ``LoggingEmitter``: one structured log line per attempt on the
  ``polygateway.attempts`` logger; records hold names, classes, status codes
  and timings, never a secret.
- ``PrometheusEmitter``: counters and a latency histogram, plus the live
  gauges of every client it is passed to (``middleware/gauges.py``, read from
  the backend at scrape time); ``prometheus_client`` is imported only when
  one is built (the ``prometheus`` extra).

An emitter may also offer an optional hook, ``attempt_headers(start:
AttemptStart)``, called as each attempt begins, whose headers go out on
that attempt's request (``HeadersEmitter``: how ``OpenTelemetryEmitter``
sends trace context upstream). ``Emitters`` looks for it once; without one
the loop pays nothing for it.
"""

from __future__ import annotations

import importlib
import logging
import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from polygateway.errors import ConfigError
from polygateway.middleware.attempt import AttemptContext
from polygateway.models import AttemptRecord, CallRecord

if TYPE_CHECKING:
    from polygateway.backends.base import Backend
    from polygateway.config import SourceConfig

__all__ = [
    "AttemptEmitter",
    "AttemptStart",
    "BindingEmitter",
    "ClientInfo",
    "Emitter",
    "Emitters",
    "HeadersEmitter",
    "LoggingEmitter",
    "NullEmitter",
    "PrometheusEmitter",
    "attempt_record",
]

_log = logging.getLogger("polygateway.telemetry")


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
        response_model=ctx.response_model,
        finish_reasons=ctx.finish_reasons,
    )


@runtime_checkable
class AttemptEmitter(Protocol):
    """An emitter of attempt records only, as emitters were before call records existed."""

    def emit_attempt(self, record: AttemptRecord) -> None:
        """Take one attempt's record (called inside the attempt)."""
        ...


@runtime_checkable
class Emitter(Protocol):
    """Receives one record per attempt and one per call; called on the hot path, so quick."""

    def emit_attempt(self, record: AttemptRecord) -> None:
        """Take one attempt's record (called inside the attempt)."""
        ...

    def emit_call(self, record: CallRecord) -> None:
        """Take one call's record (called as the call ends)."""
        ...


@dataclass(frozen=True, slots=True)
class AttemptStart:
    """An attempt about to send its request: what a header hook may know of it.

    ``call_elapsed_s`` is the time since the call began (the injected clock),
    so a hook that starts a span for the call can date it from the call's start.
    """

    call_id: str
    scope: str
    operation: str
    source: str
    attempt: int
    call_elapsed_s: float


@runtime_checkable
class HeadersEmitter(Protocol):
    """An emitter that adds headers to each attempt's request (trace context); optional.

    The headers are added to the request as it is built and never replace
    one the request already has (the source's key, its own headers). An
    emitter whose ``attempt_headers`` is ``None`` offers no hook.
    """

    def attempt_headers(self, start: AttemptStart) -> Mapping[str, str] | None:
        """The headers of the attempt beginning now, or ``None`` for none."""
        ...


def _no_classes() -> Mapping[str, tuple[int, int]]:
    """``ClientInfo.by_class`` of a client that tells none."""
    return {}


@dataclass(frozen=True, slots=True)
class ClientInfo:
    """What an emitter may learn of a client it is passed to (``bind``), once, at construction.

    ``sources`` are the scope's settings (names, protocols, models, base URLs:
    what span attributes name); ``backend`` is the shared state live gauges
    read at scrape time; ``waiting`` counts the calls of the scope waiting in
    this process; ``by_class`` gives, per priority class (``""`` for a scope
    without classes), the calls waiting and the permits in use in this
    process (the scope's waiting room: clients of one scope share it, so
    equal callables are one count). Nothing here holds a prompt, an answer or
    a secret to emit (a source's key stays in its ``SecretStr``).
    """

    kind: str
    scope: str
    sources: tuple[SourceConfig, ...]
    backend: Backend
    waiting: Callable[[], int]
    by_class: Callable[[], Mapping[str, tuple[int, int]]] = _no_classes


@runtime_checkable
class BindingEmitter(Protocol):
    """An emitter that wants to know the clients it serves (gauges, span attributes)."""

    def bind(self, client: ClientInfo) -> None:
        """Called once per client the emitter is passed to, when the client is built."""
        ...


class NullEmitter:
    """Drops every record: the default when telemetry is not wanted."""

    __slots__ = ()

    def emit_attempt(self, record: AttemptRecord) -> None:
        """Do nothing."""

    def emit_call(self, record: CallRecord) -> None:
        """Do nothing."""


class Emitters:
    """Several emitters as one: each record goes to each, in order; a failing one is logged.

    An emitter that raises is skipped for that record and logged (a warning
    the first time, at debug level after that), so telemetry never fails a
    call and a broken emitter does not flood the log. An emitter written
    before ``emit_call`` existed (``emit_attempt`` only) gets attempt records.
    The emitters' header hooks (``HeadersEmitter``) are found once, here;
    ``wants_headers`` tells the loop whether to ask for any. ``recording``
    tells it whether a record would go anywhere: an emitter may say it keeps
    nothing now (``is_recording()``, as ``OpenTelemetryEmitter`` without an
    SDK), and when every one of them says so the loop builds no record to hand
    on; an emitter without ``is_recording`` always records.
    """

    __slots__ = (
        "_attempts",
        "_calls",
        "_failed",
        "_headers",
        "_recording",
        "emitters",
        "recording",
        "wants_headers",
    )

    def __init__(self, emitters: Sequence[AttemptEmitter]) -> None:
        self.emitters = tuple(emitters)
        self._attempts = tuple(e.emit_attempt for e in self.emitters)
        self._calls = tuple(e.emit_call for e in self.emitters if isinstance(e, Emitter))
        hooks = (getattr(e, "attempt_headers", None) for e in self.emitters)
        self._headers: tuple[Callable[[AttemptStart], Mapping[str, str] | None], ...] = tuple(
            hook for hook in hooks if callable(hook)
        )
        self.wants_headers = bool(self._headers)
        checks = [getattr(e, "is_recording", None) for e in self.emitters]
        self._recording: tuple[Callable[[], bool], ...] = tuple(c for c in checks if callable(c))
        self.recording: Callable[[], bool] = (
            self._any_recording if len(self._recording) == len(checks) else _always
        )
        self._failed: set[int] = set()

    def __repr__(self) -> str:
        return f"Emitters({list(self.emitters)!r})"

    def _any_recording(self) -> bool:
        """Whether any emitter keeps records now; one that fails to say is counted as keeping."""
        for check in self._recording:
            try:
                if check():
                    return True
            except Exception as exc:  # an emitter must never fail a call
                self._failure(check, exc)
                return True
        return False

    def emit_attempt(self, record: AttemptRecord) -> None:
        """Hand the attempt's record to every emitter."""
        for emit in self._attempts:
            try:
                emit(record)
            except Exception as exc:  # an emitter must never fail a call
                self._failure(emit, exc)

    def emit_call(self, record: CallRecord) -> None:
        """Hand the call's record to every emitter that takes call records."""
        for emit in self._calls:
            try:
                emit(record)
            except Exception as exc:  # an emitter must never fail a call
                self._failure(emit, exc)

    def headers_for(
        self, ctx: AttemptContext, scope: str, operation: str, call_elapsed_s: float
    ) -> dict[str, str] | None:
        """The headers the emitters' hooks give the attempt ``ctx`` begins; ``None`` for none.

        The first hook to name a header wins it. A hook that raises, or gives
        a name or value a transport would refuse (which would fail the
        request), is logged and skipped.
        """
        start = AttemptStart(ctx.call_id, scope, operation, ctx.source, ctx.attempt, call_elapsed_s)
        merged: dict[str, str] | None = None
        for hook in self._headers:
            try:
                given = hook(start)
                if not given:
                    continue
                headers = dict(given)
                for name, value in headers.items():
                    if not _valid_header(name, value):
                        raise TypeError(f"header {name!r}: not a header name and ASCII value")
            except Exception as exc:  # an emitter must never fail a call
                self._failure(hook, exc)
                continue
            if merged is None:
                merged = headers
            else:
                for name, value in headers.items():
                    merged.setdefault(name, value)
        return merged

    def bind(self, client: ClientInfo) -> None:
        """Tell every emitter that wants to know (``BindingEmitter``) of ``client``."""
        for emitter in self.emitters:
            if isinstance(emitter, BindingEmitter):
                emitter.bind(client)

    def _failure(self, emit: Any, exc: Exception) -> None:
        owner = getattr(emit, "__self__", emit)
        first = id(owner) not in self._failed
        self._failed.add(id(owner))
        _log.log(
            logging.WARNING if first else logging.DEBUG,
            "telemetry emitter %s failed (skipped, the call goes on): %r",
            type(owner).__name__,
            exc,
        )


_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
"""An HTTP header name (RFC 9110 token)."""


def _valid_header(name: object, value: object) -> bool:
    """Whether a transport sends ``name: value`` as given: a token, printable ASCII (no CR, LF)."""
    return (
        isinstance(name, str)
        and _HEADER_NAME.fullmatch(name) is not None
        and isinstance(value, str)
        and value.isascii()
        and value.isprintable()
    )


def _always() -> bool:
    """``Emitters.recording`` when an emitter cannot say it keeps nothing."""
    return True


def emitters_of(
    emitter: AttemptEmitter | None, emitters: Sequence[AttemptEmitter] | None
) -> Emitters | None:
    """The emitters a client was given (``emitter=`` and ``emitters=``), or ``None`` for none.

    An emitter given twice is one emitter: it gets each record once (twice would
    double its counts, and start a second span for an attempt that ends one).
    """
    every = [*([] if emitter is None else [emitter]), *(emitters or ())]
    # By identity, in order: two equal emitters are still two.
    once = list({id(e): e for e in every if type(e) is not NullEmitter}.values())
    return Emitters(once) if once else None


class LoggingEmitter:
    """One structured log line per attempt and per call: DEBUG when served, WARNING otherwise.

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

    def emit_call(self, record: CallRecord) -> None:
        """Log the call's end, skipping the formatting when the level is off."""
        level = self._success_level if record.outcome == "served" else self._failure_level
        if not self._logger.isEnabledFor(level):
            return
        self._logger.log(
            level,
            "call %s scope=%s op=%s outcome=%s attempts=%d source=%s duration=%.3fs "
            "waited=%.3fs stalled=%.3fs",
            record.call_id,
            record.scope,
            record.operation,
            record.outcome,
            record.attempts,
            record.source or "-",
            record.duration_s,
            record.waited_s,
            record.stalled_s,
            extra={"polygateway": asdict(record)},
        )


_METRICS: weakref.WeakKeyDictionary[Any, tuple[Any, ...]] = weakref.WeakKeyDictionary()
"""Metrics already registered per registry: a registry refuses the same name twice."""


class PrometheusEmitter:
    """Prometheus counters of attempts and histograms of latency and TTFT.

    Metrics (prefix ``polygateway_``): ``attempts_total{scope,source,outcome}``,
    ``attempt_latency_seconds{scope,source}``, ``stream_ttft_seconds{scope,source}``,
    ``calls_total{scope,operation,outcome}`` (every call, also those that never
    reached a source) and ``call_duration_seconds{scope,operation}``.
    Passed to a client, it also shows that client's scope in the registry's
    ``LiveGauges`` (``polygateway_source_*`` and ``polygateway_scope_*``, read
    from the backend at each scrape). Several emitters on one registry share
    the same metrics and the same gauges.
    """

    __slots__ = ("_attempts", "_call_duration", "_calls", "_gauges", "_latency", "_ttft")

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
            from polygateway.middleware.gauges import LiveGauges

            gauges = LiveGauges(prometheus)
            registry.register(gauges)
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
                prometheus.Counter(
                    "polygateway_calls",
                    "Calls through the governance loop, by scope, operation and outcome.",
                    ("scope", "operation", "outcome"),
                    registry=registry,
                ),
                prometheus.Histogram(
                    "polygateway_call_duration_seconds",
                    "Duration of each call, start to end, waiting included.",
                    ("scope", "operation"),
                    registry=registry,
                ),
                gauges,
            )
            _METRICS[registry] = metrics
        (
            self._attempts,
            self._latency,
            self._ttft,
            self._calls,
            self._call_duration,
            self._gauges,
        ) = metrics

    def bind(self, client: ClientInfo) -> None:
        """Show ``client``'s scope in the live gauges, read from its backend at each scrape."""
        self._gauges.bind(client)

    def emit_attempt(self, record: AttemptRecord) -> None:
        """Count the attempt and observe its latency (and TTFT for streams)."""
        self._attempts.labels(record.scope, record.source, record.outcome).inc()
        self._latency.labels(record.scope, record.source).observe(record.latency_s)
        if record.ttft_s is not None:
            self._ttft.labels(record.scope, record.source).observe(record.ttft_s)

    def emit_call(self, record: CallRecord) -> None:
        """Count the call by its outcome and observe its duration."""
        self._calls.labels(record.scope, record.operation, record.outcome).inc()
        self._call_duration.labels(record.scope, record.operation).observe(record.duration_s)
        if self._gauges.loopless:  # a client built outside a loop: its loop is this one
            self._gauges.adopt_loop(record.scope)
