"""The simulated upstream on the wire: shapes, every fault, server-side limits, record, shutdown.

Everything here talks to a real server on 127.0.0.1 with plain httpx, so what
is pinned is what any client would see. Timing bounds are generous.
"""

from __future__ import annotations

import asyncio
import base64
import email.utils
import json
import logging
import statistics
import struct
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from polygateway.simulator import (
    PROFILES,
    FaultProfile,
    SimulatedUpstream,
    SimulatorNotRunning,
    embedding_vector,
    format_stats,
    main,
)

CHAT = {"messages": [{"role": "user", "content": "hello simulator"}], "model": "m"}
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256))


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """A plain httpx client with a generous timeout."""
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


async def eventually(check: Callable[[], bool], within_s: float = 3.0) -> bool:
    """Wait for the real server to reach a state (it runs in this loop, on its own time)."""
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an SSE response, in order."""
    return [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]


# -- healthy shapes ----------------------------------------------------------------


async def test_chat_completion_has_openai_shape_and_usage(client: httpx.AsyncClient) -> None:
    """A healthy chat answer is an OpenAI chat.completion with text, stop and usage."""
    async with SimulatedUpstream({"a": PROFILES["zero_latency"]}) as sim:
        r = await client.post(f"{sim.base_url('a')}/chat/completions", json=CHAT)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "m"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant"
    assert "Simulated reply from a." in choice["message"]["content"]
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0


async def test_zero_latency_answers_take_about_a_millisecond(client: httpx.AsyncClient) -> None:
    """Sequential answers are not held back by Nagle's algorithm (40 ms or more each if they were).

    The median of 20, not their sum: a few answers slowed by a loaded machine
    do not fail it, while Nagle's delay would slow every one of them.
    """
    async with SimulatedUpstream({"a": PROFILES["zero_latency"]}) as sim:
        url = f"{sim.base_url('a')}/embeddings"
        await client.post(url, json={"input": "warm up"})
        took = []
        for _ in range(20):
            started = time.monotonic()
            await client.post(url, json={"input": "x"})
            took.append(time.monotonic() - started)
    assert statistics.median(took) < 0.03, sorted(took)


async def test_request_with_tools_answers_one_tool_call(client: httpx.AsyncClient) -> None:
    """A request offering tools gets one call of the first tool and finish_reason tool_calls."""
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    async with SimulatedUpstream({"a": FaultProfile()}) as sim:
        r = await client.post(
            f"{sim.base_url('a')}/chat/completions", json={**CHAT, "tools": tools}
        )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "lookup", "arguments": "{}"}


async def test_forced_tool_is_called_with_an_instance_of_its_schema(
    client: httpx.AsyncClient,
) -> None:
    """tool_choice names the second tool: that one is called, its required arguments filled."""
    place = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "size": {"anyOf": [{"type": "null"}, {"type": "integer"}]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "unasked": {"type": "string"},
        },
        "required": ["city", "size", "tags"],
    }
    tools = [
        {"type": "function", "function": {"name": "lookup", "parameters": {}}},
        {"type": "function", "function": {"name": "place", "parameters": place}},
    ]
    choice = {"type": "function", "function": {"name": "place"}}
    async with SimulatedUpstream({"a": FaultProfile()}) as sim:
        r = await client.post(
            f"{sim.base_url('a')}/chat/completions",
            json={**CHAT, "tools": tools, "tool_choice": choice},
        )
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "place"
    assert json.loads(call["function"]["arguments"]) == {
        "city": "lorem",
        "size": 1,
        "tags": ["lorem"],
    }


async def test_json_schema_response_format_answers_json_of_the_schema(
    client: httpx.AsyncClient,
) -> None:
    """response_format json_schema makes the reply text JSON of the schema, $defs resolved."""
    schema = {
        "type": "object",
        "properties": {"where": {"$ref": "#/$defs/Where"}, "ok": {"type": "boolean"}},
        "required": ["where", "ok"],
        "$defs": {
            "Where": {
                "type": "object",
                "properties": {"country": {"enum": ["FR", "DE"]}, "km": {"type": "number"}},
                "required": ["country", "km"],
            }
        },
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema}}
    async with SimulatedUpstream({"a": FaultProfile()}) as sim:
        r = await client.post(
            f"{sim.base_url('a')}/chat/completions",
            json={**CHAT, "response_format": response_format},
        )
    content = r.json()["choices"][0]["message"]["content"]
    assert json.loads(content) == {"where": {"country": "FR", "km": 1}, "ok": True}


async def test_stream_sends_role_deltas_finish_usage_then_done(client: httpx.AsyncClient) -> None:
    """A stream is role chunk, content deltas joining to the full reply, finish, usage, [DONE]."""
    async with SimulatedUpstream({"a": FaultProfile(stream_chunks=5)}) as sim:
        url = f"{sim.base_url('a')}/chat/completions"
        whole = (await client.post(url, json=CHAT)).json()["choices"][0]["message"]["content"]
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", url, json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = await sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
    assert "".join(deltas) == whole
    assert len([d for d in deltas if d]) == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] > 0
    assert sim.stats("a").by_route == {"chat": 1, "chat_stream": 1}


async def test_embeddings_come_back_in_input_order_as_floats_or_base64(
    client: httpx.AsyncClient,
) -> None:
    """Each vector is embedding_vector(its input), indexed in input order; base64 packs float32."""
    texts = ["alpha", "beta", "gamma"]
    async with SimulatedUpstream({"a": FaultProfile(embedding_dim=6)}) as sim:
        url = f"{sim.base_url('a')}/embeddings"
        r = await client.post(url, json={"input": texts, "model": "e"})
        r64 = await client.post(url, json={"input": texts, "encoding_format": "base64"})
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["embedding"] for d in body["data"]] == [embedding_vector(t, 6) for t in texts]
    assert body["usage"]["prompt_tokens"] > 0
    packed = r64.json()["data"][1]["embedding"]
    decoded = struct.unpack("<6f", base64.b64decode(packed))
    assert decoded == pytest.approx(embedding_vector("beta", 6), abs=1e-6)


async def test_ocr_text_answers_monkey_ocr_shape(client: httpx.AsyncClient) -> None:
    """/ocr/text reads the multipart file and answers success, task_type text and content."""
    async with SimulatedUpstream({"o": FaultProfile()}) as sim:
        url = f"{sim.base_url('o', 'monkey_ocr')}/ocr/text"
        r = await client.post(url, files={"file": ("page.png", PNG, "image/png")})
    body = r.json()
    assert r.status_code == 200
    assert body["success"] is True
    assert body["task_type"] == "text"
    assert f"{len(PNG)} bytes" in body["content"]


@pytest.mark.parametrize("route", ["ocr/text", "parse"])
async def test_ocr_refuses_a_file_name_that_is_not_image_or_pdf(
    client: httpx.AsyncClient, route: str
) -> None:
    """A part named other than .pdf/.jpg/.jpeg/.png is refused with 400, like MonkeyOCR."""
    async with SimulatedUpstream({"o": FaultProfile()}) as sim:
        url = f"{sim.base_url('o', 'monkey_ocr')}/{route}"
        r = await client.post(url, files={"file": ("scan.gif", PNG, "image/gif")})
        ok = await client.post(url, files={"file": ("SCAN.JPEG", PNG, "image/jpeg")})
    assert r.status_code == 400
    assert ".gif" in r.json()["detail"]
    assert ok.status_code == 200
    assert sim.stats("o").by_outcome == {"bad_request": 1, "ok": 1}


async def test_parse_returns_a_content_list_with_typed_blocks(client: httpx.AsyncClient) -> None:
    """/parse?return_type=content_list_json answers a JSON content list of typed, placed blocks."""
    async with SimulatedUpstream({"o": FaultProfile()}) as sim:
        url = f"{sim.base_url('o', 'monkey_ocr')}/parse"
        r = await client.post(
            url,
            params={"return_type": "content_list_json"},
            files={"file": ("doc.pdf", b"%PDF-1.4 fake", "application/pdf")},
        )
    body = r.json()
    assert body["success"] is True
    assert body["content_type"] == "content_list_json"
    items = json.loads(body["content"])
    assert {i["type"] for i in items} == {"title", "text", "table", "equation"}
    assert {i["page_idx"] for i in items} == {0, 1}
    assert all(len(i["bbox"]) == 4 for i in items)


async def test_unknown_source_and_invalid_body_are_refused(client: httpx.AsyncClient) -> None:
    """A path naming no source is 404; a chat body without messages is 400."""
    async with SimulatedUpstream({"a": FaultProfile()}) as sim:
        missing = await client.post(f"{sim.url}/nope/v1/chat/completions", json=CHAT)
        bad = await client.post(f"{sim.base_url('a')}/chat/completions", json={"messages": []})
    assert missing.status_code == 404
    assert bad.status_code == 400
    assert "messages" in bad.json()["error"]["message"]


# -- faults on the wire ------------------------------------------------------------


async def test_random_429_carries_retry_after_in_seconds(client: httpx.AsyncClient) -> None:
    """rate_429=1 answers 429 with Retry-After in whole seconds and retry-after-ms."""
    async with SimulatedUpstream({"a": FaultProfile(rate_429=1.0, retry_after_s=2.5)}) as sim:
        r = await client.post(f"{sim.base_url('a')}/chat/completions", json=CHAT)
    assert r.status_code == 429
    assert r.headers["retry-after"] == "3"
    assert r.headers["retry-after-ms"] == "2500"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert sim.stats("a").limits_hit == {"random": 1}


async def test_random_429_can_send_an_http_date_or_no_header(client: httpx.AsyncClient) -> None:
    """Retry-After as an HTTP date lies in the future; retry_after_s=None sends none."""
    sources = {
        "date": FaultProfile(rate_429=1.0, retry_after_s=30.0, retry_after_style="http-date"),
        "none": FaultProfile(rate_429=1.0, retry_after_s=None),
    }
    async with SimulatedUpstream(sources) as sim:
        dated = await client.post(f"{sim.base_url('date')}/embeddings", json={"input": "x"})
        bare = await client.post(f"{sim.base_url('none')}/embeddings", json={"input": "x"})
    when = email.utils.parsedate_to_datetime(dated.headers["retry-after"]).timestamp()
    assert 20 < when - time.time() <= 31
    assert bare.status_code == 429
    assert "retry-after" not in bare.headers


async def test_5xx_statuses_are_drawn_from_the_profile(client: httpx.AsyncClient) -> None:
    """rate_5xx=1 answers only statuses of statuses_5xx, with an error body."""
    profile = FaultProfile(rate_5xx=1.0, statuses_5xx=(502, 503))
    async with SimulatedUpstream({"a": profile}) as sim:
        rs = [
            await client.post(f"{sim.base_url('a')}/embeddings", json={"input": "x"})
            for _ in range(12)
        ]
    assert {r.status_code for r in rs} == {502, 503}
    assert all(r.json()["error"]["type"] == "server_error" for r in rs)
    assert sim.stats("a").outcome("5xx") == 12


async def test_hang_outlasts_the_client_timeout_and_ends_when_it_leaves(
    client: httpx.AsyncClient,
) -> None:
    """A hang gives the client a read timeout; once it leaves, the server frees the request."""
    async with SimulatedUpstream({"a": FaultProfile(rate_hang=1.0)}) as sim:
        with pytest.raises(httpx.ReadTimeout):
            await client.post(f"{sim.base_url('a')}/chat/completions", json=CHAT, timeout=0.3)
        assert await eventually(lambda: sim.stats("a").current_concurrent == 0)
        stats = sim.stats("a")
    assert stats.outcome("hang") == 1
    assert stats.max_concurrent == 1


async def test_a_hang_that_outlives_hang_s_is_a_slow_answer(client: httpx.AsyncClient) -> None:
    """When hang_s passes before the client gives up, the request is answered after all."""
    async with SimulatedUpstream({"a": FaultProfile(rate_hang=1.0, hang_s=0.2)}) as sim:
        started = time.monotonic()
        r = await client.post(f"{sim.base_url('a')}/chat/completions", json=CHAT)
        waited = time.monotonic() - started
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    assert waited >= 0.2 * 0.8
    assert sim.stats("a").by_outcome == {"hang": 1}


async def test_reset_breaks_the_body_mid_way(client: httpx.AsyncClient) -> None:
    """A reset sends a 200 head and part of the body, then drops the connection."""
    async with SimulatedUpstream({"a": FaultProfile(rate_reset=1.0)}) as sim:
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await client.post(f"{sim.base_url('a')}/chat/completions", json=CHAT)
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await client.post(
                f"{sim.base_url('a', 'monkey_ocr')}/ocr/text", files={"file": ("a.png", PNG)}
            )
        # The server survives its own faults: the next connection is served.
        sim.set_profile("a", FaultProfile())
        after = await client.post(f"{sim.base_url('a')}/chat/completions", json=CHAT)
    assert after.status_code == 200
    assert sim.stats("a").outcome("reset") == 2


async def test_injected_resets_are_not_logged_as_server_errors(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """uvicorn's "Exception in ASGI application" record for a planned reset is dropped."""
    caplog.set_level(logging.INFO)
    async with SimulatedUpstream({"a": FaultProfile(rate_reset=1.0)}) as sim:
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await client.post(f"{sim.base_url('a')}/embeddings", json={"input": "x"})
        assert await eventually(lambda: sim.stats("a").current_concurrent == 0)
    assert sim.stats("a").outcome("reset") == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_reset_breaks_a_stream_after_some_chunks(client: httpx.AsyncClient) -> None:
    """A reset stream delivers some chunks, then the connection drops without [DONE]."""
    seen: list[str] = []

    async def read_stream(url: str) -> None:
        async with client.stream("POST", url, json={**CHAT, "stream": True}) as r:
            async for line in r.aiter_lines():
                seen.append(line)

    async with SimulatedUpstream({"a": FaultProfile(rate_reset=1.0)}) as sim:
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await read_stream(f"{sim.base_url('a')}/chat/completions")
    data = [s for s in seen if s.startswith("data: ")]
    assert len(data) >= 2
    assert "data: [DONE]" not in seen


