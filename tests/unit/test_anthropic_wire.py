"""The Anthropic Messages wire: request mapping, answer and stream reading, and chat through it.

The recorded shapes follow the public Messages API reference (version
2023-06-01): a ``message`` object for a plain answer, and for a stream
``message_start``, ``content_block_start`` / ``_delta`` / ``_stop`` per block,
``message_delta`` with the stop reason and usage, ``message_stop``, with
``ping`` anywhere, and no ``[DONE]``.
"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest
from _closing import closing
from pydantic import SecretStr

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import SourceConfig
from polygateway.errors import AllSourcesExhausted, RequestRejected
from polygateway.models import ChatChunk, ToolCall, ToolCallDelta, Usage
from polygateway.testing import (
    BoundedSleep,
    FakeClock,
    FakeTransport,
    Recorder,
    StreamScript,
    TransientError,
    chat_chunk_events,
    gateway_settings,
)
from polygateway.transport.anthropic import (
    ANTHROPIC_VERSION,
    DEFAULT_MAX_TOKENS,
    MessagesStreamReader,
    event_has_content,
    messages_request,
    parse_messages_response,
)
from polygateway.transport.httpx_client import HttpxTransport
from polygateway.transport.openai import estimate_chat_tokens

KEY = "sk-ant-test-SECRET-0123"
MESSAGES = [{"role": "user", "content": "hi"}]


def _source(**fields: Any) -> SourceConfig:
    base: dict[str, Any] = {
        "name": "claude",
        "protocol": "anthropic",
        "base_url": "https://api.anthropic.test/v1/",
        "model": "claude-test",
        "api_key": SecretStr(KEY),
    }
    base.update(fields)
    return SourceConfig(**base)


def _body(messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
    request = messages_request(_source(), messages, params, stream=False, timeout_s=30.0)
    body: dict[str, Any] = request.json
    return body


def _rejected(messages: list[dict[str, Any]], **params: Any) -> TransientError:
    with pytest.raises(TransientError) as info:
        messages_request(_source(), messages, params, stream=False, timeout_s=30.0)
    assert info.value.failure == "request_rejected"
    return info.value


def message_body(
    content: list[dict[str, Any]] | None = None,
    *,
    stop_reason: str | None = "end_turn",
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Messages API answer."""
    return {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": content if content is not None else [{"type": "text", "text": "ok"}],
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": usage if usage is not None else {"input_tokens": 5, "output_tokens": 2},
    }


def text_stream(texts: list[str], *, stop_reason: str = "end_turn") -> list[dict[str, Any]]:
    """The data of each event of a streamed text answer, as the API sends them."""
    return [
        {
            "type": "message_start",
            "message": {
                "id": "msg_01",
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": "claude-test",
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": 12,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0,
                    "output_tokens": 1,
                },
            },
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "ping"},
        *(
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}}
            for t in texts
        ),
        {"type": "content_block_stop", "index": 0},
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": {"output_tokens": 30},
        },
        {"type": "message_stop"},
    ]


TOOL_STREAM: list[dict[str, Any]] = [
    {
        "type": "message_start",
        "message": {
            "id": "msg_02",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": "claude-test",
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": 400,
                "cache_creation_input_tokens": 10,
                "cache_read_input_tokens": 20,
                "output_tokens": 1,
            },
        },
    },
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "Let me check."},
    },
    {"type": "content_block_stop", "index": 0},
    {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {}},
    },
    {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "input_json_delta", "partial_json": ""},
    },
    {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "input_json_delta", "partial_json": '{"city": "Pa'},
    },
    {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "input_json_delta", "partial_json": 'ris"}'},
    },
    {"type": "content_block_stop", "index": 1},
    {
        "type": "content_block_start",
        "index": 2,
        "content_block": {"type": "tool_use", "id": "toolu_02", "name": "get_time", "input": {}},
    },
    {
        "type": "content_block_delta",
        "index": 2,
        "delta": {"type": "input_json_delta", "partial_json": "{}"},
    },
    {"type": "content_block_stop", "index": 2},
    {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"output_tokens": 89},
    },
    {"type": "message_stop"},
]


# --- The request ---


