"""The OpenAI-compatible wire format: requests as built, answers as read, malformed ones refused."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from polygateway.config import SourceConfig
from polygateway.models import ToolCall, ToolCallDelta, Usage
from polygateway.transport.assembly import assemble_chat
from polygateway.transport.http import TransientError
from polygateway.transport.openai import (
    DEFAULT_MAX_TOKENS_ESTIMATE,
    IMAGE_PART_TOKENS,
    ChatChunkReader,
    _walk_chat_chunk,
    _walk_chat_response,
    chat_request,
    embedding_request,
    estimate_chat_tokens,
    estimate_embedding_tokens,
    parse_chat_chunk,
    parse_chat_response,
    parse_embedding_response,
)
from polygateway.transport.wire import endpoint, json_target, source_headers

KEY = "sk-test-SECRET-123"


def Source(**fields: Any) -> SourceConfig:
    """A source as the wire format gets it from settings (key already resolved)."""
    defaults: dict[str, Any] = {
        "name": "primary",
        "protocol": "openai",
        "base_url": "http://127.0.0.1:8001/v1/",
        "model": "gpt-4o-mini",
        "api_key": SecretStr(KEY),
        "headers": {"X-Org": "acme"},
        "connect_timeout_s": 3.0,
    }
    return SourceConfig(**(defaults | fields))


MESSAGES = [{"role": "user", "content": "hi"}]


# --- chat_request ---


def test_chat_request_builds_url_headers_and_body() -> None:
    """URL is base_url + /chat/completions; key as Bearer; params pass through, None dropped."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    request = chat_request(
        Source(),
        MESSAGES,
        {"max_tokens": 64, "temperature": 0.2, "tools": tools, "tool_choice": "auto", "seed": None},
        stream=False,
        timeout_s=30.0,
    )
    assert request.url == "http://127.0.0.1:8001/v1/chat/completions"
    assert request.method == "POST"
    assert request.source == "primary"
    assert request.headers == {
        "Content-Type": "application/json",
        "Authorization": f"Bearer {KEY}",
        "X-Org": "acme",
    }
    assert request.json == {
        "model": "gpt-4o-mini",
        "messages": MESSAGES,
        "stream": False,
        "max_tokens": 64,
        "temperature": 0.2,
        "tools": tools,
        "tool_choice": "auto",
    }
    assert (request.timeout_s, request.idle_timeout_s, request.connect_timeout_s) == (
        30.0,
        None,
        3.0,
    )


def test_chat_request_stream_asks_for_usage_and_carries_stream_timeouts() -> None:
    """A stream sets include_usage, TTFT as timeout_s and the idle timeout separately."""
    request = chat_request(
        Source(),
        MESSAGES,
        {},
        stream=True,
        timeout_s=60.0,
        ttft_timeout_s=10.0,
        idle_timeout_s=30.0,
    )
    assert request.json["stream"] is True
    assert request.json["stream_options"] == {"include_usage": True}
    assert (request.timeout_s, request.idle_timeout_s) == (10.0, 30.0)


def test_chat_request_without_key_sends_no_authorization() -> None:
    """A source without a key sends no Authorization header."""
    request = chat_request(Source(api_key=None), MESSAGES, {}, stream=False, timeout_s=1.0)
    assert "Authorization" not in request.headers


def test_chat_request_params_cannot_override_model_or_stream() -> None:
    """The source's model and the call's stream flag win over stray params."""
    request = chat_request(
        Source(), MESSAGES, {"model": "other", "stream": True}, stream=False, timeout_s=1.0
    )
    assert (request.json["model"], request.json["stream"]) == ("gpt-4o-mini", False)


def test_chat_request_repr_shows_no_key() -> None:
    """The request's repr never shows the Authorization header."""
    assert KEY not in repr(chat_request(Source(), MESSAGES, {}, stream=False, timeout_s=1.0))


def test_json_target_is_built_once_but_handed_out_fresh() -> None:
    """URL and headers as endpoint/source_headers give them; each caller gets its own dict."""
    source = Source()
    url, headers = json_target(source, "chat/completions")
    assert url == endpoint(source, "chat/completions")
    assert headers == source_headers(source, content_type="application/json")
    headers["X-Org"] = "changed"
    assert json_target(source, "chat/completions")[1]["X-Org"] == "acme"
    assert json_target(source, "embeddings")[0] == "http://127.0.0.1:8001/v1/embeddings"