async def test_malformed_body_is_a_200_that_is_not_json(client: httpx.AsyncClient) -> None:
    """rate_malformed=1 answers 200 application/json that does not parse."""
    async with SimulatedUpstream({"a": FaultProfile(rate_malformed=1.0)}) as sim:
        r = await client.post(f"{sim.base_url('a')}/embeddings", json={"input": ["x"]})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    with pytest.raises(json.JSONDecodeError):
        r.json()


async def test_error_body_is_a_200_carrying_an_error(client: httpx.AsyncClient) -> None:
    """rate_error_body=1 answers 200 with {"error": ...} (OpenAI) or success false (MonkeyOCR)."""
    async with SimulatedUpstream({"a": FaultProfile(rate_error_body=1.0)}) as sim:
        chat = await client.post(f"{sim.base_url('a')}/chat/completions", json=CHAT)
        ocr = await client.post(
            f"{sim.base_url('a', 'monkey_ocr')}/ocr/text", files={"file": ("a.pdf", b"%PDF")}
        )
    assert chat.status_code == ocr.status_code == 200
    assert "error" in chat.json()
    assert ocr.json()["success"] is False
    assert ocr.json()["message"]


async def test_truncated_stream_ends_without_finish_reason_or_done(
    client: httpx.AsyncClient,
) -> None:
    """A truncated stream closes cleanly after some content, with no finish_reason and no [DONE]."""
    async with SimulatedUpstream({"a": FaultProfile(rate_truncate=1.0)}) as sim:
        url = f"{sim.base_url('a')}/chat/completions"
        async with client.stream("POST", url, json={**CHAT, "stream": True}) as r:
            events = await sse_events(r)
        plain = await client.post(url, json=CHAT)
    assert "[DONE]" not in events
    chunks = [json.loads(e) for e in events]
    assert any(c["choices"][0]["delta"].get("content") for c in chunks)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    # Truncation is a stream fault: a plain request to the same source is answered whole.
    assert plain.json()["choices"][0]["finish_reason"] == "stop"
    assert sim.stats("a").by_outcome == {"truncated": 1, "ok": 1}