class TestRequest:
    """messages_request writes OpenAI-style messages and parameters as a Messages API request."""

    def test_endpoint_model_and_default_max_tokens(self) -> None:
        """POST {base_url}/messages with the source's model and max_tokens set even when unset."""
        request = messages_request(_source(), MESSAGES, {}, stream=False, timeout_s=30.0)
        assert request.method == "POST"
        assert request.url == "https://api.anthropic.test/v1/messages"
        assert request.timeout_s == 30.0
        assert request.json == {
            "model": "claude-test",
            "max_tokens": DEFAULT_MAX_TOKENS,
            "messages": [{"role": "user", "content": "hi"}],
        }
        assert request.is_content is None

    @pytest.mark.parametrize(
        ("params", "expected"),
        [
            ({"max_tokens": 64}, 64),
            ({"max_completion_tokens": 32}, 32),
            ({"max_tokens": 64, "max_completion_tokens": 32}, 64),
            ({"max_tokens": None}, DEFAULT_MAX_TOKENS),
        ],
    )
    def test_max_tokens_comes_from_either_openai_name(
        self, params: dict[str, Any], expected: int
    ) -> None:
        """max_tokens, else max_completion_tokens, else the module default."""
        body = _body(MESSAGES, **params)
        assert body["max_tokens"] == expected
        assert "max_completion_tokens" not in body

    def test_headers_carry_key_version_and_the_source_extras(self) -> None:
        """x-api-key from the key, anthropic-version, JSON, then the source's own headers."""
        request = messages_request(
            _source(headers={"X-Org": "acme"}), MESSAGES, {}, stream=False, timeout_s=30.0
        )
        assert request.headers == {
            "Content-Type": "application/json",
            "anthropic-version": ANTHROPIC_VERSION,
            "x-api-key": KEY,
            "X-Org": "acme",
        }
        assert "Authorization" not in request.headers

    def test_source_headers_override_the_version_in_any_case(self) -> None:
        """A source's Anthropic-Version replaces the default rather than being sent beside it."""
        source = _source(headers={"Anthropic-Version": "2099-01-01", "anthropic-beta": "x"})
        request = messages_request(source, MESSAGES, {}, stream=False, timeout_s=30.0)
        versions = [v for k, v in request.headers.items() if k.lower() == "anthropic-version"]
        assert versions == ["2099-01-01"]
        assert request.headers["anthropic-beta"] == "x"

    def test_no_key_no_key_header(self) -> None:
        """A source without a key (a local proxy) sends no x-api-key."""
        request = messages_request(_source(api_key=None), MESSAGES, {}, stream=False, timeout_s=3)
        assert "x-api-key" not in request.headers

    def test_the_key_never_shows_in_a_repr(self) -> None:
        """The request's and the source's reprs hide the key."""
        source = _source()
        request = messages_request(source, MESSAGES, {}, stream=True, timeout_s=30.0)
        assert KEY not in repr(request)
        assert KEY not in str(request)
        assert KEY not in repr(source)

    def test_stream_request_carries_ttft_idle_and_the_content_predicate(self) -> None:
        """A stream says stream: true, times its TTFT to the first content, drops stream_options."""
        request = messages_request(
            _source(),
            MESSAGES,
            {"stream_options": {"include_usage": True}},
            stream=True,
            timeout_s=60.0,
            ttft_timeout_s=5.0,
            idle_timeout_s=9.0,
        )
        assert request.json["stream"] is True
        assert "stream_options" not in request.json
        assert (request.timeout_s, request.idle_timeout_s) == (5.0, 9.0)
        assert request.is_content is event_has_content

    def test_system_messages_become_the_top_level_system_text(self) -> None:
        """System and developer messages, wherever they are, join into `system`; turns stay."""
        body = _body(
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hi"},
                {"role": "developer", "content": [{"type": "text", "text": "No emoji."}]},
            ]
        )
        assert body["system"] == "Be brief.\n\nNo emoji."
        assert body["messages"] == [{"role": "user", "content": "hi"}]

    def test_image_parts_become_base64_and_url_image_blocks(self) -> None:
        """A data: URL becomes a base64 image source, an https URL a url source; text stays text."""
        body = _body(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64,iVBORw0K"},
                        },
                        {"type": "image_url", "image_url": {"url": "https://img.test/cat.jpg"}},
                    ],
                }
            ]
        )
        assert body["messages"][0]["content"] == [
            {"type": "text", "text": "What is this?"},
            {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"},
            },
            {"type": "image", "source": {"type": "url", "url": "https://img.test/cat.jpg"}},
        ]

    @pytest.mark.parametrize(
        "url", ["data:image/png,rawbytes", "data:;base64,AAAA", "ftp://img.test/a.png", None]
    )
    def test_unusable_image_urls_are_rejected(self, url: Any) -> None:
        """An image that is neither base64 data nor http(s) is the request's fault."""
        error = _rejected(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        )
        assert "image_url" in str(error)

    def test_tool_calls_and_results_map_both_ways(self) -> None:
        """Assistant tool_calls become tool_use blocks; tool messages one user turn of results."""
        body = _body(
            [
                {"role": "user", "content": "Weather and time in Paris?"},
                {
                    "role": "assistant",
                    "content": "Checking.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        },
                        {
                            "id": "call_2",
                            "type": "function",
                            "function": {"name": "get_time", "arguments": ""},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
                {
                    "role": "tool",
                    "tool_call_id": "call_2",
                    "content": [{"type": "text", "text": "9:00"}],
                },
                {"role": "user", "content": "Thanks"},
            ]
        )
        assert body["messages"] == [
            {"role": "user", "content": "Weather and time in Paris?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "call_1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                    {"type": "tool_use", "id": "call_2", "name": "get_time", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "18 C"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "call_2",
                        "content": [{"type": "text", "text": "9:00"}],
                    },
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ]

    def test_assistant_with_only_tool_calls_has_no_empty_text_block(self) -> None:
        """content: null beside tool_calls gives tool_use blocks only (empty text is refused)."""
        body = _body(
            [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "function": {"name": "f", "arguments": {"x": 1}}},
                    ],
                },
            ]
        )
        assert body["messages"][1]["content"] == [
            {"type": "tool_use", "id": "c", "name": "f", "input": {"x": 1}}
        ]

    def test_consecutive_turns_of_one_role_are_merged(self) -> None:
        """Two user messages in a row become one user turn of two text blocks."""
        body = _body([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        assert body["messages"] == [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ]

    @pytest.mark.parametrize(
        ("messages", "fragment"),
        [
            ([{"role": "critic", "content": "x"}], "role 'critic'"),
            (
                [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ],
                "not valid JSON",
            ),
            (
                [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "function": {"name": "f", "arguments": "[" * 100_000}}
                        ],
                    }
                ],
                "not valid JSON",
            ),
            (
                [
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}],
                    }
                ],
                "not a JSON object",
            ),
            ([{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}], "has no id"),
            ([{"role": "tool", "content": "x"}], "tool_call_id"),
        ],
    )
    def test_messages_the_api_cannot_carry_are_rejected(
        self, messages: list[dict[str, Any]], fragment: str
    ) -> None:
        """An unknown role, bad tool arguments or a tool result without its id: request_rejected."""
        assert fragment in str(_rejected(messages))

    def test_tools_and_tool_choice_are_translated(self) -> None:
        """OpenAI function tools become name/description/input_schema; tool_choice maps."""
        body = _body(
            MESSAGES,
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "Weather now",
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                        },
                    },
                },
                {"type": "function", "function": {"name": "ping"}},
                {"type": "web_search_20250305", "name": "web_search"},
            ],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
        assert body["tools"] == [
            {
                "name": "get_weather",
                "description": "Weather now",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
            {"name": "ping", "input_schema": {"type": "object", "properties": {}}},
            {"type": "web_search_20250305", "name": "web_search"},
        ]
        assert body["tool_choice"] == {"type": "tool", "name": "get_weather"}

    @pytest.mark.parametrize(
        ("choice", "expected"),
        [
            ("auto", {"type": "auto"}),
            ("none", {"type": "none"}),
            ("required", {"type": "any"}),
            (
                {"type": "any", "disable_parallel_tool_use": True},
                {"type": "any", "disable_parallel_tool_use": True},
            ),
        ],
    )
    def test_tool_choice_words(self, choice: Any, expected: dict[str, Any]) -> None:
        """auto, none and required in Anthropic's words; an Anthropic object passes as given."""
        assert _body(MESSAGES, tool_choice=choice)["tool_choice"] == expected

    def test_unknown_tool_choice_is_rejected(self) -> None:
        """A tool_choice word neither API knows is the request's fault."""
        assert "tool_choice" in str(_rejected(MESSAGES, tool_choice="sometimes"))

    @pytest.mark.parametrize(("stop", "expected"), [("END", ["END"]), (["a", "b"], ["a", "b"])])
    def test_stop_becomes_stop_sequences(self, stop: Any, expected: list[str]) -> None:
        """stop, a string or a list, is sent as the stop_sequences list."""
        body = _body(MESSAGES, stop=stop)
        assert body["stop_sequences"] == expected
        assert "stop" not in body

    def test_user_becomes_metadata_and_other_params_pass_through(self) -> None:
        """user -> metadata.user_id; temperature, top_p, top_k and the unknown pass unchanged."""
        body = _body(MESSAGES, user="u-42", temperature=0.3, top_p=0.9, top_k=5, thinking={"x": 1})
        assert body["metadata"] == {"user_id": "u-42"}
        assert "user" not in body
        assert (body["temperature"], body["top_p"], body["top_k"]) == (0.3, 0.9, 5)
        assert body["thinking"] == {"x": 1}

    def test_tpm_estimate_covers_an_anthropic_shaped_conversation(self) -> None:
        """The tpm reservation counts text, tool calls and images of the messages sent."""
        messages = [
            {"role": "system", "content": "s" * 40},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "t" * 40},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64," + "A" * 4000},
                    },
                ],
            },
            {
                "role": "assistant",
                "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c", "content": "r" * 40},
        ]
        estimate = estimate_chat_tokens(messages, 100)
        assert 100 + 765 + 30 <= estimate < 100 + 765 + 100


