"""What a call may ask of a provider: each API's parameters and message shapes, checked up front.

A misspelt or mistyped parameter (``max_token=5``, ``max_tokens="lots"``)
would otherwise reach the provider, which ignores it or answers 400 after a
permit was taken; a ``model=`` or ``stream=`` would be dropped without a
word. The clients call ``ChatCheck.complete`` / ``ChatCheck.stream`` and
``check_embedding_params`` before anything else, so whatever is refused
raises ``RequestRejected`` naming the parameter (with the closest known
name when one is near) before any permit is taken or byte is sent.

The tables follow the APIs' references (the OpenAI API's chat completions
and embeddings, as in openai-python's ``completion_create_params.py`` and
``embedding_create_params.py``; the Anthropic Messages API, as in
anthropic-sdk-python's ``message_create_params.py``), with each value's JSON
type and, where the set is small and fixed, its allowed strings. ``None``
is always accepted: it means "not set", and the wires drop it. They live in
this one module rather than beside each request builder because a scope's
table is composed from its sources' protocols: a chat client speaks the
OpenAI API whichever source serves (the Anthropic wire maps or passes on
what it gets), so a scope accepts the OpenAI chat parameters, plus the
Messages API's own (``top_k``, ``thinking``, ...) when every source is an
Anthropic one, since an OpenAI source would refuse them.

``extra_body`` is the way past the tables, as in the openai SDK: an object
whose fields are merged unchecked into the top level of the request body,
last, so that they win over checked parameters of the same name (the SDK
merges ``{**body, **extra_body}``). Only the fields the gateway itself
writes (``model``, ``messages``, ``stream``, ``input``) are refused there.

Messages are checked against the roles and content shapes of the chat
completions API: the role, the keys each role may carry, content as a
string, a list of content parts of the types that role takes, or null
where the API allows it (an assistant turn with tool calls), an
assistant's ``tool_calls``, a tool message's ``tool_call_id``. The first
fault is named by index and field (``messages[0].role: 'human' is not one
of system, developer, user, assistant, tool``). The keys inside content
parts are not checked (providers add their own, like ``cache_control``);
in an all-Anthropic scope, parts of a type OpenAI does not have pass as
Messages API blocks, which the Anthropic wire sends as given.

Cost: the chat hot path is held to 1.3x raw aiohttp CPU per call
(research-wiki/BENCHMARKS.md: 175 us per call, 1.23x). A
``{"role", "content": str}`` message of a plain role is checked with a
length, two lookups and two type tests; each parameter with one lookup and
one type test, a count with a minimum (``max_tokens``) with one comparison
more. With timeit (CPython 3.11.7, the machine BENCHMARKS.md describes),
``ChatCheck.complete`` of one or two such messages with ``max_tokens`` and
``temperature`` takes 0.40 / 0.49 us (0.22 / 0.32 us without parameters); a
three-message tool-call turn with content parts, which takes the full
per-field walk, 3.3 us.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from polygateway.errors import RequestRejected

__all__ = [
    "ANTHROPIC_MESSAGES_PARAMS",
    "OPENAI_CHAT_PARAMS",
    "OPENAI_EMBEDDING_PARAMS",
    "ChatCheck",
    "Param",
    "check_embedding_params",
]


@dataclass(frozen=True, slots=True)
class Param:
    """One request parameter: the JSON types its value may take, and what else it must hold.

    ``types`` are matched exactly first (the fast path) and then by
    ``isinstance``, except that a ``bool`` is never an integer or a number
    (JSON tells them apart). ``choices`` bounds a string value; ``items``
    the type of a list's elements; ``minimum`` a number (a count the API
    refuses below it, such as ``n=0``, is a 400 not worth a permit).
    """

    types: tuple[type, ...]
    what: str
    """The expected value in words, for the error: ``an integer``."""
    choices: tuple[str, ...] = ()
    items: type | None = None
    minimum: int | None = None
    plain: bool = field(init=False, repr=False)
    """Whether a value of an exact type in ``types`` is all there is to check (the fast path)."""

    def __post_init__(self) -> None:
        plain = not self.choices and self.items is None and self.minimum is None
        object.__setattr__(self, "plain", plain)

    def accepts(self, value: object) -> bool:
        """Whether ``value`` is a value of this parameter."""
        if type(value) not in self.types and (
            isinstance(value, bool) or not isinstance(value, self.types)
        ):
            return False
        if self.choices and isinstance(value, str) and value not in self.choices:
            return False
        if self.items is not None and isinstance(value, list | tuple):
            return all(isinstance(item, self.items) for item in value)
        if self.minimum is not None and isinstance(value, int | float):
            return value >= self.minimum
        return True

    def expected(self) -> str:
        """What the value should be, in words, naming the allowed strings or the minimum."""
        if self.minimum is not None:
            return f"{self.what} >= {self.minimum}"
        if not self.choices:
            return self.what
        return f"{self.what} {', '.join(self.choices)}"


_INT: Final = Param((int,), "an integer")
_COUNT: Final = Param((int,), "an integer", minimum=0)
_POSITIVE: Final = Param((int,), "an integer", minimum=1)
_NUMBER: Final = Param((float, int), "a number")
_BOOL: Final = Param((bool,), "a boolean")
_STR: Final = Param((str,), "a string")
_LIST: Final = Param((list, tuple), "a list")
_OBJECT: Final = Param((dict,), "an object")
_STRINGS: Final = Param((list, tuple), "a list of strings", items=str)
_STR_OR_STRINGS: Final = Param((str, list, tuple), "a string or a list of strings", items=str)


def _one_of(*values: str) -> Param:
    """A string among ``values``."""
    return Param((str,), "one of", values)


def _object_or_one_of(*values: str) -> Param:
    """An object, or a string among ``values`` (``tool_choice``)."""
    return Param((str, dict), "an object or one of", values)


OPENAI_CHAT_PARAMS: Final[Mapping[str, Param]] = {
    "audio": _OBJECT,
    "frequency_penalty": _NUMBER,
    "function_call": _object_or_one_of("none", "auto"),
    "functions": _LIST,
    "logit_bias": _OBJECT,
    "logprobs": _BOOL,
    "max_completion_tokens": _POSITIVE,
    "max_tokens": _POSITIVE,
    "metadata": _OBJECT,
    "modalities": _STRINGS,
    "moderation": _OBJECT,
    "n": _POSITIVE,
    "parallel_tool_calls": _BOOL,
    "prediction": _OBJECT,
    "presence_penalty": _NUMBER,
    "prompt_cache_key": _STR,
    "prompt_cache_options": _OBJECT,
    "prompt_cache_retention": _one_of("in_memory", "24h"),
    "reasoning_effort": _one_of("none", "minimal", "low", "medium", "high", "xhigh", "max"),
    "response_format": _OBJECT,
    "safety_identifier": _STR,
    "seed": _INT,
    "service_tier": _one_of("auto", "default", "flex", "scale", "priority", "fast"),
    "stop": _STR_OR_STRINGS,
    "store": _BOOL,
    "stream_options": _OBJECT,
    "temperature": _NUMBER,
    "tool_choice": _object_or_one_of("none", "auto", "required"),
    "tools": _LIST,
    "top_logprobs": _COUNT,
    "top_p": _NUMBER,
    "user": _STR,
    "verbosity": _one_of("low", "medium", "high"),
    "web_search_options": _OBJECT,
    "extra_body": _OBJECT,
}
"""The chat completions API's request parameters (``model``, ``messages``, ``stream`` aside).

