"""The OpenAI-compatible wire format: chat completions (plain and streamed) and embeddings.

Pure functions, no I/O: build the ``HttpRequest`` of a call, and read the
provider's JSON back into PolyGateway's types. Covers OpenAI itself and the
servers that copy its API (vLLM, Ollama, DeepSeek, Qwen compatible mode), so
the readers accept the harmless variations seen among them (content as a list
of parts, tool-call arguments as an object, chunks without ``index``) and
reject everything else as a malformed body.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from polygateway.models import (
    ChatChunk,
    Choice,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from polygateway.transport.http import HintSink, HttpRequest, TransientError, excerpt
from polygateway.transport.wire import (
    add_headers,
    json_target,
    malformed_body,
    opt_int,
    opt_str,
    req_list,
    req_obj,
    req_str,
    response_model,
)

if TYPE_CHECKING:
    from polygateway.config import SourceConfig

__all__ = [
    "DEFAULT_MAX_TOKENS_ESTIMATE",
    "IMAGE_PART_TOKENS",
    "ChatChunkReader",
    "ParsedChat",
    "chat_request",
    "chunk_has_content",
    "embedding_request",
    "estimate_chat_tokens",
    "estimate_embedding_tokens",
    "parse_chat_chunk",
    "parse_chat_response",
    "parse_embedding_response",
]

DEFAULT_MAX_TOKENS_ESTIMATE = 256
"""Completion tokens reserved for tpm when the caller set no ``max_tokens``."""

IMAGE_PART_TOKENS = 765
"""Prompt tokens reserved per image part: OpenAI's price of a 1024x1024 high-detail image.

An image sent inline is a long base64 data URL; counting its characters
would reserve thousands of tokens the provider never charges.
"""

_CHARS_PER_TOKEN = 4
_RESERVED = frozenset({"model", "messages", "input", "stream", "extra_body"})


@dataclass(slots=True)
class ParsedChat:
    """A chat completion as read off the wire; the client adds source and attempts.

    Slotted but not frozen: it lives for one call, and a frozen dataclass
    pays an ``object.__setattr__`` per field on every call.
    """

    text: str
    finish_reason: str | None
    tool_calls: tuple[ToolCall, ...]
    usage: Usage
    raw: dict[str, Any] = field(repr=False)
    choices: tuple[Choice, ...] = ()
    """Every choice; the fields above are those of the first (``n > 1`` asks for more)."""
    refusal: str | None = None
    """The first choice's refusal message, ``None`` when the model answered."""

    def response_model(self) -> str | None:
        """The model the answer names (``model``), for telemetry; ``None`` when it names none."""
        return response_model(self.raw)

    def finish_reasons(self) -> tuple[str, ...]:
        """The finish reason of each choice that has one, for telemetry."""
        choices = self.choices
        if len(choices) == 1:  # the common answer, without a generator
            reason = choices[0].finish_reason
            return (reason,) if reason else ()
        if not choices:
            return (self.finish_reason,) if self.finish_reason else ()
        return tuple(c.finish_reason for c in choices if c.finish_reason)


def _passthrough(params: Mapping[str, Any]) -> dict[str, Any]:
    """Caller parameters for the body; ``None`` means unset, and ours cannot be overridden.

    ``extra_body`` is not one of them: its fields are merged in last (``_with_extra``).
    """
    return {k: v for k, v in params.items() if v is not None and k not in _RESERVED}


def _with_extra(body: dict[str, Any], params: Mapping[str, Any]) -> None:
    """Merge the caller's ``extra_body`` into the top level of ``body``, as the openai SDK does.

    Last and shallow, so its fields win over the checked parameters of the
    same name; a ``None`` in it is sent as JSON null, as given.
    """
    extra = params.get("extra_body")
    if extra:
        body.update(extra)