# --- The answer ---


class TestResponse:
    """parse_messages_response reads a Messages API answer into the chat answer."""

    def test_text_blocks_are_joined_and_raw_kept(self) -> None:
        """Text blocks join; thinking blocks are skipped; raw is the provider's JSON."""
        body = message_body(
            [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "text", "text": "Hello, "},
                {"type": "text", "text": "world"},
            ]
        )
        parsed = parse_messages_response(body)
        assert parsed.text == "Hello, world"
        assert parsed.finish_reason == "stop"
        assert parsed.tool_calls == ()
        assert parsed.raw is body

    def test_tool_use_blocks_become_tool_calls(self) -> None:
        """tool_use -> ToolCall(id, name, JSON arguments, type function)."""
        body = message_body(
            [
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Zürich"},
                },
            ],
            stop_reason="tool_use",
        )
        parsed = parse_messages_response(body)
        assert parsed.text == "Checking."
        assert parsed.finish_reason == "tool_calls"
        assert parsed.tool_calls == (
            ToolCall(
                id="toolu_1", name="get_weather", arguments='{"city": "Zürich"}', type="function"
            ),
        )
        assert json.loads(parsed.tool_calls[0].arguments) == {"city": "Zürich"}

    @pytest.mark.parametrize(
        ("stop_reason", "expected"),
        [
            ("end_turn", "stop"),
            ("stop_sequence", "stop"),
            ("max_tokens", "length"),
            ("tool_use", "tool_calls"),
            ("refusal", "content_filter"),
            ("pause_turn", "pause_turn"),
            ("model_context_window_exceeded", "length"),
            ("a_reason_added_later", "a_reason_added_later"),
            (None, None),
        ],
    )
    def test_every_stop_reason_is_mapped(
        self, stop_reason: str | None, expected: str | None
    ) -> None:
        """Anthropic's stop reasons in OpenAI's words; unknown ones kept as given."""
        assert (
            parse_messages_response(message_body(stop_reason=stop_reason)).finish_reason == expected
        )

    def test_usage_counts_cached_prompt_tokens(self) -> None:
        """prompt = input + cache writes + cache reads; completion = output."""
        usage = {
            "input_tokens": 10,
            "cache_creation_input_tokens": 200,
            "cache_read_input_tokens": 3000,
            "output_tokens": 7,
        }
        parsed = parse_messages_response(message_body(usage=usage))
        assert parsed.usage == Usage(prompt_tokens=3210, completion_tokens=7, total_tokens=3217)

    def test_usage_without_cache_fields(self) -> None:
        """Absent or null cache counts count as zero."""
        usage = {"input_tokens": 10, "cache_read_input_tokens": None, "output_tokens": 7}
        assert parse_messages_response(message_body(usage=usage)).usage == Usage(10, 7, 17)

    @pytest.mark.parametrize(
        ("kind", "status", "failure"),
        [
            ("overloaded_error", 529, "transient"),
            ("rate_limit_error", 429, "rate_limited"),
            ("api_error", 500, "transient"),
            ("invalid_request_error", None, "transient"),
        ],
    )
    def test_error_objects_are_classified(
        self, kind: str, status: int | None, failure: str
    ) -> None:
        """An error object raises a TransientError with the status its type stands for."""
        body = {"type": "error", "error": {"type": kind, "message": "Overloaded"}}
        with pytest.raises(TransientError) as info:
            parse_messages_response(body)
        assert info.value.status_code == status
        assert info.value.failure == failure
        assert kind in str(info.value)

    @pytest.mark.parametrize(
        ("body", "fragment"),
        [
            ([], "body is not an object"),
            ({"type": "message"}, "content is not an array"),
            (message_body([{"type": "text", "text": 3}]), "content[0].text"),
            (message_body(["text"]), "content[0] is not an object"),
            (
                message_body([{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]),
                "content[0].input",
            ),
            (message_body([{"type": "tool_use", "id": "t", "input": {}}]), "content[0].name"),
            (message_body([{"text": "no type"}]), "content[0].type"),
            ({**message_body(), "stop_reason": 3}, "stop_reason"),
            (message_body(usage={"input_tokens": -1}), "usage.input_tokens"),
            ({**message_body(), "usage": "many"}, "usage is not an object"),
        ],
    )
    def test_malformed_shapes_are_malformed_bodies(self, body: Any, fragment: str) -> None:
        """Anything but the promised shape is a transient malformed body naming the field."""
        with pytest.raises(TransientError) as info:
            parse_messages_response(body)
        assert info.value.failure == "transient"
        assert "malformed body" in str(info.value)
        assert fragment in str(info.value)


# --- The stream ---


def _read_all(events: list[dict[str, Any]], source: str = "claude") -> list[ChatChunk]:
    reader = MessagesStreamReader()
    return [reader.read(event, source) for event in events]


class TestStreamReader:
    """MessagesStreamReader turns each event into the chunk parse_chat_chunk would give."""

    def test_text_stream_reads_into_text_chunks_a_finish_and_usage(self) -> None:
        """Text deltas are text; message_delta carries the finish and prompt + completion usage."""
        chunks = _read_all(text_stream(["Hel", "lo"]))
        delivered = [c for c in chunks if c.text or c.tool_calls or c.finish_reason or c.usage]
        assert [c.text for c in delivered] == ["Hel", "lo", ""]
        last = delivered[-1]
        assert last.finish_reason == "stop"
        assert last.usage == Usage(prompt_tokens=12, completion_tokens=30, total_tokens=42)
        assert {c.source for c in chunks} == {"claude"}
        # message_start, the empty block start, ping and the stops are empty chunks.
        assert sum(1 for c in chunks if c == ChatChunk(source="claude")) == 5

    def test_tool_use_stream_numbers_tool_calls_among_themselves(self) -> None:
        """tool_use starts give id and name; input_json_delta pieces follow at the tool's index."""
        chunks = _read_all(TOOL_STREAM)
        deltas = [d for c in chunks for d in c.tool_calls]
        assert deltas == [
            ToolCallDelta(index=0, id="toolu_01", name="get_weather", arguments=""),
            ToolCallDelta(index=0, arguments=""),
            ToolCallDelta(index=0, arguments='{"city": "Pa'),
            ToolCallDelta(index=0, arguments='ris"}'),
            ToolCallDelta(index=1, id="toolu_02", name="get_time", arguments=""),
            ToolCallDelta(index=1, arguments="{}"),
        ]
        assert "".join(c.text for c in chunks) == "Let me check."
        assert json.loads("".join(d.arguments or "" for d in deltas if d.index == 0)) == {
            "city": "Paris"
        }
        final = chunks[-2]
        assert final.finish_reason == "tool_calls"
        assert final.usage == Usage(prompt_tokens=430, completion_tokens=89, total_tokens=519)

    def test_cumulative_input_counts_in_message_delta_replace_message_start(self) -> None:
        """A message_delta that reports input counts (newer API) has the last word on them."""
        events = text_stream(["x"])
        events[-2] = {
            "type": "message_delta",
            "delta": {"stop_reason": "max_tokens"},
            "usage": {"input_tokens": 15, "cache_read_input_tokens": 5, "output_tokens": 4},
        }
        final = _read_all(events)[-2]
        assert final.finish_reason == "length"
        assert final.usage == Usage(prompt_tokens=20, completion_tokens=4, total_tokens=24)

    def test_thinking_and_unknown_events_read_as_empty_chunks(self) -> None:
        """Thinking and signature deltas, and event types added later, carry nothing to deliver."""
        reader = MessagesStreamReader()
        for event in (
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "thinking", "thinking": ""},
            },
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "thinking_delta", "thinking": "hmm"},
            },
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "signature_delta", "signature": "s"},
            },
            {"type": "brand_new_event", "stuff": [1, 2]},
        ):
            assert reader.read(event, "claude") == ChatChunk(source="claude")

    @pytest.mark.parametrize(
        ("kind", "status"),
        [("overloaded_error", 529), ("rate_limit_error", 429), ("api_error", 500)],
    )
    def test_error_event_raises_its_classified_failure(self, kind: str, status: int) -> None:
        """An in-stream error event raises like the same error object of a plain answer."""
        with pytest.raises(TransientError) as info:
            MessagesStreamReader().read(
                {"type": "error", "error": {"type": kind, "message": "m"}}, "c"
            )
        assert info.value.status_code == status

    @pytest.mark.parametrize(
        "event",
        [
            "text",
            {"no": "type"},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": 1}},
            {"type": "content_block_delta", "index": 0, "delta": "x"},
            {
                "type": "content_block_delta",
                "index": 5,
                "delta": {"type": "input_json_delta", "partial_json": "{"},
            },
            {
                "type": "content_block_start",
                "index": "0",
                "content_block": {"type": "tool_use", "id": "t", "name": "f"},
            },
            {"type": "message_start", "message": None},
            {"type": "message_delta", "delta": {"stop_reason": 1}},
            {"type": "message_delta", "delta": {}, "usage": {"output_tokens": "many"}},
        ],
    )
    def test_malformed_events_are_malformed_bodies(self, event: Any) -> None:
        """A wrongly shaped event is a transient malformed body, never a KeyError."""
        with pytest.raises(TransientError, match="malformed body") as info:
            MessagesStreamReader().read(event, "claude")
        assert info.value.failure == "transient"

    @pytest.mark.parametrize(
        ("event", "expected"),
        [
            (TOOL_STREAM[0], False),  # message_start
            (TOOL_STREAM[1], False),  # an empty text block starts
            ({"type": "ping"}, False),
            ({"type": "content_block_stop", "index": 0}, False),
            (
                {
                    "type": "content_block_delta",
                    "index": 1,
                    "delta": {"type": "input_json_delta", "partial_json": ""},
                },
                False,
            ),
            (
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": None},
                    "usage": {"output_tokens": 1},
                },
                False,
            ),
            (TOOL_STREAM[2], True),  # a text delta
            (TOOL_STREAM[4], True),  # a tool_use block starts
            (TOOL_STREAM[6], True),  # tool input
            (
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "thinking_delta", "thinking": "h"},
                },
                True,
            ),
            (TOOL_STREAM[-2], True),  # message_delta with a stop reason
            ({"type": "error", "error": {"type": "overloaded_error"}}, True),
            ("not an object", True),
        ],
    )
    def test_event_has_content(self, event: Any, expected: bool) -> None:
        """Text, tool use, thinking, a stop reason or an error end the TTFT; the frame does not."""
        assert event_has_content(event) is expected