def test_json_target_follows_each_source_past_its_table_size() -> None:
    """Hundreds of distinct sources (more than the table keeps) each get their own target."""
    sources = [
        Source(name=f"s{i}", base_url=f"http://127.0.0.1:9/{i}", api_key=None) for i in range(600)
    ]
    for source in sources:
        url, headers = json_target(source, "chat/completions")
        assert url == f"http://127.0.0.1:9/{source.name[1:]}/chat/completions"
        assert "Authorization" not in headers


# --- parse_chat_response ---

COMPLETION: dict[str, Any] = {
    "id": "chatcmpl-abc",
    "object": "chat.completion",
    "created": 1_700_000_000,
    "model": "gpt-4o-mini",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19},
}


def test_parse_chat_response_reads_tool_calls_and_usage() -> None:
    """Text, finish reason, tool calls and usage come out typed; raw is the provider's JSON."""
    parsed = parse_chat_response(COMPLETION)
    assert parsed.text == ""
    assert parsed.finish_reason == "tool_calls"
    assert parsed.tool_calls == (
        ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}'),
    )
    assert parsed.usage == Usage(prompt_tokens=12, completion_tokens=7, total_tokens=19)
    assert parsed.raw is COMPLETION


def test_parse_chat_response_reads_text() -> None:
    """A plain answer's text and finish reason; absent usage is zeros."""
    body = {
        "choices": [{"message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"}]
    }
    parsed = parse_chat_response(body)
    assert (parsed.text, parsed.finish_reason, parsed.tool_calls) == ("Hello", "stop", ())
    assert parsed.usage == Usage()


def test_parse_chat_response_accepts_content_parts_and_object_arguments() -> None:
    """Content as a list of text parts is joined; Ollama's object arguments become JSON text."""
    body = {
        "choices": [
            {
                "message": {
                    "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
                    "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}],
                },
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    parsed = parse_chat_response(body)
    assert parsed.text == "Hello"
    assert parsed.tool_calls == (ToolCall(id="", name="f", arguments='{"x": 1}'),)
    assert parsed.usage.total_tokens == 5


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        "text",
        {},
        {"choices": None},
        {"choices": []},
        {"choices": {"0": {}}},
        {"choices": ["x"]},
        {"choices": [{}]},
        {"choices": [{"message": "hi"}]},
        {"choices": [{"message": {"content": 5}}]},
        {"choices": [{"message": {"content": "x", "tool_calls": "nope"}}]},
        {"choices": [{"message": {"content": "x", "tool_calls": [{"function": {}}]}}]},
        {"choices": [{"message": {"content": "x", "tool_calls": [{"function": {"name": 1}}]}}]},
        {"choices": [{"message": {"content": "x"}, "finish_reason": 3}]},
        {"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": "12"}},
        {"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": True}},
        {"choices": [{"message": {"content": "x"}}], "usage": "lots"},
    ],
)
def test_malformed_chat_response_is_transient_not_key_error(body: Any) -> None:
    """Any wrong shape is TransientError('malformed body ...'), never KeyError/TypeError."""
    with pytest.raises(TransientError, match="malformed body") as info:
        parse_chat_response(body)
    assert info.value.failure == "transient"
    assert info.value.status_code is None


def test_in_band_error_object_is_transient() -> None:
    """A 200 carrying {"error": ...} is a transient failure quoting the provider's message."""
    with pytest.raises(TransientError, match="overloaded") as info:
        parse_chat_response({"error": {"message": "model overloaded", "type": "server_error"}})
    assert info.value.failure == "transient"


# --- parse_chat_chunk ---


def test_chunk_with_text_delta() -> None:
    """A content delta becomes chunk text; no finish reason yet, no usage."""
    chunk = parse_chat_chunk(
        {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]}
    )
    assert (chunk.text, chunk.finish_reason, chunk.usage, chunk.tool_calls) == (
        "Hel",
        None,
        None,
        (),
    )


