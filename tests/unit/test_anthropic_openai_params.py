"""OpenAI chat parameters on the Anthropic wire: what the Messages API cannot carry.

The Messages API refuses every field it does not define with a 400
("``seed``: Extra inputs are not permitted"), which ends the call as
``RequestRejected`` even in a scope whose OpenAI sources would serve it. The
wire treats the OpenAI parameters as Anthropic's own OpenAI compatibility
layer does (https://docs.anthropic.com/en/api/openai-sdk, "Request fields"):
those without a Messages API field are left out, ``temperature`` is capped at
1, ``n`` must be 1; and it sends ``metadata`` and ``service_tier`` only as far
as the Messages API defines them.
"""

from __future__ import annotations

from typing import Any

import pytest
from _anthropic_source import claude_source

from polygateway.testing import TransientError
from polygateway.transport.anthropic import _MAPPED, IGNORED_OPENAI_PARAMS, messages_request
from polygateway.transport.params import ANTHROPIC_MESSAGES_PARAMS, OPENAI_CHAT_PARAMS

MESSAGES = [{"role": "user", "content": "hello"}]

# A value of each OpenAI-only parameter as a caller would pass it.
SAMPLES: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "wav"},
    "frequency_penalty": 0.5,
    "logit_bias": {"50256": -100},
    "logprobs": True,
    "modalities": ["text"],
    "moderation": {"mode": "block"},
    "prediction": {"type": "content", "content": "hello"},
    "presence_penalty": -0.5,
    "prompt_cache_key": "tenant-7",
    "prompt_cache_options": {"ttl": "1h"},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "low",
    "response_format": {"type": "json_object"},
    "safety_identifier": "user-hash",
    "seed": 42,
    "store": True,
    "top_logprobs": 3,
    "verbosity": "low",
    "web_search_options": {},
}


def _body(**params: Any) -> dict[str, Any]:
    request = messages_request(claude_source(), MESSAGES, params, stream=False, timeout_s=30.0)
    body: dict[str, Any] = request.json
    return body


def test_every_openai_parameter_has_its_way_onto_the_anthropic_wire() -> None:
    """A parameter added to the OpenAI table must be placed: mapped, left out, or carried."""
    handled = {"temperature", "top_p", "n", "metadata", "service_tier"}
    placed = handled | _MAPPED | IGNORED_OPENAI_PARAMS
    assert set(OPENAI_CHAT_PARAMS) - placed == set()
    assert set(SAMPLES) == set(IGNORED_OPENAI_PARAMS)
    assert not IGNORED_OPENAI_PARAMS & set(ANTHROPIC_MESSAGES_PARAMS)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_an_openai_parameter_without_a_messages_field_is_left_out(name: str) -> None:
    body = _body(**{name: SAMPLES[name]}, max_tokens=50)
    assert name not in body
    assert body["max_tokens"] == 50
    assert body["messages"] == [{"role": "user", "content": "hello"}]


def test_all_of_them_at_once_leave_a_body_of_messages_api_fields() -> None:
    body = _body(**SAMPLES, temperature=0.4)
    assert set(body) == {"model", "max_tokens", "messages", "temperature"}


@pytest.mark.parametrize(("given", "sent"), [(0.0, 0.0), (0.7, 0.7), (1.0, 1.0), (1.5, 1), (2, 1)])
def test_temperature_is_capped_at_the_messages_api_maximum(given: float, sent: float) -> None:
    body = _body(temperature=given)
    assert body["temperature"] == sent


def test_one_choice_is_what_the_messages_api_answers() -> None:
    assert "n" not in _body(n=1)
    with pytest.raises(TransientError) as caught:
        _body(n=3)
    assert caught.value.failure == "request_rejected"
    assert "n must be 1" in str(caught.value)
    assert "sk-ant" not in str(caught.value)


def test_metadata_keeps_the_one_field_the_messages_api_defines() -> None:
    assert _body(metadata={"user_id": "u-1", "purpose": "eval"})["metadata"] == {"user_id": "u-1"}
    assert "metadata" not in _body(metadata={"purpose": "eval"})
    assert _body(metadata={"purpose": "eval"}, user="u-2")["metadata"] == {"user_id": "u-2"}


@pytest.mark.parametrize(
    ("tier", "kept"), [("auto", True), ("standard_only", True), ("flex", False)]
)
def test_service_tier_is_sent_only_as_a_messages_api_tier(tier: str, kept: bool) -> None:
    body = _body(service_tier=tier)
    assert ("service_tier" in body) is kept
    if kept:
        assert body["service_tier"] == tier


def test_messages_api_parameters_and_extra_body_still_pass_as_given() -> None:
    body = _body(top_k=5, top_p=0.9, thinking={"type": "enabled", "budget_tokens": 1024})
    assert (body["top_k"], body["top_p"]) == (5, 0.9)
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert _body(extra_body={"seed": 7, "temperature": 1.5})["seed"] == 7
    assert _body(extra_body={"temperature": 1.5})["temperature"] == 1.5