def chat_request(
    source: SourceConfig,
    messages: Sequence[Mapping[str, Any]],
    params: Mapping[str, Any],
    *,
    stream: bool,
    timeout_s: float,
    ttft_timeout_s: float | None = None,
    idle_timeout_s: float | None = None,
    on_hint: HintSink | None = None,
    extra_headers: Mapping[str, str] | None = None,
) -> HttpRequest:
    """The request of one chat completion to ``source``.

    ``params`` (max_tokens, temperature, tools, tool_choice, response_format,
    ...) pass through as given, and the fields of ``extra_body`` are merged
    into the top level last, winning over any of the same name. A stream
    asks for usage in its last chunk and carries the TTFT timeout as its
    ``timeout_s`` and the idle timeout separately; each defaults to
    ``timeout_s``. Its TTFT runs to the first chunk with content
    (``chunk_has_content``). ``extra_headers`` (trace context) are added
    where the request has no header of the name (``wire.add_headers``).
    """
    body: dict[str, Any] = _passthrough(params) if params else {}
    body["model"] = source.model
    body["messages"] = [dict(m) for m in messages]
    body["stream"] = stream
    if stream:
        options = dict(body.get("stream_options") or {})
        options.setdefault("include_usage", True)
        body["stream_options"] = options
    if params:
        _with_extra(body, params)
    url, headers = json_target(source, "chat/completions")
    if extra_headers:
        add_headers(headers, extra_headers)
    return HttpRequest(
        source.name,
        url,
        (ttft_timeout_s or timeout_s) if stream else timeout_s,  # timeout_s
        headers=headers,
        json=body,
        idle_timeout_s=(idle_timeout_s or timeout_s) if stream else None,
        connect_timeout_s=source.connect_timeout_s,
        is_content=chunk_has_content if stream else None,
        on_hint=on_hint,
    )


def chunk_has_content(event: Any) -> bool:
    """Whether a streamed chunk ends the TTFT: it carries content, not just a preamble.

    Content is any delta field but ``role`` holding data (text, tool-call
    pieces, a refusal, a legacy ``function_call``, ``reasoning_content``, or
    whatever field a server adds), or a ``finish_reason``. A role-only or
    empty delta and the usage-only chunk of ``include_usage`` are not. An
    ``{"error": ...}`` event, or one that is not an object, counts, so that its
    failure surfaces at once rather than at the TTFT. Called on the first
    chunks of a stream only, until one holds; never raises.
    """
    if type(event) is not dict or event.get("error") is not None:
        return True
    choices = event.get("choices")
    if type(choices) is not list:
        # Not a chunk: the reader names the fault at once.
        return True
    for choice in choices:
        if type(choice) is not dict or choice.get("finish_reason"):
            return True
        delta = choice.get("delta")
        if type(delta) is not dict:
            if delta is not None:
                return True
            continue
        for name, value in delta.items():
            # Empty strings, empty lists and nulls are the padding of a preamble chunk.
            if value and name != "role":
                return True
    return False


def _content_text(value: Any, what: str) -> str:
    """Message content as text: a string, null, or a list of parts whose text parts are joined."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    parts = req_list(value, what)
    texts = []
    for i, part in enumerate(parts):
        part = req_obj(part, f"{what}[{i}]")
        if part.get("type", "text") == "text":
            texts.append(req_str(part.get("text", ""), f"{what}[{i}].text"))
    return "".join(texts)


def _arguments(value: Any, what: str) -> str:
    """Tool-call arguments as the JSON text OpenAI sends (Ollama sends an object)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    raise malformed_body(f"{what} is neither a string nor an object")


def _usage(value: Any) -> Usage:
    """Token counts; ``total_tokens`` defaults to the sum when the provider omits it."""
    usage = req_obj(value, "usage")
    prompt = opt_int(usage.get("prompt_tokens"), "usage.prompt_tokens")
    completion = opt_int(usage.get("completion_tokens"), "usage.completion_tokens")
    total = opt_int(usage.get("total_tokens"), "usage.total_tokens") or prompt + completion
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=total)