def test_first_role_only_chunk_has_empty_text() -> None:
    """The role-only opening chunk carries no text."""
    chunk = parse_chat_chunk({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    assert chunk.text == ""


def test_chunk_with_tool_call_deltas() -> None:
    """Tool-call pieces keep their index, id, name, argument fragment and type if named."""
    chunk = parse_chat_chunk(
        {
            "choices": [
                {
                    "delta": {
                        "tool_calls": [
                            {
                                "index": 0,
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": ""},
                            },
                            {"index": 1, "function": {"arguments": '{"ci'}},
                        ]
                    }
                }
            ]
        }
    )
    assert chunk.tool_calls == (
        ToolCallDelta(index=0, id="call_1", name="get_weather", arguments="", type="function"),
        ToolCallDelta(index=1, arguments='{"ci'),
    )


def test_final_chunks_carry_finish_reason_and_usage() -> None:
    """The last choice chunk has the finish reason; the include_usage chunk has empty choices."""
    last = parse_chat_chunk({"choices": [{"delta": {}, "finish_reason": "stop"}]})
    usage = parse_chat_chunk(
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}
    )
    assert last.finish_reason == "stop"
    assert (usage.text, usage.usage) == ("", Usage(9, 4, 13))


def test_chunks_are_built_with_their_source() -> None:
    """The source given to the parser is on every chunk, the usage-only one too; default empty."""
    text = parse_chat_chunk({"choices": [{"delta": {"content": "a"}}]}, "primary")
    usage = parse_chat_chunk(
        {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}},
        "primary",
    )
    assert (text.source, text.text, usage.source) == ("primary", "a", "primary")
    assert parse_chat_chunk({"choices": [{"delta": {"content": "a"}}]}).source == ""


@pytest.mark.parametrize(
    "event",
    [
        None,
        "x",
        {},
        {"choices": "x"},
        {"choices": [1]},
        {"choices": [{"delta": "x"}]},
        {"choices": [{"delta": {"content": 1}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": "0"}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": 2}}]}}]},
        {"choices": [], "usage": {"completion_tokens": -1}},
    ],
)
def test_malformed_chunk_is_transient(event: Any) -> None:
    """A chunk of the wrong shape is a transient malformed body."""
    with pytest.raises(TransientError, match="malformed body"):
        parse_chat_chunk(event)


def test_error_event_in_stream_is_transient() -> None:
    """An in-band error event in a stream is a transient failure."""
    with pytest.raises(TransientError, match="rate limit"):
        parse_chat_chunk({"error": {"message": "rate limit reached"}})


# --- the direct reading of common answers agrees with the field-by-field walk ---

# Values the readers meet, right and wrong: each field drawn from these.
_ODD = st.sampled_from([None, "", "x", 0, 3, -1, 2.0, 2.5, True, [], {}, [1], {"a": 1}, "stop"])
_COUNT = st.one_of(st.sampled_from([None, 0, 7, -2, 3.0, 1.5, True, "5"]), st.integers(0, 10**6))
_USAGE = st.one_of(
    _ODD,
    st.fixed_dictionaries(
        {},
        optional={"prompt_tokens": _COUNT, "completion_tokens": _COUNT, "total_tokens": _COUNT},
    ),
)
_TEXT = st.one_of(_ODD, st.text(max_size=5), st.just([{"type": "text", "text": "part"}]))
_CALLS = st.one_of(
    _ODD, st.just([{"id": "c1", "function": {"name": "f", "arguments": "{}"}, "index": 0}])
)
_MESSAGE = st.one_of(
    _ODD,
    st.fixed_dictionaries({}, optional={"role": _ODD, "content": _TEXT, "tool_calls": _CALLS}),
)
_FINISH = st.one_of(_ODD, st.sampled_from(["stop", "length"]))


def _outcome(read: Any, *args: Any) -> Any:
    """What a reader returns, or the message of the failure it raises."""
    try:
        return read(*args)
    except TransientError as exc:
        return ("failed", str(exc))


