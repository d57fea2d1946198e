"""Parameters and messages are checked before anything is sent; extra_body goes unchecked.

Every refusal raises ``RequestRejected`` naming the fault, and leaves no
request at the upstream and no permit held, through ``ChatClient``
(``complete`` and ``stream``) and ``EmbeddingClient``.
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.embedding import EmbeddingClient
from polygateway.errors import RequestRejected
from polygateway.testing import (
    BoundedSleep,
    FakeClock,
    FakeTransport,
    StreamScript,
    chat_chunk_events,
    chat_completion,
    embedding_body,
    gateway_settings,
)
from polygateway.testing.recording import CountingBackend
from polygateway.transport.params import OPENAI_CHAT_PARAMS, ChatCheck, Param

MESSAGES = [{"role": "user", "content": "hi"}]
ANTHROPIC = {"name": "claude", "protocol": "anthropic"}


def message_body() -> dict[str, Any]:
    """A Messages API answer."""
    return {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": [{"type": "text", "text": "ok"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 2},
    }


@asynccontextmanager
async def chat_client(
    *sources: Any, script: Sequence[Any] = ()
) -> AsyncIterator[tuple[ChatClient, FakeTransport, MemoryBackend]]:
    """A chat client on a fake clock (one OpenAI source unless told), closed at exit."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    transport = FakeTransport(script, clock=clock)
    async with ChatClient(
        gateway_settings(*(sources or ("primary",))),
        backend=backend,
        transport=transport,
        now=clock,
        sleep=BoundedSleep(clock),
        rng=random.Random(1),
    ) as chat:
        yield chat, transport, backend


