"""The bodies a healthy upstream answers with: OpenAI, Anthropic Messages and MonkeyOCR shapes.

Pure functions of the request, so a test can predict every answer: the reply
text depends on the source and the request, an embedding vector on its input
text alone (its first component is a stable hash, which makes the input order
visible in the output). One ``ChatReply`` is shaped either as an OpenAI
``chat.completion`` (and its chunks) or as an Anthropic ``message`` (and its
events), so every wire says the same words.

Azure OpenAI's answers carry its content filter's annotations besides
(``content_filter=True``): ``prompt_filter_results`` for the prompt, at the
top of a completion or in a chunk of their own that opens a stream (empty
``choices``, empty ``id``, ``model`` and ``object``, ``created`` 0), and
``content_filter_results`` in each choice, every category ``safe`` where
there is text to rate, ``{}`` where there is none (the role, tool-call and
finish chunks). That is Azure's default (buffered) filter mode. Its
asynchronous filter (``asynchronous_filter=True``), as Azure's content
streaming guide describes it ("Annotations and sample responses",
research-wiki/guides/providers.md), streams the content chunks bare, with no
``content_filter_results``, and rates the text afterwards in chunks of their
own: empty ``id``, ``model`` and ``object``, ``created`` 0, one choice with
no ``delta``, holding ``content_filter_results`` and ``content_filter_offsets``
(``check_offset``, ``start_offset``, ``end_offset``: character offsets counted
from the start of the prompt, ``check_offset`` never decreasing); the last of
them comes after everything the model sent (the finish chunk, and the usage
chunk when asked for). A reply that says a flagged word
(``ChatReply.flagged``) is cut there: the filter's verdict comes late, one
content chunk after the flagged one, as an annotation chunk whose choice has
``finish_reason: "content_filter"`` and a category ``filtered: true`` (the
guide's blocked sample: ``protected_material_text``), with no finish chunk
of the model's before it.

A request that offers legacy ``functions`` (OpenAI's deprecated function
calling) is answered as OpenAI answers it: a call of the function
``function_call`` names (``{"name": ...}``), else of the first (``"auto"``,
the default), as the message's ``function_call`` (no id, no ``tool_calls``),
streamed as ``delta.function_call`` pieces (the name with ``"arguments": ""``
first, then the arguments), ``finish_reason`` ``function_call``;
``function_call: "none"`` gets text, as ``tool_choice: "none"`` does (and
the Messages API's ``{"type": "none"}``).

A request that asks for JSON of a schema gets an instance of it
(``schema_instance``): ``response_format`` ``json_schema`` makes the reply
text that JSON, and a tool call's arguments are an instance of the called
tool's schema (the one ``tool_choice`` forces, else the first offered).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

__all__ = [
    "OCR_SUFFIXES",
    "SYSTEM_FINGERPRINT",
    "ChatReply",
    "Event",
    "StreamPlan",
    "anthropic_events",
    "anthropic_message",
    "chat_chunks",
    "chat_completion",
    "chat_reply",
    "content_list",
    "embedding_vector",
    "embeddings_response",
    "input_tokens",
    "ocr_text_response",
    "parse_response",
    "schema_instance",
]

OCR_SUFFIXES = frozenset({".pdf", ".jpg", ".jpeg", ".png"})
"""File name endings MonkeyOCR accepts for an upload."""

SYSTEM_FINGERPRINT = "fp_5e1f0c7a2b"
"""The ``system_fingerprint`` of every OpenAI-shaped answer: one simulated backend configuration."""

_FILTER_CATEGORIES = ("hate", "self_harm", "sexual", "violence")
"""The categories Azure's default content filter rates, prompt and completion alike."""

_FILLER = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit")