async def test_slow_first_token_delays_the_first_chunk(client: httpx.AsyncClient) -> None:
    """ttft_s delays the first content chunk; the role chunk goes at once, as OpenAI's does."""
    async with SimulatedUpstream({"a": FaultProfile(ttft_s=1.0)}) as sim:
        url = f"{sim.base_url('a')}/chat/completions"
        async with client.stream("POST", url, json={**CHAT, "stream": True}) as r:
            headers_at = time.monotonic()
            lines = (line async for line in r.aiter_lines() if line)
            first = await anext(lines)
            role_after = time.monotonic() - headers_at
            content = await anext(lines)
            ttft = time.monotonic() - headers_at
            rest = [line async for line in lines]
    assert json.loads(first[6:])["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
        "refusal": None,
    }
    # Well before the TTFT (a role chunk held back with the content would come after it);
    # the margin is for a loaded machine.
    assert role_after < 0.6
    assert json.loads(content[6:])["choices"][0]["delta"]["content"]
    assert ttft >= 1.0 * 0.8
    assert "data: [DONE]" in rest


# -- server-side limits ------------------------------------------------------------


async def test_rpm_limit_answers_429_with_retry_after_once_exceeded(
    client: httpx.AsyncClient,
) -> None:
    """With rpm_limit=5, eight quick requests get five answers and three 429s with Retry-After."""
    async with SimulatedUpstream({"a": FaultProfile(rpm_limit=5)}) as sim:
        rs = [
            await client.post(f"{sim.base_url('a')}/chat/completions", json=CHAT) for _ in range(8)
        ]
    assert [r.status_code for r in rs] == [200] * 5 + [429] * 3
    assert all(1 <= int(r.headers["retry-after"]) <= 60 for r in rs[5:])
    stats = sim.stats("a")
    assert stats.limits_hit == {"rpm": 3}
    assert stats.requests == 8
    assert stats.max_in_window(60.0) == 8


