"""The simulator against the providers' public references: what OpenAI, Anthropic, Azure send.

``polygateway simulate`` runs as a user starts it (a subprocess on
127.0.0.1), and its answers are read over real sockets with httpx. Faults no
built-in profile plays come from a ``SimulatedUpstream`` on 127.0.0.1 in the
test's own loop. The shapes pinned here are those of
research-wiki/guides/providers.md.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from cli_run import serve_simulator

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings, ScopeConfig, SourceConfig
from polygateway.simulator import FaultProfile, SimulatedUpstream

MESSAGES = [{"role": "user", "content": "hello simulator"}]
ANTHROPIC_HEADERS = {"x-api-key": "sk-test", "anthropic-version": "2023-06-01"}
TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def anthropic_sim() -> Iterator[str]:
    """``polygateway simulate --wire anthropic`` with one healthy source ``a``."""
    yield from serve_simulator("--sources", "a", "--wire", "anthropic")


@pytest.fixture(scope="module")
def azure_sim() -> Iterator[str]:
    """``polygateway simulate --wire azure`` with one healthy source ``a``."""
    yield from serve_simulator("--sources", "a", "--wire", "azure")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """A plain httpx client, bounded in time."""
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as c:
        yield c


def _data(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded except the ``[DONE]`` sentinel."""
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


async def _openai_stream(
    client: httpx.AsyncClient, root: str, **extra: Any
) -> tuple[httpx.Response, list[Any]]:
    """A streamed chat completion from source ``a``: the answer and its data payloads."""
    body = {"model": "gpt-sim", "messages": MESSAGES, "stream": True, **extra}
    r = await client.post(f"{root}/a/v1/chat/completions", json=body)
    return r, _data(r.text)