def _error_event(body: dict[str, Any]) -> TransientError | None:
    """The failure an in-band ``{"error": ...}`` object reports, if the body is one."""
    error = body.get("error")
    if error is None:
        return None
    message = error.get("message") if isinstance(error, dict) else error
    return TransientError(f"provider error: {excerpt(str(message))}", failure="transient")


def _choices(body: dict[str, Any]) -> list[Any]:
    """The ``choices`` array: a completion reads each choice, a chunk its first only."""
    return req_list(body.get("choices"), "choices")


def _plain_usage(value: Any) -> Usage | None:
    """``usage`` in its common form (counts absent or plain ints), else ``None``: walk it."""
    if type(value) is not dict:
        return None
    prompt = value.get("prompt_tokens", 0)
    completion = value.get("completion_tokens", 0)
    total = value.get("total_tokens", 0)
    if prompt is None:
        prompt = 0
    if completion is None:
        completion = 0
    if total is None:
        total = 0
    if (
        type(prompt) is not int
        or type(completion) is not int
        or type(total) is not int
        or prompt < 0
        or completion < 0
        or total < 0
    ):
        return None
    return Usage(prompt, completion, total or prompt + completion)


def parse_chat_response(body: Any) -> ParsedChat:
    """Read a chat completion; any shape but the promised one is a malformed body.

    A refusal (``message.refusal``) is read as the answer's ``refusal``, a
    served answer like any other, with the text (null content) empty.

    The common completion (one choice, text, no tool calls nor refusal) is read directly
    here. Every check is exact (``type(x) is dict``), so whatever it accepts
    the generic walk (``_walk_chat_response``) reads to the same result;
    anything else, odd or wrong or ``n > 1``, goes to the walk, which accepts
    the variations or names the fault. An empty ``finish_reason`` is none, as
    in a streamed chunk (``parse_chat_chunk``). A speed trick kept for the target
    "memory backend on aiohttp, c1: <= 1.3x raw aiohttp" (research-wiki/designs/speed-tricks.md).
    """
    if type(body) is not dict or body.get("error") is not None:
        return _walk_chat_response(body)
    choices = body.get("choices")
    if type(choices) is not list or len(choices) != 1:
        return _walk_chat_response(body)
    choice = choices[0]
    if type(choice) is not dict:
        return _walk_chat_response(body)
    index = choice.get("index", 0)
    if type(index) is not int:
        return _walk_chat_response(body)
    message = choice.get("message")
    # OpenAI sends "refusal": null in every message: only a refusal takes the walk.
    if (
        type(message) is not dict
        or message.get("tool_calls")
        or message.get("refusal") is not None
        or message.get("function_call")
    ):
        return _walk_chat_response(body)
    content = message.get("content")
    finish = choice.get("finish_reason")
    if (content is not None and type(content) is not str) or (
        finish is not None and type(finish) is not str
    ):
        return _walk_chat_response(body)
    raw_usage = body.get("usage")
    usage = Usage() if raw_usage is None else _plain_usage(raw_usage)
    if usage is None:
        return _walk_chat_response(body)
    text = content or ""
    finish = finish or None
    return ParsedChat(text, finish, (), usage, body, (Choice(index, text, (), finish),))


def _walk_chat_response(body: Any) -> ParsedChat:
    """``parse_chat_response`` field by field: every variation accepted, every fault named."""
    answer = req_obj(body, "body")
    if (error := _error_event(answer)) is not None:
        raise error
    choices = _choices(answer)
    if not choices:
        raise malformed_body("choices is empty")
    read = tuple(_walk_choice(raw_choice, i) for i, raw_choice in enumerate(choices))
    first = read[0]
    usage = _usage(answer["usage"]) if answer.get("usage") is not None else Usage()
    return ParsedChat(
        text=first.text,
        finish_reason=first.finish_reason,
        tool_calls=first.tool_calls,
        usage=usage,
        raw=answer,
        choices=read,
        refusal=first.refusal,
    )