async def test_concurrency_limit_answers_429_with_retry_after_1(client: httpx.AsyncClient) -> None:
    """With max_concurrency=2, four requests at once get two answers and two 429 Retry-After 1."""
    async with SimulatedUpstream({"a": FaultProfile(latency_s=0.5, max_concurrency=2)}) as sim:
        url = f"{sim.base_url('a')}/embeddings"
        rs = await asyncio.gather(*(client.post(url, json={"input": "x"}) for _ in range(4)))
        later = await client.post(url, json={"input": "x"})
    statuses = sorted(r.status_code for r in rs)
    assert statuses == [200, 200, 429, 429]
    assert {r.headers.get("retry-after") for r in rs if r.status_code == 429} == {"1"}
    # Places are given back when answers finish: a later request is served.
    assert later.status_code == 200
    stats = sim.stats("a")
    # The two held requests overlap every later arrival; a 429 may finish before the next arrives.
    assert stats.max_concurrent in (3, 4)
    assert stats.current_concurrent == 0
    assert stats.limits_hit == {"concurrency": 2}


# -- record, determinism, lifecycle -----------------------------------------------------------


async def test_record_counts_routes_outcomes_and_resets(client: httpx.AsyncClient) -> None:
    """The record counts per source, route and outcome; reset_stats starts it afresh."""
    sources = {"a": FaultProfile(), "b": FaultProfile(rate_5xx=1.0, statuses_5xx=(500,))}
    async with SimulatedUpstream(sources) as sim:
        await client.post(f"{sim.base_url('a')}/chat/completions", json=CHAT)
        await client.post(f"{sim.base_url('a')}/embeddings", json={"input": "x"})
        await client.post(f"{sim.base_url('b')}/embeddings", json={"input": "x"})
        a, b = sim.stats("a"), sim.stats("b")
        table = format_stats(sim.record.values())
        sim.reset_stats()
        cleared = sim.stats("a")
    assert (a.requests, a.by_route, a.by_outcome) == (2, {"chat": 1, "embeddings": 1}, {"ok": 2})
    assert (b.by_outcome, b.by_status) == ({"5xx": 1}, {500: 1})
    assert sum(a.per_minute().values()) == 2
    assert table.splitlines()[0].split()[:2] == ["source", "requests"]
    assert cleared.requests == 0
    assert cleared.arrivals == ()
    with pytest.raises(KeyError, match="zzz"):
        sim.stats("zzz")