def _tokens(text: str) -> int:
    """A rough token count (4 characters a token), never 0, like an estimate providers match."""
    return max(1, len(text) // 4)


def input_tokens(texts: Sequence[str]) -> int:
    """The tokens an embeddings request spends: what its usage reports."""
    return sum(_tokens(t) for t in texts)


def _prompt_text(messages: Sequence[Any]) -> str:
    """All text of the messages, for the token count and the echo in the reply."""
    parts: list[str] = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(
                str(p.get("text", "")) for p in content if isinstance(p, Mapping) and "text" in p
            )
    return " ".join(parts)


@dataclass(frozen=True, slots=True)
class ChatReply:
    """What a chat answer will say, before it is shaped as a completion or as chunks."""

    id: str
    model: str
    created: int
    words: tuple[str, ...]
    tool_name: str | None
    prompt_tokens: int
    json_text: str | None = None
    """The reply text when the request asked for JSON of a schema (``response_format``)."""
    tool_input: str = "{}"
    """The tool call's arguments: JSON text of an instance of the tool's schema."""
    cut: bool = False
    """Whether ``max_tokens`` cut the text short, which the finish reason then says."""
    legacy: bool = False
    """Whether the call answers legacy ``functions``: a ``function_call``, not ``tool_calls``."""
    flagged: int | None = None
    """The index in ``words`` of the first word a content filter flags, if any."""
    prompt_chars: int = 0
    """Characters of the prompt's text, where the content filter's offsets start counting."""

    @property
    def content(self) -> str:
        """The full reply text (the streamed deltas join to exactly this)."""
        if self.json_text is not None:
            return self.json_text
        return " ".join(self.words)

    @property
    def finish_reason(self) -> str:
        """``tool_calls`` (legacy: ``function_call``) for a call, ``length`` if cut, or ``stop``."""
        if self.tool_name is not None:
            return "function_call" if self.legacy else "tool_calls"
        return "length" if self.cut else "stop"

    @property
    def completion_tokens(self) -> int:
        """Tokens of the answer: a word each (JSON text: 4 characters each), 8 for a tool call."""
        if self.tool_name is not None:
            return 8
        return len(self.words) if self.json_text is None else _tokens(self.json_text)

    @property
    def total_tokens(self) -> int:
        """Prompt and completion tokens: what the reply spends of a token limit."""
        return self.prompt_tokens + self.completion_tokens

    def usage(self) -> dict[str, int]:
        """The OpenAI usage object of this reply."""
        return self.usage_of(self.completion_tokens)

    def usage_of(self, completion_tokens: int) -> dict[str, int]:
        """The OpenAI usage object of this prompt and ``completion_tokens`` of answer."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def runs(self, chunks: int) -> list[str]:
        """The text split into ``chunks`` near-equal runs that concatenate to ``content``."""
        if self.json_text is not None:
            text = self.json_text
            n = max(1, min(chunks, len(text)))
            return [text[len(text) * i // n : len(text) * (i + 1) // n] for i in range(n)]
        n = max(1, min(chunks, len(self.words)))
        out: list[str] = []
        for i in range(n):
            # Every run after the first starts with the space that joined it, so
            # the deltas concatenate to the non-streamed content exactly.
            lo, hi = len(self.words) * i // n, len(self.words) * (i + 1) // n
            text = " ".join(self.words[lo:hi])
            out.append(text if i == 0 else " " + text)
        return out

    def function_call(self) -> dict[str, Any]:
        """The legacy ``function_call`` of a reply to ``functions``: a name and JSON arguments."""
        return {"name": self.tool_name, "arguments": self.tool_input}

    def tool_call(self) -> dict[str, Any]:
        """The one tool call of a tool reply, arguments as a JSON string like OpenAI sends."""
        return {
            "id": f"call_{self.id[-8:]}",
            "type": "function",
            "function": {"name": self.tool_name, "arguments": self.tool_input},
        }


def chat_reply(
    request: Mapping[str, Any],
    *,
    source: str,
    request_no: int,
    created: int,
    min_words: int,
    flags: Sequence[str] = (),
) -> ChatReply:
    """Decide the reply to a chat request; ``min_words`` lets a stream fill its chunks.

    Args:
        flags: words a content filter flags (case aside, punctuation around
            them aside): the first one the text says sets ``ChatReply.flagged``.
    """
    messages = request.get("messages", [])
    prompt = _prompt_text(messages if isinstance(messages, list) else [])
    words = [*f"Simulated reply from {source}.".split(), *prompt.split()[:8]]
    i = 0
    while len(words) < min_words:
        words.append(_FILLER[i % len(_FILLER)])
        i += 1
    max_tokens = request.get("max_tokens") or request.get("max_completion_tokens")
    cut = False
    if isinstance(max_tokens, int) and max_tokens > 0:
        cut = len(words) > max_tokens
        words = words[:max_tokens]
    tool_name: str | None = None
    tool_input = "{}"
    legacy = False
    tools = request.get("tools")
    functions = request.get("functions")
    called: tuple[Any, Any] | None = None
    if isinstance(tools, list) and tools and not _declines_tools(request.get("tool_choice")):
        # Offered tools make the reply a call of the one tool_choice forces, else of the
        # first, named where OpenAI ({"function": {"name"}}) or Anthropic ({"name"}) puts it.
        called = _called_tool(tools, request.get("tool_choice"))
    elif isinstance(functions, list) and functions and request.get("function_call") != "none":
        called = _called_function(functions, request.get("function_call"))
        legacy = True
    if called is not None:
        name, schema = called
        tool_name = name if isinstance(name, str) else "tool"
        arguments = schema_instance(schema)
        # Arguments are an object whatever the schema says (an empty schema says nothing).
        tool_input = json.dumps(arguments if isinstance(arguments, dict) else {})
    json_text = None
    answer_format = request.get("response_format")
    if tool_name is None and isinstance(answer_format, Mapping):
        spec = answer_format.get("json_schema")
        if answer_format.get("type") == "json_schema" and isinstance(spec, Mapping):
            json_text = json.dumps(schema_instance(spec.get("schema")))
    flagged = None
    if flags and tool_name is None and json_text is None:
        wanted = {f.lower() for f in flags}
        said = (i for i, w in enumerate(words) if w.strip(_PUNCTUATION).lower() in wanted)
        flagged = next(said, None)
    model = request.get("model")
    return ChatReply(
        id=f"chatcmpl-sim-{source}-{request_no}",
        model=model if isinstance(model, str) else "sim-model",
        created=created,
        words=tuple(words),
        tool_name=tool_name,
        prompt_tokens=_tokens(prompt),
        json_text=json_text,
        tool_input=tool_input,
        # A JSON answer is written whole, whatever max_tokens says.
        cut=cut and json_text is None,
        legacy=legacy,
        flagged=flagged,
        prompt_chars=len(prompt),
    )


_PUNCTUATION = ".,;:!?\"'()[]"
"""What a flagged word may be wrapped in and still be the word."""


def _declines_tools(choice: Any) -> bool:
    """Whether ``tool_choice`` says to call no tool: OpenAI's ``"none"``, Anthropic's object."""
    return choice == "none" or (isinstance(choice, Mapping) and choice.get("type") == "none")


def _tool_name_and_schema(tool: Any) -> tuple[Any, Any]:
    """An offered tool's name and input schema, in OpenAI's shape or Anthropic's."""
    if not isinstance(tool, Mapping):
        return None, None
    function = tool.get("function")
    if isinstance(function, Mapping):
        return function.get("name"), function.get("parameters")
    return tool.get("name"), tool.get("input_schema")


def _called_tool(tools: list[Any], choice: Any) -> tuple[Any, Any]:
    """The tool a reply calls: the one ``tool_choice`` names (either API's form), or the first."""
    forced = None
    if isinstance(choice, Mapping):
        function = choice.get("function")
        forced = function.get("name") if isinstance(function, Mapping) else choice.get("name")
    offered = [_tool_name_and_schema(tool) for tool in tools]
    for name, schema in offered:
        if forced is not None and name == forced:
            return name, schema
    return offered[0]


def _called_function(functions: list[Any], choice: Any) -> tuple[Any, Any]:
    """The legacy function a reply calls: the one ``function_call`` names, or the first.

    A name no function has is refused by the server before this (a 400, as OpenAI's).
    """
    offered = [
        (f.get("name"), f.get("parameters")) if isinstance(f, Mapping) else (None, None)
        for f in functions
    ]
    forced = choice.get("name") if isinstance(choice, Mapping) else None
    for name, schema in offered:
        if forced is not None and name == forced:
            return name, schema
    return offered[0]


def schema_instance(schema: Any, root: Mapping[str, Any] | None = None) -> Any:
    """A value valid for the JSON schema ``schema``, for a model asked to answer in it.

    Objects get their required properties (all of them in a strict schema),
    arrays one item, strings ``"lorem"``, numbers 1, booleans ``true``; an
    ``enum`` or ``const`` gives its first value, a union its first non-null
    branch, a local ``$ref`` what it points at. Enough for the schemas a
    pydantic model of plain fields writes; anything else is ``null``.
    """
    if not isinstance(schema, Mapping):
        return None
    root = schema if root is None else root
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, Mapping) else None
        return schema_instance(target, root)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[0]
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            for branch in branches:
                if not (isinstance(branch, Mapping) and branch.get("type") == "null"):
                    return schema_instance(branch, root)
            return None
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        required = schema.get("required")
        names = required if isinstance(required, list) else []
        return {name: schema_instance(properties.get(name), root) for name in names}
    if kind == "array":
        items = schema.get("items")
        return [schema_instance(items, root)] if isinstance(items, Mapping) else []
    return _PLAIN.get(kind) if isinstance(kind, str) else None


