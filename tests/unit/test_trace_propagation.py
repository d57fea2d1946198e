"""Trace context to the upstream: ``OpenTelemetryEmitter(propagate=True)`` sends each attempt's
``traceparent``, naming the very attempt span it exports; the emitters' header hook never fails a
call, never replaces a source's key, and costs nothing when no emitter offers it."""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from _closing import closing
from _failover_chat import failover_chat
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pydantic import SecretStr

import polygateway.middleware.otel as otel
from polygateway import OpenTelemetryEmitter
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import SourceConfig
from polygateway.embedding import EmbeddingClient
from polygateway.middleware.telemetry import AttemptStart, Emitters, LoggingEmitter
from polygateway.models import AttemptRecord, CallRecord
from polygateway.ocr import OcrClient
from polygateway.testing import (
    Delay,
    FakeClock,
    FakeTransport,
    Recorder,
    StreamScript,
    TransientError,
    anthropic_message,
    chat_chunk_events,
    chat_completion,
    embedding_body,
    gateway_settings,
)
from polygateway.transport import anthropic, monkey_ocr, openai, vision_ocr
from polygateway.transport.http import HttpRequest

MESSAGES = [{"role": "user", "content": "hello"}]
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")


class Sdk:
    """An SDK tracer provider exporting to memory."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def finished(self) -> tuple[ReadableSpan, ...]:
        return tuple(self.exporter.get_finished_spans())


@pytest.fixture
def sdk() -> Iterator[Sdk]:
    s = Sdk()
    yield s
    s.provider.shutdown()


def make_chat(transport: FakeTransport, clock: FakeClock, *emitters: Any) -> ChatClient:
    """The failover pair on a fake clock, its requests kept by ``transport``."""
    return failover_chat(clock, transport, *emitters)


def sent_context(request: HttpRequest) -> tuple[int, int]:
    """(trace id, span id) of the ``traceparent`` a request carried."""
    match = TRACEPARENT.match(request.headers["traceparent"])
    assert match is not None, request.headers["traceparent"]
    return int(match[1], 16), int(match[2], 16)


def by_attempt(spans: tuple[ReadableSpan, ...]) -> list[ReadableSpan]:
    return sorted(
        (s for s in spans if "polygateway.attempt" in (s.attributes or {})),
        key=lambda s: (s.attributes or {})["polygateway.attempt"],
    )


class HeaderHook:
    """An emitter whose header hook gives fixed headers, or raises."""

    def __init__(self, headers: Mapping[str, Any] | None = None, fail: bool = False) -> None:
        self.headers = headers
        self.fail = fail
        self.starts: list[AttemptStart] = []

    def emit_attempt(self, record: AttemptRecord) -> None:
        pass

    def emit_call(self, record: CallRecord) -> None:
        pass

    def attempt_headers(self, start: AttemptStart) -> Mapping[str, Any] | None:
        self.starts.append(start)
        if self.fail:
            raise RuntimeError("the hook broke")
        return self.headers


async def test_each_attempt_sends_the_traceparent_of_its_exported_span(sdk: Sdk) -> None:
    """Fail over once: each request names its own attempt span, beneath the call's, beneath ours."""
    clock = FakeClock()
    transport = FakeTransport(
        {
            "primary": [Delay(1.0, TransientError(status_code=503))],
            "backup": [Delay(2.0, anthropic_message("ok"))],
        },
        clock=clock,
    )
    emitter = OpenTelemetryEmitter(tracer_provider=sdk.provider, propagate=True)
    chat = make_chat(transport, clock, emitter)
    with sdk.provider.get_tracer("app").start_as_current_span("handle request") as outer:
        assert (await chat.complete(MESSAGES)).text == "ok"
    first, second = transport.requests
    attempts = by_attempt(sdk.finished())
    assert [s.name for s in attempts] == ["chat big-1", "chat claude-x"]
    [call] = [
        s
        for s in sdk.finished()
        if (s.attributes or {}).get("polygateway.call_id")
        and "polygateway.attempt" not in (s.attributes or {})
    ]
    for request, span in zip((first, second), attempts, strict=True):
        assert sent_context(request) == (span.context.trace_id, span.context.span_id)
        assert span.parent is not None
        assert span.parent.span_id == call.context.span_id
        assert span.end_time is not None
    assert sent_context(first)[1] != sent_context(second)[1]
    assert call.parent is not None
    assert call.parent.span_id == outer.get_span_context().span_id
    assert call.context.trace_id == outer.get_span_context().trace_id
    assert call.name == "chat claude-x"  # named, at its end, for the source that served
    assert (call.attributes or {})["polygateway.source"] == "backup"
    assert (call.attributes or {})["polygateway.attempts"] == 2
    assert call.start_time is not None
    assert attempts[0].start_time is not None
    assert call.start_time <= attempts[0].start_time
    # The source's key is sent as configured, never touched by the added header.
    assert first.headers["Authorization"] == "Bearer sk-test-primary-secret"
    assert second.headers["x-api-key"] == "sk-test-backup-secret"


