"""The simulator's provider wires on a real socket: shapes, event order, headers, gates, faults.

Each wire (``FaultProfile.wire``) imitates what one provider sends, as
research-wiki/guides/providers.md describes it; every fault composes with
every wire. Everything here talks to a real server on 127.0.0.1 with plain
httpx. Timing bounds are generous: they tell "at once" from "after the delay".
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from polygateway.simulator import WIRES, FaultProfile, SimulatedUpstream, Wire, main

MESSAGES = [{"role": "user", "content": "hello simulator"}]
CHAT = {"messages": MESSAGES, "model": "m"}
ANTHROPIC_HEADERS = {"x-api-key": "sk-test", "anthropic-version": "2023-06-01"}
AZURE_QUERY = "api-version=2024-10-21"
GO_DURATION = re.compile(r"^(\d+ms|(\d+h)?(\d+m)?\d+(\.\d+)?s)$")
OPENAI_SHAPED: tuple[Wire, ...] = ("openai", "azure", "litellm", "vllm")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """A plain httpx client with a generous timeout."""
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


def chat_url(sim: SimulatedUpstream, name: str, wire: Wire) -> str:
    """Where a client of ``wire`` posts a chat request to source ``name``."""
    if wire == "azure":
        return f"{sim.url}/{name}/openai/deployments/dep/chat/completions?{AZURE_QUERY}"
    if wire == "anthropic":
        return f"{sim.url}/{name}/v1/messages"
    return f"{sim.base_url(name)}/chat/completions"


def chat_body(wire: Wire, **extra: Any) -> dict[str, Any]:
    """A valid chat request body for ``wire`` (Anthropic's needs max_tokens)."""
    body: dict[str, Any] = {**CHAT, **extra}
    if wire == "anthropic":
        body.setdefault("max_tokens", 64)
    return body


def chat_headers(wire: Wire) -> dict[str, str]:
    """The headers a client of ``wire`` must send."""
    return dict(ANTHROPIC_HEADERS) if wire == "anthropic" else {}


async def timed_lines(response: httpx.Response) -> list[tuple[float, str]]:
    """The non-empty lines of a stream, each with seconds since the headers arrived."""
    started = time.monotonic()
    return [(time.monotonic() - started, line) async for line in response.aiter_lines() if line]


def data_events(lines: list[tuple[float, str]]) -> list[tuple[float, Any]]:
    """The ``data:`` payloads of SSE lines, JSON-decoded unless they are ``[DONE]``."""
    out: list[tuple[float, Any]] = []
    for at, line in lines:
        if line.startswith("data: "):
            raw = line[6:]
            out.append((at, raw if raw == "[DONE]" else json.loads(raw)))
    return out


def without_filter_annotations(
    wire: Wire, events: list[tuple[float, Any]]
) -> list[tuple[float, Any]]:
    """``events`` without Azure's content filter annotations, which leaves OpenAI's stream.

    Azure opens with a chunk of the prompt's ``prompt_filter_results`` alone and
    rates each choice (``content_filter_results``); the other wires send neither.
    """
    if wire != "azure":
        return events
    (_, prompt), *rest = events
    assert prompt["choices"] == []
    assert prompt["prompt_filter_results"]
    for _, data in rest:
        if isinstance(data, dict):
            for choice in data["choices"]:
                choice.pop("content_filter_results")
    return rest


def named_events(lines: list[tuple[float, str]]) -> list[tuple[float, str, dict[str, Any]]]:
    """Anthropic's ``event:`` / ``data:`` pairs, in order."""
    out: list[tuple[float, str, dict[str, Any]]] = []
    name = ""
    for at, line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((at, name, json.loads(line[6:])))
    return out


async def stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[httpx.Response, list[tuple[float, str]]]:
    """Post a streaming request; the response (read) and its timed lines."""
    async with client.stream("POST", url, json=body, headers=headers) as r:
        lines = await timed_lines(r)
    return r, lines


# -- OpenAI-shaped wires -------------------------------------------------------------------------


@pytest.mark.parametrize("wire", OPENAI_SHAPED)
async def test_openai_shaped_wires_answer_a_completion_and_a_stream_role_first(
    client: httpx.AsyncClient, wire: Wire
) -> None:
    """Plain: a chat.completion. Stream: role chunk, content, finish, [DONE], in that order."""
    async with SimulatedUpstream({"s": FaultProfile(wire=wire, stream_chunks=3)}) as sim:
        url = chat_url(sim, "s", wire)
        plain = await client.post(url, json=CHAT)
        r, lines = await stream(client, url, {**CHAT, "stream": True}, {})
    assert plain.status_code == 200
    whole = plain.json()["choices"][0]["message"]["content"]
    assert plain.json()["object"] == "chat.completion"
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [data for _, data in without_filter_annotations(wire, data_events(lines))]
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    contents = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert len(contents) == 3
    assert "".join(contents) == whole
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert "usage" not in chunks[-1]


async def test_openai_usage_chunk_only_when_include_usage_is_set(
    client: httpx.AsyncClient,
) -> None:
    """include_usage adds a last chunk with empty choices and the usage; others say null."""
    async with SimulatedUpstream({"s": FaultProfile()}) as sim:
        url = chat_url(sim, "s", "openai")
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        _, lines = await stream(client, url, body, {})
    chunks = [data for _, data in data_events(lines)][:-1]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["total_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])


@pytest.mark.parametrize("wire", OPENAI_SHAPED)
async def test_ttft_is_waited_after_the_role_chunk_and_before_the_first_content(
    client: httpx.AsyncClient, wire: Wire
) -> None:
    """The role chunk comes at once; the first content about ttft_s after the headers."""
    async with SimulatedUpstream({"s": FaultProfile(wire=wire, ttft_s=1.0)}) as sim:
        _, lines = await stream(client, chat_url(sim, "s", wire), {**CHAT, "stream": True}, {})
    events = without_filter_annotations(wire, data_events(lines))
    role_at, role = events[0]
    content_at, content = events[1]
    assert role["choices"][0]["delta"]["role"] == "assistant"
    # Well before the TTFT (held back with the content it would come after it); the
    # margin is for a loaded machine.
    assert role_at < 0.6
    assert content["choices"][0]["delta"]["content"]
    assert 1.0 * 0.8 <= content_at < 1.0 + 1.5


async def test_openai_tool_call_stream_names_the_tool_after_the_delay(
    client: httpx.AsyncClient,
) -> None:
    """With tools offered, the stream is one call of the first tool, finish tool_calls."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    async with SimulatedUpstream({"s": FaultProfile(ttft_s=0.3)}) as sim:
        body = {**CHAT, "tools": tools, "stream": True}
        _, lines = await stream(client, chat_url(sim, "s", "openai"), body, {})
    events = data_events(lines)
    first_at, first = events[0]
    call = first["choices"][0]["delta"]["tool_calls"][0]
    assert call["function"]["name"] == "lookup"
    assert first_at >= 0.3 * 0.8
    assert events[-2][1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_openai_headers_report_the_request_and_token_windows(
    client: httpx.AsyncClient,
) -> None:
    """Every answer of a limited source carries the six x-ratelimit-* headers, resets as Go."""
    profile = FaultProfile(request_limit=10, request_window_s=30.0, token_limit=5000)
    async with SimulatedUpstream({"s": profile}) as sim:
        first = await client.post(chat_url(sim, "s", "openai"), json=CHAT)
        second = await client.post(chat_url(sim, "s", "openai"), json=CHAT)
    h = second.headers
    assert h["x-ratelimit-limit-requests"] == "10"
    assert first.headers["x-ratelimit-remaining-requests"] == "9"
    assert h["x-ratelimit-remaining-requests"] == "8"
    assert h["x-ratelimit-limit-tokens"] == "5000"
    spent = first.json()["usage"]["total_tokens"] + second.json()["usage"]["total_tokens"]
    assert int(h["x-ratelimit-remaining-tokens"]) == 5000 - spent
    assert GO_DURATION.match(h["x-ratelimit-reset-requests"])
    assert GO_DURATION.match(h["x-ratelimit-reset-tokens"])
    assert h["x-ratelimit-reset-requests"].startswith(("29.", "30s"))
    assert h["x-ratelimit-reset-tokens"].startswith(("59.", "1m0s"))


async def test_a_source_without_limits_sends_no_rate_limit_headers(
    client: httpx.AsyncClient,
) -> None:
    """No server-side limit, nothing to report: a plain answer carries no x-ratelimit-*."""
    async with SimulatedUpstream({"s": FaultProfile()}) as sim:
        r = await client.post(chat_url(sim, "s", "openai"), json=CHAT)
    assert not [k for k in r.headers if k.startswith("x-ratelimit")]


# -- the request window: remaining reaches 0, then 429 with the reset ------------------------------


def remaining_requests(wire: Wire, headers: httpx.Headers) -> str:
    """The remaining-requests header of ``wire``."""
    if wire == "anthropic":
        return headers["anthropic-ratelimit-requests-remaining"]
    if wire == "litellm":
        assert (
            headers["llm_provider-x-ratelimit-remaining-requests"]
            == (headers["x-ratelimit-remaining-requests"])
        )
    return headers["x-ratelimit-remaining-requests"]


@pytest.mark.parametrize("wire", ["openai", "azure", "anthropic", "litellm"])
async def test_remaining_requests_reach_zero_then_429_until_the_window_frees(
    client: httpx.AsyncClient, wire: Wire
) -> None:
    """request_limit=2 per 1.5 s: remaining 1, 0, then 429 with Retry-After; served after it."""
    profile = FaultProfile(wire=wire, request_limit=2, request_window_s=1.5)
    async with SimulatedUpstream({"s": profile}) as sim:
        url, body, headers = chat_url(sim, "s", wire), chat_body(wire), chat_headers(wire)
        started = time.monotonic()
        rs = []
        answered_wall = []  # when each answer came, on the wall clock the reset times use
        for _ in range(3):
            rs.append(await client.post(url, json=body, headers=headers))
            answered_wall.append(time.time())
        retry_after = float(rs[2].headers["retry-after"])
        await asyncio.sleep(1.5 - (time.monotonic() - started) + 0.05)
        later = await client.post(url, json=body, headers=headers)
        stats = sim.stats("s")
    assert [r.status_code for r in rs] == [200, 200, 429]
    assert [remaining_requests(wire, r.headers) for r in rs] == ["1", "0", "0"]
    assert 1 <= retry_after <= 2
    assert later.status_code == 200
    assert stats.limits_hit == {"requests": 1}
    assert stats.requests == 4
    assert stats.arrivals_between(started, started + 1.0) == 3
    if wire in ("openai", "azure", "litellm"):
        assert 1000 <= int(rs[2].headers["retry-after-ms"]) <= 1500
    if wire == "openai":
        assert rs[2].json()["error"]["type"] == "requests"
        # A burst fills the window at once: it frees its oldest request about 1.5 s later.
        duration = rs[1].headers["x-ratelimit-reset-requests"]
        assert GO_DURATION.match(duration)
        assert 0.5 < float(duration.removesuffix("s")) <= 1.5
    if wire == "anthropic":
        assert rs[2].json()["error"]["type"] == "rate_limit_error"
        assert "retry-after-ms" not in rs[2].headers
        reset_at = datetime.strptime(
            rs[1].headers["anthropic-ratelimit-requests-reset"], "%Y-%m-%dT%H:%M:%SZ"
        ).replace(tzinfo=UTC)
        # Whole seconds rounded up: from 0 to 1.5 s (the window) plus 1 s after the answer.
        assert 0 < reset_at.timestamp() - answered_wall[1] <= 3.0
    if wire == "azure":
        assert rs[2].json()["error"]["code"] == "429"


async def test_token_limit_refuses_a_request_that_would_overspend_the_window(
    client: httpx.AsyncClient,
) -> None:
    """token_limit counts each answer's total tokens; the one that would pass it gets 429 tokens."""
    async with SimulatedUpstream({"s": FaultProfile(token_limit=12, token_window_s=30.0)}) as sim:
        url = chat_url(sim, "s", "openai")
        first = await client.post(url, json=CHAT)
        second = await client.post(url, json=CHAT)
    spent = first.json()["usage"]["total_tokens"]
    assert first.status_code == 200
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 12 - spent
    assert second.status_code == 429
    assert second.json()["error"]["type"] == "tokens"
    assert 1 <= int(second.headers["retry-after"]) <= 30
    assert sim.stats("s").limits_hit == {"tokens": 1}


async def test_rpm_limit_is_a_60_second_request_limit_with_the_same_headers(
    client: httpx.AsyncClient,
) -> None:
    """rpm_limit keeps its 429s (cause rpm) and reports its window like request_limit."""
    async with SimulatedUpstream({"s": FaultProfile(rpm_limit=1)}) as sim:
        url = chat_url(sim, "s", "openai")
        ok, refused = [await client.post(url, json=CHAT) for _ in range(2)]
    assert (ok.status_code, refused.status_code) == (200, 429)
    assert ok.headers["x-ratelimit-limit-requests"] == "1"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert sim.stats("s").limits_hit == {"rpm": 1}


# -- 429 forever and 5xx with Retry-After, on every wire -------------------------------------------


@pytest.mark.parametrize("wire", WIRES)
async def test_429_forever_composes_with_every_wire(client: httpx.AsyncClient, wire: Wire) -> None:
    """rate_429=1 answers every request 429 with Retry-After, in the wire's error shape."""
    profile = FaultProfile(wire=wire, rate_429=1.0, retry_after_s=2.5)
    async with SimulatedUpstream({"s": profile}) as sim:
        url, headers = chat_url(sim, "s", wire), chat_headers(wire)
        rs = [await client.post(url, json=chat_body(wire), headers=headers) for _ in range(3)]
    assert [r.status_code for r in rs] == [429] * 3
    assert all(r.headers["retry-after"] == "3" for r in rs)
    body = rs[0].json()
    if wire == "anthropic":
        assert body["type"] == "error"
        assert body["error"]["type"] == "rate_limit_error"
    elif wire == "azure":
        assert body["error"]["code"] == "429"
    else:
        assert body["error"]["message"]
    has_ms = wire in ("openai", "azure", "litellm")
    assert ("retry-after-ms" in rs[0].headers) is has_ms
    if wire == "litellm":
        assert rs[0].headers["llm_provider-retry-after"] == "3"
        assert rs[0].headers["llm_provider-retry-after-ms"] == "2500"


async def test_anthropic_529_is_overloaded_error_with_retry_after(
    client: httpx.AsyncClient,
) -> None:
    """statuses_5xx=(529,) with retry_after_on_5xx: 529 overloaded_error carrying Retry-After."""
    profile = FaultProfile(
        wire="anthropic",
        rate_5xx=1.0,
        statuses_5xx=(529,),
        retry_after_on_5xx=True,
        retry_after_s=4.0,
    )
    async with SimulatedUpstream({"s": profile}) as sim:
        r = await client.post(
            chat_url(sim, "s", "anthropic"), json=chat_body("anthropic"), headers=ANTHROPIC_HEADERS
        )
    assert r.status_code == 529
    assert r.json()["error"] == {"type": "overloaded_error", "message": "Overloaded"}
    assert r.headers["retry-after"] == "4"


@pytest.mark.parametrize("retry_after_on_5xx", [True, False])
async def test_503_carries_retry_after_only_when_asked(
    client: httpx.AsyncClient, retry_after_on_5xx: bool
) -> None:
    """retry_after_on_5xx puts retry-after and retry-after-ms on a 503; without it, none."""
    profile = FaultProfile(
        rate_5xx=1.0, statuses_5xx=(503,), retry_after_on_5xx=retry_after_on_5xx, retry_after_s=1.5
    )
    async with SimulatedUpstream({"s": profile}) as sim:
        r = await client.post(chat_url(sim, "s", "openai"), json=CHAT)
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "server_error"
    if retry_after_on_5xx:
        assert (r.headers["retry-after"], r.headers["retry-after-ms"]) == ("2", "1500")
    else:
        assert "retry-after" not in r.headers


# -- Azure ---------------------------------------------------------------------------------------


async def test_azure_wants_api_version_and_its_api_key(client: httpx.AsyncClient) -> None:
    """No api-version: 404 Resource not found. No or wrong api-key: 401. Both: served."""
    profile = FaultProfile(wire="azure", api_key="azure-key", request_limit=100)
    async with SimulatedUpstream({"s": profile}) as sim:
        base = f"{sim.url}/s/openai/deployments/gpt-dep"
        no_version = await client.post(
            f"{base}/chat/completions", json=CHAT, headers={"api-key": "azure-key"}
        )
        no_key = await client.post(f"{base}/chat/completions?{AZURE_QUERY}", json=CHAT)
        wrong_key = await client.post(
            f"{base}/chat/completions?{AZURE_QUERY}", json=CHAT, headers={"api-key": "nope"}
        )
        ok = await client.post(
            f"{base}/chat/completions?{AZURE_QUERY}",
            json={"messages": MESSAGES},
            headers={"api-key": "azure-key"},
        )
        embedded = await client.post(
            f"{base}/embeddings?{AZURE_QUERY}",
            json={"input": "x"},
            headers={"api-key": "azure-key"},
        )
        openai_route = await client.post(f"{sim.base_url('s')}/chat/completions", json=CHAT)
        stats = sim.stats("s")
    assert no_version.status_code == 404
    assert no_version.json() == {"error": {"code": "404", "message": "Resource not found"}}
    assert no_key.status_code == wrong_key.status_code == 401
    assert no_key.json()["error"]["code"] == "401"
    assert "subscription key" in no_key.json()["error"]["message"]
    assert ok.status_code == 200
    assert ok.json()["model"] == "gpt-dep"
    assert ok.headers["x-ratelimit-remaining-requests"] == "99"
    assert "x-ratelimit-limit-requests" not in ok.headers
    assert embedded.status_code == 200
    assert embedded.json()["model"] == "gpt-dep"
    assert openai_route.status_code == 404
    assert stats.by_outcome == {"bad_request": 4, "ok": 2}


# -- Anthropic -----------------------------------------------------------------------------------


async def test_anthropic_wants_its_key_version_and_max_tokens(client: httpx.AsyncClient) -> None:
    """Missing x-api-key: 401; missing anthropic-version: 400; missing max_tokens: 400."""
    async with SimulatedUpstream({"s": FaultProfile(wire="anthropic", api_key="sk-a")}) as sim:
        url = chat_url(sim, "s", "anthropic")
        body = chat_body("anthropic")
        no_key = await client.post(url, json=body, headers={"anthropic-version": "2023-06-01"})
        wrong_key = await client.post(url, json=body, headers=ANTHROPIC_HEADERS)
        good = {**ANTHROPIC_HEADERS, "x-api-key": "sk-a"}
        no_version = await client.post(url, json=body, headers={"x-api-key": "sk-a"})
        no_max = await client.post(url, json=CHAT, headers=good)
        ok = await client.post(url, json=body, headers=good)
        openai_route = await client.post(f"{sim.base_url('s')}/chat/completions", json=CHAT)
    assert (no_key.status_code, wrong_key.status_code) == (401, 401)
    assert no_key.json()["type"] == "error"
    assert no_key.json()["error"] == {
        "type": "authentication_error",
        "message": "x-api-key header is required",
    }
    assert no_key.json()["request_id"].startswith("req_")
    assert no_version.status_code == 400
    assert no_version.json()["error"]["type"] == "invalid_request_error"
    assert "anthropic-version" in no_version.json()["error"]["message"]
    assert no_max.status_code == 400
    assert "max_tokens" in no_max.json()["error"]["message"]
    assert ok.status_code == 200
    assert openai_route.status_code == 404
    assert openai_route.json()["error"]["type"] == "not_found_error"


async def test_anthropic_message_has_content_blocks_stop_reason_and_usage(
    client: httpx.AsyncClient,
) -> None:
    """A Messages answer: text block, end_turn, input/output tokens; with tools, a tool_use."""
    tools = [{"name": "lookup", "description": "d", "input_schema": {"type": "object"}}]
    async with SimulatedUpstream({"s": FaultProfile(wire="anthropic")}) as sim:
        url = chat_url(sim, "s", "anthropic")
        text = await client.post(url, json=chat_body("anthropic"), headers=ANTHROPIC_HEADERS)
        tool = await client.post(
            url, json=chat_body("anthropic", tools=tools), headers=ANTHROPIC_HEADERS
        )
    body = text.json()
    assert body["type"] == "message"
    assert body["role"] == "assistant"
    assert body["id"].startswith("msg_")
    assert body["stop_reason"] == "end_turn"
    (block,) = body["content"]
    assert block["type"] == "text"
    assert "Simulated reply from s." in block["text"]
    assert body["usage"]["input_tokens"] > 0
    assert body["usage"]["output_tokens"] > 0
    assert tool.json()["stop_reason"] == "tool_use"
    (call,) = tool.json()["content"]
    assert (call["type"], call["name"], call["input"]) == ("tool_use", "lookup", {})


async def test_anthropic_stream_is_the_documented_event_sequence_with_ttft_after_ping(
    client: httpx.AsyncClient,
) -> None:
    """message_start, content_block_start, ping at once; after ttft the deltas, stop, no [DONE]."""
    profile = FaultProfile(wire="anthropic", ttft_s=1.0, stream_chunks=3)
    async with SimulatedUpstream({"s": profile}) as sim:
        url = chat_url(sim, "s", "anthropic")
        whole = (
            await client.post(url, json=chat_body("anthropic"), headers=ANTHROPIC_HEADERS)
        ).json()
        r, lines = await stream(client, url, chat_body("anthropic", stream=True), ANTHROPIC_HEADERS)
    events = named_events(lines)
    names = [name for _, name, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for _, name, data in events)
    assert not [line for _, line in lines if "[DONE]" in line]
    assert r.headers["content-type"].startswith("text/event-stream")
    # At once, well before the TTFT; the margin is for a loaded machine.
    assert max(at for at, _, _ in events[:3]) < 0.6
    assert 1.0 * 0.8 <= events[3][0] < 1.0 + 1.5
    deltas = [data["delta"] for _, name, data in events if name == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert "".join(d["text"] for d in deltas) == whole["content"][0]["text"]
    start = events[0][2]["message"]
    assert (start["content"], start["stop_reason"]) == ([], None)
    final = events[-2][2]
    assert final["delta"]["stop_reason"] == "end_turn"
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


async def test_anthropic_tool_use_streams_input_json_deltas(client: httpx.AsyncClient) -> None:
    """With tools, the block is a tool_use whose input arrives as input_json_delta partial JSON."""
    tools = [{"name": "lookup", "input_schema": {"type": "object"}}]
    async with SimulatedUpstream({"s": FaultProfile(wire="anthropic")}) as sim:
        _, lines = await stream(
            client,
            chat_url(sim, "s", "anthropic"),
            chat_body("anthropic", stream=True, tools=tools),
            ANTHROPIC_HEADERS,
        )
    events = [(name, data) for _, name, data in named_events(lines)]
    assert [name for name, _ in events][:3] == ["message_start", "ping", "content_block_start"]
    assert events[2][1]["content_block"]["type"] == "tool_use"
    assert events[2][1]["content_block"]["name"] == "lookup"
    partial = [
        data["delta"]["partial_json"]
        for name, data in events
        if name == "content_block_delta" and data["delta"]["type"] == "input_json_delta"
    ]
    assert json.loads("".join(partial)) == {}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert events[-1][0] == "message_stop"


async def test_anthropic_error_fault_is_an_error_event_mid_stream(
    client: httpx.AsyncClient,
) -> None:
    """error_body, anthropic: a 200 stream, some deltas, then event: error, no message_stop."""
    profile = FaultProfile(wire="anthropic", rate_error_body=1.0, stream_chunks=4)
    async with SimulatedUpstream({"s": profile}) as sim:
        r, lines = await stream(
            client,
            chat_url(sim, "s", "anthropic"),
            chat_body("anthropic", stream=True),
            ANTHROPIC_HEADERS,
        )
    events = named_events(lines)
    names = [name for _, name, _ in events]
    assert r.status_code == 200
    assert names.count("content_block_delta") == 2
    assert names[-1] == "error"
    assert events[-1][2] == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "Overloaded"},
    }
    assert "message_stop" not in names
    assert sim.stats("s").outcome("error_body") == 1


async def test_anthropic_truncated_stream_stops_before_message_delta(
    client: httpx.AsyncClient,
) -> None:
    """truncate on the anthropic wire: some deltas, then the stream ends without its stop events."""
    profile = FaultProfile(wire="anthropic", rate_truncate=1.0, stream_chunks=4)
    async with SimulatedUpstream({"s": profile}) as sim:
        _, lines = await stream(
            client,
            chat_url(sim, "s", "anthropic"),
            chat_body("anthropic", stream=True),
            ANTHROPIC_HEADERS,
        )
    names = [name for _, name, _ in named_events(lines)]
    assert names.count("content_block_delta") == 2
    assert not {"content_block_stop", "message_delta", "message_stop"} & set(names)


# -- LiteLLM -------------------------------------------------------------------------------------


async def test_litellm_forwards_provider_headers_with_the_llm_provider_prefix(
    client: httpx.AsyncClient,
) -> None:
    """Each provider header comes twice: as is, and again prefixed with llm_provider-."""
    profile = FaultProfile(wire="litellm", request_limit=5, token_limit=10_000)
    async with SimulatedUpstream({"s": profile}) as sim:
        r = await client.post(chat_url(sim, "s", "litellm"), json=CHAT)
    for name in (
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    ):
        assert r.headers[f"llm_provider-{name}"] == r.headers[name]
    assert r.headers["llm_provider-x-ratelimit-remaining-requests"] == "4"


async def test_litellm_stream_error_is_in_band_after_some_content(
    client: httpx.AsyncClient,
) -> None:
    """error_body, litellm: a 200 stream with content, then data: {"error"}, no [DONE]."""
    profile = FaultProfile(wire="litellm", rate_error_body=1.0, stream_chunks=4)
    async with SimulatedUpstream({"s": profile}) as sim:
        r, lines = await stream(client, chat_url(sim, "s", "litellm"), {**CHAT, "stream": True}, {})
    events = [data for _, data in data_events(lines)]
    assert r.status_code == 200
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [e["choices"][0]["delta"]["content"] for e in events[1:-1]]
    assert events[-1]["error"]["code"] == "503"
    assert events[-1]["error"]["message"].startswith("litellm.")
    assert "[DONE]" not in events


# -- vLLM ----------------------------------------------------------------------------------------


async def test_vllm_sends_keep_alive_comments_while_waiting_for_the_first_token(
    client: httpx.AsyncClient,
) -> None:
    """ttft 1.2 s: ': keep-alive' about every 0.5 s of the wait, all before the first content."""
    profile = FaultProfile(wire="vllm", ttft_s=1.2, request_limit=10)
    async with SimulatedUpstream({"s": profile}) as sim:
        r, lines = await stream(client, chat_url(sim, "s", "vllm"), {**CHAT, "stream": True}, {})
    comments = [at for at, line in lines if line == ": keep-alive"]
    content_at = next(
        at
        for at, data in data_events(lines)
        if data != "[DONE]" and data["choices"][0]["delta"].get("content")
    )
    assert len(comments) == 2
    # Lower bounds only (the server cannot send early; a loaded client may read late).
    assert comments[0] >= 0.5 * 0.8
    assert comments[1] >= 1.0 * 0.8
    assert max(comments) < content_at
    assert content_at >= 1.2 * 0.8
    assert not [k for k in r.headers if "ratelimit" in k]


async def test_vllm_sends_a_keep_alive_even_when_the_first_token_is_quick(
    client: httpx.AsyncClient,
) -> None:
    """A short wait still shows one keep-alive comment before the first content."""
    async with SimulatedUpstream({"s": FaultProfile(wire="vllm")}) as sim:
        _, lines = await stream(client, chat_url(sim, "s", "vllm"), {**CHAT, "stream": True}, {})
    texts = [line for _, line in lines]
    assert texts[0].startswith("data: ")
    assert texts[1] == ": keep-alive"
    second = json.loads(texts[2].removeprefix("data: "))
    assert second["choices"][0]["delta"]["content"]
    assert texts[-1] == "data: [DONE]"


# -- record, profile and command line --------------------------------------------------------------


async def test_arrivals_can_be_counted_in_a_time_window(client: httpx.AsyncClient) -> None:
    """arrivals_between counts the requests that reached a source in [start, end)."""
    async with SimulatedUpstream({"s": FaultProfile(rate_429=1.0)}) as sim:
        url = chat_url(sim, "s", "openai")
        await client.post(url, json=CHAT)
        middle = time.monotonic()
        await client.post(url, json=CHAT)
        await client.post(url, json=CHAT)
        stats = sim.stats("s")
    assert stats.arrivals_between(stats.since, middle) == 1
    assert stats.arrivals_between(middle, time.monotonic()) == 2
    assert stats.requests == len(stats.arrivals) == 3


def test_fault_profile_refuses_an_unknown_wire_and_two_request_limits() -> None:
    """An unknown wire and request_limit with rpm_limit are refused by name."""
    with pytest.raises(ValueError, match="wire"):
        FaultProfile(wire="bedrock")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="request_limit or rpm_limit"):
        FaultProfile(request_limit=1, rpm_limit=1)
    with pytest.raises(ValueError, match="request_window_s"):
        FaultProfile(request_limit=1, request_window_s=0.0)
    assert "api_key" not in repr(FaultProfile(api_key="secret"))


def test_command_line_serves_every_source_on_the_chosen_wire(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``polygateway simulate --wire anthropic`` prints each source's Messages URL."""
    code = main(["--wire", "anthropic", "--sources", "a,b", "--duration", "0.1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "(healthy, anthropic)" in out
    assert "/a/v1/messages" in out
    assert "/b/v1/messages" in out
