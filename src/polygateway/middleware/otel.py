"""OpenTelemetry spans and metrics from telemetry records, after the GenAI semantic conventions.

``OpenTelemetryEmitter`` turns each ``CallRecord`` into a CLIENT span and each
of its ``AttemptRecord`` s into a child CLIENT span, named ``{operation}
{model}`` and carrying the ``gen_ai.*``, ``server.*`` and ``error.type``
attributes of the GenAI conventions plus ours under ``polygateway.``; it
records the GenAI client metrics and, for each client it is bound to, reads
the backend's live state through observable gauges. Only ``opentelemetry-api``
is needed (the ``otel`` extra); with no SDK installed every call is a no-op.

Records arrive after the fact (an attempt's as it ends, a call's as it
ends), so spans are made retroactively with explicit times: the end is the
wall clock when the record arrives, the start that minus the record's
duration. An attempt's record is kept until its call's record arrives (at
most ``_MAX_PENDING_CALLS`` calls; past that the oldest call's attempts are
emitted without their call span). A call's span is a child of the context
current when the call's first record arrived: the caller's, since the loop
runs attempts and ends calls in the caller's task.

With ``propagate=True`` a header sent upstream must name a span that will be
exported, so spans are started live instead: the emitter's
``attempt_headers`` hook (``telemetry.HeadersEmitter``), called as each
attempt begins, starts the call's span on the first attempt (dated from the
call's start, a child of the caller's current span) and the attempt's span
beneath it, and returns the attempt's ``traceparent`` (and whatever else the
global propagator writes, ``opentelemetry.propagate.inject``); the records
end them. The call may fail over and OpenTelemetry cannot take an attribute
back, so its span starts with only the source attributes every source of its
scope shares (what a sampler sees) and its record sets those of the source that
served (else the last tried), as a span made from the record says. Without
propagation the hook is ``None`` and the loop never calls it.

Operation names: ``chat.*`` is ``chat``, ``embed`` is ``embeddings``, and
OCR (``ocr.*``: an image in, text out) is ``generate_content``, the
conventions' multimodal operation; ``polygateway.operation`` keeps the
client's own name. ``gen_ai.response.model`` and
``gen_ai.response.finish_reasons`` come from the attempt's record (the
answer's ``model`` and each choice's finish reason); a call's span takes
those of the attempt that served it, and neither a failed attempt's span nor
the span of a call not served names them. Never recorded: prompts, completions,
error messages (a provider's error body may quote the prompt) or anything
of a source's key.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

from polygateway.errors import ConfigError
from polygateway.middleware.gauges import BREAKER_STATES, LiveReader
from polygateway.middleware.telemetry import AttemptStart, ClientInfo
from polygateway.models import AttemptRecord, CallRecord

if TYPE_CHECKING:
    from polygateway.backends.base import ScopeSnapshot
    from polygateway.config import SourceConfig

__all__ = ["OpenTelemetryEmitter"]

_log = logging.getLogger("polygateway.telemetry")

INSTRUMENTATION: Final = "polygateway"
"""The instrumentation scope's name (tracer and meter)."""

_MAX_PENDING_CALLS: Final = 4096
"""Calls whose attempt records wait for the call's record; a lost call never leaks past this."""

_RECHECK_EVERY: Final = 256
"""Records between two looks at the global tracer provider while it is the no-op stand-in."""

_OPERATIONS: Final = {"chat": "chat", "embed": "embeddings", "ocr": "generate_content"}
"""GenAI operation name by the first part of a client operation (``chat.stream`` -> ``chat``)."""

_PROVIDERS: Final = {
    "openai": "openai",
    "anthropic": "anthropic",
    # An OpenAI-compatible vision chat model: the OpenAI wire, whoever hosts it.
    "vision_ocr": "openai",
    "monkey_ocr": "monkey_ocr",
}
"""``gen_ai.provider.name`` by source protocol."""