def _walk_choice(raw_choice: Any, i: int) -> Choice:
    """Choice ``i`` of a completion; its faults are named as ``choices[i]...``.

    The first choice's message fields keep their short names (``message.content``).
    ``index`` is the one sent, or the position when none is sent as an integer.
    A legacy ``function_call`` (the answer to a request's ``functions``) is
    read as a tool call of type ``function_call``, after any tool calls.
    """
    choice = req_obj(raw_choice, f"choices[{i}]")
    message = req_obj(choice.get("message"), f"choices[{i}].message")
    where = "message" if i == 0 else f"choices[{i}].message"
    text = _content_text(message.get("content"), f"{where}.content")
    calls = [
        _tool_call(raw_call, f"{where}.tool_calls[{j}]")
        for j, raw_call in enumerate(
            req_list(message.get("tool_calls") or [], f"{where}.tool_calls")
        )
    ]
    if message.get("function_call"):
        calls.append(_function_call(message["function_call"], f"{where}.function_call"))
    index = choice.get("index")
    if type(index) is not int:
        # Never read before n > 1 was: a server that numbers its choices oddly is not faulted.
        index = i
    return Choice(
        index=index,
        text=text,
        tool_calls=tuple(calls),
        finish_reason=opt_str(choice.get("finish_reason"), f"choices[{i}].finish_reason") or None,
        refusal=_refusal(message.get("refusal")),
    )


def _refusal(value: Any) -> str | None:
    """A message's (or delta's) ``refusal``: the text, or ``None`` when null, empty or not text.

    Lenient, unlike the other fields: an odd value from a compatible server
    must not fail an answer whose content is whole.
    """
    return value if type(value) is str and value else None


def _tool_call(raw_call: Any, what: str) -> ToolCall:
    """One tool call of a completion: a function's, or a custom tool's.

    A custom (free-form) tool's call carries ``custom: {name, input}`` in place
    of ``function``, its input plain text rather than JSON; it is read with
    ``type="custom"`` and the input as its ``arguments``, so the caller can
    answer it and send it back as it came.
    """
    call = req_obj(raw_call, what)
    kind = opt_str(call.get("type"), f"{what}.type") or "function"
    call_id = opt_str(call.get("id"), f"{what}.id") or ""
    if kind == "custom":
        custom = req_obj(call.get("custom"), f"{what}.custom")
        return ToolCall(
            id=call_id,
            name=req_str(custom.get("name"), f"{what}.custom.name"),
            arguments=opt_str(custom.get("input"), f"{what}.custom.input") or "",
            type=kind,
        )
    function = req_obj(call.get("function"), f"{what}.function")
    return ToolCall(
        id=call_id,
        name=req_str(function.get("name"), f"{what}.function.name"),
        arguments=_arguments(function.get("arguments"), f"{what}.function.arguments"),
        type=kind,
    )


def _function_call(raw_call: Any, what: str) -> ToolCall:
    """A message's legacy ``function_call`` (``{name, arguments}``), as a ``function_call`` call.

    The legacy protocol names no call id: the id is empty, and the type tells
    the caller to send the call back as the message's ``function_call``.
    """
    call = req_obj(raw_call, what)
    return ToolCall(
        id="",
        name=req_str(call.get("name"), f"{what}.name"),
        arguments=_arguments(call.get("arguments"), f"{what}.arguments"),
        type="function_call",
    )


