"""A streamed chat answer put back together: the ``ParsedChat`` its chunks add up to.

Pure, no I/O, and protocol-blind: it reads the ``ChatChunk``s either wire's
reader made (``ChatChunkReader``, ``MessagesStreamReader``), so
``ChatStream.response()`` returns what ``complete()`` would have for the same
answer, whichever kind of source served:

- text: the chunks' text, joined; refusal: the chunks' refusal pieces
  (``delta.refusal``), joined, ``None`` when none came;
- tool calls: the ``ToolCallDelta`` pieces grouped by ``index``, in index
  order; a call's id, name and type are the first ones sent (OpenAI sends
  each once; servers that repeat them on every piece do not get them
  doubled), the type ``function`` when no piece names one,
  its arguments the pieces joined, then written by the protocol's
  ``arguments`` function (the Anthropic wire re-writes its partial JSON as a
  completion writes a tool input: ``streamed_arguments``);
- finish reason and usage: the last ones sent (usage counts are cumulative on
  every wire); ``Usage()`` when the provider sent none;
- one choice: a stream follows the first choice only.

``raw`` cannot be the provider's JSON (there is none for a whole stream): it
is a ``chat.completion`` object in OpenAI's shape built from the assembled
fields, the same shape whichever protocol served (no ``id``, ``model`` or
``created``, which chunks do not carry to the caller). Each call is written
where a completion holds it by its type: a custom tool's as ``custom``, a
legacy ``function_call`` as the message's ``function_call``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from polygateway.models import ChatChunk, Choice, ToolCall, Usage
from polygateway.transport.openai import ParsedChat

__all__ = ["assemble_chat"]


class _Call:
    """One tool call's pieces so far."""

    __slots__ = ("arguments", "id", "name", "type")

    def __init__(self) -> None:
        self.id = ""
        self.name = ""
        self.type = ""
        self.arguments: list[str] = []


def assemble_chat(
    chunks: Iterable[ChatChunk], *, arguments: Callable[[str], str] | None = None
) -> ParsedChat:
    """The answer ``chunks`` add up to (see the module docstring); ``raw`` is synthesized.

    Args:
        chunks: the chunks of one stream, in the order they came.
        arguments: writes a tool call's joined argument pieces as the
            protocol's completion would (``None``: as they came, as OpenAI's do).
    """
    texts: list[str] = []
    refusals: list[str] = []
    calls: dict[int, _Call] = {}
    finish: str | None = None
    usage: Usage | None = None
    for chunk in chunks:
        if chunk.text:
            texts.append(chunk.text)
        if chunk.refusal:
            refusals.append(chunk.refusal)
        for delta in chunk.tool_calls:
            call = calls.get(delta.index)
            if call is None:
                call = calls[delta.index] = _Call()
            if delta.id and not call.id:
                call.id = delta.id
            if delta.name and not call.name:
                call.name = delta.name
            if delta.type and not call.type:
                call.type = delta.type
            if delta.arguments:
                call.arguments.append(delta.arguments)
        if chunk.finish_reason is not None:
            finish = chunk.finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    text = "".join(texts)
    refusal = "".join(refusals) or None
    tool_calls = tuple(
        ToolCall(
            id=c.id,
            name=c.name,
            arguments=_written("".join(c.arguments), arguments),
            type=c.type or "function",
        )
        for _, c in sorted(calls.items())
    )
    counted = usage if usage is not None else Usage()
    return ParsedChat(
        text=text,
        finish_reason=finish,
        tool_calls=tool_calls,
        usage=counted,
        raw=_completion(text, tool_calls, finish, usage, refusal),
        choices=(Choice(0, text, tool_calls, finish, refusal),),
        refusal=refusal,
    )


def _written(joined: str, arguments: Callable[[str], str] | None) -> str:
    return joined if arguments is None else arguments(joined)


def _completion(
    text: str,
    tool_calls: tuple[ToolCall, ...],
    finish: str | None,
    usage: Usage | None,
    refusal: str | None,
) -> dict[str, Any]:
    """A ``chat.completion`` object in OpenAI's shape holding the assembled answer."""
    # OpenAI sends null content beside tool calls, or a refusal, when the model said nothing.
    content = (text or None) if tool_calls or refusal else text
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if refusal is not None:
        message["refusal"] = refusal
    written = [_written_call(call) for call in tool_calls if call.type != "function_call"]
    if written:
        message["tool_calls"] = written
    for call in tool_calls:
        if call.type == "function_call":
            message["function_call"] = {"name": call.name, "arguments": call.arguments}
    completion: dict[str, Any] = {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
    }
    if usage is not None:
        completion["usage"] = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        }
    return completion


def _written_call(call: ToolCall) -> dict[str, Any]:
    """One entry of a message's ``tool_calls``: a custom tool's input under ``custom``."""
    if call.type == "custom":
        return {
            "id": call.id,
            "type": "custom",
            "custom": {"name": call.name, "input": call.arguments},
        }
    return {
        "id": call.id,
        "type": call.type,
        "function": {"name": call.name, "arguments": call.arguments},
    }