_PLAIN: dict[str, Any] = {"string": "lorem", "integer": 1, "number": 1, "boolean": True}
"""The value of each plain JSON type in a ``schema_instance``."""


def _content_filter_results() -> dict[str, Any]:
    """Azure's ``content_filter_results`` of text that passed every default category."""
    return {c: {"filtered": False, "severity": "safe"} for c in _FILTER_CATEGORIES}


def _prompt_filter_results() -> list[dict[str, Any]]:
    """Azure's ``prompt_filter_results``: the prompt passed, prompt shields (jailbreak) too."""
    results = _content_filter_results()
    results["jailbreak"] = {"filtered": False, "detected": False}
    return [{"prompt_index": 0, "content_filter_results": results}]


def chat_completion(reply: ChatReply, *, content_filter: bool = False) -> dict[str, Any]:
    """A non-streamed ``chat.completion`` object.

    As OpenAI sends it: the ``system_fingerprint``, ``"logprobs": null`` in the
    choice and ``"refusal": null`` in a message the model did not refuse.
    ``content_filter`` adds Azure's annotations (module docstring).
    """
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
    if reply.legacy:
        message = {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "function_call": reply.function_call(),
        }
    elif reply.tool_name is not None:
        message = {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "tool_calls": [reply.tool_call()],
        }
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": reply.finish_reason,
    }
    completion: dict[str, Any] = {
        "id": reply.id,
        "object": "chat.completion",
        "created": reply.created,
        "model": reply.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [choice],
        "usage": reply.usage(),
    }
    if content_filter:
        choice["content_filter_results"] = (
            {} if reply.tool_name is not None else _content_filter_results()
        )
        completion["prompt_filter_results"] = _prompt_filter_results()
    return completion