class ChatChunkReader:
    """One stream's chunks, read by ``parse_chat_chunk``, tool calls numbered across chunks.

    OpenAI numbers every tool-call delta with ``index``. Gemini's
    OpenAI-compatible endpoint sends none (each call whole, in a chunk of its
    own, or its arguments split over later deltas), and some servers number
    only a call's first delta; read chunk by chunk, each such delta would be
    numbered by its place in its chunk, 0, and the stream's calls merged into
    one. This reader remembers the last call: a delta without ``index`` whose
    ``id`` differs from that call's starts a new call, numbered after the
    highest index seen; one without ``id`` (or with an empty or the same one)
    continues it. A delta with ``index`` keeps it, and only updates which
    call was last. One reader per stream; a text chunk never reaches it
    (the common path of ``parse_chat_chunk`` reads no tool calls).
    """

    __slots__ = ("_last", "_last_id", "_next")

    def __init__(self) -> None:
        self._last = -1
        """The index of the call the last tool-call delta belonged to; -1 before any."""
        self._last_id: str | None = None
        """That call's id, when one was sent."""
        self._next = 0
        """One past the highest index seen: the index of a new call."""

    def read(self, event: Any, source: str = "") -> ChatChunk:
        """``parse_chat_chunk(event, source)``, with this stream's numbering of tool calls."""
        return parse_chat_chunk(event, source, self)

    def place(self, call_id: str | None) -> int:
        """The index of a tool-call delta sent without one (``call_id``: its id, if any)."""
        if self._last < 0 or (call_id and call_id != self._last_id):
            self.seen(self._next, call_id)
        return self._last

    def seen(self, index: int, call_id: str | None) -> None:
        """Note a tool-call delta of call ``index`` (sent with it, or placed)."""
        if call_id or index != self._last:
            self._last_id = call_id or None
        self._last = index
        if index >= self._next:
            self._next = index + 1


def parse_chat_chunk(
    event: Any, source: str = "", calls: ChatChunkReader | None = None
) -> ChatChunk:
    """Read one streamed chunk: text, tool-call deltas, refusal, finish reason, usage if present.

    ``source`` is set on the chunk as it is built: copying every chunk
    afterwards to add it (``dataclasses.replace``) was a per-chunk cost.
    The usage-only chunk that ``include_usage`` adds has empty ``choices``.
    An empty ``finish_reason`` (older Ollama sends ``""`` on every chunk) is
    none, as ``chunk_has_content`` reads it: taken for a finish, it would make
    a stream cut after it look whole. An in-band error event is a transient
    failure. A tool-call delta without ``index`` is numbered by ``calls``,
    the stream's ``ChatChunkReader``, when given; without it, by its place
    in the chunk.

    The common chunk (a text delta, no tool calls nor refusal) is read directly here,
    with exact checks as in ``parse_chat_response``, inline because it runs
    per chunk; anything else is walked field by field (``_walk_chat_chunk``).
    """
    if type(event) is not dict or event.get("error") is not None:
        return _walk_chat_chunk(event, source, calls)
    raw_usage = event.get("usage")
    usage: Usage | None = None
    if raw_usage is not None and (usage := _plain_usage(raw_usage)) is None:
        return _walk_chat_chunk(event, source, calls)
    choices = event.get("choices")
    if type(choices) is not list:
        return _walk_chat_chunk(event, source, calls)
    if not choices:
        return ChatChunk(source=source, usage=usage)
    choice = choices[0]
    if type(choice) is not dict:
        return _walk_chat_chunk(event, source, calls)
    delta = choice.get("delta") or {}
    # A refusal piece is rare (OpenAI's first delta sends "refusal": null): the walk reads it.
    if (
        type(delta) is not dict
        or delta.get("tool_calls")
        or delta.get("refusal") is not None
        or delta.get("function_call")
    ):
        return _walk_chat_chunk(event, source, calls)
    content = delta.get("content")
    finish = choice.get("finish_reason")
    if (content is not None and type(content) is not str) or (
        finish is not None and type(finish) is not str
    ):
        return _walk_chat_chunk(event, source, calls)
    # Every field, in order (text, tool_calls, finish_reason, source, usage): one per chunk.
    return ChatChunk(content or "", (), finish or None, source, usage)