@asynccontextmanager
async def embedding_client(
    script: Sequence[Any] = (),
) -> AsyncIterator[tuple[EmbeddingClient, FakeTransport, MemoryBackend]]:
    """An embedding client with one OpenAI source on a fake clock, closed at exit."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    transport = FakeTransport(script, clock=clock)
    async with EmbeddingClient(
        gateway_settings("emb", scope="embed", kind="embed"),
        backend=backend,
        transport=transport,
        now=clock,
        sleep=BoundedSleep(clock),
        rng=random.Random(1),
    ) as emb:
        yield emb, transport, backend


async def call(chat: ChatClient, how: str, messages: Any, **params: Any) -> None:
    """One call, plain or streamed to its end."""
    if how == "complete":
        await chat.complete(messages, **params)
        return
    async with chat.stream(messages, **params) as stream:
        _ = [chunk async for chunk in stream]


def answer(how: str) -> Any:
    """What the upstream plays for one call: a completion, or a stream of one chunk."""
    return chat_completion() if how == "complete" else StreamScript(chat_chunk_events(["x"]))


async def assert_chat_refused(
    messages: Any, params: dict[str, Any], *needles: str, how: str, sources: Sequence[Any] = ()
) -> RequestRejected:
    """The call raises RequestRejected naming every needle; nothing sent, no permit held."""
    async with chat_client(*sources, script=[answer(how)]) as (chat, transport, backend):
        with pytest.raises(RequestRejected) as caught:
            await call(chat, how, messages, **params)
        assert transport.requests == []
        assert (await backend.snapshot("chat")).in_flight == 0
    assert caught.value.scope == "chat"
    for needle in needles:
        assert needle in str(caught.value)
    return caught.value


BOTH = pytest.mark.parametrize("how", ["complete", "stream"])

PARAM_REFUSALS = [
    pytest.param(
        {"max_token": 5}, ["unknown parameter 'max_token' (did you mean 'max_tokens'?)"], id="typo"
    ),
    pytest.param({"temprature": 0.2}, ["did you mean 'temperature'?"], id="typo-2"),
    pytest.param({"frobnicate": 1}, ["'frobnicate'", "extra_body"], id="unknown-no-match"),
    pytest.param({"max_tokens": "lots"}, ["max_tokens must be an integer", "'lots'"], id="str"),
    pytest.param({"max_tokens": True}, ["max_tokens must be an integer"], id="bool-for-int"),
    pytest.param({"max_tokens": 1.5}, ["max_tokens must be an integer"], id="float-for-int"),
    pytest.param({"temperature": "0.2"}, ["temperature must be a number"], id="str-for-number"),
    pytest.param({"logprobs": 1}, ["logprobs must be a boolean"], id="int-for-bool"),
    pytest.param({"user": 42}, ["user must be a string"], id="int-for-str"),
    pytest.param({"tools": {"type": "function"}}, ["tools must be a list"], id="dict-for-list"),
    pytest.param({"response_format": "json"}, ["response_format must be an object"], id="str"),
    pytest.param({"stop": ["END", 3]}, ["stop must be a string or a list of strings"], id="stop"),
    pytest.param(
        {"reasoning_effort": "extreme"},
        ["reasoning_effort must be one of none, minimal, low", "'extreme'", "extra_body"],
        id="enum",
    ),
    pytest.param({"tool_choice": "any"}, ["tool_choice must be an object or one of"], id="choice"),
    pytest.param({"model": "gpt-5"}, ["'model'", "chosen per source in the settings"], id="model"),
    pytest.param({"top_k": 5}, ["'top_k'", "Anthropic", "extra_body"], id="messages-api-only"),
    pytest.param(
        {"system": "be brief"}, ["'system'", "{'role': 'system', ...} message"], id="system"
    ),
    pytest.param({"extra_body": [("top_k", 5)]}, ["extra_body must be an object"], id="extra"),
    pytest.param({"extra_body": "top_k=5"}, ["extra_body must be an object"], id="extra-str"),
    pytest.param(
        {"extra_body": {"model": "gpt-5"}}, ["extra_body cannot set 'model'"], id="extra-model"
    ),
    pytest.param(
        {"extra_body": {"messages": []}}, ["extra_body cannot set 'messages'"], id="extra-msgs"
    ),
    pytest.param({"max_tokens": 5, "stream_optoins": {}}, ["'stream_optoins'"], id="second-param"),
]


class TestParameters:
    """Unknown, mistyped and refused parameters never reach a provider."""

    @BOTH
    @pytest.mark.parametrize(("params", "needles"), PARAM_REFUSALS)
    async def test_bad_parameter_is_refused_before_any_permit(
        self, how: str, params: dict[str, Any], needles: list[str]
    ) -> None:
        """RequestRejected names the parameter (and the near name); nothing sent, no permit."""
        await assert_chat_refused(MESSAGES, params, *needles, how=how)

    async def test_stream_on_complete_points_to_stream(self) -> None:
        """complete(stream=True) is refused with a pointer to stream(), not silently dropped."""
        await assert_chat_refused(
            MESSAGES, {"stream": True}, "'stream'", "call stream()", how="complete"
        )

    async def test_stream_on_stream_is_refused(self) -> None:
        """stream(stream=...) is refused too: stream() always streams."""
        for value in (True, False):
            await assert_chat_refused(
                MESSAGES, {"stream": value}, "'stream'", "always streams", how="stream"
            )

    async def test_stream_options_on_complete_is_refused(self) -> None:
        """stream_options belong to a stream: complete() refuses them (OpenAI answers 400)."""
        await assert_chat_refused(
            MESSAGES, {"stream_options": {"include_usage": True}}, "stream_options", how="complete"
        )

    async def test_refused_at_the_call_not_at_iteration(self) -> None:
        """stream() raises as it is called: no stream object, no permit, nothing sent."""
        async with chat_client() as (chat, transport, backend):
            with pytest.raises(RequestRejected, match="max_tokens"):
                chat.stream(MESSAGES, max_tokens="lots")
            assert transport.requests == []
            assert (await backend.snapshot("chat")).in_flight == 0

    @BOTH
    async def test_parameters_of_the_api_are_sent_as_given(self, how: str) -> None:
        """Values of the right type pass, ints as numbers and None meaning unset included."""
        params: dict[str, Any] = {
            "max_tokens": 64,
            "temperature": 0,
            "top_p": 0.9,
            "stop": ["END"],
            "seed": 7,
            "logprobs": False,
            "tools": ({"type": "function", "function": {"name": "f"}},),
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "response_format": {"type": "json_object"},
            "reasoning_effort": "low",
            "user": "u-1",
            "metadata": None,
        }
        if how == "stream":
            params["stream_options"] = {"include_usage": True}
        async with chat_client(script=[answer(how)]) as (chat, transport, _):
            await call(chat, how, MESSAGES, **params)
            body = transport.requests[0].json
        assert body is not None
        for name, value in params.items():
            if value is None:
                assert name not in body
            else:
                assert body[name] == value

    async def test_every_name_in_the_table_is_accepted_with_a_value_of_its_type(self) -> None:
        """Each chat parameter of the table passes with a value it declares (the table is sound)."""
        check = ChatCheck(["openai"])
        # A parameter OpenAI takes only beside another one gets that one too.
        companions = {"function_call": {"functions": [{"name": "f"}]}}
        for name, param in OPENAI_CHAT_PARAMS.items():
            check.stream(MESSAGES, {name: sample(param), **companions.get(name, {})}, "chat")


def sample(param: Param) -> Any:
    """A value ``param`` accepts."""
    if param.choices:
        return param.choices[0]
    kind = param.types[0]
    if kind is list or kind is tuple:
        return ["x"]
    return {"bool": True, "int": 1, "float": 0.5, "str": "x", "dict": {}}[kind.__name__]


class TestAnthropicScopes:
    """A scope of Anthropic sources takes the Messages API's own parameters and blocks too."""

    async def test_messages_api_parameters_pass_in_an_all_anthropic_scope(self) -> None:
        """top_k and thinking reach an Anthropic body; a mixed scope refuses them."""
        async with chat_client(ANTHROPIC, script=[message_body()]) as (chat, transport, _):
            await chat.complete(MESSAGES, top_k=5, thinking={"type": "disabled"}, max_tokens=9)
            body = transport.requests[0].json
        assert body is not None
        assert (body["top_k"], body["thinking"], body["max_tokens"]) == (
            5,
            {"type": "disabled"},
            9,
        )
        await assert_chat_refused(
            MESSAGES, {"top_k": 5}, "'top_k'", how="complete", sources=[ANTHROPIC, "primary"]
        )

    async def test_several_choices_are_refused_before_any_permit_in_an_all_anthropic_scope(
        self,
    ) -> None:
        """The Messages API answers one choice: n > 1 there is refused, no permit asked for."""
        clock = FakeClock()
        backend = CountingBackend(MemoryBackend(now=clock))
        transport = FakeTransport([message_body()], clock=clock)
        settings = gateway_settings(ANTHROPIC, ANTHROPIC | {"name": "claude-2"})
        async with ChatClient(
            settings, backend=backend, transport=transport, now=clock, sleep=BoundedSleep(clock)
        ) as chat:
            with pytest.raises(RequestRejected, match="n must be 1") as caught:
                await chat.complete(MESSAGES, n=2)
            assert backend.calls.get("acquire", 0) == 0
            assert transport.requests == []
            assert caught.value.scope == "chat"
            await chat.complete(MESSAGES, n=1)
            assert backend.calls["acquire"] == 1

    async def test_anthropic_blocks_pass_only_in_an_all_anthropic_scope(self) -> None:
        """A Messages API image block is sent as given to Anthropic; refused where OpenAI serves."""
        block = {"type": "image", "source": {"type": "url", "url": "https://img.test/a.png"}}
        messages = [{"role": "user", "content": [{"type": "text", "text": "what?"}, block]}]
        async with chat_client(ANTHROPIC, script=[message_body()]) as (chat, transport, _):
            await chat.complete(messages)
            body = transport.requests[0].json
        assert body is not None
        assert body["messages"][0]["content"][1] == block
        await assert_chat_refused(
            messages,
            {},
            "messages[0].content[1].type: 'image' is not one of text, image_url",
            how="complete",
            sources=[ANTHROPIC, "primary"],
        )


