"""Azure OpenAI's content filter annotations in a stream: read past, never taken for content.

The chunks are those of Azure's documented sample streams
(research-wiki/guides/providers.md, "Azure OpenAI"): a first chunk holding
only the prompt's ``prompt_filter_results``, ``content_filter_results`` in
each choice, and with the asynchronous filter, annotation-only chunks (a
choice without ``delta``), one of them after the finish chunk.
"""

from __future__ import annotations

import random
from typing import Any

from _closing import closing

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.testing import (
    BoundedSleep,
    FakeClock,
    FakeTransport,
    StreamScript,
    gateway_settings,
)
from polygateway.transport.openai import chunk_has_content, parse_chat_chunk

MESSAGES = [{"role": "user", "content": "What is color?"}]
SAFE = {
    category: {"filtered": False, "severity": "safe"}
    for category in ("hate", "self_harm", "sexual", "violence")
}
PROMPT = {
    "id": "",
    "object": "",
    "created": 0,
    "model": "",
    "prompt_filter_results": [{"prompt_index": 0, "content_filter_results": SAFE}],
    "choices": [],
    "usage": None,
}


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-7rCNsVeZy0PGnX3H6jK8STps5nZUY",
        "object": "chat.completion.chunk",
        "created": 1692913344,
        "model": "gpt-35-turbo",
        "choices": [
            {"index": 0, "finish_reason": finish, "delta": delta, "content_filter_results": {}}
        ],
        "usage": None,
    }


def _annotation(check_offset: int) -> dict[str, Any]:
    offsets = {"check_offset": check_offset, "start_offset": 44, "end_offset": 198}
    choice = {
        "index": 0,
        "finish_reason": None,
        "content_filter_results": SAFE,
        "content_filter_offsets": offsets,
    }
    return {"id": "", "object": "", "created": 0, "model": "", "choices": [choice], "usage": None}


EVENTS = [
    PROMPT,
    _chunk({"role": "assistant"}),
    _chunk({"content": "Color"}),
    _chunk({"content": " is"}),
    _annotation(44),
    _chunk({"content": " light."}),
    _chunk({}, "stop"),
    _annotation(506),
]


def test_annotations_are_no_content_and_carry_nothing() -> None:
    """The prompt's chunk and an annotation chunk read as empty chunks, not ending the TTFT."""
    for event in (PROMPT, _annotation(44)):
        assert not chunk_has_content(event)
        chunk = parse_chat_chunk(event, "azure")
        assert (chunk.text, chunk.tool_calls, chunk.finish_reason, chunk.usage) == (
            "",
            (),
            None,
            None,
        )


async def test_stream_through_annotations_delivers_the_text_and_keeps_the_finish() -> None:
    """Only content reaches the caller; an annotation after the finish leaves ``stop``."""
    clock = FakeClock()
    chat = closing(
        ChatClient(
            gateway_settings("azure"),
            backend=MemoryBackend(now=clock),
            transport=FakeTransport([StreamScript(EVENTS)], clock=clock),
            now=clock,
            sleep=BoundedSleep(clock),
            rng=random.Random(5),
        )
    )
    async with chat.stream(MESSAGES) as stream:
        chunks = [chunk async for chunk in stream]
        response = await stream.response()
    assert [c.text for c in chunks] == ["Color", " is", " light.", ""]
    assert chunks[-1].finish_reason == "stop"
    assert (response.text, response.finish_reason) == ("Color is light.", "stop")