def _walk_chat_chunk(event: Any, source: str, calls: ChatChunkReader | None = None) -> ChatChunk:
    """``parse_chat_chunk`` field by field: every variation accepted, every fault named.

    A tool-call ``index`` that is absent or null is ``calls``' to give (else
    the delta's place in the chunk); one sent is noted there as it is kept.
    A piece of a custom tool's call carries ``custom: {name, input}`` in
    place of ``function``. A legacy ``delta.function_call`` piece (openai-python's
    ``ChoiceDeltaFunctionCall``: a name, argument fragments) is a delta of
    call 0, typed ``function_call``: the legacy protocol streams one call.
    """
    chunk = req_obj(event, "chunk")
    if (error := _error_event(chunk)) is not None:
        raise error
    usage = _usage(chunk["usage"]) if chunk.get("usage") is not None else None
    choices = _choices(chunk)
    if not choices:
        return ChatChunk(source=source, usage=usage)
    choice = req_obj(choices[0], "choices[0]")
    delta = req_obj(choice.get("delta") or {}, "choices[0].delta")
    deltas = []
    for i, raw_call in enumerate(req_list(delta.get("tool_calls") or [], "delta.tool_calls")):
        what = f"delta.tool_calls[{i}]"
        call = req_obj(raw_call, what)
        call_id = opt_str(call.get("id"), f"{what}.id")
        index = call.get("index")
        if index is None:
            index = i if calls is None else calls.place(call_id)
        elif isinstance(index, bool) or not isinstance(index, int):
            raise malformed_body(f"{what}.index is not an integer")
        elif calls is not None:
            calls.seen(index, call_id)
        kind = call.get("type")
        name, arguments = _call_piece(call, what)
        deltas.append(
            ToolCallDelta(
                index=index,
                id=call_id,
                name=name,
                arguments=arguments,
                type=kind if type(kind) is str and kind else None,
            )
        )
    legacy = delta.get("function_call")
    if legacy:
        where = "delta.function_call"
        name, arguments = _function_piece(req_obj(legacy, where), where)
        if name or arguments:
            deltas.append(
                ToolCallDelta(index=0, name=name, arguments=arguments, type="function_call")
            )
    return ChatChunk(
        text=_content_text(delta.get("content"), "delta.content"),
        tool_calls=tuple(deltas),
        finish_reason=opt_str(choice.get("finish_reason"), "choices[0].finish_reason") or None,
        source=source,
        usage=usage,
        refusal=_refusal(delta.get("refusal")),
    )


def _call_piece(call: dict[str, Any], what: str) -> tuple[str | None, str | None]:
    """The name and arguments a tool-call delta carries, each ``None`` when not in this piece.

    A function's are under ``function``; a custom tool's under ``custom``
    (``name``, plain-text ``input``), on its first piece named by ``type`` and
    on the later ones by that key alone.
    """
    custom = call.get("custom")
    if call.get("type") == "custom" or (custom is not None and call.get("function") is None):
        piece = req_obj(custom or {}, f"{what}.custom")
        return (
            opt_str(piece.get("name"), f"{what}.custom.name"),
            opt_str(piece.get("input"), f"{what}.custom.input"),
        )
    where = f"{what}.function"
    return _function_piece(req_obj(call.get("function") or {}, where), where)


def _function_piece(function: dict[str, Any], what: str) -> tuple[str | None, str | None]:
    """The name and argument fragment of ``function`` (at ``what``), ``None`` when not sent."""
    arguments = function.get("arguments")
    return (
        opt_str(function.get("name"), f"{what}.name"),
        None if arguments is None else _arguments(arguments, f"{what}.arguments"),
    )


def embedding_request(
    source: SourceConfig,
    texts: Sequence[str],
    params: Mapping[str, Any],
    *,
    timeout_s: float,
    on_hint: HintSink | None = None,
    extra_headers: Mapping[str, str] | None = None,
) -> HttpRequest:
    """The request embedding one batch of ``texts`` at ``source``; ``extra_body`` merged last.

    ``extra_headers`` are added as ``chat_request`` adds them.
    """
    body: dict[str, Any] = _passthrough(params)
    body["model"] = source.model
    body["input"] = list(texts)
    _with_extra(body, params)
    url, headers = json_target(source, "embeddings")
    if extra_headers:
        add_headers(headers, extra_headers)
    return HttpRequest(
        source=source.name,
        url=url,
        timeout_s=timeout_s,
        headers=headers,
        json=body,
        connect_timeout_s=source.connect_timeout_s,
        on_hint=on_hint,
    )