``extra_body`` is the openai SDK's own way past them, not a field of the API.
"""

ANTHROPIC_MESSAGES_PARAMS: Final[Mapping[str, Param]] = {
    "cache_control": _OBJECT,
    "container": _STR,
    "inference_geo": _STR,
    "metadata": _OBJECT,
    "output_config": _OBJECT,
    "service_tier": _one_of("auto", "standard_only"),
    "stop_sequences": _STRINGS,
    "temperature": _NUMBER,
    "thinking": _OBJECT,
    "top_k": _INT,
    "top_p": _NUMBER,
}
"""The Messages API's own parameters that the Anthropic wire passes on as given.

Those it writes from the OpenAI ones (``max_tokens``, ``system``, ``tools``,
``tool_choice``, ``stop`` as ``stop_sequences``, ``user`` as metadata) are
the OpenAI table's.
"""

OPENAI_EMBEDDING_PARAMS: Final[Mapping[str, Param]] = {
    "dimensions": _POSITIVE,
    "encoding_format": _one_of("float", "base64"),
    "user": _STR,
    "extra_body": _OBJECT,
}
"""The embeddings API's request parameters (``model`` and ``input`` aside)."""

_MODEL_CHOSEN: Final = (
    "models are chosen per source in the settings (a scope is a pool of equivalent "
    "sources, each with its own model): use a scope whose sources serve the model you want"
)