EXTRA = {"top_k": 5, "chat_template_kwargs": {"enable_thinking": False}, "min_p": None}


class TestExtraBody:
    """extra_body fields are merged, unchecked and unchanged, into the top of the body."""

    @BOTH
    async def test_extra_body_reaches_an_openai_body_unchanged(self, how: str) -> None:
        """Every field arrives as given (a null included) and wins over a checked parameter."""
        params = {"max_tokens": 10, "extra_body": {**EXTRA, "max_tokens": 20}}
        async with chat_client(script=[answer(how)]) as (chat, transport, _):
            await call(chat, how, MESSAGES, **params)
            body = transport.requests[0].json
        assert body is not None
        assert {name: body[name] for name in EXTRA} == EXTRA
        assert body["max_tokens"] == 20
        assert "extra_body" not in body
        assert body["stream"] is (how == "stream")

    async def test_extra_body_reaches_an_anthropic_body_unchanged(self) -> None:
        """The Messages body gets the fields too, after the mapping, winning over its results."""
        params = {"max_tokens": 10, "extra_body": {**EXTRA, "max_tokens": 20, "system": "s"}}
        async with chat_client(ANTHROPIC, script=[message_body()]) as (chat, transport, _):
            await chat.complete([{"role": "system", "content": "x"}, *MESSAGES], **params)
            body = transport.requests[0].json
        assert body is not None
        assert {name: body[name] for name in EXTRA} == EXTRA
        assert (body["max_tokens"], body["system"]) == (20, "s")
        assert "extra_body" not in body

    async def test_extra_body_reaches_an_embeddings_body_unchanged(self) -> None:
        """An embedding request carries extra_body's fields at its top level, as given."""
        extra = {"input_type": "query", "truncate": "END", "dimensions": 3}
        script = [embedding_body([[0.1, 0.2, 0.3]])]
        async with embedding_client(script) as (emb, transport, _):
            await emb.embed(["a"], dimensions=8, extra_body=extra)
            body = transport.requests[0].json
        assert body is not None
        assert {name: body[name] for name in extra} == extra
        assert body["input"] == ["a"]
        assert "extra_body" not in body

    async def test_an_empty_or_null_extra_body_adds_nothing(self) -> None:
        """extra_body={} or None leaves the body as the checked parameters make it."""
        async with chat_client(script=[chat_completion()] * 3) as (chat, transport, _):
            await chat.complete(MESSAGES)
            await chat.complete(MESSAGES, extra_body={})
            await chat.complete(MESSAGES, extra_body=None)
        plain, empty, null = (request.json for request in transport.requests)
        assert plain == empty == null