Event = tuple[str | None, Any]
"""One SSE event: its ``event:`` name (Anthropic names its events, OpenAI does not) and its data."""


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """A healthy stream's events in three parts, so the server can time and break them.

    Attributes:
        head: what the provider sends at once, before the model has produced
            anything (the OpenAI role chunk; Anthropic's ``message_start``,
            ``content_block_start`` and ``ping``).
        body: the content events; the first-token delay comes before the first
            of them, and a broken stream stops halfway through them.
        tail: the events that finish the answer (finish reason, usage, stop).
    """

    head: tuple[Event, ...]
    body: tuple[Event, ...]
    tail: tuple[Event, ...]


def _filter_offsets(reply: ChatReply, start: int, end: int) -> dict[str, int]:
    """``content_filter_offsets`` of the answer's characters ``start`` to ``end``.

    Counted from the start of the prompt; everything before ``start`` was
    checked already, so ``check_offset`` is ``start`` and never decreases.
    """
    base = reply.prompt_chars
    return {"check_offset": base + start, "start_offset": base + start, "end_offset": base + end}


def _annotation(
    reply: ChatReply, start: int, end: int, *, include_usage: bool, blocked: bool = False
) -> Event:
    """An asynchronous filter's annotation chunk rating the answer's characters ``start``-``end``.

    ``blocked``: the filter stops the answer there (``finish_reason:
    "content_filter"``, the flagged category ``filtered: true``).
    """
    results = (
        {"protected_material_text": {"filtered": True, "detected": True}}
        if blocked
        else _content_filter_results()
    )
    choice = {
        "index": 0,
        "finish_reason": "content_filter" if blocked else None,
        "content_filter_results": results,
        "content_filter_offsets": _filter_offsets(reply, start, end),
    }
    body: dict[str, Any] = {"id": "", "object": "", "created": 0, "model": "", "choices": [choice]}
    if include_usage:
        body["usage"] = None
    return None, body