_COMPLETE_REFUSED: Final[Mapping[str, str]] = {
    "model": _MODEL_CHOSEN,
    "stream": "complete() does not stream: call stream() for a streamed answer",
    "stream_options": "stream_options applies to stream() only",
    "system": "the system prompt is a {'role': 'system', ...} message",
}
_STREAM_REFUSED: Final[Mapping[str, str]] = {
    "model": _MODEL_CHOSEN,
    "stream": "stream() always streams: leave stream= out (complete() answers in one piece)",
    "system": _COMPLETE_REFUSED["system"],
    "response_model": (
        "complete() takes it; a stream's answer can be parsed from await stream.response()"
    ),
}
_MESSAGES_API_ONLY: Final = (
    "a Messages API parameter, taken when every source of the scope is an Anthropic one; "
    "here it goes in extra_body={...}"
)
_EMBED_REFUSED: Final[Mapping[str, str]] = {
    "model": _MODEL_CHOSEN,
    "input": "the texts are embed()'s first argument",
}
_CHAT_OWNED: Final = ("model", "messages", "stream")
_EMBED_OWNED: Final = ("model", "input")

_REPLACED: Final = (("functions", "tools"), ("function_call", "tool_choice"))
"""OpenAI's deprecated function-calling parameters and their successors: one or the other."""


def _rejected(message: str, scope: str) -> RequestRejected:
    return RequestRejected(message, scope=scope)


def _check_legacy_functions(params: Mapping[str, Any], scope: str) -> None:
    """OpenAI's rules for ``functions`` / ``function_call``, which every scope follows.

    OpenAI answers 400 to either beside its successor (``tools``,
    ``tool_choice``), to ``function_call`` without ``functions`` and to an
    empty ``functions``; the Anthropic wire maps the legacy pair onto the
    new one and could not carry both. Refused here, before a permit is taken.
    """
    for old, new in _REPLACED:
        if params.get(old) is not None and params.get(new) is not None:
            raise _rejected(f"{old} and {new} cannot both be given ({new} replaces {old})", scope)
    functions = params.get("functions")
    if functions is None:
        if params.get("function_call") is not None:
            raise _rejected("function_call is only allowed when functions are given", scope)
    elif not functions:
        raise _rejected("functions is empty: offer at least one function, or leave it out", scope)


def _shown(value: object) -> str:
    """A value in an error: its type, and its repr cut short."""
    return f"{type(value).__name__} {value!r:.60}"


def _unknown(
    name: str, table: Mapping[str, Param], refused: Mapping[str, str], scope: str
) -> RequestRejected:
    """The refusal of a parameter the table does not hold: why, or the nearest known name."""
    reason = refused.get(name)
    if reason is not None:
        return _rejected(f"parameter {name!r} is refused: {reason}", scope)
    near = difflib.get_close_matches(name, table.keys(), n=1)
    hint = f"did you mean {near[0]!r}?" if near else "provider fields go in extra_body={...}"
    return _rejected(f"unknown parameter {name!r} ({hint})", scope)