# --- Through ChatClient ---


def make_chat(
    clock: FakeClock, script: Any, *sources: Any, emitter: Any = None
) -> tuple[ChatClient, FakeTransport, MemoryBackend]:
    """A chat client over a FakeTransport on a fake clock; sources default to one Anthropic one."""
    settings = gateway_settings(*(sources or ({"name": "claude", "protocol": "anthropic"},)))
    backend = MemoryBackend(now=clock)
    transport = FakeTransport(script, clock=clock)
    chat = closing(
        ChatClient(
            settings,
            backend=backend,
            transport=transport,
            now=clock,
            sleep=BoundedSleep(clock),
            rng=random.Random(3),
            emitter=emitter,
        )
    )
    return chat, transport, backend


class TestChatClient:
    """A chat scope serves calls from Anthropic sources, alone or mixed with OpenAI ones."""

    async def test_complete_on_an_anthropic_source(self) -> None:
        """complete() sends a Messages request and returns the same ChatResponse as OpenAI's."""
        clock = FakeClock()
        body = message_body(
            [
                {"type": "text", "text": "Sure."},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
            ],
            stop_reason="tool_use",
            usage={"input_tokens": 9, "output_tokens": 4},
        )
        chat, transport, backend = make_chat(clock, [body])
        response = await chat.complete(
            [{"role": "system", "content": "sys"}, *MESSAGES], max_tokens=50, temperature=0
        )
        assert response.text == "Sure."
        assert response.source == "claude"
        assert response.finish_reason == "tool_calls"
        assert response.tool_calls == (ToolCall("toolu_1", "f", '{"a": 1}'),)
        assert response.usage == Usage(9, 4, 13)
        assert response.raw == body
        assert [a.outcome for a in response.attempts] == ["success"]
        request = transport.requests[0]
        assert request.url == "http://127.0.0.1:9/claude/messages"
        assert request.json["system"] == "sys"
        assert request.json["max_tokens"] == 50
        assert request.headers["x-api-key"] == "sk-test-claude-secret"
        assert (await backend.snapshot("chat")).in_flight == 0

    async def test_stream_on_an_anthropic_source_ends_cleanly_without_done(self) -> None:
        """A recorded stream, closed after message_stop with no [DONE], is one whole answer."""
        clock = FakeClock()
        recorder = Recorder()
        chat, transport, backend = make_chat(
            clock, [StreamScript(text_stream(["Hel", "lo"]), done=False)], emitter=recorder
        )
        async with chat.stream(MESSAGES) as stream:
            chunks = [c async for c in stream]
        assert "".join(c.text for c in chunks) == "Hello"
        assert [c.finish_reason for c in chunks] == [None, None, "stop"]
        assert chunks[-1].usage == Usage(12, 30, 42)
        assert {c.source for c in chunks} == {"claude"}
        assert recorder.outcomes() == ["success"]
        record = recorder.records[0]
        assert (record.prompt_tokens, record.completion_tokens) == (12, 30)
        body = transport.requests[0].json
        assert body["stream"] is True
        assert "stream_options" not in body
        assert (await backend.snapshot("chat")).in_flight == 0

    async def test_stream_of_tool_use_delivers_tool_call_deltas(self) -> None:
        """Tool-use blocks reach the caller as ToolCallDelta pieces, like an OpenAI stream's."""
        clock = FakeClock()
        chat, _, _ = make_chat(clock, [StreamScript(TOOL_STREAM, done=False)])
        chunks = [
            c
            async for c in chat.stream(
                MESSAGES, tools=[{"type": "function", "function": {"name": "f"}}]
            )
        ]
        deltas = [d for c in chunks for d in c.tool_calls]
        assert [(d.index, d.id, d.name) for d in deltas if d.id] == [
            (0, "toolu_01", "get_weather"),
            (1, "toolu_02", "get_time"),
        ]
        assert chunks[-1].finish_reason == "tool_calls"

    async def test_stream_role_frame_then_hang_fails_over_at_the_ttft(self) -> None:
        """message_start and an empty text block, then silence: cut at the TTFT, next source."""
        clock = FakeClock()
        recorder = Recorder()
        chat, transport, _ = make_chat(
            clock,
            {
                "claude": [StreamScript(text_stream(["x"])[:3], hang_after=3)],
                "gpt": [StreamScript(chat_chunk_events(["from gpt"]))],
            },
            {
                "name": "claude",
                "protocol": "anthropic",
                "ttft_timeout_s": 4,
                "stream_idle_timeout_s": 30,
            },
            {"name": "gpt", "priority": 1},
            emitter=recorder,
        )
        chunks = [c async for c in chat.stream(MESSAGES)]
        assert "".join(c.text for c in chunks) == "from gpt"
        assert transport.sources_called() == ["claude", "gpt"]
        assert recorder.records[0].latency_s == pytest.approx(4.0)

    async def test_overloaded_anthropic_source_fails_over_to_an_openai_source(self) -> None:
        """A 529 from the Anthropic source is transient: the OpenAI source of the scope answers."""
        clock = FakeClock()
        recorder = Recorder()
        openai_body = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "from gpt"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        }
        chat, transport, backend = make_chat(
            clock,
            {
                "claude": [
                    TransientError("HTTP 529 from claude: overloaded_error", status_code=529)
                ],
                "gpt": [openai_body],
            },
            {"name": "claude", "protocol": "anthropic"},
            {"name": "gpt", "priority": 1},
            emitter=recorder,
        )
        response = await chat.complete(MESSAGES)
        assert response.text == "from gpt"
        assert response.source == "gpt"
        assert [(a.source, a.outcome, a.status_code) for a in response.attempts] == [
            ("claude", "transient", 529),
            ("gpt", "success", None),
        ]
        claude, gpt = transport.requests
        assert claude.url.endswith("/claude/messages")
        assert claude.json["max_tokens"] == DEFAULT_MAX_TOKENS
        assert gpt.url.endswith("/gpt/chat/completions")
        assert "max_tokens" not in gpt.json
        assert "Authorization" in gpt.headers
        assert (await backend.snapshot("chat")).in_flight == 0

    async def test_in_band_overloaded_error_in_a_2xx_answer_fails_over(self) -> None:
        """An error object in a 2xx body is the same 529: the next source serves."""
        clock = FakeClock()
        chat, transport, _ = make_chat(
            clock,
            {
                "claude": [
                    {
                        "type": "error",
                        "error": {"type": "overloaded_error", "message": "Overloaded"},
                    }
                ],
                "claude2": [message_body()],
            },
            {"name": "claude", "protocol": "anthropic"},
            {"name": "claude2", "protocol": "anthropic", "priority": 1},
        )
        response = await chat.complete(MESSAGES)
        assert response.source == "claude2"
        assert response.attempts[0].status_code == 529
        assert transport.sources_called() == ["claude", "claude2"]

    async def test_message_the_api_cannot_carry_is_rejected_at_once(self) -> None:
        """A role the Messages API has no turn for raises RequestRejected, one source tried."""
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, [message_body()])
        with pytest.raises(RequestRejected, match="critic"):
            await chat.complete([{"role": "critic", "content": "x"}])
        assert transport.requests == []

    async def test_every_source_overloaded_exhausts_the_call(self) -> None:
        """529 from every Anthropic attempt ends like any other outage: AllSourcesExhausted."""
        clock = FakeClock()
        chat, _, _ = make_chat(clock, [TransientError(status_code=529)] * 3)
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES)
        assert caught.value.reason == "retry_exhausted"


