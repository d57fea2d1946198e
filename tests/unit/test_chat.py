"""ChatClient.complete: the answer it builds, the input it refuses, what it sends, and the
secrets it never shows."""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any

import pytest
from _chat_clients import chat_on_clock

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import AllSourcesExhausted, ConfigError, RequestRejected
from polygateway.middleware.telemetry import LoggingEmitter
from polygateway.models import ToolCall
from polygateway.testing import (
    FakeClock,
    FakeTransport,
    TransientError,
    chat_completion,
    gateway_settings,
)

MESSAGES = [{"role": "user", "content": "hi"}]
SECRET = "sk-test-primary-secret"


def make_chat(
    clock: FakeClock, script: Any = (), *, emitter: Any = None, **source: Any
) -> tuple[ChatClient, FakeTransport, MemoryBackend]:
    """A chat client with one source ("primary", API key SECRET) on a fake clock."""
    settings = gateway_settings({"name": "primary", **source})
    backend = MemoryBackend(now=clock)
    transport = FakeTransport(script, clock=clock)
    chat = chat_on_clock(settings, backend, transport, clock, seed=2, emitter=emitter)
    return chat, transport, backend


class TestAnswer:
    """complete() turns the provider's JSON into a ChatResponse."""

    async def test_response_carries_text_source_usage_attempts_and_raw(self) -> None:
        """Every field of ChatResponse is filled from the answer and the loop."""
        clock = FakeClock()
        body = chat_completion("hello", prompt_tokens=9, completion_tokens=3)
        chat, _, _ = make_chat(clock, [body])
        response = await chat.complete(MESSAGES)
        assert response.text == "hello"
        assert response.source == "primary"
        assert response.finish_reason == "stop"
        assert response.tool_calls == ()
        assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (9, 3)
        assert response.raw == body
        assert [a.outcome for a in response.attempts] == ["success"]
        assert response.attempts[0].prompt_tokens == 9

    async def test_tool_calls_are_parsed(self) -> None:
        """Tool calls of the answer come back as ToolCall records."""
        clock = FakeClock()
        body = chat_completion(
            "",
            finish_reason="tool_calls",
            tool_calls=[{"id": "c1", "name": "lookup", "arguments": '{"q": 1}'}],
        )
        chat, _, _ = make_chat(clock, [body])
        response = await chat.complete(MESSAGES, tools=[{"type": "function"}])
        assert response.finish_reason == "tool_calls"
        assert response.tool_calls == (ToolCall(id="c1", name="lookup", arguments='{"q": 1}'),)

    async def test_params_and_model_reach_the_request(self) -> None:
        """Caller params pass through; the model and the effective timeout come from the source."""
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, [chat_completion()], model="m-1", timeout_s=12)
        await chat.complete(MESSAGES, max_tokens=64, temperature=0.5)
        request = transport.requests[0]
        assert request.json["model"] == "m-1"
        assert request.json["max_tokens"] == 64
        assert request.json["temperature"] == 0.5
        assert request.json["stream"] is False
        assert request.timeout_s == 12

    async def test_malformed_answer_is_a_transient_failure(self) -> None:
        """A 200 whose body is not a chat completion is retried like any transient failure."""
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, [{"unexpected": True}, chat_completion("fine")])
        response = await chat.complete(MESSAGES)
        assert response.text == "fine"
        assert [a.outcome for a in response.attempts] == ["transient", "success"]
        assert len(transport.requests) == 2

    async def test_real_usage_reconciles_the_tpm_reservation(self) -> None:
        """The release reports the tokens really used, so the tpm bucket gets the rest back."""
        clock = FakeClock()
        chat, _, backend = make_chat(
            clock, [chat_completion(prompt_tokens=5, completion_tokens=2)], tpm=6000
        )
        await chat.complete(MESSAGES, max_tokens=20)  # reserves 1 + 20 tokens
        snap = (await backend.snapshot("chat")).source("primary")
        assert snap is not None
        assert snap.tpm_tokens == pytest.approx(100 - 7)  # capacity 100, 7 really used


class TestInput:
    """Bad input is refused before any request is sent."""

    @pytest.mark.parametrize(
        "messages",
        [
            [],
            "hello",
            [{"content": "no role"}],
            ["not a dict"],
            [{"role": "", "content": "empty role"}],
            [{"role": "user", "content": "fine"}, {"content": "second has no role"}],
            [{"role": "user", "content": "fine"}, {"role": 5, "content": "role not text"}],
            None,
        ],
    )
    async def test_invalid_messages_raise_request_rejected(self, messages: Any) -> None:
        """Messages must be a non-empty list of dicts with a role."""
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, [chat_completion()])
        with pytest.raises(RequestRejected) as caught:
            await chat.complete(messages)
        assert caught.value.scope == "chat"
        assert transport.requests == []

    async def test_messages_as_a_tuple_of_mappings_are_sent_as_dicts(self) -> None:
        """Any sequence of mappings with roles is accepted and sent as a list of plain dicts."""
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, [chat_completion()])
        await chat.complete((MappingProxyType({"role": "user", "content": "hi"}),))
        assert transport.requests[0].json["messages"] == [{"role": "user", "content": "hi"}]

    def test_scope_of_another_kind_is_a_config_error(self) -> None:
        """A ChatClient on an embed scope fails at construction, naming the field."""
        settings = gateway_settings("e", scope="embed", kind="embed")
        with pytest.raises(ConfigError) as caught:
            ChatClient(settings, "embed", transport=FakeTransport())
        assert caught.value.field == "scopes.embed.kind"

    def test_unknown_scope_is_a_config_error(self) -> None:
        """Naming a scope the settings do not have fails at construction."""
        with pytest.raises(ConfigError):
            ChatClient(gateway_settings("a"), "nope", transport=FakeTransport())


class TestSecrets:
    """No API key in errors, logs, records or reprs."""

    async def test_key_echoed_by_the_upstream_is_scrubbed_everywhere(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Even an upstream message quoting the key leaves no trace of it."""
        clock = FakeClock()
        echo = f"invalid key {SECRET} for this model"
        chat, transport, _ = make_chat(
            clock,
            [TransientError(echo, status_code=503)] * 3 + [TransientError(echo, status_code=400)],
            emitter=LoggingEmitter(),
        )
        with caplog.at_level(logging.DEBUG, logger="polygateway"):
            with pytest.raises(AllSourcesExhausted) as exhausted:
                await chat.complete(MESSAGES)
            with pytest.raises(RequestRejected) as rejected:
                await chat.complete(MESSAGES)
        shown = [
            str(exhausted.value),
            repr(exhausted.value),
            str(rejected.value),
            repr(rejected.value),
            repr(exhausted.value.attempts),
            caplog.text,
            repr(chat),
            repr(transport.requests),
            repr(chat.backend),
        ]
        assert "invalid key" in caplog.text  # the message itself is kept, minus the key
        for text in shown:
            assert SECRET not in text
        assert transport.requests[0].headers["Authorization"] == f"Bearer {SECRET}"