MESSAGE_REFUSALS = [
    pytest.param(
        [{"role": "human", "text": "hi"}],
        "messages[0].role: 'human' is not one of system, developer, user, assistant, tool",
        id="role",
    ),
    pytest.param([{"content": "hi"}], "messages[0].role: missing", id="no-role"),
    pytest.param([{"role": "user", "text": "hi"}], "messages[0].text: not a key", id="key"),
    pytest.param(
        [*MESSAGES, {"role": "user", "content": "hi", "tool_call_id": "c"}],
        "messages[1].tool_call_id: not a key of a user message",
        id="key-of-another-role",
    ),
    pytest.param([{"role": "user"}], "messages[0].content: missing", id="no-content"),
    pytest.param(
        [{"role": "user", "content": None}], "messages[0].content: may be null only", id="null"
    ),
    pytest.param(
        [{"role": "assistant", "content": None}],
        "messages[0].content: may be null only in an assistant message with tool_calls",
        id="null-without-tool-calls",
    ),
    pytest.param(
        [{"role": "user", "content": {"type": "text", "text": "hi"}}],
        "messages[0].content: must be a string or a list of content parts",
        id="content-dict",
    ),
    pytest.param(
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}],
        "messages[0].content[1].type: 'image' is not one of text, image_url, input_audio, file",
        id="part-type",
    ),
    pytest.param(
        [{"role": "user", "content": [{"text": "a"}]}],
        "messages[0].content[0].type: None is not one of",
        id="part-without-type",
    ),
    pytest.param(
        [{"role": "user", "content": [{"type": "text", "content": "a"}]}],
        "messages[0].content[0].text: must be a string",
        id="text-part-without-text",
    ),
    pytest.param(
        [{"role": "user", "content": [{"type": "image_url", "image_url": "https://x/a.png"}]}],
        "messages[0].content[0].image_url: must be an object",
        id="image-url-as-string",
    ),
    pytest.param(
        [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}],
        "messages[0].content[0].input_audio.format",
        id="audio-format",
    ),
    pytest.param(
        [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
        "messages[0].content[0].type: 'image_url' is not one of text",
        id="system-takes-text-only",
    ),
    pytest.param(
        [{"role": "assistant", "content": [{"type": "file", "file": {}}]}],
        "messages[0].content[0].type: 'file' is not one of text, refusal",
        id="assistant-parts",
    ),
    pytest.param(
        [{"role": "tool", "content": "18 C"}],
        "messages[0].tool_call_id: missing",
        id="tool-without-tool-call-id",
    ),
    pytest.param(
        [{"role": "tool", "content": "18 C", "tool_call_id": ""}],
        "messages[0].tool_call_id: must be a non-empty string",
        id="tool-empty-id",
    ),
    pytest.param(
        [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}],
        "messages[0].tool_calls[0].id",
        id="tool-call-without-id",
    ),
    pytest.param(
        [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}],
        "messages[0].tool_calls[0].type: None is not one of function, custom",
        id="tool-call-without-type",
    ),
    pytest.param(
        [
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
                ],
            }
        ],
        "messages[0].tool_calls[0].function.arguments: must be a string (JSON text)",
        id="arguments-as-object",
    ),
    pytest.param(
        [{"role": "assistant", "content": "x", "tool_calls": {"id": "c"}}],
        "messages[0].tool_calls: must be a list",
        id="tool-calls-not-a-list",
    ),
    pytest.param(
        [{"role": "user", "content": "hi", "name": 5}], "messages[0].name: must be a string", id="n"
    ),
    pytest.param([{"role": "function", "content": "x"}], "messages[0].name", id="function-name"),
    pytest.param(["hi"], "messages[0]: must be an object", id="not-an-object"),
    pytest.param("hi", "messages must be a list", id="a-string"),
    pytest.param([], "messages must not be empty", id="empty"),
]