def chat_chunks(
    reply: ChatReply,
    *,
    chunks: int,
    include_usage: bool,
    content_filter: bool = False,
    asynchronous_filter: bool = False,
) -> StreamPlan:
    """The ``chat.completion.chunk`` objects of a stream: role, deltas, finish, then usage.

    As OpenAI sends them: every chunk names the ``system_fingerprint`` and its
    choice says ``"logprobs": null``; the role chunk says ``"refusal": null``.
    ``content_filter`` adds Azure's annotations (module docstring): the prompt's
    chunk first, sent at once, and each choice's ``content_filter_results``;
    with ``asynchronous_filter`` too, the choices are bare and annotation
    chunks rate the text after it was sent (and a flagged reply is cut).

    The usage chunk (empty ``choices``) comes only when the request set
    ``stream_options.include_usage``, and then every other chunk carries
    ``"usage": null``. The ``[DONE]`` sentinel is not a chunk; the server sends
    it after these.
    """

    rated_inline = content_filter and not asynchronous_filter

    def chunk(delta: dict[str, Any], finish: str | None = None) -> Event:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if rated_inline:
            rated = bool(delta.get("content"))
            choice["content_filter_results"] = _content_filter_results() if rated else {}
        body: dict[str, Any] = {
            "id": reply.id,
            "object": "chat.completion.chunk",
            "created": reply.created,
            "model": reply.model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [choice],
        }
        if include_usage:
            body["usage"] = None
        return None, body

    head: tuple[Event, ...] = ()
    body: tuple[Event, ...]
    if reply.legacy:
        # The legacy protocol streams one call: its name first (arguments empty), then
        # the arguments, as openai-python's ChoiceDeltaFunctionCall pieces.
        name = {"name": reply.tool_name, "arguments": ""}
        body = (
            chunk({"role": "assistant", "content": None, "function_call": name, "refusal": None}),
            chunk({"function_call": {"arguments": reply.tool_input}}),
        )
    elif reply.tool_name is not None:
        # The call's name is model output, so it comes after the first-token delay
        # together with the role, as OpenAI's first tool chunk carries both.
        call = reply.tool_call()
        start = {**call, "index": 0, "function": {"name": reply.tool_name, "arguments": ""}}
        args = {"index": 0, "function": {"arguments": call["function"]["arguments"]}}
        body = (
            chunk({"role": "assistant", "content": None, "tool_calls": [start], "refusal": None}),
            chunk({"tool_calls": [args]}),
        )
    else:
        head = (chunk({"role": "assistant", "content": "", "refusal": None}),)
        body = tuple(chunk({"content": text}) for text in reply.runs(chunks))
    if content_filter:
        prompt: dict[str, Any] = {
            "choices": [],
            "created": 0,
            "id": "",
            "model": "",
            "object": "",
            "prompt_filter_results": _prompt_filter_results(),
        }
        if include_usage:
            prompt["usage"] = None
        head = ((None, prompt), *head)
        if asynchronous_filter and reply.tool_name is None:
            return _asynchronously_filtered(reply, chunks, include_usage, head, chunk)
    tail = [chunk({}, reply.finish_reason)]
    if include_usage:
        tail.append(_usage_chunk(chunk, reply.usage()))
    return StreamPlan(head, body, tuple(tail))


def _usage_chunk(chunk: Callable[[dict[str, Any]], Event], usage: dict[str, int]) -> Event:
    """The last chunk of ``include_usage``: empty ``choices``, the answer's ``usage``."""
    _, last = chunk({})
    last["choices"] = []
    last["usage"] = usage
    return None, last