def _check_params(
    params: Mapping[str, Any],
    table: Mapping[str, Param],
    refused: Mapping[str, str],
    owned: Sequence[str],
    scope: str,
) -> None:
    """Refuse the first parameter the table does not hold or whose value it does not accept."""
    for name, value in params.items():
        param = table.get(name)
        if param is None:
            raise _unknown(name, table, refused, scope)
        if value is None or (param.plain and type(value) in param.types):
            continue
        floor = param.minimum
        if floor is not None and type(value) is int and value >= floor:
            continue  # a count in range (max_tokens is on the hot path)
        if not param.accepts(value):
            # A value newer than the table still reaches the provider through extra_body.
            hint = " (another value goes in extra_body={...})" if param.choices else ""
            raise _rejected(f"{name} must be {param.expected()}, not {_shown(value)}{hint}", scope)
    extra = params.get("extra_body")
    if extra:
        for name in owned:
            if name in extra:
                raise _rejected(f"extra_body cannot set {name!r}: the gateway writes it", scope)


def check_embedding_params(params: Mapping[str, Any], scope: str) -> None:
    """Refuse an unknown or mistyped embeddings parameter, ``model=`` or ``input=``.

    Raises:
        RequestRejected: naming the parameter.
    """
    if params:
        _check_params(params, OPENAI_EMBEDDING_PARAMS, _EMBED_REFUSED, _EMBED_OWNED, scope)


# --- Messages --------------------------------------------------------------------------------

_ROLES_SHOWN: Final = "system, developer, user, assistant, tool"
"""The roles an error lists; the legacy ``function`` role is accepted but not advertised."""

_PLAIN_ROLES: Final = frozenset({"system", "developer", "user", "assistant"})
"""Roles whose ``{"role", "content": str}`` message is whole (the fast path)."""

_KEYS: Final[Mapping[str, frozenset[str]]] = {
    "system": frozenset({"role", "content", "name"}),
    "developer": frozenset({"role", "content", "name"}),
    "user": frozenset({"role", "content", "name"}),
    "assistant": frozenset(
        {"role", "content", "name", "tool_calls", "function_call", "refusal", "audio"}
    ),
    "tool": frozenset({"role", "content", "tool_call_id"}),
    "function": frozenset({"role", "content", "name"}),
}
"""The keys a message of each role may carry."""

_PART_TYPES: Final[Mapping[str, tuple[str, ...]]] = {
    "system": ("text",),
    "developer": ("text",),
    "user": ("text", "image_url", "input_audio", "file"),
    "assistant": ("text", "refusal"),
    "tool": ("text",),
}
"""The content part types of each role; a ``function`` message's content is text only."""

_OPENAI_PARTS: Final = frozenset({"text", "image_url", "input_audio", "file", "refusal"})
_AUDIO_FORMATS: Final = ("wav", "mp3")


def _part_fault(part: object, types: tuple[str, ...], native_blocks: bool) -> str | None:
    """What is wrong with one content part, as ``field: problem`` under the part, or ``None``."""
    if not isinstance(part, Mapping):
        return f": must be an object, not {_shown(part)}"
    kind = part.get("type")
    if kind not in types:
        if native_blocks and isinstance(kind, str) and kind not in _OPENAI_PARTS:
            return None
        return f".type: {kind!r} is not one of {', '.join(types)}"
    if kind == "text" or kind == "refusal":
        if not isinstance(part.get(kind), str):
            return f".{kind}: must be a string, not {_shown(part.get(kind))}"
        return None
    body = part.get(kind)
    if not isinstance(body, Mapping):
        return f".{kind}: must be an object, not {_shown(body)}"
    if kind == "image_url" and not isinstance(body.get("url"), str):
        return f".image_url.url: must be a string, not {_shown(body.get('url'))}"
    if kind == "input_audio":
        if not isinstance(body.get("data"), str):
            return f".input_audio.data: must be a string, not {_shown(body.get('data'))}"
        if body.get("format") not in _AUDIO_FORMATS:
            return f".input_audio.format: {body.get('format')!r} is not one of wav, mp3"
    return None


