"""Azure OpenAI's Asynchronous Filter over real sockets: annotations after the text, a late block.

The shapes are those of Azure's content streaming guide, "Annotations and
sample responses" (research-wiki/guides/providers.md, "Azure OpenAI"), which
the simulator plays with ``FaultProfile(azure_filter="asynchronous")``: the
prompt's annotation chunk first (empty ``choices``, empty ``id`` and
``model``), then the content chunks with no ``content_filter_results``, and
annotation-only chunks (a choice without ``delta``, holding
``content_filter_results`` and ``content_filter_offsets``) in the middle and
after the finish chunk. Its blocked sample ends with an annotation whose
choice says ``finish_reason: "content_filter"`` and a category
``filtered: true``, after some content was already sent and with no finish
chunk of the model's.

What the library owes the caller: the annotations are read past (no empty
or repeated chunk for them, no error, the finish reason the one sent); a
late block is a served answer, like Anthropic's ``stop_reason: "refusal"``
(research-wiki/ARCHITECTURE.md, "The chat answer"): the text already sent
stays the text (the guide leaves its redaction to the application),
``finish_reason`` is ``content_filter``, nothing is retried or failed over.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings, ScopeConfig, SourceConfig
from polygateway.simulator import FaultProfile, SimulatedUpstream

KEY = "sk-azure-Async-0123456789"
QUERY = {"api-version": "2024-10-21"}
BOUND_S = 30.0
"""Bounds the tests' own waits, never a timing under test."""
ASK = [{"role": "user", "content": "what is color"}]
FLAGGED = [{"role": "user", "content": "say forbidden now"}]
"""A prompt the reply echoes: ``forbidden`` is its 6th word of 8, one word a chunk."""


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedUpstream]:
    """One Azure source with the asynchronous filter, one word a chunk, flagging ``forbidden``."""
    azure = FaultProfile(
        wire="azure",
        api_key=KEY,
        stream_chunks=8,
        azure_filter="asynchronous",
        azure_filter_flags=("forbidden",),
    )
    async with SimulatedUpstream({"az": azure, "spare": azure}) as upstream:
        yield upstream


def _source(sim: SimulatedUpstream, name: str, priority: int = 0) -> SourceConfig:
    """The source as a user configures an Azure deployment."""
    return SourceConfig(
        name=name,
        base_url=sim.base_url(name, "azure", deployment="gpt-4o"),
        protocol="openai",
        model="gpt-4o",
        api_key=KEY,
        api_key_header="api-key",
        query=QUERY,
        priority=priority,
        timeout_s=5.0,
        ttft_timeout_s=2.0,
    )


def _chat(sim: SimulatedUpstream, transport: str, *names: str) -> ChatClient:
    """A chat client over the named sources, in that order, on ``transport``."""
    sources = [_source(sim, name, i) for i, name in enumerate(names)]
    settings = GatewaySettings(
        _env_file=None,
        transport=transport,
        scopes={"chat": ScopeConfig(kind="chat", sources=sources)},
    )
    return ChatClient.from_settings(settings, "chat", backend=MemoryBackend())


async def _raw_stream(sim: SimulatedUpstream, messages: list[dict[str, Any]]) -> list[Any]:
    """The ``data:`` payloads of one stream with usage, read with plain httpx."""
    url = f"{sim.base_url('az', 'azure', deployment='gpt-4o')}/chat/completions"
    body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=BOUND_S) as client:
        r = await client.post(url, json=body, params=QUERY, headers={"api-key": KEY})
    assert r.status_code == 200
    out: list[Any] = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _annotations(events: list[Any]) -> list[dict[str, Any]]:
    """The annotation-only chunks: a choice with ``content_filter_offsets`` and no ``delta``."""
    return [
        e
        for e in events
        if isinstance(e, dict)
        and e.get("choices")
        and "content_filter_offsets" in e["choices"][0]
        and "delta" not in e["choices"][0]
    ]