class TestMessages:
    """Messages are checked against the roles and content shapes of the chat API."""

    @BOTH
    @pytest.mark.parametrize(("messages", "needle"), MESSAGE_REFUSALS)
    async def test_bad_message_is_refused_naming_index_and_field(
        self, how: str, messages: Any, needle: str
    ) -> None:
        """RequestRejected names the first bad message's index and field; nothing sent."""
        await assert_chat_refused(messages, {}, needle, how=how)

    async def test_every_role_and_content_shape_of_the_api_is_sent_as_given(self) -> None:
        """A conversation using each role and part type passes and is sent unchanged."""
        call_ = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        messages: list[dict[str, Any]] = [
            {"role": "developer", "content": "be brief", "name": "ops"},
            {"role": "system", "content": [{"type": "text", "text": "sys"}]},
            {
                "role": "user",
                "name": "ann",
                "content": [
                    {"type": "text", "text": "see", "cache_control": {"type": "ephemeral"}},
                    {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}},
                    {"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}},
                    {"type": "file", "file": {"file_id": "file-1"}},
                ],
            },
            {"role": "assistant", "content": None, "tool_calls": [call_]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            {"role": "assistant", "content": "ok", "refusal": None, "name": "bot"},
            {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": ""}},
            {"role": "function", "name": "f", "content": None},
            {"role": "user", "content": "and?"},
        ]
        async with chat_client(script=[chat_completion()]) as (chat, transport, _):
            await chat.complete(messages)
            body = transport.requests[0].json
        assert body is not None
        assert body["messages"] == messages


class TestEmbeddingParameters:
    """embed() parameters are checked like chat's: nothing sent, no permit held."""

    @pytest.mark.parametrize(
        ("params", "needles"),
        [
            pytest.param(
                {"dimensionz": 3},
                ["unknown parameter 'dimensionz' (did you mean 'dimensions'?)"],
                id="typo",
            ),
            pytest.param({"dimensions": "3"}, ["dimensions must be an integer"], id="str"),
            pytest.param({"dimensions": math.pi}, ["dimensions must be an integer"], id="float"),
            pytest.param({"user": ["u"]}, ["user must be a string"], id="list-for-str"),
            pytest.param({"encoding_format": ["float"]}, ["encoding_format"], id="format"),
            pytest.param({"encoding_format": "base64"}, ["encoding_format"], id="base64"),
            pytest.param({"model": "text-embedding-3-large"}, ["'model'", "per source"], id="m"),
            pytest.param({"input": ["a"]}, ["'input'"], id="input"),
            pytest.param({"max_tokens": 5}, ["unknown parameter 'max_tokens'"], id="chat-param"),
            pytest.param({"extra_body": 3}, ["extra_body must be an object"], id="extra"),
            pytest.param(
                {"extra_body": {"input": ["b"]}}, ["extra_body cannot set 'input'"], id="extra-in"
            ),
        ],
    )
    async def test_bad_parameter_is_refused_before_any_permit(
        self, params: dict[str, Any], needles: list[str]
    ) -> None:
        """RequestRejected names the parameter; no request reaches the upstream, no permit."""
        async with embedding_client([embedding_body([[0.1]])]) as (emb, transport, backend):
            with pytest.raises(RequestRejected) as caught:
                await emb.embed(["a"], **params)
            assert transport.requests == []
            assert (await backend.snapshot("embed")).in_flight == 0
        assert caught.value.scope == "embed"
        for needle in needles:
            assert needle in str(caught.value)

    async def test_parameters_of_the_api_are_sent_as_given(self) -> None:
        """dimensions, encoding_format="float" and user reach the body."""
        params = {"dimensions": 2, "encoding_format": "float", "user": "u-1"}
        async with embedding_client([embedding_body([[0.1, 0.2]])]) as (emb, transport, _):
            await emb.embed(["a"], **params)
            body = transport.requests[0].json
        assert body is not None
        assert {name: body[name] for name in params} == params


async def test_stream_refuses_more_than_one_choice() -> None:
    """A stream is read as one answer: n > 1 is refused before anything is sent."""
    async with chat_client() as (chat, transport, backend):
        with pytest.raises(RequestRejected, match="n must be 1"):
            chat.stream(MESSAGES, n=2)
        assert transport.requests == []
        assert (await backend.snapshot("chat")).in_flight == 0


async def test_stream_refuses_response_model_with_the_way_round() -> None:
    """response_model belongs to complete(); the error says how to parse a stream's answer."""
    async with chat_client() as (chat, transport, _):
        with pytest.raises(RequestRejected, match=r"stream\.response\(\)"):
            chat.stream(MESSAGES, response_model=dict)
        assert transport.requests == []
