"""What the hot path builds is what callers know: plain frozen records, and
``parse_json_body``'s UTF-8 fast path decoding as ``json.loads`` does."""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import json
import random
from typing import Any

import pytest
from _closing import closing

from polygateway.backends.base import AcquireResult, Lease, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.models import ChatChunk, Usage
from polygateway.testing import FakeClock, FakeTransport, Gate, chat_completion, gateway_settings
from polygateway.transport.http import TransientError, parse_json_body
from polygateway.transport.openai import parse_chat_chunk, parse_chat_response


class TestParseJsonBody:
    """The UTF-8 fast path decodes exactly as ``json.loads`` does on bytes."""

    @pytest.mark.parametrize(
        "body",
        [
            '{"a": "h\u00e9llo \u2603"}'.encode(),
            b'{"a": "\\ud800"}',  # an escaped lone surrogate
            b"{}",
            b'{"a": 1}'.decode().encode("utf-16-le"),
            b'{"a": 1}'.decode().encode("utf-16"),
            codecs.BOM_UTF8 + b'{"a": 1}',
            b"[1, 2]",
            b'"{"',
        ],
    )
    def test_same_value_as_json_loads(self, body: bytes) -> None:
        """Every body parses to what json.loads(bytes) gives (fast path or not)."""
        assert parse_json_body(body, "primary") == json.loads(body)

    @pytest.mark.parametrize("body", [b'{"a": "\xff"}', b'{"a": ', b"{\x00"])
    def test_undecodable_body_is_malformed(self, body: bytes) -> None:
        """Invalid UTF-8 or broken JSON after an opening brace is a malformed body."""
        with pytest.raises(TransientError, match="malformed body from primary"):
            parse_json_body(body, "primary")


async def test_caller_cancelling_complete_gets_cancelled_error_and_frees_the_permit() -> None:
    """complete() left by the caller's cancellation re-raises CancelledError, permit freed."""
    clock = FakeClock()
    gate = Gate()
    backend = MemoryBackend(now=clock)
    chat = closing(
        ChatClient(
            gateway_settings({"name": "primary"}),
            backend=backend,
            transport=FakeTransport([gate, chat_completion("late")], clock=clock),
            now=clock,
            rng=random.Random(1),
        )
    )
    call: asyncio.Task[Any] = asyncio.create_task(chat.complete([{"role": "user", "content": "x"}]))
    await gate.wait_entered()
    assert (await backend.snapshot("chat")).in_flight == 1
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert (await backend.snapshot("chat")).in_flight == 0
    assert (await chat.complete([{"role": "user", "content": "x"}])).text == "late"


class TestBuiltRecordsOnThePath:
    """Records the hot path builds are the frozen types callers know."""

    async def test_memory_grant_is_a_frozen_lease_with_every_field(self) -> None:
        """A memory-backend grant returns an AcquireResult and a Lease equal to plain ones."""
        clock = FakeClock()
        backend = MemoryBackend(now=clock)
        spec = SourceSpec(name="primary", max_concurrency=2)
        result = await backend.acquire("chat", [spec], cost_tokens=5, ttl_s=30.0)
        lease = result.lease
        assert type(result) is AcquireResult
        assert type(lease) is Lease
        assert lease == Lease("chat", "primary", lease.lease_id, 30.0, 5, False)
        assert result == AcquireResult(lease, ())
        with pytest.raises(dataclasses.FrozenInstanceError):
            lease.ttl_s = 1.0  # type: ignore[misc]  # the point: it is frozen

    def test_common_completion_usage_is_a_plain_usage(self) -> None:
        """parse_chat_response's common path gives a Usage equal to Usage(7, 3, 10)."""
        parsed = parse_chat_response(chat_completion("hi", prompt_tokens=7, completion_tokens=3))
        assert type(parsed.usage) is Usage
        assert parsed.usage == Usage(7, 3, 10)

    def test_common_chunk_is_a_plain_chat_chunk(self) -> None:
        """parse_chat_chunk's common path gives a ChatChunk equal to the keyword-built one."""
        event = {"choices": [{"index": 0, "delta": {"content": "he"}, "finish_reason": None}]}
        chunk = parse_chat_chunk(event, "primary")
        assert type(chunk) is ChatChunk
        assert chunk == ChatChunk(text="he", source="primary")
        assert hash(chunk) == hash(ChatChunk(text="he", source="primary"))