async def test_same_seed_replays_the_same_faults(client: httpx.AsyncClient) -> None:
    """Two servers with one seed play one fault sequence; another seed plays another."""
    profile = FaultProfile(rate_5xx=0.5, statuses_5xx=(503,))

    async def statuses(seed: int) -> list[int]:
        async with SimulatedUpstream({"a": profile}, seed=seed) as sim:
            url = f"{sim.base_url('a')}/embeddings"
            return [(await client.post(url, json={"input": "x"})).status_code for _ in range(16)]

    first, again, other = await statuses(7), await statuses(7), await statuses(8)
    assert first == again
    assert first != other
    assert set(first) == {200, 503}


async def test_shutdown_ends_a_pending_hang_and_leaves_no_task(client: httpx.AsyncClient) -> None:
    """Leaving the context answers a still-hanging request at once and leaves no task behind."""
    before = asyncio.all_tasks()
    sim = SimulatedUpstream({"a": FaultProfile(rate_hang=1.0)})
    async with sim:
        url = f"{sim.base_url('a')}/chat/completions"
        pending = asyncio.create_task(client.post(url, json=CHAT))
        assert await eventually(lambda: sim.stats("a").current_concurrent == 1)
        exit_started = time.monotonic()
    stopped_in = time.monotonic() - exit_started
    response = await pending
    assert response.status_code == 503
    assert stopped_in < 2.5
    await client.aclose()
    assert asyncio.all_tasks() - before - {asyncio.current_task()} == set()
    with pytest.raises(SimulatorNotRunning):
        _ = sim.url