async def test_openai_chunks_carry_fingerprint_logprobs_and_the_role_chunks_refusal(
    client: httpx.AsyncClient, simulator: str
) -> None:
    """Chunks have ``system_fingerprint``, ``logprobs: null``; the role chunk ``refusal: null``."""
    r, events = await _openai_stream(client, simulator)
    assert r.status_code == 200
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    fingerprints = {c.get("system_fingerprint") for c in chunks}
    assert len(fingerprints) == 1
    (fingerprint,) = fingerprints
    assert isinstance(fingerprint, str)
    assert fingerprint.startswith("fp_")
    assert all(len(c["choices"]) == 1 for c in chunks)
    choices = [c["choices"][0] for c in chunks]
    assert all("logprobs" in ch and ch["logprobs"] is None for ch in choices)
    assert choices[0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert all(ch["finish_reason"] is None for ch in choices[:-1])
    assert choices[-1] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert all("usage" not in c for c in chunks)


async def test_openai_usage_chunk_has_no_choices_and_the_others_say_usage_null(
    client: httpx.AsyncClient, simulator: str
) -> None:
    """``include_usage``: a last chunk with ``choices: []`` and totals, ``usage: null`` before."""
    _, events = await _openai_stream(client, simulator, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    *chunks, last = events[:-1]
    assert all("usage" in c and c["usage"] is None for c in chunks)
    assert last["choices"] == []
    assert last["object"] == "chat.completion.chunk"
    assert last["id"] == chunks[0]["id"]
    usage = last["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0


async def test_openai_completion_carries_fingerprint_logprobs_and_refusal(
    client: httpx.AsyncClient, simulator: str
) -> None:
    """A completion names its fingerprint; its choice says ``logprobs`` and ``refusal`` null."""
    body = {"model": "gpt-sim", "messages": MESSAGES}
    r = await client.post(f"{simulator}/a/v1/chat/completions", json=body)
    assert r.status_code == 200
    completion = r.json()
    assert completion["object"] == "chat.completion"
    assert completion["system_fingerprint"].startswith("fp_")
    (choice,) = completion["choices"]
    assert "logprobs" in choice
    assert choice["logprobs"] is None
    assert choice["finish_reason"] == "stop"
    message = choice["message"]
    assert message["role"] == "assistant"
    assert "refusal" in message
    assert message["refusal"] is None
    assert isinstance(message["content"], str)


OPENAI_REQUEST_ID = re.compile(r"^req_[0-9a-f]{32}$")


async def test_every_openai_answer_names_its_request_id_and_processing_time(
    client: httpx.AsyncClient, simulator: str
) -> None:
    """Plain, streamed, refused: each a fresh ``x-request-id`` and its ``openai-processing-ms``."""
    url = f"{simulator}/a/v1/chat/completions"
    plain = await client.post(url, json={"model": "gpt-sim", "messages": MESSAGES})
    streamed, _ = await _openai_stream(client, simulator)
    refused = await client.post(url, json={"model": "gpt-sim"})
    assert [r.status_code for r in (plain, streamed, refused)] == [200, 200, 400]
    ids = [r.headers.get("x-request-id", "") for r in (plain, streamed, refused)]
    assert all(OPENAI_REQUEST_ID.match(i) for i in ids), ids
    assert len(set(ids)) == 3
    for r in (plain, streamed, refused):
        assert r.headers.get("openai-processing-ms", "").isdigit(), r.headers


async def test_every_anthropic_answer_names_its_request_id_as_its_error_body_does(
    client: httpx.AsyncClient, anthropic_sim: str
) -> None:
    """``request-id`` on every answer; an error body's ``request_id`` is that same id."""
    url = f"{anthropic_sim}/a/v1/messages"
    body = {"model": "claude-sim", "max_tokens": 64, "messages": MESSAGES}
    plain = await client.post(url, headers=ANTHROPIC_HEADERS, json=body)
    streamed = await client.post(url, headers=ANTHROPIC_HEADERS, json={**body, "stream": True})
    refused = await client.post(url, headers=ANTHROPIC_HEADERS, json={"messages": MESSAGES})
    assert [r.status_code for r in (plain, streamed, refused)] == [200, 200, 400]
    ids = [r.headers.get("request-id", "") for r in (plain, streamed, refused)]
    assert all(i.startswith("req_") and len(i) > len("req_") for i in ids), ids
    assert len(set(ids)) == 3
    error = refused.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert error["request_id"] == ids[2]


OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


async def test_openai_error_objects_in_a_200_and_in_a_stream_have_all_four_fields(
    client: httpx.AsyncClient,
) -> None:
    """The ``error_body`` fault: ``{"error": {message, type, param, code}}``, plain or in band."""
    async with SimulatedUpstream({"e": FaultProfile(rate_error_body=1.0)}) as sim:
        url = f"{sim.base_url('e')}/chat/completions"
        body = {"model": "gpt-sim", "messages": MESSAGES}
        plain = await client.post(url, json=body)
        streamed = await client.post(url, json={**body, "stream": True})
    assert plain.status_code == 200
    assert set(plain.json()["error"]) == OPENAI_ERROR_KEYS
    assert plain.json()["error"]["type"] == "server_error"
    errors = [e for e in _data(streamed.text) if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1
    assert set(errors[0]["error"]) == OPENAI_ERROR_KEYS
    assert errors[0]["error"]["type"] == "server_error"


async def test_openai_answer_cut_at_max_tokens_finishes_for_length(
    client: httpx.AsyncClient, simulator: str
) -> None:
    """A reply cut at ``max_tokens`` says ``finish_reason: "length"``, plain and streamed."""
    body = {"model": "gpt-sim", "messages": MESSAGES, "max_tokens": 2}
    plain = await client.post(f"{simulator}/a/v1/chat/completions", json=body)
    _, events = await _openai_stream(client, simulator, max_tokens=2)
    (choice,) = plain.json()["choices"]
    assert len(choice["message"]["content"].split()) == 2
    assert plain.json()["usage"]["completion_tokens"] == 2
    assert choice["finish_reason"] == "length"
    finishes = [c["choices"][0]["finish_reason"] for c in events[:-1]]
    assert finishes[-1] == "length"
    assert set(finishes[:-1]) == {None}


async def test_anthropic_answer_cut_at_max_tokens_stops_for_max_tokens(
    client: httpx.AsyncClient, anthropic_sim: str
) -> None:
    """A reply cut at ``max_tokens`` says ``stop_reason: "max_tokens"``, plain and streamed."""
    url = f"{anthropic_sim}/a/v1/messages"
    body = {"model": "claude-sim", "max_tokens": 2, "messages": MESSAGES}
    plain = await client.post(url, headers=ANTHROPIC_HEADERS, json=body)
    streamed = await client.post(url, headers=ANTHROPIC_HEADERS, json={**body, "stream": True})
    assert plain.json()["stop_reason"] == "max_tokens"
    assert plain.json()["usage"]["output_tokens"] == 2
    (delta,) = [e for e in _data(streamed.text) if e["type"] == "message_delta"]
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"]["output_tokens"] == 2


async def test_anthropic_stream_plays_the_documented_event_flow(
    client: httpx.AsyncClient, anthropic_sim: str
) -> None:
    """message_start (full message), block start, ping, deltas, block stop, message_delta, stop."""
    url = f"{anthropic_sim}/a/v1/messages"
    body = {"model": "claude-sim", "max_tokens": 64, "messages": MESSAGES, "stream": True}
    r = await client.post(url, headers=ANTHROPIC_HEADERS, json=body)
    names = [
        line.removeprefix("event: ") for line in r.text.splitlines() if line.startswith("event:")
    ]
    events = _data(r.text)
    assert [e["type"] for e in events] == names
    assert "[DONE]" not in r.text
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    message = events[0]["message"]
    assert message["id"].startswith("msg_")
    assert (message["type"], message["role"], message["content"]) == ("message", "assistant", [])
    assert message["model"] == "claude-sim"
    assert message["stop_reason"] is None
    assert message["stop_sequence"] is None
    assert set(message["usage"]) >= {"input_tokens", "output_tokens"}
    text = "".join(e["delta"]["text"] for e in events[3:-3])
    final = events[-2]
    assert final["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == len(text.split())


async def test_anthropic_overload_is_a_529_overloaded_error_naming_its_request(
    client: httpx.AsyncClient,
) -> None:
    """529 ``{"type": "error", "error": {"type": "overloaded_error", ...}, "request_id"}``."""
    overloaded = FaultProfile(wire="anthropic", rate_5xx=1.0, statuses_5xx=(529,))
    async with SimulatedUpstream({"o": overloaded}) as sim:
        body = {"model": "claude-sim", "max_tokens": 8, "messages": MESSAGES}
        r = await client.post(f"{sim.url}/o/v1/messages", headers=ANTHROPIC_HEADERS, json=body)
    assert r.status_code == 529
    error = r.json()
    assert set(error) == {"type", "error", "request_id"}
    assert error["type"] == "error"
    assert error["error"] == {"type": "overloaded_error", "message": "Overloaded"}
    assert error["request_id"] == r.headers["request-id"]


async def test_openai_embeddings_are_a_list_of_embedding_objects_with_usage(
    client: httpx.AsyncClient, simulator: str
) -> None:
    """``object: "list"``, ``data[].object: "embedding"`` in input order, prompt/total tokens."""
    body = {"model": "emb-sim", "input": ["first text here", "second one"]}
    r = await client.post(f"{simulator}/a/v1/embeddings", json=body)
    answer = r.json()
    assert r.status_code == 200
    assert answer["object"] == "list"
    assert answer["model"] == "emb-sim"
    assert [(d["object"], d["index"]) for d in answer["data"]] == [
        ("embedding", 0),
        ("embedding", 1),
    ]
    assert all(isinstance(x, float) for d in answer["data"] for x in d["embedding"])
    usage = answer["usage"]
    assert usage["prompt_tokens"] == usage["total_tokens"] > 0
    assert OPENAI_REQUEST_ID.match(r.headers["x-request-id"])


AZURE_DEPLOYMENT = "/a/openai/deployments/gpt-4o"
AZURE_QUERY = {"api-version": "2024-10-21"}
SAFE = {"filtered": False, "severity": "safe"}
RATED = {"hate": SAFE, "self_harm": SAFE, "sexual": SAFE, "violence": SAFE}


async def test_azure_stream_opens_with_the_prompts_filter_results_and_rates_each_chunk(
    client: httpx.AsyncClient, azure_sim: str
) -> None:
    """First a chunk of ``prompt_filter_results`` (no choices), then every choice rated."""
    body = {"messages": MESSAGES, "stream": True}
    url = f"{azure_sim}{AZURE_DEPLOYMENT}/chat/completions"
    r = await client.post(url, json=body, params=AZURE_QUERY)
    assert r.status_code == 200
    events = _data(r.text)
    assert events[-1] == "[DONE]"
    prompt, role, *texts, finish = events[:-1]
    assert (prompt["choices"], prompt["id"], prompt["model"], prompt["object"]) == ([], "", "", "")
    assert prompt["created"] == 0
    (result,) = prompt["prompt_filter_results"]
    assert result["prompt_index"] == 0
    assert result["content_filter_results"] == {
        **RATED,
        "jailbreak": {"filtered": False, "detected": False},
    }
    assert role["choices"][0]["delta"]["role"] == "assistant"
    assert role["choices"][0]["content_filter_results"] == {}
    assert texts
    assert all(c["choices"][0]["delta"]["content"] for c in texts)
    assert all(c["choices"][0]["content_filter_results"] == RATED for c in texts)
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert finish["choices"][0]["content_filter_results"] == {}


async def test_azure_completion_carries_the_prompts_and_the_choices_filter_results(
    client: httpx.AsyncClient, azure_sim: str
) -> None:
    """A completion: ``prompt_filter_results`` at the top, ``content_filter_results`` per choice."""
    url = f"{azure_sim}{AZURE_DEPLOYMENT}/chat/completions"
    r = await client.post(url, json={"messages": MESSAGES}, params=AZURE_QUERY)
    assert r.status_code == 200
    completion = r.json()
    assert completion["prompt_filter_results"][0]["prompt_index"] == 0
    assert completion["choices"][0]["content_filter_results"] == RATED


async def test_library_streams_an_azure_answer_as_it_completes_one(azure_sim: str) -> None:
    """Through the annotated Azure stream: the chunks' text, the response, equal to complete()."""
    source = SourceConfig(
        name="azure",
        base_url=f"{azure_sim}{AZURE_DEPLOYMENT}",
        protocol="openai",
        model="gpt-4o",
        api_key="sk-test",
        api_key_header="api-key",
        query=AZURE_QUERY,
        timeout_s=TIMEOUT_S,
    )
    settings = GatewaySettings(
        _env_file=None, scopes={"chat": ScopeConfig(kind="chat", sources=[source])}
    )
    async with ChatClient.from_settings(settings, "chat", backend=MemoryBackend()) as chat:
        plain = await chat.complete(MESSAGES)
        async with chat.stream(MESSAGES) as stream:
            chunks = [chunk async for chunk in stream]
            streamed = await stream.response()
    assert plain.text
    assert all(chunk.text or chunk.finish_reason or chunk.usage for chunk in chunks)
    assert "".join(chunk.text for chunk in chunks) == streamed.text == plain.text
    assert (streamed.finish_reason, streamed.usage) == ("stop", plain.usage)
    assert [a.outcome for a in stream.attempts] == ["success"]
