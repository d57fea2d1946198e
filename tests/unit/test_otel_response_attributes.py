"""The answer's model and finish reasons: on every attempt record, and as the GenAI attributes
``gen_ai.response.model`` / ``gen_ai.response.finish_reasons`` on attempt and call spans."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from _closing import closing
from _failover_chat import failover_chat
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from polygateway import OpenTelemetryEmitter
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.embedding import EmbeddingClient
from polygateway.errors import AllSourcesExhausted
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

PROMPT = "what is the airspeed velocity of an unladen swallow"
COMPLETION = "african or european"
MESSAGES = [{"role": "user", "content": PROMPT}]
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64


@pytest.fixture
def spans() -> Iterator[tuple[InMemorySpanExporter, TracerProvider]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter, provider
    provider.shutdown()


def make_chat(clock: FakeClock, script: Any, emitter: Any) -> ChatClient:
    """The failover pair on a fake clock, answering from ``script``."""
    return failover_chat(clock, FakeTransport(script, clock=clock), emitter)


def anthropic_stream(text: str, *, model: str, stop_reason: str) -> list[dict[str, Any]]:
    """The events of a streamed Messages API answer."""
    return [
        {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": model,
                "usage": {"input_tokens": 9, "output_tokens": 1},
            },
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason},
            "usage": {"output_tokens": 3},
        },
        {"type": "message_stop"},
    ]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


@pytest.mark.parametrize("propagate", [False, True], ids=["retroactive", "live"])
async def test_attempt_spans_of_a_failover_carry_the_answer_s_model_and_finish_reasons(
    spans: tuple[InMemorySpanExporter, TracerProvider], propagate: bool
) -> None:
    """Primary fails, backup answers: its span and the call's name the answer's model and finish."""
    exporter, provider = spans
    emitter = OpenTelemetryEmitter(tracer_provider=provider, propagate=propagate)
    clock = FakeClock()
    chat = make_chat(
        clock,
        {
            "primary": [Delay(1.0, TransientError(status_code=503))],
            "backup": [
                anthropic_message(COMPLETION, model="claude-x-20250514", stop_reason="max_tokens")
            ],
        },
        emitter,
    )
    r = await chat.complete(MESSAGES)
    assert r.finish_reason == "length"
    finished = exporter.get_finished_spans()
    [call] = [s for s in finished if s.parent is None]
    failed, served = sorted(
        (s for s in finished if s.parent is not None),
        key=lambda s: attrs(s)["polygateway.attempt"],
    )
    assert attrs(served)["gen_ai.response.model"] == "claude-x-20250514"
    assert attrs(served)["gen_ai.response.finish_reasons"] == ("length",)
    assert "gen_ai.response.model" not in attrs(failed)
    assert "gen_ai.response.finish_reasons" not in attrs(failed)
    assert attrs(call)["gen_ai.response.model"] == "claude-x-20250514"
    assert attrs(call)["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs(call)["gen_ai.request.model"] == "claude-x"
    values = [str(v) for s in finished for v in attrs(s).values()]
    assert not any(PROMPT in v or COMPLETION in v for v in values)


async def test_a_call_that_was_not_served_names_no_response_model(
    spans: tuple[InMemorySpanExporter, TracerProvider],
) -> None:
    """Every source fails: the call span names no answer's model or finish reason."""
    exporter, provider = spans
    clock = FakeClock()
    chat = make_chat(
        clock,
        {"primary": [TransientError(status_code=500)], "backup": [TransientError(status_code=500)]},
        OpenTelemetryEmitter(tracer_provider=provider),
    )
    with pytest.raises(AllSourcesExhausted):
        await chat.complete(MESSAGES, fail_fast=True)
    [call] = [s for s in exporter.get_finished_spans() if s.parent is None]
    assert "gen_ai.response.model" not in attrs(call)
    assert "gen_ai.response.finish_reasons" not in attrs(call)