async def test_a_taken_port_fails_with_oserror() -> None:
    """Asking for a port another server holds raises OSError, and the first keeps serving."""
    async with SimulatedUpstream() as first:
        with pytest.raises(OSError, match="in use"):
            async with SimulatedUpstream(port=first.port):
                pass
        async with httpx.AsyncClient() as c:
            r = await c.post(f"{first.base_url('a')}/chat/completions", json=CHAT)
    assert r.status_code == 200


def test_fault_profile_refuses_rates_that_cannot_be_played() -> None:
    """Rates that add up past 1, negative delays and empty 5xx lists are refused by name."""
    with pytest.raises(ValueError, match="add up"):
        FaultProfile(rate_429=0.6, rate_5xx=0.6)
    with pytest.raises(ValueError, match="latency_s"):
        FaultProfile(latency_s=-1.0)
    with pytest.raises(ValueError, match="statuses_5xx"):
        FaultProfile(rate_5xx=0.1, statuses_5xx=())


def test_command_line_serves_then_prints_the_record(capsys: pytest.CaptureFixture[str]) -> None:
    """``polygateway simulate`` prints each source's URLs, serves, then prints the table."""
    code = main(
        ["--profile", "flaky", "--sources", "a,b", "--source", "c=failing", "--duration", "0.2"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "listening on http://127.0.0.1:" in out
    assert "/c/v1" in out
    assert "(failing)" in out
    assert out.strip().splitlines()[-1].split()[0] == "c"


def test_command_line_lists_the_built_in_profiles(capsys: pytest.CaptureFixture[str]) -> None:
    """--list-profiles names every built-in profile with what it changes."""
    assert main(["--list-profiles"]) == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines()] == list(PROFILES)
    assert "rpm_limit=30" in out


def test_command_line_refuses_an_unknown_profile(capsys: pytest.CaptureFixture[str]) -> None:
    """An unknown profile name is a usage error naming the known ones."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--profile", "nope"])
    assert exit_info.value.code == 2
    assert "healthy" in capsys.readouterr().err