# Nested one_of/dictionaries are slow to generate, slower still on a loaded machine: neither
# the per-example deadline nor the too_slow health check may fail the test for that.
BODIES = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _body(inner: str) -> Any:
    """A body whose first choice holds ``inner`` (message or delta): mostly right, often not."""
    plain_message = st.fixed_dictionaries(
        {"content": st.one_of(st.none(), st.text(max_size=5))}, optional={"role": st.just("a")}
    )
    plain_usage = st.fixed_dictionaries(
        {}, optional={k: st.integers(0, 99) for k in ("prompt_tokens", "completion_tokens")}
    )
    choice = st.fixed_dictionaries(
        {},
        optional={
            inner: st.one_of(plain_message, plain_message, _MESSAGE),
            "finish_reason": st.one_of(st.none(), _FINISH),
        },
    )
    choices = st.one_of(st.lists(choice, min_size=1, max_size=2), _ODD, st.lists(_ODD, max_size=2))
    usage = st.one_of(st.none(), plain_usage, _USAGE)
    return st.one_of(
        st.fixed_dictionaries(
            {"choices": choices},
            optional={"usage": usage, "error": st.sampled_from([None, "e"])},
        ),
        _ODD,
    )


@BODIES
@given(_body("message"))
def test_chat_response_read_directly_or_walked_gives_the_same(body: Any) -> None:
    """Every body, right or wrong, reads the same as the field-by-field walk reads it."""
    assert _outcome(parse_chat_response, body) == _outcome(_walk_chat_response, body)


@BODIES
@given(_body("delta"), st.sampled_from(["", "primary"]))
def test_chat_chunk_read_directly_or_walked_gives_the_same(event: Any, source: str) -> None:
    """Every chunk, right or wrong, reads the same as the field-by-field walk reads it."""
    assert _outcome(parse_chat_chunk, event, source) == _outcome(_walk_chat_chunk, event, source)


# --- Embeddings ---


def test_embedding_request_builds_url_and_body() -> None:
    """POST {base}/embeddings with model and the input list; params pass through."""
    request = embedding_request(
        Source(model="text-embedding-3-small"), ["a", "b"], {"dimensions": 8}, timeout_s=20.0
    )
    assert request.url == "http://127.0.0.1:8001/v1/embeddings"
    assert request.json == {"model": "text-embedding-3-small", "input": ["a", "b"], "dimensions": 8}
    assert request.headers["Authorization"] == f"Bearer {KEY}"
    assert request.timeout_s == 20.0


def _embedding_body(indexes: list[int], dim: int = 3) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": [float(i)] * dim} for i in indexes
        ],
        "model": "text-embedding-3-small",
        "usage": {"prompt_tokens": 6, "total_tokens": 6},
    }


def test_embedding_vectors_come_back_in_input_order() -> None:
    """Shuffled indexes are put back in input order; usage is read."""
    indexes = list(range(10))
    random.Random(7).shuffle(indexes)
    vectors, usage = parse_embedding_response(_embedding_body(indexes), 10)
    assert vectors == [[float(i)] * 3 for i in range(10)]
    assert usage == Usage(prompt_tokens=6, completion_tokens=0, total_tokens=6)


def test_wrong_number_of_vectors_is_malformed() -> None:
    """Fewer vectors than texts is TransientError naming expected and got."""
    with pytest.raises(TransientError, match=r"malformed body: expected 3 vectors, got 2") as info:
        parse_embedding_response(_embedding_body([0, 1]), 3)
    assert info.value.failure == "transient"


@pytest.mark.parametrize(
    "body",
    [
        _embedding_body([0, 0]),
        _embedding_body([0, 2]),
        _embedding_body([0, -1]),
        {"data": [{"index": 0, "embedding": [1.0]}, {"index": 1, "embedding": ["x"]}]},
        {"data": [{"index": 0, "embedding": [1.0]}, {"index": 1, "embedding": [True]}]},
        {"data": [{"index": 0, "embedding": [1.0]}, {"index": 1, "embedding": []}]},
        {"data": [{"index": 0, "embedding": [1.0]}, {"index": 1, "embedding": "AAAA"}]},
        {"data": [{"index": 0, "embedding": [1.0]}, {"index": 1, "embedding": [1.0, 2.0]}]},
        {"data": [{"index": 0, "embedding": [1.0]}, {"index": "1", "embedding": [1.0]}]},
        {"data": [{"index": 0, "embedding": [1.0]}, {"index": 1, "embedding": [float("nan")]}]},
        {"data": "nope"},
        {},
        [],
    ],
)
def test_bad_embedding_answers_are_malformed(body: Any) -> None:
    """Repeated or missing indexes, non-numbers, mixed dimensions: malformed, never shifted."""
    with pytest.raises(TransientError, match="malformed body"):
        parse_embedding_response(body, 2)