# --- Over the real httpx transport (MockTransport: only the socket is replaced) ---


def _sse_body(events: list[dict[str, Any]]) -> bytes:
    """The bytes of an Anthropic event stream: a named event and its data, no [DONE]."""
    return b"".join(
        f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode() for event in events
    )


async def test_anthropic_stream_over_httpx_ends_at_the_connection_close() -> None:
    """Through HttpxTransport, a stream with no [DONE] is a success and sends Anthropic headers."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=_sse_body(text_stream(["Hi", " there"])),
        )

    settings = gateway_settings({"name": "claude", "protocol": "anthropic"})
    sources = settings.scope("chat").sources
    transport = HttpxTransport(
        sources, max_connections=2, mock_transport=httpx.MockTransport(handle)
    )
    recorder = Recorder()
    async with ChatClient(
        settings, transport=transport, backend=MemoryBackend(), emitter=recorder
    ) as chat:
        chunks = [c async for c in chat.stream(MESSAGES)]
    await transport.aclose()
    assert "".join(c.text for c in chunks) == "Hi there"
    assert chunks[-1].finish_reason == "stop"
    assert recorder.outcomes() == ["success"]
    headers = seen[0].headers
    assert headers["x-api-key"] == "sk-test-claude-secret"
    assert headers["anthropic-version"] == ANTHROPIC_VERSION
    assert "authorization" not in headers
    assert json.loads(seen[0].content)["stream"] is True


async def test_an_echoed_anthropic_key_never_reaches_an_error() -> None:
    """A 401 whose body echoes the x-api-key value: the call's error shows no trace of it."""
    secret = "sk-test-claude-secret"

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            401, json={"type": "error", "error": {"message": f"bad key {secret}"}}
        )

    settings = gateway_settings({"name": "claude", "protocol": "anthropic"}, max_attempts=1)
    transport = HttpxTransport(
        settings.scope("chat").sources,
        max_connections=2,
        mock_transport=httpx.MockTransport(handle),
    )
    async with ChatClient(settings, transport=transport, backend=MemoryBackend()) as chat:
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES, fail_fast=True)
    await transport.aclose()
    shown = [str(caught.value), repr(caught.value), *(str(a.error) for a in caught.value.attempts)]
    assert caught.value.attempts[0].status_code == 401
    assert all(secret not in text for text in shown)


def test_streamed_arguments_nested_past_the_parser_depth_are_kept_as_received() -> None:
    """Text that does not parse is returned as received, however deep its nesting."""
    from polygateway.transport.anthropic import streamed_arguments

    deep = "[" * 100_000
    assert streamed_arguments(deep) == deep