async def test_a_stream_s_attempt_span_stays_open_until_the_stream_ends(sdk: Sdk) -> None:
    """A stream's traceparent names its attempt span, ended when the stream is read to its end."""
    clock = FakeClock()
    transport = FakeTransport(
        {"primary": [StreamScript(chat_chunk_events(["a", "b"]))]}, clock=clock
    )
    emitter = OpenTelemetryEmitter(tracer_provider=sdk.provider, propagate=True)
    chat = make_chat(transport, clock, emitter)
    texts = []
    async with chat.stream(MESSAGES) as stream:
        async for chunk in stream:
            assert not sdk.finished()  # both spans open while chunks flow
            texts.append(chunk.text)
    assert "".join(texts) == "ab"
    [request] = transport.requests
    [attempt] = by_attempt(sdk.finished())
    assert sent_context(request) == (attempt.context.trace_id, attempt.context.span_id)
    assert (attempt.attributes or {})["polygateway.outcome"] == "success"
    assert len(sdk.finished()) == 2
    assert not emitter._live


async def test_without_propagate_no_traceparent_is_sent(sdk: Sdk) -> None:
    """The default: spans are made from records, and no request carries trace context."""
    clock = FakeClock()
    transport = FakeTransport(
        {"primary": [TransientError(status_code=503)], "backup": [anthropic_message("ok")]},
        clock=clock,
    )
    emitter = OpenTelemetryEmitter(tracer_provider=sdk.provider)
    chat = make_chat(transport, clock, emitter)
    with sdk.provider.get_tracer("app").start_as_current_span("handle request"):
        await chat.complete(MESSAGES)
    assert len(transport.requests) == 2
    assert not any(name.lower() == "traceparent" for r in transport.requests for name in r.headers)
    assert len(by_attempt(sdk.finished())) == 2
    assert emitter.attempt_headers is None
    assert not Emitters([emitter, LoggingEmitter(), Recorder()]).wants_headers


async def test_a_hook_that_raises_is_logged_and_the_call_is_served(
    sdk: Sdk, caplog: pytest.LogCaptureFixture
) -> None:
    """A broken hook is skipped (logged once as a warning); the others' headers still go out."""
    clock = FakeClock()
    transport = FakeTransport({"primary": [chat_completion("ok")]}, clock=clock)
    broken = HeaderHook(fail=True)
    emitter = OpenTelemetryEmitter(tracer_provider=sdk.provider, propagate=True)
    chat = make_chat(transport, clock, broken, emitter)
    with caplog.at_level(logging.WARNING, logger="polygateway.telemetry"):
        assert (await chat.complete(MESSAGES)).text == "ok"
    assert len(broken.starts) == 1
    assert any(
        "HeaderHook failed" in r.getMessage() and "the hook broke" in r.getMessage()
        for r in caplog.records
    )
    [request] = transport.requests
    [attempt] = by_attempt(sdk.finished())
    assert sent_context(request)[1] == attempt.context.span_id