def _asynchronously_filtered(
    reply: ChatReply,
    chunks: int,
    include_usage: bool,
    head: tuple[Event, ...],
    chunk: Callable[..., Event],
) -> StreamPlan:
    """A text stream under Azure's asynchronous filter (module docstring).

    The first half of the content is rated by an annotation chunk in the
    middle of the stream, the rest by one after everything else; a flagged
    reply stops one content chunk after the flagged one, with the blocking
    annotation in place of the finish chunk, and its usage (when asked for)
    counts the words that were sent.
    """
    runs = reply.runs(chunks)
    sent = len(runs)
    if reply.flagged is not None:
        words = 0
        for i, text in enumerate(runs):
            words += len(text.split())
            if words > reply.flagged:
                sent = min(len(runs), i + 2)
                break
    ends = list(itertools.accumulate(len(text) for text in runs[:sent]))
    mid = sent // 2
    body: list[Event] = [chunk({"content": text}) for text in runs[:sent]]
    checked = 0
    if mid and (reply.flagged is None or sent - 1 > mid):
        checked = ends[mid - 1]
        body.insert(mid, _annotation(reply, 0, checked, include_usage=include_usage))
    tail: list[Event] = []
    if reply.flagged is not None:
        blocking = _annotation(reply, checked, ends[-1], include_usage=include_usage, blocked=True)
        tail.append(blocking)
        if include_usage:
            spoken = sum(len(text.split()) for text in runs[:sent])
            tail.append(_usage_chunk(chunk, reply.usage_of(spoken)))
        return StreamPlan(head, tuple(body), tuple(tail))
    tail.append(chunk({}, reply.finish_reason))
    if include_usage:
        tail.append(_usage_chunk(chunk, reply.usage()))
    tail.append(_annotation(reply, checked, ends[-1], include_usage=include_usage))
    return StreamPlan(head, tuple(body), tuple(tail))


def _message_id(reply: ChatReply) -> str:
    """The reply's id in Anthropic's ``msg_`` form."""
    return "msg_" + reply.id.removeprefix("chatcmpl-")


def _stop_reason(reply: ChatReply) -> str:
    """Anthropic's ``stop_reason``: ``tool_use``, ``max_tokens`` (text cut short), ``end_turn``."""
    if reply.tool_name is not None:
        return "tool_use"
    return "max_tokens" if reply.cut else "end_turn"


def _tool_use_id(reply: ChatReply) -> str:
    """The id of the reply's ``tool_use`` block."""
    return f"toolu_{reply.id[-8:]}"


def anthropic_message(reply: ChatReply) -> dict[str, Any]:
    """A non-streamed Anthropic ``message``: content blocks, ``stop_reason`` and usage."""
    content: list[dict[str, Any]] = [{"type": "text", "text": reply.content}]
    if reply.tool_name is not None:
        content = [
            {
                "type": "tool_use",
                "id": _tool_use_id(reply),
                "name": reply.tool_name,
                "input": json.loads(reply.tool_input),
            }
        ]
    return {
        "id": _message_id(reply),
        "type": "message",
        "role": "assistant",
        "model": reply.model,
        "content": content,
        "stop_reason": _stop_reason(reply),
        "stop_sequence": None,
        "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens},
    }


def anthropic_events(reply: ChatReply, *, chunks: int) -> StreamPlan:
    """The named events of an Anthropic stream, as the Messages API sends them.

    ``message_start`` (empty content), one content block (``content_block_start``,
    deltas, ``content_block_stop``), ``message_delta`` with the stop reason and
    the cumulative output tokens, ``message_stop``. A ``ping`` closes what is
    sent at once: after a text block starts (as in the documented example), or
    before a ``tool_use`` block, whose tool name is model output. A text block
    streams ``text_delta``s, a tool call ``input_json_delta`` partial JSON
    strings. There is no ``[DONE]``.
    """

    def event(name: str, **data: Any) -> Event:
        return name, {"type": name, **data}

    start = event(
        "message_start",
        message={
            "id": _message_id(reply),
            "type": "message",
            "role": "assistant",
            "model": reply.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": reply.prompt_tokens, "output_tokens": 1},
        },
    )
    ping = event("ping")
    block_stop = event("content_block_stop", index=0)
    if reply.tool_name is not None:
        half = len(reply.tool_input) // 2
        # The block names the tool, which is model output: it follows the delay.
        block = {
            "type": "tool_use",
            "id": _tool_use_id(reply),
            "name": reply.tool_name,
            "input": {},
        }
        head: tuple[Event, ...] = (start, ping)
        body: tuple[Event, ...] = (
            event("content_block_start", index=0, content_block=block),
            *(
                event(
                    "content_block_delta",
                    index=0,
                    delta={"type": "input_json_delta", "partial_json": part},
                )
                for part in ("", reply.tool_input[:half], reply.tool_input[half:])
            ),
            block_stop,
        )
        closing: tuple[Event, ...] = ()
    else:
        head = (
            start,
            event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
            ping,
        )
        body = tuple(
            event("content_block_delta", index=0, delta={"type": "text_delta", "text": text})
            for text in reply.runs(chunks)
        )
        closing = (block_stop,)
    tail = (
        *closing,
        event(
            "message_delta",
            delta={"stop_reason": _stop_reason(reply), "stop_sequence": None},
            usage={"output_tokens": reply.completion_tokens},
        ),
        event("message_stop"),
    )
    return StreamPlan(head, body, tail)