# The conventions' advised buckets (research-wiki/guides/observability.md, OpenTelemetry).
_DURATION_BUCKETS: Final = (
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
_TOKEN_BUCKETS: Final = tuple(4.0**i for i in range(14))


def _server(base_url: str) -> dict[str, Any]:
    """``server.address`` and ``server.port`` of a base URL (never its user info or query)."""
    try:
        parts = urlsplit(base_url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return {}
    if not host:
        return {}
    if port is None:
        port = {"https": 443, "http": 80}.get(parts.scheme)
    return (
        {"server.address": host} if port is None else {"server.address": host, "server.port": port}
    )


def _source_attributes(operation: str, source: SourceConfig) -> dict[str, Any]:
    """What a span and a metric say of the source a request went to."""
    attrs: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": _PROVIDERS.get(source.protocol, source.protocol),
    }
    if source.model:
        attrs["gen_ai.request.model"] = source.model
    attrs.update(_server(source.base_url))
    return attrs


def _operation(name: str) -> str:
    """The GenAI operation name of a client operation."""
    head = name.split(".", 1)[0]
    return _OPERATIONS.get(head, head)


class _Shape:
    """What every span and data point of one (scope, source, operation) shares, built once.

    ``attrs`` (the ``gen_ai.*`` and ``server.*`` ones) becomes the shape's own:
    the scope is added to it. The dicts are handed to OpenTelemetry as they
    are (it copies attributes it keeps) and never changed after construction.
    """

    __slots__ = ("input", "metric", "name", "output")

    def __init__(self, scope: str, attrs: dict[str, Any]) -> None:
        operation = attrs["gen_ai.operation.name"]
        attrs["polygateway.scope"] = scope
        model = attrs.get("gen_ai.request.model")
        self.name = f"{operation} {model}" if model else operation
        self.metric: dict[str, Any] = attrs
        self.input = {**attrs, "gen_ai.token.type": "input"}
        self.output = {**attrs, "gen_ai.token.type": "output"}


def _answer_attributes(
    attrs: dict[str, Any], answer: AttemptRecord | None, prompt_tokens: int, completion_tokens: int
) -> None:
    """The GenAI attributes of an answer: its model and finish reasons (from ``answer``), tokens."""
    if answer is not None:
        if answer.response_model:
            attrs["gen_ai.response.model"] = answer.response_model
        if answer.finish_reasons:
            attrs["gen_ai.response.finish_reasons"] = answer.finish_reasons
    if prompt_tokens:
        attrs["gen_ai.usage.input_tokens"] = prompt_tokens
    if completion_tokens:
        attrs["gen_ai.usage.output_tokens"] = completion_tokens


class _Pending:
    """A call's attempts that arrived before the call's record, and the caller's context then."""

    __slots__ = ("attempts", "context")

    def __init__(self, context: Any) -> None:
        self.context = context
        self.attempts: list[tuple[AttemptRecord, int]] = []


class _Live:
    """A call whose spans were started as it ran (trace propagation): open until its record.

    ``context`` holds the call's span, the parent of its attempts' spans;
    ``attempts`` are the attempt spans still open, by attempt number;
    ``last`` is the record of the latest attempt that ended a live span (``_latest``
    weighs it against the attempts kept without one); ``tried`` is the shape of
    the source of the latest attempt begun.
    """

    __slots__ = ("attempts", "context", "last", "span", "tried")

    def __init__(self, span: Any, context: Any, tried: _Shape) -> None:
        self.span = span
        self.context = context
        self.attempts: dict[int, Any] = {}
        self.last: AttemptRecord | None = None
        self.tried = tried

    def end(self, end_ns: int) -> None:
        """End every span still open."""
        for span in self.attempts.values():
            span.end(end_time=end_ns)
        self.attempts.clear()
        self.span.end(end_time=end_ns)

    def drop(self, end_ns: int) -> None:
        """End a call whose record never came, its span named for the last source tried."""
        if self.span.is_recording():
            self.span.update_name(self.tried.name)
            self.span.set_attributes(self.tried.metric)
        self.end(end_ns)


def _latest(pending: _Pending | None, live: _Live | None) -> AttemptRecord | None:
    """The call's last attempt: of those kept without a live span and the live ones, the latest.

    A call's attempts run one after the other, so each list ends with its own
    latest; which list holds the call's last depends on which attempts had a
    live span (a hook that failed, an SDK installed mid-call), so their
    numbers decide.
    """
    kept = pending.attempts[-1][0] if pending is not None and pending.attempts else None
    ended = live.last if live is not None else None
    if kept is None or (ended is not None and ended.attempt > kept.attempt):
        return ended
    return kept


class OpenTelemetryEmitter:
    """A CLIENT span per call with one child per attempt, GenAI metrics, and live gauges.

    Args:
        tracer_provider: where spans go; the global provider when omitted.
        meter_provider: where metrics go; the global provider when omitted.
        propagate: send the trace context of each attempt's span upstream
            (``traceparent``, through the globally configured propagator,
            ``opentelemetry.propagate.inject``); spans are then started as
            the call runs rather than made from its records.

    Metrics: ``gen_ai.client.operation.duration`` (s, per call),
    ``gen_ai.client.token.usage`` ({token}, per call, ``gen_ai.token.type``
    input / output), ``gen_ai.client.operation.time_to_first_chunk`` (s, per
    streamed attempt), and per bound client the observable gauges
    ``polygateway.source.permits.in_use``, ``polygateway.source.limit``,
    ``polygateway.source.breaker.state`` (1 for the current state),
    ``polygateway.source.breaker.reopen`` (s), ``polygateway.source.paused``
    (s), ``polygateway.source.rpm_tokens``, ``polygateway.source.tpm_tokens``,
    ``polygateway.scope.calls.waiting`` and, per ``polygateway.priority_class``
    (``""`` for a scope without classes), ``polygateway.scope.calls.waiting_by_class``
    and ``polygateway.scope.permits.in_use`` (this process; exported to Prometheus they are
    named as ``PrometheusEmitter``'s live gauges). Gauges read the backends of
    the bound clients as ``PrometheusEmitter``'s do (``gauges.LiveReader``,
    backends held weakly): from the SDK's reader thread each read runs on the
    client's event loop with a bounded wait, so a Redis fleet's state is
    read too; on the loop's own thread a Redis scope shows its latest
    snapshot and starts the next.
    """

    __slots__ = (
        "_bound",
        "_call_duration",
        "_call_shapes",
        "_context",
        "_get_meter_provider",
        "_get_tracer_provider",
        "_inject",
        "_kind",
        "_live",
        "_meter",
        "_meter_provider",
        "_metered",
        "_no_op_meters",
        "_no_op_providers",
        "_observation",
        "_op_names",
        "_operations",
        "_pending",
        "_reader",
        "_recheck_in",
        "_set_span_in_context",
        "_shapes",
        "_sources",
        "_status_error",
        "_token_usage",
        "_traced",
        "_tracer",
        "_tracer_provider",
        "_ttfc",
        "attempt_headers",
    )

    def __init__(
        self, tracer_provider: Any = None, meter_provider: Any = None, *, propagate: bool = False
    ) -> None:
        try:
            trace = importlib.import_module("opentelemetry.trace")
            metrics = importlib.import_module("opentelemetry.metrics")
            context = importlib.import_module("opentelemetry.context")
            propagation = importlib.import_module("opentelemetry.propagate")
        except ImportError as exc:
            raise ConfigError(
                "OpenTelemetryEmitter needs opentelemetry-api: install polygateway[otel]"
            ) from exc
        self._tracer = trace.get_tracer(INSTRUMENTATION, tracer_provider=tracer_provider)
        self._tracer_provider = tracer_provider
        self._get_tracer_provider = trace.get_tracer_provider
        self._no_op_providers = (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
        self._traced = False
        self._recheck_in = 1
        self._meter = metrics.get_meter(INSTRUMENTATION, meter_provider=meter_provider)
        self._meter_provider = meter_provider
        self._get_meter_provider = metrics.get_meter_provider
        # The global stand-in before an SDK is installed; a private name of the API, so
        # without it only the API's no-op counts as idle (metrics then always recorded).
        internal = importlib.import_module("opentelemetry.metrics._internal")
        proxy = getattr(internal, "_ProxyMeterProvider", metrics.NoOpMeterProvider)
        self._no_op_meters = (metrics.NoOpMeterProvider, proxy)
        self._metered = False
        self._context = context
        self._kind = trace.SpanKind.CLIENT
        self._set_span_in_context = trace.set_span_in_context
        self._status_error = trace.Status(trace.StatusCode.ERROR)
        self._observation = metrics.Observation
        self._inject = propagation.inject
        # The fan-out (``Emitters``) calls the hook only when it is set: without
        # propagation the loop pays nothing for it and spans stay retroactive.
        self.attempt_headers: Callable[[AttemptStart], Mapping[str, str] | None] | None = (
            self._attempt_headers if propagate else None
        )
        self._call_duration = self._meter.create_histogram(
            "gen_ai.client.operation.duration",
            unit="s",
            description="GenAI operation duration: a call, start to end, waiting included.",
            explicit_bucket_boundaries_advisory=list(_DURATION_BUCKETS),
        )
        self._token_usage = self._meter.create_histogram(
            "gen_ai.client.token.usage",
            unit="{token}",
            description="Number of input and output tokens used, per call.",
            explicit_bucket_boundaries_advisory=list(_TOKEN_BUCKETS),
        )
        self._ttfc = self._meter.create_histogram(
            "gen_ai.client.operation.time_to_first_chunk",
            unit="s",
            description="Time from a streamed attempt's request to its first chunk.",
            explicit_bucket_boundaries_advisory=list(_DURATION_BUCKETS),
        )
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._live: OrderedDict[str, _Live] = OrderedDict()
        self._sources: dict[tuple[str, str], SourceConfig] = {}
        self._operations: dict[str, str] = {}
        """GenAI operation by scope (its clients' kind), for attempts whose call never ended."""
        self._op_names: dict[str, str] = {}
        """GenAI operation by client operation (``chat.stream`` -> ``chat``), filled as met."""
        self._shapes: dict[tuple[str, str | None, str], _Shape] = {}
        self._call_shapes: dict[tuple[str, str], _Shape] = {}
        """What every source of a scope shares, by scope and GenAI operation (``_call_shape``)."""
        self._bound = 0
        self._reader = LiveReader()

    def __repr__(self) -> str:
        propagate = ", propagate=True" if self.attempt_headers is not None else ""
        return f"OpenTelemetryEmitter(clients={self._bound}{propagate})"

    # --- records -> spans and metrics ------------------------------------------------

    def is_recording(self) -> bool:
        """Whether a record would go anywhere: spans or metrics to a provider that keeps them.

        With the API's no-op providers (no SDK installed) nothing would, and
        the loop (``Emitters.recording``) then builds no call record for this
        emitter: the no-op costs a look, not a record (the 10% target of
        research-wiki/BENCHMARKS.md, telemetry).
        """
        if not (self._traced and self._metered):
            self._look()
        return self._traced or self._metered

    def _tracing(self) -> bool:
        """Whether spans go anywhere: not while the provider is the API's no-op or its stand-in."""
        if not self._traced:
            self._look()
        return self._traced

    def _look(self) -> None:
        """Ask the providers again, every ``_RECHECK_EVERY`` looks while one of them is idle.

        An application may install its SDK after building clients (the global
        stand-ins then hand spans and measurements on). Asking costs an
        environment lookup, more than the rest of a record without an SDK, so
        it is done only every ``_RECHECK_EVERY`` looks. Once a provider keeps
        records it always will: a global provider is set once.
        """
        self._recheck_in -= 1
        if self._recheck_in > 0:
            return
        self._recheck_in = _RECHECK_EVERY
        if not self._traced:
            tracers = self._tracer_provider
            if tracers is None:
                tracers = self._get_tracer_provider()
            self._traced = not isinstance(tracers, self._no_op_providers)
        if not self._metered:
            meters = self._meter_provider
            if meters is None:
                meters = self._get_meter_provider()
            self._metered = not isinstance(meters, self._no_op_meters)

    def _operation(self, name: str) -> str:
        """The GenAI operation of a client operation, remembered."""
        operation = self._op_names.get(name)
        if operation is None:
            operation = self._op_names[name] = _operation(name)
        return operation

    def _attempt_headers(self, start: AttemptStart) -> Mapping[str, str] | None:
        """Start the attempt's span (and, on its first, the call's); its trace context, injected.

        Runs in the caller's task as the attempt begins, so the call's span is
        a child of the caller's current span; the call's span is dated from
        the call's start (``call_elapsed_s`` before now). Both stay open until
        their records arrive (``emit_attempt``, ``emit_call``), at most for the
        latest ``_MAX_PENDING_CALLS`` calls.
        """
        if not self._tracing():
            return None
        now_ns = time.time_ns()  # the edge: spans are dated by the wall clock
        operation = self._operation(start.operation)
        shape = self._shape(start.scope, start.source, operation)
        live = self._live.get(start.call_id)
        if live is None:
            parent = self._context.get_current()
            # The call may fail over, and an attribute once set stays: it starts with what
            # any source would give it, the rest set from its record (``_end_call_span``).
            begun = self._call_shape(start.scope, start.source, operation)
            span = self._start_span(begun, parent, now_ns - int(start.call_elapsed_s * 1e9))
            context = self._set_span_in_context(span, parent)
            live = self._live[start.call_id] = _Live(span, context, shape)
            if len(self._live) > _MAX_PENDING_CALLS:
                _, lost = self._live.popitem(last=False)
                lost.drop(now_ns)
        live.tried = shape
        span = self._start_span(shape, live.context, now_ns)
        live.attempts[start.attempt] = span
        carrier: dict[str, str] = {}
        self._inject(carrier, context=self._set_span_in_context(span, live.context))
        return carrier

    def emit_attempt(self, record: AttemptRecord) -> None:
        """End the attempt's live span, or keep the record until its call ends; stream TTFT."""
        if self._tracing():
            end_ns = time.time_ns()  # the edge: spans are dated by the wall clock
            live = self._live.get(record.call_id) if self._live else None
            span = None if live is None else live.attempts.pop(record.attempt, None)
            if live is not None and span is not None:
                live.last = record
                self._end_attempt_span(span, record, end_ns)
            else:
                pending = self._pending.get(record.call_id)
                if pending is None:
                    pending = self._pending[record.call_id] = _Pending(self._context.get_current())
                    if len(self._pending) > _MAX_PENDING_CALLS:
                        _, lost = self._pending.popitem(last=False)
                        operation = self._operations.get(lost.attempts[0][0].scope) or "chat"
                        self._attempt_spans(lost.attempts, lost.context, operation)
                pending.attempts.append((record, end_ns))
        if record.ttft_s is not None:
            shape = self._shape(record.scope, record.source, "chat")
            self._ttfc.record(record.ttft_s, shape.metric)

    def emit_call(self, record: CallRecord) -> None:
        """The call's span, its attempts' spans beneath it, and the call's metrics.

        Like ``PrometheusEmitter``'s, the gauges of a client built outside any
        event loop learn its loop here, from its first call: without it a
        backend that must be awaited (Redis) would never be read.
        """
        pending = self._pending.pop(record.call_id, None) if self._pending else None
        live = self._live.pop(record.call_id, None) if self._live else None
        operation = self._operation(record.operation)
        # The span names the source that served, else the last one tried.
        name = record.source
        if name is None:
            last = _latest(pending, live)
            name = None if last is None else last.source
        shape = self._shape(record.scope, name, operation)
        failed = record.outcome != "served"
        if live is not None:
            self._end_call_span(live, record, shape, operation, pending, failed)
        elif self._tracing():
            self._call_span(record, shape, operation, pending, failed)
        metric = shape.metric if not failed else {**shape.metric, "error.type": record.outcome}
        self._call_duration.record(record.duration_s, metric)
        if record.prompt_tokens:
            tokens = shape.input if not failed else {**shape.input, "error.type": record.outcome}
            self._token_usage.record(record.prompt_tokens, tokens)
        if record.completion_tokens:
            tokens = shape.output if not failed else {**shape.output, "error.type": record.outcome}
            self._token_usage.record(record.completion_tokens, tokens)
        if self._reader.loopless:  # a client built outside a loop: its loop is this one
            self._reader.adopt_loop(record.scope)

    def _call_span(
        self,
        record: CallRecord,
        shape: _Shape,
        operation: str,
        pending: _Pending | None,
        failed: bool,
    ) -> None:
        """The call's span, ended, with its attempts' spans beneath it."""
        end_ns = time.time_ns()  # the edge: spans are dated by the wall clock
        parent = self._context.get_current() if pending is None else pending.context
        span = self._start_span(shape, parent, end_ns - int(record.duration_s * 1e9))
        # Sampled out, nothing below is kept: skip building it.
        if span.is_recording():
            last = pending.attempts[-1][0] if pending is not None and pending.attempts else None
            self._call_attributes(span, record, last, failed)
            if pending is not None:
                context = self._set_span_in_context(span, parent)
                self._attempt_spans(pending.attempts, context, operation)
        span.end(end_time=end_ns)

    def _end_call_span(
        self,
        live: _Live,
        record: CallRecord,
        shape: _Shape,
        operation: str,
        pending: _Pending | None,
        failed: bool,
    ) -> None:
        """End the call's live span, named now for the source that served (else the last tried).

        Attempts recorded without a live span (begun before an SDK was
        installed) get their spans beneath it, after the fact.
        """
        end_ns = time.time_ns()  # the edge: spans are dated by the wall clock
        span = live.span
        if span.is_recording():
            last = _latest(pending, live)
            if pending is not None:
                self._attempt_spans(pending.attempts, live.context, operation)
            span.update_name(shape.name)
            span.set_attributes(shape.metric)
            self._call_attributes(span, record, last, failed)
        live.end(end_ns)

    def _call_attributes(
        self, span: Any, record: CallRecord, last: AttemptRecord | None, failed: bool
    ) -> None:
        """What a call's span says of the call; the answer's model and finish from ``last``."""
        attrs: dict[str, Any] = {
            "polygateway.operation": record.operation,
            "polygateway.call_id": record.call_id,
            "polygateway.outcome": record.outcome,
            "polygateway.attempts": record.attempts,
            "polygateway.waited_s": record.waited_s,
            "polygateway.stalled_s": record.stalled_s,
        }
        served_by = None
        if record.source is not None:
            attrs["polygateway.source"] = record.source
            # The serving attempt is the call's last; a call not served (a stream cut or
            # left after its first chunks) has none, so its span names no answer.
            if not failed and last is not None and last.source == record.source:
                served_by = last
        _answer_attributes(attrs, served_by, record.prompt_tokens, record.completion_tokens)
        if failed:
            attrs["error.type"] = record.outcome
            span.set_status(self._status_error)
        span.set_attributes(attrs)

    def _start_span(self, shape: _Shape, parent: Any, start_ns: int) -> Any:
        """A span of ``shape`` (name, attributes) beneath ``parent``, started at ``start_ns``."""
        return self._tracer.start_span(
            shape.name,
            context=parent,
            kind=self._kind,
            attributes=shape.metric,
            start_time=start_ns,
        )

    def _attempt_spans(
        self, attempts: Iterable[tuple[AttemptRecord, int]], parent: Any, operation: str
    ) -> None:
        """One ended span per attempt, beneath ``parent``."""
        for record, end_ns in attempts:
            shape = self._shape(record.scope, record.source, operation)
            span = self._start_span(shape, parent, end_ns - int(record.latency_s * 1e9))
            self._end_attempt_span(span, record, end_ns)

    def _end_attempt_span(self, span: Any, record: AttemptRecord, end_ns: int) -> None:
        """Say what the attempt's record says on its span, and end it at ``end_ns``."""
        if span.is_recording():
            attrs: dict[str, Any] = {
                "polygateway.source": record.source,
                "polygateway.call_id": record.call_id,
                "polygateway.attempt": record.attempt,
                "polygateway.outcome": record.outcome,
                "polygateway.permit_wait_s": record.permit_wait_s,
                "polygateway.stalled_s": record.stalled_s,
            }
            if record.status_code is not None:
                attrs["http.response.status_code"] = record.status_code
            # What a failed attempt read of its answer (a cut stream's model) is no answer.
            answer = record if record.outcome == "success" else None
            _answer_attributes(attrs, answer, record.prompt_tokens, record.completion_tokens)
            if record.ttft_s is not None:
                attrs["polygateway.ttft_s"] = record.ttft_s
            if record.outcome != "success":
                attrs["error.type"] = record.outcome
                span.set_status(self._status_error)
            span.set_attributes(attrs)
        span.end(end_time=end_ns)

    def _shape(self, scope: str, source: str | None, operation: str) -> _Shape:
        """The shared attributes of ``source`` in ``scope`` for ``operation``, made on first use."""
        key = (scope, source, operation)
        shape = self._shapes.get(key)
        if shape is None:
            config = None if source is None else self._sources.get((scope, source))
            attrs = (
                {"gen_ai.operation.name": operation}
                if config is None
                else _source_attributes(operation, config)
            )
            shape = self._shapes[key] = _Shape(scope, attrs)
        return shape

    def _call_shape(self, scope: str, source: str, operation: str) -> _Shape:
        """What a live call's span starts with: the source attributes every source of ``scope``
        gives alike (those a sampler sees), so none of them can turn out wrong after a failover.

        A call begun at a source of no bound client may go anywhere: its span then starts
        with the operation alone.
        """
        if (scope, source) not in self._sources:
            return self._shape(scope, None, operation)
        key = (scope, operation)
        shape = self._call_shapes.get(key)
        if shape is None:
            shared = _source_attributes(operation, self._sources[(scope, source)])
            for (owner, _), config in self._sources.items():
                if owner == scope:
                    attrs = _source_attributes(operation, config)
                    shared = {k: v for k, v in shared.items() if attrs.get(k) == v}
            shape = self._call_shapes[key] = _Shape(scope, shared)
        return shape

    # --- clients -> live gauges -------------------------------------------------------

    def bind(self, client: ClientInfo) -> None:
        """Learn a client's sources (span attributes) and read its backend in the gauges."""
        for source in client.sources:
            self._sources[(client.scope, source.name)] = source
        # A source seen before its client was bound got a shape without its settings, and
        # a scope's new sources may share less with the others.
        self._shapes.clear()
        self._call_shapes.clear()
        self._operations[client.scope] = _operation(client.kind)
        first = not self._bound
        self._bound += 1
        self._reader.bind(client)
        if first:
            self._gauges()

    def _gauges(self) -> None:
        """The observable instruments, made once, on the first client bound."""
        meter = self._meter
        for name, unit, description, read in (
            (
                "polygateway.source.permits.in_use",
                "{permit}",
                "Permits held at a source.",
                lambda s: s.in_flight,
            ),
            (
                "polygateway.source.limit",
                "{permit}",
                "The source's current concurrency limit (AIMD).",
                lambda s: s.limit,
            ),
            (
                "polygateway.source.paused",
                "s",
                "Seconds until the source's pacing pause ends (0: not paused).",
                lambda s: s.paced_for_s or 0.0,
            ),
            (
                "polygateway.source.breaker.reopen",
                "s",
                "Seconds until an open breaker lets a probe through (0: not open).",
                lambda s: s.reopen_in_s or 0.0,
            ),
            (
                "polygateway.source.rpm_tokens",
                "{request}",
                "Requests left in the source's rpm bucket.",
                lambda s: s.rpm_tokens,
            ),
            (
                "polygateway.source.tpm_tokens",
                "{token}",
                "Tokens left in the source's tpm bucket.",
                lambda s: s.tpm_tokens,
            ),
        ):
            meter.create_observable_gauge(
                name, callbacks=[self._source_callback(read)], unit=unit, description=description
            )
        meter.create_observable_gauge(
            "polygateway.source.breaker.state",
            callbacks=[self._breaker_callback],
            unit="1",
            description="1 for the breaker's current state (closed, half_open, open), else 0.",
        )
        meter.create_observable_gauge(
            "polygateway.scope.calls.waiting",
            callbacks=[self._waiting_callback],
            unit="{call}",
            description="Calls of the scope waiting in this process.",
        )
        meter.create_observable_gauge(
            "polygateway.scope.calls.waiting_by_class",
            callbacks=[self._class_callback(0)],
            unit="{call}",
            description="Calls of the scope waiting in this process, per priority class.",
        )
        meter.create_observable_gauge(
            "polygateway.scope.permits.in_use",
            callbacks=[self._class_callback(1)],
            unit="{permit}",
            description="Permits the scope's calls hold in this process, per priority class.",
        )

    def _snapshots(self) -> list[ScopeSnapshot]:
        """The snapshot of every bound scope, read as ``LiveReader`` reads (``gauges.py``).

        The SDK's periodic reader calls back on its own thread: the snapshot
        is then taken on the client's event loop, so a Redis fleet's state is
        read as a memory backend's is; on the loop's own thread a backend that
        must wait for I/O shows its latest snapshot and starts the next.
        """
        try:
            readings = self._reader.read()
        except Exception as exc:  # a gauge must never break the metric reader
            _log.debug("gauge snapshots skipped: %r", exc)
            return []
        return [r.snapshot for r in readings if r.snapshot is not None]

    def _source_callback(self, read: Any) -> Any:
        """A callback observing ``read(source snapshot)`` for every source of every bound scope."""
        observation = self._observation

        def callback(options: Any) -> list[Any]:
            out = []
            for snap in self._snapshots():
                for source in snap.sources:
                    value = read(source)
                    if value is not None:
                        attrs = {"polygateway.scope": snap.scope, "polygateway.source": source.name}
                        out.append(observation(value, attrs))
            return out

        return callback

    def _breaker_callback(self, options: Any) -> list[Any]:
        observation = self._observation
        out = []
        for snap in self._snapshots():
            for source in snap.sources:
                for state in BREAKER_STATES:
                    attrs = {
                        "polygateway.scope": snap.scope,
                        "polygateway.source": source.name,
                        "polygateway.breaker.state": state,
                    }
                    out.append(observation(1 if source.breaker == state else 0, attrs))
        return out

    def _class_callback(self, index: int) -> Any:
        """A callback observing, per scope and class, calls waiting (0) or permits in use (1)."""
        observation = self._observation

        def callback(options: Any) -> list[Any]:
            return [
                observation(
                    counts[index], {"polygateway.scope": scope, "polygateway.priority_class": name}
                )
                for scope, _, by_class in self._reader.counts()
                for name, counts in by_class.items()
            ]

        return callback

    def _waiting_callback(self, options: Any) -> list[Any]:
        observation = self._observation
        return [
            observation(waiting, {"polygateway.scope": scope})
            for scope, waiting, _ in self._reader.counts()
        ]
