"""Builders of provider bodies and of a one-scope configuration, for scripts and tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import SecretStr

from polygateway.config import GatewaySettings, ScopeConfig, ScopeKind, SourceConfig

__all__ = [
    "anthropic_message",
    "chat_chunk_events",
    "chat_completion",
    "embedding_body",
    "gateway_settings",
]


def chat_completion(
    text: str = "ok",
    *,
    finish_reason: str | None = "stop",
    tool_calls: Sequence[Mapping[str, str]] | None = None,
    prompt_tokens: int = 5,
    completion_tokens: int = 2,
    model: str = "fake-model",
) -> dict[str, Any]:
    """An OpenAI chat completion body; ``tool_calls`` items are ``{"id", "name", "arguments"}``."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = [
            {
                "id": call.get("id", f"call_{i}"),
                "type": "function",
                "function": {"name": call["name"], "arguments": call.get("arguments", "{}")},
            }
            for i, call in enumerate(tool_calls)
        ]
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def anthropic_message(
    text: str = "ok",
    *,
    model: str = "claude-x",
    stop_reason: str = "end_turn",
    input_tokens: int = 11,
    output_tokens: int = 4,
) -> dict[str, Any]:
    """An Anthropic Messages API answer: one text block, its stop reason and usage."""
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }


def _chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def chat_chunk_events(
    texts: Sequence[str],
    finish_reason: str | None = "stop",
    *,
    usage: tuple[int, int] | None = None,
    role_first: bool = True,
    tool_calls: Sequence[Mapping[str, str]] | None = None,
) -> list[dict[str, Any]]:
    """The ``data:`` events of a streamed answer: a role chunk, one per text, a finish chunk.

    ``usage=(prompt, completion)`` adds the usage-only chunk ``include_usage``
    asks for; ``finish_reason=None`` leaves the finish chunk out.
    ``tool_calls`` (items ``{"id", "name", "arguments"}``, as for
    ``chat_completion``) follow the texts as OpenAI streams them: a chunk
    naming each call (index, id, name, empty arguments), then its arguments
    in two pieces.
    """
    events = [_chunk({"role": "assistant", "content": ""})] if role_first else []
    events += [_chunk({"content": t}) for t in texts]
    for i, call in enumerate(tool_calls or ()):
        head = {
            "index": i,
            "id": call.get("id", f"call_{i}"),
            "type": "function",
            "function": {"name": call["name"], "arguments": ""},
        }
        events.append(_chunk({"tool_calls": [head]}))
        arguments = call.get("arguments", "{}")
        half = len(arguments) // 2
        for piece in (arguments[:half], arguments[half:]):
            events.append(_chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}))
    if finish_reason is not None:
        events.append(_chunk({}, finish_reason))
    if usage is not None:
        prompt, completion = usage
        events.append(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                },
            }
        )
    return events


def embedding_body(
    vectors: Sequence[Sequence[float]], *, prompt_tokens: int | None = None
) -> dict[str, Any]:
    """An OpenAI embeddings body with ``vectors`` in input order."""
    tokens = prompt_tokens if prompt_tokens is not None else len(vectors)
    return {
        "object": "list",
        "model": "fake-embedding",
        "data": [
            {"object": "embedding", "index": i, "embedding": list(v)} for i, v in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


_PROTOCOL_OF_KIND = {"chat": "openai", "embed": "openai", "ocr": "monkey_ocr"}


def gateway_settings(
    *sources: str | Mapping[str, Any],
    scope: str = "chat",
    kind: ScopeKind = "chat",
    **gateway: Any,
) -> GatewaySettings:
    """Settings with one scope, built in code; ``.env`` is not read.

    Each source is a name, or a mapping of ``SourceConfig`` fields with a
    ``name``. Defaults: protocol by kind, ``base_url http://127.0.0.1:9/<name>``,
    model ``fake-model`` and a fake API key (``sk-test-<name>-secret``), so a
    test can check that it never shows. ``gateway`` sets gateway fields.
    """
    built = []
    for spec in sources or ("primary",):
        fields: dict[str, Any] = {"name": spec} if isinstance(spec, str) else dict(spec)
        name = fields["name"]
        fields.setdefault("protocol", _PROTOCOL_OF_KIND[kind])
        fields.setdefault("base_url", f"http://127.0.0.1:9/{name}")
        fields.setdefault("model", "fake-model")
        if "api_key_env" not in fields:
            fields.setdefault("api_key", SecretStr(f"sk-test-{name}-secret"))
        elif isinstance(fields.get("api_key"), str):
            fields["api_key"] = SecretStr(fields["api_key"])
        built.append(SourceConfig(**fields))
    return GatewaySettings(
        _env_file=None, scopes={scope: ScopeConfig(kind=kind, sources=tuple(built))}, **gateway
    )