def embedding_vector(text: str, dim: int = 8) -> list[float]:
    """The simulator's embedding of ``text``: a pure function of the text.

    Component 0 is the first 32 bits of the text's SHA-256 as a fraction in
    [0, 1), so a test can tell which input a vector belongs to; the others are
    further hash bytes spread over [-1, 1].
    """
    stream = b""
    block = 0
    while len(stream) < 4 + dim:
        stream += hashlib.sha256(f"{block}:{text}".encode()).digest()
        block += 1
    head = hashlib.sha256(text.encode()).digest()
    vector = [int.from_bytes(head[:4], "big") / 2**32]
    vector += [round(b / 127.5 - 1.0, 6) for b in stream[4 : 4 + dim - 1]]
    return vector


def embeddings_response(
    inputs: Sequence[str], *, model: str, dim: int, encoding_format: str
) -> dict[str, Any]:
    """An OpenAI ``list`` of embeddings in input order; ``base64`` packs float32 like OpenAI."""
    data: list[dict[str, Any]] = []
    for index, text in enumerate(inputs):
        vector = embedding_vector(text, dim)
        embedding: list[float] | str = vector
        if encoding_format == "base64":
            embedding = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode("ascii")
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    tokens = input_tokens(inputs)
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _digest(data: bytes) -> str:
    """A short, stable fingerprint of an upload, echoed so tests see the bytes arrived."""
    return hashlib.sha256(data).hexdigest()[:12]


def ocr_text_response(filename: str, data: bytes) -> dict[str, Any]:
    """MonkeyOCR's ``/ocr/text`` answer for an upload."""
    text = (
        f"Recognized text of {filename}\n\n"
        f"{len(data)} bytes, sha256 {_digest(data)}.\n"
        "The quick brown fox jumps over the lazy dog."
    )
    return {
        "success": True,
        "task_type": "text",
        "content": text,
        "message": "Text extraction completed successfully",
    }


def content_list(filename: str, data: bytes, pages: int = 2) -> list[dict[str, Any]]:
    """A MonkeyOCR / MinerU content list: a title, text, a table and an equation per page."""
    stem = PurePosixPath(filename).stem or "document"
    items: list[dict[str, Any]] = []
    for page in range(pages):
        items += [
            {
                "type": "title",
                "text": f"{stem}, page {page + 1}",
                "text_level": 1,
                "bbox": [72, 60, 540, 90],
                "page_idx": page,
            },
            {
                "type": "text",
                "text": f"Body text of page {page + 1} ({len(data)} bytes, {_digest(data)}).",
                "bbox": [72, 110, 540, 300],
                "page_idx": page,
            },
            {
                "type": "table",
                "table_body": "<table><tr><td>a</td><td>1</td></tr></table>",
                "table_caption": [f"Table {page + 1}"],
                "bbox": [72, 320, 540, 460],
                "page_idx": page,
            },
            {
                "type": "equation",
                "text": "$$E = mc^2$$",
                "text_format": "latex",
                "bbox": [200, 480, 400, 520],
                "page_idx": page,
            },
        ]
    return items


def parse_response(filename: str, data: bytes, return_type: str | None) -> dict[str, Any]:
    """MonkeyOCR's ``/parse`` answer: a JSON content list, or markdown when not asked for one."""
    items = content_list(filename, data)
    if return_type == "content_list_json":
        content = json.dumps(items, ensure_ascii=False)
        content_type = "content_list_json"
    else:
        lines: list[str] = []
        for item in items:
            if item["type"] == "title":
                lines.append(f"# {item['text']}")
            elif item["type"] == "table":
                lines.append(item["table_body"])
            else:
                lines.append(item["text"])
        content = "\n\n".join(lines)
        content_type = "markdown"
    return {
        "success": True,
        "message": "Document parsing completed successfully",
        "content": content,
        "content_type": content_type,
    }