def test_embedding_from_json_text_with_nan_is_malformed() -> None:
    """NaN that json.loads accepts is still not a vector value."""
    body = json.loads('{"data": [{"index": 0, "embedding": [NaN]}]}')
    with pytest.raises(TransientError, match="malformed body"):
        parse_embedding_response(body, 1)


@pytest.mark.parametrize(
    "bad",
    [[1.0, None], [1.0, [2.0]], [1.0, False], [float("inf"), 1.0], [-float("inf")], [10**400]],
)
def test_any_non_finite_or_non_number_element_is_malformed(bad: list[Any]) -> None:
    """None, a nested list, a bool, an infinity or an int no float can hold: malformed."""
    body = {"data": [{"index": 0, "embedding": bad}]}
    with pytest.raises(TransientError, match="non-numeric value"):
        parse_embedding_response(body, 1)


def test_integer_elements_come_back_as_floats_and_values_are_kept() -> None:
    """Ints in a vector become floats; a vector of floats keeps every value as sent."""
    body = {
        "data": [
            {"index": 0, "embedding": [1, 2.5, -3]},
            {"index": 1, "embedding": [1e308, -1e308, 5e-324]},
        ]
    }
    vectors, _ = parse_embedding_response(body, 2)
    assert vectors == [[1.0, 2.5, -3.0], [1e308, -1e308, 5e-324]]
    assert [type(x) for x in vectors[0]] == [float, float, float]


# --- Token estimates ---


def test_chat_estimate_is_prompt_chars_over_four_plus_max_tokens() -> None:
    """ceil(chars / 4) + max_tokens; 256 completion tokens when max_tokens is absent."""
    messages = [{"role": "system", "content": "x" * 10}, {"role": "user", "content": "y" * 30}]
    assert estimate_chat_tokens(messages, 64) == 10 + 64
    assert estimate_chat_tokens(messages) == 10 + DEFAULT_MAX_TOKENS_ESTIMATE


def test_chat_estimate_counts_images_as_fixed_cost() -> None:
    """An inline image costs a fixed reservation, not its base64 length."""
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "abcd"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 40000}},
            ],
        }
    ]
    assert estimate_chat_tokens(messages, 0) == 1 + IMAGE_PART_TOKENS


def test_embedding_estimate_is_chars_over_four_at_least_one_each() -> None:
    """Per text ceil(chars / 4), at least 1."""
    assert estimate_embedding_tokens(["abcdefgh", "", "abc"]) == 2 + 1 + 1


def test_streamed_custom_tool_call_assembles_as_the_completion_reads_it() -> None:
    """A custom tool's pieces (``custom: {name, input}``) join into the completion's call."""

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    head = {"index": 0, "id": "call_c", "type": "custom", "custom": {"name": "sql", "input": ""}}
    events = [
        chunk({"role": "assistant", "tool_calls": [head]}),
        chunk({"tool_calls": [{"index": 0, "custom": {"input": "SELECT "}}]}),
        chunk({"tool_calls": [{"index": 0, "custom": {"input": "1"}}]}),
        chunk({}, "tool_calls"),
    ]
    completion = {
        "choices": [
            {
                "message": {
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_c",
                            "type": "custom",
                            "custom": {"name": "sql", "input": "SELECT 1"},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ]
    }
    reader = ChatChunkReader()
    assembled = assemble_chat(reader.read(event) for event in events)
    expected = (ToolCall("call_c", "sql", "SELECT 1", type="custom"),)
    assert parse_chat_response(completion).tool_calls == expected
    assert assembled.tool_calls == expected
    assert parse_chat_response(assembled.raw).tool_calls == expected