def _content_fault(message: Mapping[str, Any], role: str, native_blocks: bool) -> str | None:
    """What is wrong with a message's content, as ``.content...: problem``, or ``None``."""
    content = message.get("content")
    if isinstance(content, str):
        return None
    if content is None:
        if role == "function" and "content" in message:
            return None
        if role == "assistant" and (
            message.get("tool_calls") or message.get("function_call") or message.get("audio")
        ):
            return None
        if "content" not in message:
            return ".content: missing"
        return ".content: may be null only in an assistant message with tool_calls"
    types = _PART_TYPES.get(role)
    if types is None or not isinstance(content, list | tuple):
        want = "a string" if types is None else "a string or a list of content parts"
        return f".content: must be {want}, not {_shown(content)}"
    for i, part in enumerate(content):
        fault = _part_fault(part, types, native_blocks)
        if fault is not None:
            return f".content[{i}]{fault}"
    return None


def _tool_call_fault(call: object) -> str | None:
    """What is wrong with one of an assistant's ``tool_calls``, or ``None``."""
    if not isinstance(call, Mapping):
        return f": must be an object, not {_shown(call)}"
    call_id = call.get("id")
    if not isinstance(call_id, str) or not call_id:
        return f".id: must be a non-empty string, not {_shown(call_id)}"
    kind = call.get("type")
    if kind not in ("function", "custom"):
        return f".type: {kind!r} is not one of function, custom"
    body = call.get(kind)
    if not isinstance(body, Mapping):
        return f".{kind}: must be an object, not {_shown(body)}"
    if not isinstance(body.get("name"), str):
        return f".{kind}.name: must be a string, not {_shown(body.get('name'))}"
    field = "arguments" if kind == "function" else "input"
    if not isinstance(body.get(field), str):
        return f".{kind}.{field}: must be a string (JSON text), not {_shown(body.get(field))}"
    return None


def _message_fault(message: object, native_blocks: bool) -> str | None:
    """What is wrong with one message, as ``.field: problem`` (or ``: problem``), or ``None``."""
    if not isinstance(message, Mapping):
        return f": must be an object, not {_shown(message)}"
    role = message.get("role")
    keys = _KEYS.get(role) if isinstance(role, str) else None
    if keys is None or not isinstance(role, str):
        if role is None:
            return ".role: missing"
        return f".role: {role!r:.60} is not one of {_ROLES_SHOWN}"
    for key in message:
        if key not in keys:
            return f".{key}: not a key of a {role} message ({', '.join(sorted(keys))})"
    fault = _content_fault(message, role, native_blocks)
    if fault is not None:
        return fault
    if "name" in message and not isinstance(message["name"], str):
        return f".name: must be a string, not {_shown(message['name'])}"
    if role == "function" and not isinstance(message.get("name"), str):
        return ".name: a function message needs the function's name"
    if role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is None:
            return ".tool_call_id: missing (the id of the tool call this message answers)"
        if not isinstance(call_id, str) or not call_id:
            return f".tool_call_id: must be a non-empty string, not {_shown(call_id)}"
    if role == "assistant":
        return _assistant_fault(message)
    return None


def _assistant_fault(message: Mapping[str, Any]) -> str | None:
    """What is wrong with an assistant message's fields besides its content, or ``None``."""
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list | tuple):
            return f".tool_calls: must be a list, not {_shown(calls)}"
        for i, call in enumerate(calls):
            fault = _tool_call_fault(call)
            if fault is not None:
                return f".tool_calls[{i}]{fault}"
    function_call = message.get("function_call")
    if function_call is not None and not (
        isinstance(function_call, Mapping)
        and isinstance(function_call.get("name"), str)
        and isinstance(function_call.get("arguments"), str)
    ):
        return ".function_call: must be an object with a name and arguments (JSON text)"
    refusal = message.get("refusal")
    if refusal is not None and not isinstance(refusal, str):
        return f".refusal: must be a string, not {_shown(refusal)}"
    audio = message.get("audio")
    if audio is not None and not (isinstance(audio, Mapping) and isinstance(audio.get("id"), str)):
        return ".audio: must be an object with the id of a previous audio answer"
    return None