async def test_simulator_plays_the_guides_passing_stream(sim: SimulatedUpstream) -> None:
    """Prompt chunk, bare content chunks, annotations mid-stream and after the finish and usage."""
    events = await _raw_stream(sim, ASK)
    assert events[-1] == "[DONE]"
    prompt, role, *rest = events[:-1]
    assert (prompt["choices"], prompt["id"], prompt["model"]) == ([], "", "")
    assert prompt["prompt_filter_results"][0]["prompt_index"] == 0
    assert role["choices"][0]["delta"]["role"] == "assistant"
    content = [
        e for e in rest if e.get("choices") and e["choices"][0].get("delta", {}).get("content")
    ]
    assert content
    assert all("content_filter_results" not in e["choices"][0] for e in content)
    notes = _annotations(rest)
    assert len(notes) == 2
    assert rest[-1] is notes[-1], "the last annotation comes after everything the model sent"
    finish = next(e for e in rest if e.get("choices") and e["choices"][0]["finish_reason"])
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert rest.index(finish) < rest.index(notes[-1])
    for note in notes:
        assert (note["id"], note["model"], note["object"], note["created"]) == ("", "", "", 0)
        choice = note["choices"][0]
        assert choice["finish_reason"] is None
        assert all(not r["filtered"] for r in choice["content_filter_results"].values())
    checks = [n["choices"][0]["content_filter_offsets"]["check_offset"] for n in notes]
    assert checks == sorted(checks), "check_offset never decreases"
    offsets = notes[-1]["choices"][0]["content_filter_offsets"]
    text = "".join(e["choices"][0]["delta"]["content"] for e in content)
    # Offsets count from the start of the prompt, and the last one rates the text to its end.
    assert offsets["end_offset"] == len("what is color") + len(text)


async def test_simulator_blocks_a_flagged_reply_late(sim: SimulatedUpstream) -> None:
    """The flagged word and one more chunk go out; then the block, with no model finish chunk."""
    events = await _raw_stream(sim, FLAGGED)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    text = "".join(
        e["choices"][0]["delta"].get("content") or ""
        for e in chunks
        if e.get("choices") and "delta" in e["choices"][0]
    )
    assert text == "Simulated reply from az. say forbidden now"
    block = _annotations(chunks)[-1]
    choice = block["choices"][0]
    assert choice["finish_reason"] == "content_filter"
    assert any(r.get("filtered") for r in choice["content_filter_results"].values())
    finishes = [e["choices"][0]["finish_reason"] for e in chunks if e.get("choices")]
    assert [f for f in finishes if f] == ["content_filter"]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == len(text.split())


async def test_stream_through_the_asynchronous_filter_delivers_text_finish_and_usage(
    sim: SimulatedUpstream, transport: str
) -> None:
    """Only the content reaches the caller; the annotations add no chunk; response() whole."""
    async with _chat(sim, transport, "az") as client:
        plain = await asyncio.wait_for(client.complete(ASK), BOUND_S)
        async with client.stream(ASK) as stream:
            chunks = [c async for c in stream]
            response = await stream.response()
    texts = [c.text for c in chunks if c.text]
    assert "".join(texts) == plain.text == response.text
    assert len(texts) == 8, "one chunk a word: no empty nor repeated delta from the annotations"
    # The deliverable chunks: 8 words, the finish, the usage; nothing for the 2 annotations.
    assert len(chunks) == 10
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]
    assert response.finish_reason == "stop"
    assert response.usage == plain.usage
    assert response.usage.completion_tokens == 8
    assert [(a.source, a.outcome) for a in response.attempts] == [("az", "success")]
    # The annotations' empty model names none: the record keeps the deployment's.
    (attempt,) = response.attempts
    assert (attempt.response_model, attempt.finish_reasons) == ("gpt-4o", ("stop",))


async def test_a_late_block_is_a_served_answer_with_the_content_filter_finish(
    sim: SimulatedUpstream, transport: str
) -> None:
    """The text sent before the block stays; ``content_filter`` is the finish; no failover."""
    async with _chat(sim, transport, "az", "spare") as client, client.stream(FLAGGED) as stream:
        chunks = [c async for c in stream]
        response = await stream.response()
    assert response.text == "Simulated reply from az. say forbidden now"
    assert "".join(c.text for c in chunks) == response.text
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["content_filter"]
    assert response.finish_reason == "content_filter"
    assert response.usage.completion_tokens == 7
    assert [(a.source, a.outcome) for a in response.attempts] == [("az", "success")]
    assert response.attempts[0].finish_reasons == ("content_filter",)
    assert sim.stats("spare").requests == 0


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"wire": "openai", "azure_filter": "asynchronous"}, "azure wire"),
        ({"wire": "azure", "azure_filter_flags": ("bad",)}, "asynchronous"),
        ({"wire": "azure", "azure_filter": "buffered"}, "azure_filter unknown"),
    ],
)
def test_a_filter_mode_the_wire_cannot_play_is_refused(fields: dict[str, Any], named: str) -> None:
    """The filter knobs belong to the azure wire, and the flags to its asynchronous mode."""
    with pytest.raises(ValueError, match=named):
        FaultProfile(**fields)