@pytest.mark.parametrize(
    "headers",
    [
        {"x-bad": "a\r\nInjected: 1"},
        {"x-bad": 7},
        {"": "empty name"},
        {"x bad": "space in name"},
        {"x-bad": "caf\u00e9"},
    ],
    ids=["crlf", "not-a-string", "empty-name", "bad-name", "not-ascii"],
)
async def test_a_hook_giving_headers_no_request_may_carry_is_logged_and_skipped(
    headers: Mapping[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A value a transport would refuse is never sent: the hook is logged, the call served."""
    clock = FakeClock()
    transport = FakeTransport({"primary": [chat_completion("ok")]}, clock=clock)
    chat = make_chat(transport, clock, HeaderHook(headers))
    with caplog.at_level(logging.WARNING, logger="polygateway.telemetry"):
        assert (await chat.complete(MESSAGES)).text == "ok"
    [request] = transport.requests
    assert not any(name in request.headers for name in headers)
    assert any("HeaderHook failed" in r.getMessage() for r in caplog.records)


async def test_the_hook_learns_the_call_and_attempt_it_serves() -> None:
    """AttemptStart names the call, scope, operation, source and attempt number."""
    clock = FakeClock()
    transport = FakeTransport(
        {"primary": [TransientError(status_code=503)], "backup": [anthropic_message("ok")]},
        clock=clock,
    )
    hook = HeaderHook({"x-test": "1"})
    recorder = Recorder()
    chat = make_chat(transport, clock, hook, recorder)
    await chat.complete(MESSAGES)
    call_id = recorder.records[0].call_id
    assert [(s.call_id, s.scope, s.operation, s.source, s.attempt) for s in hook.starts] == [
        (call_id, "chat", "chat.complete", "primary", 1),
        (call_id, "chat", "chat.complete", "backup", 2),
    ]
    assert hook.starts[0].call_elapsed_s == 0.0
    assert hook.starts[1].call_elapsed_s > 0.0  # after the back-off
    assert all(r.headers["x-test"] == "1" for r in transport.requests)


def embed_client(transport: FakeTransport, clock: FakeClock, hook: HeaderHook) -> Any:
    return closing(
        EmbeddingClient(
            gateway_settings("emb", scope="embed", kind="embed"),
            "embed",
            backend=MemoryBackend(now=clock),
            transport=transport,
            now=clock,
            sleep=clock.sleep,
            rng=random.Random(1),
            emitter=hook,
        )
    )


def ocr_client(protocol: str, transport: FakeTransport, clock: FakeClock, hook: HeaderHook) -> Any:
    return closing(
        OcrClient(
            gateway_settings({"name": "ocr", "protocol": protocol}, scope="ocr", kind="ocr"),
            "ocr",
            backend=MemoryBackend(now=clock),
            transport=transport,
            now=clock,
            sleep=clock.sleep,
            rng=random.Random(1),
            emitter=hook,
        )
    )


MONKEY_TEXT = {"success": True, "task_type": "text", "content": "T", "message": "ok"}
MONKEY_PARSE = {"success": True, "message": "ok", "content": "[]"}


@pytest.mark.parametrize(
    "case", ["chat.stream", "embed", "vision_ocr", "monkey_ocr.text", "monkey_ocr.parse"]
)
async def test_every_client_and_protocol_sends_the_hook_s_headers(case: str) -> None:
    """Streams, embeddings and both OCR wires carry the added header, and the key untouched."""
    clock = FakeClock()
    hook = HeaderHook({"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
    if case == "chat.stream":
        transport = FakeTransport([StreamScript(chat_chunk_events(["a"]))], clock=clock)
        async with make_chat(transport, clock, hook).stream(MESSAGES) as stream:
            assert [c async for c in stream]
    elif case == "embed":
        transport = FakeTransport([embedding_body([[1.0]])], clock=clock)
        await embed_client(transport, clock, hook).embed(["one"])
    elif case == "vision_ocr":
        transport = FakeTransport([chat_completion("T")], clock=clock)
        await ocr_client("vision_ocr", transport, clock, hook).recognize_text(PNG)
    elif case == "monkey_ocr.text":
        transport = FakeTransport([MONKEY_TEXT], clock=clock)
        await ocr_client("monkey_ocr", transport, clock, hook).recognize_text(PNG)
    else:
        transport = FakeTransport([MONKEY_PARSE], clock=clock)
        await ocr_client("monkey_ocr", transport, clock, hook).parse_layout(PNG)
    [request] = transport.requests
    assert request.headers["traceparent"].startswith("00-111")
    assert any("sk-test-" in value for value in request.headers.values())


def keyed_source(protocol: str, **fields: Any) -> SourceConfig:
    return SourceConfig(
        name="s",
        protocol=protocol,
        base_url="https://up.example.com/v1",
        model="m",
        api_key=SecretStr("sk-real-key"),
        headers={"X-Org": "acme"},
        **fields,
    )


EXTRA = {
    "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
    "authorization": "Bearer stolen",
    "X-API-KEY": "stolen",
    "api-key": "stolen",
    "x-org": "evil",
    "content-type": "text/evil",
}


@pytest.mark.parametrize(
    ("name", "build"),
    [
        (
            "openai chat",
            lambda extra: openai.chat_request(
                keyed_source("openai"),
                MESSAGES,
                {},
                stream=False,
                timeout_s=1.0,
                extra_headers=extra,
            ),
        ),
        (
            "openai embeddings",
            lambda extra: openai.embedding_request(
                keyed_source("openai"), ["t"], {}, timeout_s=1.0, extra_headers=extra
            ),
        ),
        (
            "azure chat",
            lambda extra: openai.chat_request(
                keyed_source("openai", api_key_header="api-key"),
                MESSAGES,
                {},
                stream=True,
                timeout_s=1.0,
                extra_headers=extra,
            ),
        ),
        (
            "anthropic",
            lambda extra: anthropic.messages_request(
                keyed_source("anthropic"),
                MESSAGES,
                {},
                stream=False,
                timeout_s=1.0,
                extra_headers=extra,
            ),
        ),
        (
            "vision_ocr",
            lambda extra: vision_ocr.text_request(
                keyed_source("vision_ocr"), PNG, "png", timeout_s=1.0, extra_headers=extra
            ),
        ),
        (
            "monkey_ocr text",
            lambda extra: monkey_ocr.text_request(
                keyed_source("monkey_ocr"), PNG, "image.png", timeout_s=1.0, extra_headers=extra
            ),
        ),
        (
            "monkey_ocr parse",
            lambda extra: monkey_ocr.parse_request(
                keyed_source("monkey_ocr"), PNG, "image.png", timeout_s=1.0, extra_headers=extra
            ),
        ),
    ],
)
def test_added_headers_never_replace_the_request_s_own(name: str, build: Any) -> None:
    """Every builder adds the traceparent and keeps its key, content type and the source's own."""
    plain = dict(build(None).headers)
    headers = dict(build(EXTRA).headers)
    assert headers.pop("traceparent") == EXTRA["traceparent"]
    assert headers == plain, name
    assert any("sk-real-key" in value for value in headers.values())


def test_the_call_span_is_dated_from_the_call_s_start(sdk: Sdk) -> None:
    """A call whose first attempt began 5 s in: its live span starts 5 s before that attempt's."""
    emitter = OpenTelemetryEmitter(tracer_provider=sdk.provider, propagate=True)
    assert emitter.attempt_headers is not None
    headers = emitter.attempt_headers(
        AttemptStart("c1", "chat", "chat.complete", "primary", 1, 5.0)
    )
    assert headers is not None
    assert TRACEPARENT.match(headers["traceparent"])
    emitter.emit_attempt(AttemptRecord("c1", "chat", "primary", 1, "success", 200, 0.1))
    emitter.emit_call(
        CallRecord("c1", "chat", "chat.complete", "served", 1, "primary", 5.1, 5.0, 0.0)
    )
    [attempt] = by_attempt(sdk.finished())
    [call] = [s for s in sdk.finished() if s is not attempt]
    assert call.start_time is not None
    assert attempt.start_time is not None
    assert (attempt.start_time - call.start_time) / 1e9 == pytest.approx(5.0, abs=0.05)
    assert sent_id(headers) == attempt.context.span_id


def sent_id(headers: Mapping[str, str]) -> int:
    match = TRACEPARENT.match(headers["traceparent"])
    assert match is not None
    return int(match[2], 16)


def test_live_calls_whose_records_never_come_are_bounded_and_ended(
    sdk: Sdk, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spans started for calls that never end are kept for a bounded number of calls, then ended."""
    monkeypatch.setattr(otel, "_MAX_PENDING_CALLS", 3)
    emitter = OpenTelemetryEmitter(tracer_provider=sdk.provider, propagate=True)
    assert emitter.attempt_headers is not None
    for i in range(10):
        emitter.attempt_headers(AttemptStart(f"c{i}", "chat", "chat.complete", "primary", 1, 0.0))
    assert len(emitter._live) == 3
    assert len(sdk.finished()) == 14  # the call and attempt spans of the 7 calls pushed out


def test_without_an_sdk_propagation_sends_nothing_and_keeps_nothing() -> None:
    """On the API's no-op providers the hook gives no headers and no call is kept."""
    emitter = OpenTelemetryEmitter(propagate=True)
    assert emitter.attempt_headers is not None
    started = time.perf_counter()
    for i in range(300):
        start = AttemptStart(f"c{i}", "chat", "chat.complete", "primary", 1, 0.0)
        assert emitter.attempt_headers(start) is None
    assert time.perf_counter() - started < 1.0
    assert not emitter._live
