"""Observability edges found in review: what spans say of the answer of a failed attempt
or of a call that was not served."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _failover_chat import failover_chat
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from polygateway import OpenTelemetryEmitter
from polygateway.chat import ChatClient
from polygateway.errors import StreamInterrupted
from polygateway.testing import (
    FakeClock,
    FakeTransport,
    Recorder,
    StreamScript,
    chat_chunk_events,
)

MESSAGES = [{"role": "user", "content": "hi"}]
ANSWER = ("gen_ai.response.model", "gen_ai.response.finish_reasons")


class Spans:
    """An SDK tracer provider exporting to memory."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def finished(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


@pytest.fixture
def spans() -> Iterator[Spans]:
    s = Spans()
    yield s
    s.provider.shutdown()


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def model_events(texts: list[str]) -> list[dict[str, Any]]:
    """A streamed chat answer whose every chunk names the model that answers."""
    events = chat_chunk_events(texts)
    for event in events:
        event["model"] = "big-1-0613"
    return events


async def read_all(chat: ChatClient) -> None:
    """Read a stream of ``chat`` to its end."""
    async with chat.stream(MESSAGES) as stream:
        async for _ in stream:
            pass


@pytest.mark.parametrize("propagate", [False, True], ids=["retroactive", "live"])
async def test_a_stream_cut_after_its_first_chunks_names_no_answer_on_its_spans(
    spans: Spans, propagate: bool
) -> None:
    """Interrupted mid-stream: the failed attempt's and the call's spans name no answer model."""
    clock = FakeClock()
    recorder = Recorder()
    emitter = OpenTelemetryEmitter(tracer_provider=spans.provider, propagate=propagate)
    script = {"primary": [StreamScript(model_events(["a", "b", "c"]), fail_after=2)]}
    chat = failover_chat(clock, FakeTransport(script, clock=clock), recorder, emitter)
    with pytest.raises(StreamInterrupted):
        await read_all(chat)
    [record] = recorder.records
    assert record.outcome == "transient"
    assert record.response_model == "big-1-0613"  # the record keeps what the attempt read
    [attempt] = [s for s in spans.finished() if s.parent is not None]
    [call] = [s for s in spans.finished() if s.parent is None]
    assert attrs(call)["polygateway.outcome"] == "interrupted"
    for span in (attempt, call):
        assert span.status.status_code is StatusCode.ERROR
        assert not [key for key in ANSWER if key in attrs(span)], span.name


async def test_a_stream_closed_early_names_no_answer_on_its_cancelled_spans(spans: Spans) -> None:
    """The consumer stops after one chunk: a cancelled call, whose spans name no answer."""
    clock = FakeClock()
    emitter = OpenTelemetryEmitter(tracer_provider=spans.provider)
    script = {"primary": [StreamScript(model_events(["a", "b"]))]}
    chat = failover_chat(clock, FakeTransport(script, clock=clock), emitter)
    async with chat.stream(MESSAGES) as stream:
        async for _ in stream:
            break
    finished = spans.finished()
    assert [attrs(s)["polygateway.outcome"] for s in finished] == ["cancelled", "cancelled"]
    for span in finished:
        assert not [key for key in ANSWER if key in attrs(span)], span.name