def _check_messages(messages: object, native_blocks: bool, scope: str) -> list[Mapping[str, Any]]:
    """The caller's messages as a list, or ``RequestRejected`` naming the first fault."""
    if type(messages) is list and messages:
        # The common case, checked without the ABCs' slower isinstance: a plain role with
        # exactly a role and text content is whole.
        for message in messages:
            if type(message) is not dict or len(message) != 2:
                break
            role = message.get("role")
            if (
                type(role) is not str
                or role not in _PLAIN_ROLES
                or type(message.get("content")) is not str
            ):
                break
        else:
            return list(messages)
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise _rejected(
            f"messages must be a list of message objects, not {_shown(messages)}", scope
        )
    if not messages:
        raise _rejected("messages must not be empty", scope)
    for i, message in enumerate(messages):
        fault = _message_fault(message, native_blocks)
        if fault is not None:
            raise _rejected(f"messages[{i}]{fault}", scope)
    return list(messages)


class ChatCheck:
    """The checks of a chat scope's calls: its parameter table and how it takes content parts.

    Built once per client from the protocols of the scope's sources.
    """

    __slots__ = (
        "_complete_refused",
        "_complete_table",
        "_native_blocks",
        "_stream_refused",
        "_table",
    )

    def __init__(self, protocols: Iterable[str]) -> None:
        # Messages API parameters and blocks only where no OpenAI source could be given them.
        self._native_blocks = set(protocols) == {"anthropic"}
        table = (
            {**OPENAI_CHAT_PARAMS, **ANTHROPIC_MESSAGES_PARAMS}
            if self._native_blocks
            else OPENAI_CHAT_PARAMS
        )
        self._table: Mapping[str, Param] = table
        # stream_options without a stream is a 400 at OpenAI: refused, with the reason.
        self._complete_table: Mapping[str, Param] = {
            name: param for name, param in table.items() if name != "stream_options"
        }
        # A Messages API name where an OpenAI source may serve is refused with the way round.
        foreign = {
            name: _MESSAGES_API_ONLY for name in ANTHROPIC_MESSAGES_PARAMS if name not in table
        }
        self._complete_refused: Mapping[str, str] = {**foreign, **_COMPLETE_REFUSED}
        self._stream_refused: Mapping[str, str] = {**foreign, **_STREAM_REFUSED}

    def complete(
        self, messages: object, params: Mapping[str, Any], scope: str
    ) -> list[Mapping[str, Any]]:
        """The messages of a ``complete()`` call, once they and its parameters are checked.

        Raises:
            RequestRejected: naming the first bad message field or parameter.
        """
        checked = _check_messages(messages, self._native_blocks, scope)
        if params:
            _check_params(params, self._complete_table, self._complete_refused, _CHAT_OWNED, scope)
            if "functions" in params or "function_call" in params:
                _check_legacy_functions(params, scope)
            n = params.get("n")
            if self._native_blocks and n is not None and n != 1:
                # No source of the scope could answer more than one (transport/anthropic.py).
                raise _rejected(
                    f"the Messages API answers one choice: n must be 1, not {_shown(n)} "
                    "(every source of this scope is an Anthropic one)",
                    scope,
                )
        return checked

    def stream(
        self, messages: object, params: Mapping[str, Any], scope: str
    ) -> list[Mapping[str, Any]]:
        """The messages of a ``stream()`` call, once they and its parameters are checked.

        Raises:
            RequestRejected: naming the first bad message field or parameter.
        """
        checked = _check_messages(messages, self._native_blocks, scope)
        if params:
            _check_params(params, self._table, self._stream_refused, _CHAT_OWNED, scope)
            if "functions" in params or "function_call" in params:
                _check_legacy_functions(params, scope)
            n = params.get("n")
            if n is not None and n != 1:
                # Chunks carry every choice interleaved; a stream is read as one answer.
                raise _rejected(
                    f"stream() reads one choice: n must be 1, not {_shown(n)} "
                    "(complete() returns every choice on r.choices)",
                    scope,
                )
        return checked