async def test_every_choice_s_finish_reason_is_recorded() -> None:
    """n=2: one finish reason per choice, in order, and the model the answer names."""
    body = chat_completion(COMPLETION, model="big-1-0613")
    body["choices"].append(
        {"index": 1, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
    )
    recorder = Recorder()
    chat = make_chat(FakeClock(), {"primary": [body]}, recorder)
    await chat.complete(MESSAGES, n=2)
    [record] = recorder.records
    assert record.response_model == "big-1-0613"
    assert record.finish_reasons == ("stop", "length")


async def test_an_openai_stream_records_the_chunks_model_and_its_final_finish_reason() -> None:
    """The model every chunk names, and the finish reason of the last chunk that has one."""
    events = chat_chunk_events(["a", "b"], "length", usage=(3, 2))
    for event in events:
        event["model"] = "big-1-0613"
    recorder = Recorder()
    chat = make_chat(FakeClock(), {"primary": [StreamScript(events)]}, recorder)
    async with chat.stream(MESSAGES) as stream:
        assert [c.text async for c in stream if c.text] == ["a", "b"]
    [record] = recorder.records
    assert record.outcome == "success"
    assert record.response_model == "big-1-0613"
    assert record.finish_reasons == ("length",)


async def test_an_anthropic_stream_records_the_model_of_its_message_start() -> None:
    """After a failover to an Anthropic source: message_start's model, the mapped stop reason."""
    recorder = Recorder()
    chat = make_chat(
        FakeClock(),
        {
            "primary": [TransientError(status_code=503)],
            "backup": [
                StreamScript(anthropic_stream("hi", model="claude-x-2025", stop_reason="end_turn"))
            ],
        },
        recorder,
    )
    async with chat.stream(MESSAGES) as stream:
        assert "".join([c.text async for c in stream]) == "hi"
    failed, served = recorder.records
    assert (failed.response_model, failed.finish_reasons) == (None, ())
    assert (served.response_model, served.finish_reasons) == ("claude-x-2025", ("stop",))


async def test_a_stream_without_a_model_leaves_it_unset() -> None:
    """Chunks that name no model: nothing is made up."""
    recorder = Recorder()
    chat = make_chat(FakeClock(), {"primary": [StreamScript(chat_chunk_events(["a"]))]}, recorder)
    async with chat.stream(MESSAGES) as stream:
        assert [c async for c in stream]
    [record] = recorder.records
    assert (record.response_model, record.finish_reasons) == (None, ("stop",))


async def test_an_embedding_records_the_model_its_answer_names() -> None:
    """The embeddings wire names its model; it has no finish reason."""
    clock = FakeClock()
    recorder = Recorder()
    client = closing(
        EmbeddingClient(
            gateway_settings("emb", scope="embed", kind="embed"),
            "embed",
            backend=MemoryBackend(now=clock),
            transport=FakeTransport([embedding_body([[1.0, 0.0]])], clock=clock),
            now=clock,
            sleep=clock.sleep,
            rng=random.Random(1),
            emitter=recorder,
        )
    )
    await client.embed(["one"])
    [record] = recorder.records
    assert (record.response_model, record.finish_reasons) == ("fake-embedding", ())


@pytest.mark.parametrize(
    ("protocol", "answer", "expected"),
    [
        ("vision_ocr", chat_completion("TEXT", model="vision-2024"), ("vision-2024", ("stop",))),
        (
            "monkey_ocr",
            {"success": True, "task_type": "text", "content": "TEXT", "message": "ok"},
            (None, ()),
        ),
    ],
)
async def test_ocr_records_what_its_wire_names(
    protocol: str, answer: dict[str, Any], expected: tuple[str | None, tuple[str, ...]]
) -> None:
    """Vision OCR is a chat answer (model, finish); MonkeyOCR names neither."""
    clock = FakeClock()
    recorder = Recorder()
    client = closing(
        OcrClient(
            gateway_settings({"name": "ocr", "protocol": protocol}, scope="ocr", kind="ocr"),
            "ocr",
            backend=MemoryBackend(now=clock),
            transport=FakeTransport([answer], clock=clock),
            now=clock,
            sleep=clock.sleep,
            rng=random.Random(1),
            emitter=recorder,
        )
    )
    assert (await client.recognize_text(PNG)).text == "TEXT"
    [record] = recorder.records
    assert (record.response_model, record.finish_reasons) == expected