_FLOATS = frozenset({float})
_NUMBERS = frozenset({float, int})


def _vector(value: Any, what: str) -> list[float]:
    """One embedding: a non-empty array of finite numbers (``bool`` is not one), as floats.

    Every element is still checked, but in C-level passes (``set(map(type,
    ...))``, ``all(map(math.isfinite, ...))``) rather than a Python loop per
    element: real vectors have 768-3,072. A vector of floats, what
    ``json.loads`` gives, is returned as is, not copied.
    """
    items = req_list(value, what)
    if not items:
        raise malformed_body(f"{what} is empty")
    types = set(map(type, items))
    try:
        # Exact types: bool, str, None and containers are refused, int and float kept.
        numeric = types <= _NUMBERS and all(map(math.isfinite, items))
    except OverflowError:  # an int too large for a float
        numeric = False
    if not numeric:
        raise malformed_body(f"{what} holds a non-numeric value")
    return items if types == _FLOATS else list(map(float, items))


def parse_embedding_response(body: Any, expected: int) -> tuple[list[list[float]], Usage]:
    """Vectors in input order (sorted by ``index``) and usage.

    Exactly ``expected`` vectors with indexes ``0..expected-1``, all of one
    dimension, or the answer is malformed: a short answer must never shift
    vectors onto the wrong texts.
    """
    answer = req_obj(body, "body")
    if (error := _error_event(answer)) is not None:
        raise error
    data = req_list(answer.get("data"), "data")
    if len(data) != expected:
        raise malformed_body(f"expected {expected} vectors, got {len(data)}")
    by_index: dict[int, list[float]] = {}
    for i, raw_item in enumerate(data):
        item = req_obj(raw_item, f"data[{i}]")
        index = item.get("index", i)
        if isinstance(index, bool) or not isinstance(index, int):
            raise malformed_body(f"data[{i}].index is not an integer")
        if not 0 <= index < expected or index in by_index:
            raise malformed_body(
                f"expected {expected} vectors, got index {index} out of range or repeated"
            )
        by_index[index] = _vector(item.get("embedding"), f"data[{i}].embedding")
    vectors = [by_index[i] for i in range(expected)]
    if len({len(v) for v in vectors}) > 1:
        raise malformed_body("vectors of different dimensions")
    usage = _usage(answer["usage"]) if answer.get("usage") is not None else Usage()
    return vectors, usage


def _chars_to_tokens(chars: int) -> int:
    return -(-chars // _CHARS_PER_TOKEN)


def _message_chars(message: Mapping[str, Any]) -> tuple[int, int]:
    """(characters of text, number of image parts) in one message."""
    content = message.get("content")
    chars, images = 0, 0
    if isinstance(content, str):
        chars += len(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, Mapping) and part.get("type", "text") == "text":
                chars += len(str(part.get("text", "")))
            else:
                images += 1
    tool_calls = message.get("tool_calls")
    if tool_calls:
        # Tool calls the model made earlier are prompt text now.
        chars += len(json.dumps(tool_calls, default=str))
    return chars, images


def estimate_chat_tokens(
    messages: Sequence[Mapping[str, Any]], max_tokens: int | None = None
) -> int:
    """The tpm reservation of a chat call: prompt chars / 4, images, plus ``max_tokens``.

    ``max_tokens`` defaults to ``DEFAULT_MAX_TOKENS_ESTIMATE``; the backend
    reconciles the reservation with reported usage afterwards.
    """
    chars, images = 0, 0
    for message in messages:
        c, i = _message_chars(message)
        chars += c
        images += i
    completion = DEFAULT_MAX_TOKENS_ESTIMATE if max_tokens is None else max_tokens
    return -(-chars // _CHARS_PER_TOKEN) + images * IMAGE_PART_TOKENS + completion


def estimate_embedding_tokens(texts: Sequence[str]) -> int:
    """The tpm reservation of an embedding batch: chars / 4 per text, at least 1 each."""
    return sum(max(1, _chars_to_tokens(len(t))) for t in texts)
