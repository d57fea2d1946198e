"""The Anthropic Messages wire format: chat completions, plain and streamed, as ``POST /messages``.

Pure functions and one stream reader, no I/O. A chat call takes OpenAI-style
messages and parameters whichever source serves it; this module builds the
Messages API request from them and reads the answer back into the same
``ParsedChat`` and ``ChatChunk`` the OpenAI wire gives, so a scope may mix
both kinds of source and a caller cannot tell which one served. The mapping
follows the public Messages API reference (``anthropic-version: 2023-06-01``):

- system (and developer) messages become the top-level ``system`` text;
- content parts: text as text blocks, ``image_url`` as an image block (a
  ``data:`` URL as a base64 source, an http(s) URL as a url source), a
  ``file`` part's PDF (``file_data``) as a document block titled by its
  ``filename``, any other part (a block already in Anthropic's shape) as
  given; audio and a Files API ``file_id`` have no Messages API block and
  are refused;
- OpenAI's parameters without a Messages API field are left out, as
  Anthropic's own OpenAI compatibility layer ignores them (``_passed``);
- an assistant's ``tool_calls`` become ``tool_use`` blocks and ``role: "tool"``
  messages a user turn of ``tool_result`` blocks; consecutive turns of one
  role are merged, since the API wants user and assistant turns to alternate;
- each ``tool_result`` goes into the user turn right after its ``tool_use``
  turn, ahead of that turn's text, even when user messages came between the
  call and its result: the API refuses a ``tool_use`` not answered there,
  results first (``_place_result``);
- ``parallel_tool_calls=False`` becomes ``tool_choice.disable_parallel_tool_use``;
- OpenAI's legacy function calling is mapped as its successor is: each of
  ``functions`` as the tool a function tool would be, ``function_call`` as
  ``tool_choice`` (one call at most: a legacy answer holds one), an
  assistant's ``function_call`` as a ``tool_use`` block and the
  ``role: "function"`` message after it as its ``tool_result``, the two
  paired by an id made from the call's position (the legacy protocol has
  none, the Messages API requires one); the combinations OpenAI refuses
  (``functions`` with ``tools``, ``function_call`` with ``tool_choice`` or
  without ``functions``) never get here: the chat client refuses them
  before a permit is taken (``transport/params.py``);
- ``max_tokens`` is required by the API: ``DEFAULT_MAX_TOKENS`` when unset;
- stop reasons are mapped to OpenAI's words (``end_turn`` -> ``stop``, ...),
  usage to prompt (input, cache writes, cache reads) and completion tokens.

An Anthropic stream has no ``[DONE]``: it ends with ``message_stop`` and the
connection closing, which the transport reports as a truncated stream; the
``message_delta`` before it carries the finish reason that makes that end a
clean one for the chat client. A message the API cannot carry (an unknown
role, tool-call arguments that are not a JSON object, an image URL that is
neither ``data:`` nor http(s), a function result that answers no call) is
refused as the request's fault, before anything is sent.

The answer to a call that offered ``functions`` (``answers_legacy_functions``)
reads back as OpenAI's legacy answer when the reader is told so
(``parse_messages_response(..., legacy=True)``, ``MessagesStreamReader(legacy=True)``):
its ``tool_use`` as a ``function_call`` call with an empty id, and the
``tool_use`` stop as the ``function_call`` finish.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from polygateway.models import (
    ChatChunk,
    Choice,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from polygateway.transport.http import HintSink, HttpRequest, TransientError, excerpt
from polygateway.transport.openai import ParsedChat
from polygateway.transport.wire import (
    add_headers,
    endpoint,
    key_header,
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
    "ANTHROPIC_VERSION",
    "DEFAULT_MAX_TOKENS",
    "IGNORED_OPENAI_PARAMS",
    "MessagesStreamReader",
    "answers_legacy_functions",
    "event_has_content",
    "event_model",
    "finish_reason",
    "messages_request",
    "parse_messages_response",
    "provider_error",
    "streamed_arguments",
]

ANTHROPIC_VERSION: Final = "2023-06-01"
"""The ``anthropic-version`` header sent unless the source's ``headers`` set their own."""

DEFAULT_MAX_TOKENS: Final = 4096
"""``max_tokens`` sent when the caller set none: the API refuses a request without it.

The OpenAI wire leaves an unset limit unset, so a call that names none is
served by either kind of source in a mixed scope.
"""

_STOP_REASONS: Final[Mapping[str, str]] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    # The context window filled before max_tokens: cut short all the same.
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}
"""Anthropic's stop reasons in OpenAI's words; others (``pause_turn``, ...) are kept as given."""

_ERROR_STATUSES: Final[Mapping[str, int]] = {
    "overloaded_error": 529,
    "rate_limit_error": 429,
    "api_error": 500,
}
"""The HTTP status an in-band error type stands for, so it is classified as that status."""

_MAPPED = frozenset(
    {
        "model",
        "messages",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "user",
        "extra_body",
    }
)
"""Call parameters this module translates or drops; every other one passes through as given.

``extra_body`` is merged into the body last, its fields winning over any of the same name.
"""

IGNORED_OPENAI_PARAMS: Final = frozenset(
    {
        "audio",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "modalities",
        "moderation",
        "prediction",
        "presence_penalty",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "reasoning_effort",
        "response_format",
        "safety_identifier",
        "seed",
        "store",
        "top_logprobs",
        "verbosity",
        "web_search_options",
    }
)
"""OpenAI chat parameters the Messages API has no field for: left out of the body.

Sent, each is a 400 ("``seed``: Extra inputs are not permitted") that ends the
call as ``RequestRejected``, even in a scope whose OpenAI sources would serve
it. Anthropic's own OpenAI compatibility layer ignores them alike
(https://docs.anthropic.com/en/api/openai-sdk, "Request fields"); a request
that needs one honoured belongs on a scope of sources that have it.
"""

_MAX_TEMPERATURE: Final = 1
"""The Messages API's highest ``temperature`` (OpenAI's is 2): higher is capped to it, as
Anthropic's OpenAI compatibility layer caps it."""

_SERVICE_TIERS: Final = frozenset({"auto", "standard_only"})
"""The Messages API's ``service_tier`` values; OpenAI's others (``flex``, ...) are left out."""

_TOOL_CHOICES: Final[Mapping[str, dict[str, str]]] = {
    "auto": {"type": "auto"},
    "none": {"type": "none"},
    "required": {"type": "any"},
}

_FUNCTION_CALLS: Final[Mapping[str, dict[str, Any]]] = {
    "auto": {"type": "auto", "disable_parallel_tool_use": True},
    "none": {"type": "none"},
}
"""Legacy ``function_call`` words as ``tool_choice``: a legacy answer holds one call at most."""

_FUNCTION_CALL: Final = "function_call"
"""The legacy protocol's word: the finish of an answer to ``functions`` that calls one, and
the ``ToolCall.type`` of that call (``transport/openai.py`` reads an OpenAI answer so)."""

_SYSTEM_ROLES = frozenset({"system", "developer"})
_JSON = "application/json"


# --- The request ---------------------------------------------------------------------------


def _rejected(source: str, detail: str) -> TransientError:
    """The caller's request cannot be written as a Messages API request: its fault, no retry."""
    return TransientError(
        f"the request to {source} was not sent: {detail}", failure="request_rejected"
    )


def _headers(source: SourceConfig) -> dict[str, str]:
    """Key, version and content type, then the source's own headers, which win by any case."""
    headers = {"Content-Type": _JSON, "anthropic-version": ANTHROPIC_VERSION}
    key = key_header(source, "x-api-key")
    if key is not None:
        headers[key[0]] = key[1]
    if source.headers:
        # Names are case-insensitive: a source's "Anthropic-Version" replaces ours, not joins it.
        own = {name.lower() for name in source.headers}
        headers = {name: value for name, value in headers.items() if name.lower() not in own}
        headers.update(source.headers)
    return headers


def _base64_data(url: str) -> tuple[str, str] | None:
    """A base64 ``data:`` URL's media type and data; ``None`` for any other text."""
    if not url.startswith("data:"):
        return None
    header, comma, data = url[5:].partition(",")
    media_type, *options = header.split(";")
    if not comma or "base64" not in options or not media_type:
        return None
    return media_type, data


def _image(url: Any, what: str, source: str) -> dict[str, Any]:
    """An ``image_url`` as an image block: a base64 ``data:`` URL or an http(s) URL."""
    if not isinstance(url, str):
        raise _rejected(source, f"{what} has no URL")
    if url.startswith("data:"):
        inline = _base64_data(url)
        if inline is None:
            raise _rejected(source, f"{what} is a data: URL that is not base64 with a media type")
        media_type, data = inline
        return {
            "type": "image",
            "source": {"type": "base64", "media_type": media_type, "data": data},
        }
    if url[:8].lower().startswith(("http://", "https://")):
        return {"type": "image", "source": {"type": "url", "url": url}}
    raise _rejected(source, f"{what} is neither a data: URL nor an http(s) URL")


def _document(file: Any, what: str, source: str) -> dict[str, Any]:
    """A ``file`` part's PDF (``file_data``, a base64 ``data:`` URL) as a document block.

    Its ``filename`` becomes the document's ``title``. A ``file_id`` names a
    file of OpenAI's Files API, which an Anthropic source cannot read.
    """
    if not isinstance(file, Mapping):
        raise _rejected(source, f"{what} is not an object")
    file_data = file.get("file_data")
    if file_data is None and file.get("file_id") is not None:
        raise _rejected(
            source,
            f"{what}.file_id names a file of OpenAI's Files API, which an Anthropic source "
            "cannot read: send the file's content as file_data",
        )
    inline = _base64_data(file_data) if isinstance(file_data, str) else None
    if inline is None or inline[0] != "application/pdf":
        raise _rejected(
            source,
            f"{what}.file_data is no base64 data: URL of a PDF, the one file the Messages "
            "API reads as a document",
        )
    block: dict[str, Any] = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": inline[1]},
    }
    filename = file.get("filename")
    if isinstance(filename, str) and filename:
        block["title"] = filename
    return block


def _part(part: Any, what: str, source: str) -> dict[str, Any]:
    """One content part as a content block."""
    if not isinstance(part, Mapping):
        raise _rejected(source, f"{what} is not an object")
    kind = part.get("type", "text")
    if kind == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise _rejected(source, f"{what}.text is not a string")
        return {**part, "type": "text"}
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, Mapping) else image
        return _image(url, f"{what}.image_url", source)
    if kind == "file":
        return _document(part.get("file"), f"{what}.file", source)
    if kind == "input_audio":
        raise _rejected(source, f"{what} is audio, which the Messages API does not take")
    # Anything else is taken to be a block in Anthropic's own shape (image, document, ...).
    return dict(part)


def _content(value: Any, what: str, source: str) -> str | list[dict[str, Any]]:
    """Message content: a string as is, a list of parts as blocks, null as empty."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence):
        return [_part(part, f"{what}[{i}]", source) for i, part in enumerate(value)]
    raise _rejected(source, f"{what} is neither a string nor a list of parts")


def _blocks(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Content as a list of blocks; an empty string is no block (the API refuses empty text)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return content


def _system_text(value: Any, what: str, source: str) -> str:
    """A system message's text: a string, or its text parts joined."""
    content = _content(value, what, source)
    if isinstance(content, str):
        return content
    texts = []
    for i, block in enumerate(content):
        if block.get("type") != "text":
            raise _rejected(source, f"{what}[{i}] is not text, and the system prompt is text only")
        texts.append(block["text"])
    return "".join(texts)


def _tool_input(arguments: Any, what: str, source: str) -> dict[str, Any]:
    """Tool-call arguments (JSON text, or an object) as the ``input`` object of a ``tool_use``."""
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError) as exc:
            raise _rejected(source, f"{what} is not valid JSON") from exc
    if not isinstance(arguments, dict):
        raise _rejected(source, f"{what} is not a JSON object")
    return arguments


def _tool_use(call: Any, what: str, source: str) -> dict[str, Any]:
    """One of an assistant's ``tool_calls`` as a ``tool_use`` block."""
    if not isinstance(call, Mapping):
        raise _rejected(source, f"{what} is not an object")
    function = call.get("function")
    call_id = call.get("id")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise _rejected(source, f"{what}.function has no name")
    if not isinstance(call_id, str) or not call_id:
        raise _rejected(source, f"{what} has no id, which a tool_result must refer to")
    return _use_block(
        call_id, function["name"], function.get("arguments"), f"{what}.function.arguments", source
    )


def _use_block(call_id: str, name: str, arguments: Any, what: str, source: str) -> dict[str, Any]:
    """A ``tool_use`` block: the call's id and name, its JSON ``arguments`` as the input."""
    return {
        "type": "tool_use",
        "id": call_id,
        "name": name,
        "input": _tool_input(arguments, what, source),
    }


def _legacy_call_id(position: int) -> str:
    """The id of the legacy ``function_call`` of the assistant message at ``position``.

    Made from the position alone, so the same conversation is the same
    request; the ``function`` message answering the call refers to it.
    """
    return f"function_call_{position}"


def _function_use(call: Any, call_id: str, what: str, source: str) -> dict[str, Any]:
    """An assistant's legacy ``function_call`` (``{name, arguments}``) as a ``tool_use`` block."""
    if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
        raise _rejected(source, f"{what} has no name")
    return _use_block(call_id, call["name"], call.get("arguments"), f"{what}.arguments", source)


def _assistant(
    message: Mapping[str, Any], what: str, source: str, legacy_id: str
) -> str | list[dict[str, Any]]:
    """An assistant turn: its content, then its tool calls (and legacy call) as ``tool_use``."""
    content = _content(message.get("content"), f"{what}.content", source)
    calls = message.get("tool_calls")
    legacy = message.get("function_call")
    if not calls and legacy is None:
        return content
    uses = []
    if calls:
        if not isinstance(calls, Sequence) or isinstance(calls, str):
            raise _rejected(source, f"{what}.tool_calls is not a list")
        uses = [_tool_use(call, f"{what}.tool_calls[{i}]", source) for i, call in enumerate(calls)]
    if legacy is not None:
        uses.append(_function_use(legacy, legacy_id, f"{what}.function_call", source))
    return _blocks(content) + uses


def _tool_result(
    message: Mapping[str, Any], call_id: str, what: str, source: str
) -> dict[str, Any]:
    """A ``tool`` (or legacy ``function``) message as the ``tool_result`` block of a user turn."""
    result: dict[str, Any] = {"type": "tool_result", "tool_use_id": call_id}
    content = message.get("content")
    if content is not None:
        result["content"] = _content(content, f"{what}.content", source)
    return result


def _place_result(
    turns: list[dict[str, Any]], result: dict[str, Any], call_turn: int | None
) -> None:
    """Put a ``tool_result`` block in the first user turn after its ``tool_use`` turn.

    The API refuses a ``tool_use`` whose result is not in the very next turn,
    and a turn whose ``tool_result`` blocks do not come before its other
    content; an OpenAI conversation may hold user messages between a call and
    its result, so the result goes after the results already there and
    before that turn's text. A result whose call is the last turn opens the
    next one; one answering no call is mapped where it stands.
    """
    if call_turn is not None and call_turn + 1 < len(turns):
        turn = turns[call_turn + 1]
        blocks = _blocks(turn["content"])
        first = next(
            (i for i, block in enumerate(blocks) if block.get("type") != "tool_result"),
            len(blocks),
        )
        turn["content"] = [*blocks[:first], result, *blocks[first:]]
    elif turns and turns[-1]["role"] == "user":
        turns[-1]["content"] = [*_blocks(turns[-1]["content"]), result]
    else:
        turns.append({"role": "user", "content": [result]})


def _turns(messages: Sequence[Mapping[str, Any]], source: str) -> tuple[str, list[dict[str, Any]]]:
    """The system text and the alternating user / assistant turns of OpenAI-style messages."""
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    # The id of the last assistant function_call no function message has answered yet.
    unanswered: str | None = None
    # Each tool_use id, and the index of the assistant turn holding it.
    call_turns: dict[str, int] = {}
    for i, message in enumerate(messages):
        what = f"messages[{i}]"
        role = message.get("role")
        content: str | list[dict[str, Any]]
        if role in _SYSTEM_ROLES:
            text = _system_text(message.get("content"), f"{what}.content", source)
            if text:
                system.append(text)
            continue
        if role == "user":
            content = _content(message.get("content"), f"{what}.content", source)
        elif role == "assistant":
            content = _assistant(message, what, source, _legacy_call_id(i))
            unanswered = _legacy_call_id(i) if message.get("function_call") is not None else None
        elif role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _rejected(source, f"{what} has no tool_call_id")
            result = _tool_result(message, call_id, what, source)
            _place_result(turns, result, call_turns.get(call_id))
            continue
        elif role == "function":
            if unanswered is None:
                raise _rejected(
                    source, f"{what} is a function result with no assistant function_call before it"
                )
            result = _tool_result(message, unanswered, what, source)
            _place_result(turns, result, call_turns.get(unanswered))
            unanswered = None
            continue
        else:
            raise _rejected(source, f"{what} has role {role!r}, which has no Messages API turn")
        if turns and turns[-1]["role"] == role:
            last = turns[-1]
            last["content"] = _blocks(last["content"]) + _blocks(content)
        else:
            turns.append({"role": role, "content": content})
        if role == "assistant" and isinstance(content, list):
            for block in content:
                if block.get("type") == "tool_use" and isinstance(block.get("id"), str):
                    call_turns[block["id"]] = len(turns) - 1
    return "\n\n".join(system), turns


def _tool(tool: Any, what: str, source: str) -> dict[str, Any]:
    """An OpenAI function tool as an Anthropic tool; one already in Anthropic's shape as given."""
    if not isinstance(tool, Mapping):
        raise _rejected(source, f"{what} is not an object")
    if tool.get("type") != "function":
        return dict(tool)
    return _function_tool(tool.get("function"), f"{what}.function", source)


def _function_tool(function: Any, what: str, source: str) -> dict[str, Any]:
    """An OpenAI function (a function tool's, or one of legacy ``functions``) as an Anthropic tool.

    ``parameters`` is the ``input_schema``; a function without one takes no arguments.
    """
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise _rejected(source, f"{what} has no name")
    mapped: dict[str, Any] = {"name": function["name"]}
    description = function.get("description")
    if description is not None:
        mapped["description"] = description
    schema = function.get("parameters")
    mapped["input_schema"] = schema if schema is not None else {"type": "object", "properties": {}}
    return mapped


def _tool_choice(choice: Any, source: str) -> dict[str, Any]:
    """OpenAI's ``tool_choice`` in Anthropic's words; an Anthropic-shaped object as given."""
    if isinstance(choice, str):
        mapped = _TOOL_CHOICES.get(choice)
        if mapped is None:
            raise _rejected(source, f"tool_choice {choice!r} is not auto, none or required")
        return dict(mapped)
    if not isinstance(choice, Mapping):
        raise _rejected(source, "tool_choice is neither a string nor an object")
    if choice.get("type") == "function":
        function = choice.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise _rejected(source, "tool_choice.function has no name")
        return {"type": "tool", "name": function["name"]}
    return dict(choice)


def _functions(
    params: Mapping[str, Any], source: str
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Legacy ``functions`` and ``function_call`` as ``tools`` and ``tool_choice``.

    The chat client has refused what OpenAI refuses (either beside its
    successor, ``function_call`` without ``functions``, an empty list:
    ``transport/params.py``) before any permit; what is left to refuse here
    is what the Messages API cannot carry.
    """
    functions = params.get("functions")
    choice = params.get("function_call")
    if not isinstance(functions, Sequence) or isinstance(functions, str):
        raise _rejected(source, "functions is not a list")
    tools = [_function_tool(f, f"functions[{i}]", source) for i, f in enumerate(functions)]
    if choice is None:
        choice = "auto"
    if isinstance(choice, str) and choice in _FUNCTION_CALLS:
        return tools, dict(_FUNCTION_CALLS[choice])
    if isinstance(choice, Mapping) and isinstance(choice.get("name"), str):
        return tools, {"type": "tool", "name": choice["name"], "disable_parallel_tool_use": True}
    raise _rejected(source, "function_call is neither auto, none nor {'name': ...}")


def answers_legacy_functions(params: Mapping[str, Any]) -> bool:
    """Whether a call's answer is read as OpenAI's legacy one: the call offered ``functions``."""
    return params.get("functions") is not None


def _disable_parallel_tool_use(body: dict[str, Any]) -> None:
    """``parallel_tool_calls=False`` in Anthropic's words: a flag on ``tool_choice``.

    The Messages API has no top-level field of that name (it refuses an
    unknown one); its ``auto``, ``any`` and ``tool`` choices take
    ``disable_parallel_tool_use``, ``none`` does not (no call to limit). A flag
    the caller's own Anthropic-shaped choice sets is kept.
    """
    choice = body.get("tool_choice") or {"type": "auto"}
    if choice.get("type") != "none":
        body["tool_choice"] = {"disable_parallel_tool_use": True, **choice}


def _stop_sequences(stop: Any, source: str) -> list[str]:
    """``stop`` (a string or a list of strings) as ``stop_sequences``."""
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise _rejected(source, "stop is neither a string nor a list of strings")


def _passed(params: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The parameters that go into the body as they are, or as far as the Messages API has them.

    Those this module translates are left for ``messages_request``; an OpenAI parameter
    without a Messages API field is left out (``IGNORED_OPENAI_PARAMS``); ``temperature``
    is capped at 1, ``metadata`` keeps ``user_id``, ``service_tier`` only the API's own
    tiers; ``n`` must be 1 (the API answers one choice).
    """
    body: dict[str, Any] = {}
    for key, value in params.items():
        if value is None or key in _MAPPED or key in IGNORED_OPENAI_PARAMS:
            continue
        if key == "n":
            if value != 1:
                raise _rejected(
                    source, f"the Messages API answers one choice: n must be 1, not {value!r}"
                )
            continue
        if key == "temperature" and isinstance(value, int | float) and value > _MAX_TEMPERATURE:
            value = _MAX_TEMPERATURE
        elif key == "metadata" and isinstance(value, Mapping):
            if "user_id" not in value:
                continue
            value = {"user_id": value["user_id"]}
        elif key == "service_tier" and value not in _SERVICE_TIERS:
            continue
        body[key] = value
    return body


def messages_request(
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
    """The request of one chat completion to an Anthropic ``source`` (``POST {base_url}/messages``).

    ``params`` use the OpenAI names: ``max_tokens`` (or
    ``max_completion_tokens``; ``DEFAULT_MAX_TOKENS`` when neither is set),
    ``stop``, ``tools``, ``tool_choice``, ``parallel_tool_calls`` (false: at
    most one tool call, ``_disable_parallel_tool_use``; true is the API's
    default) and ``user`` are translated,
    ``stream_options`` is dropped (every Anthropic stream reports usage),
    OpenAI's parameters without a Messages API field are left out and
    ``temperature``, ``metadata``, ``service_tier`` and ``n`` kept to what the
    API takes (``_passed``), every other parameter (top_p, top_k, ...) passes
    through as given, and the fields of ``extra_body`` are merged into the top level
    last, winning over any of the same name (as the openai SDK merges it).
    A stream carries the TTFT timeout as its ``timeout_s``, which runs to the
    first content (``event_has_content``), and the idle timeout separately;
    each defaults to ``timeout_s``. ``extra_headers`` (trace context) are
    added where the request has no header of the name (``wire.add_headers``).

    Raises:
        TransientError: ``request_rejected``, for messages or parameters the
            Messages API cannot carry.
    """
    name = source.name
    system, turns = _turns(messages, name)
    body = _passed(params, name)
    body["model"] = source.model
    limit = params.get("max_tokens")
    if limit is None:
        limit = params.get("max_completion_tokens")
    body["max_tokens"] = DEFAULT_MAX_TOKENS if limit is None else limit
    if system:
        body["system"] = system
    body["messages"] = turns
    if (stop := params.get("stop")) is not None:
        body["stop_sequences"] = _stop_sequences(stop, name)
    if (tools := params.get("tools")) is not None:
        if not isinstance(tools, Sequence) or isinstance(tools, str):
            raise _rejected(name, "tools is not a list")
        body["tools"] = [_tool(tool, f"tools[{i}]", name) for i, tool in enumerate(tools)]
    if (choice := params.get("tool_choice")) is not None:
        body["tool_choice"] = _tool_choice(choice, name)
    if params.get("functions") is not None:
        body["tools"], body["tool_choice"] = _functions(params, name)
    if params.get("parallel_tool_calls") is False and body.get("tools"):
        _disable_parallel_tool_use(body)
    if (user := params.get("user")) is not None:
        metadata = body.get("metadata")
        body["metadata"] = {**(metadata if isinstance(metadata, Mapping) else {}), "user_id": user}
    if stream:
        body["stream"] = True
    if extra := params.get("extra_body"):
        body.update(extra)
    headers = _headers(source)
    if extra_headers:
        add_headers(headers, extra_headers)
    return HttpRequest(
        name,
        endpoint(source, "messages"),
        (ttft_timeout_s or timeout_s) if stream else timeout_s,  # timeout_s
        headers=headers,
        json=body,
        idle_timeout_s=(idle_timeout_s or timeout_s) if stream else None,
        connect_timeout_s=source.connect_timeout_s,
        is_content=event_has_content if stream else None,
        on_hint=on_hint,
    )


# --- The answer ----------------------------------------------------------------------------


def finish_reason(stop_reason: str | None, *, legacy: bool = False) -> str | None:
    """An Anthropic ``stop_reason`` in OpenAI's words (``end_turn`` -> ``stop``, ...).

    ``legacy``: the answer is to a call that offered ``functions``, whose
    call OpenAI finishes as ``function_call``, not ``tool_calls``.
    """
    if stop_reason is None:
        return None
    if legacy and stop_reason == "tool_use":
        return _FUNCTION_CALL
    return _STOP_REASONS.get(stop_reason, stop_reason)


def provider_error(error: Any) -> TransientError:
    """The failure an Anthropic error object (``{"type": ..., "message": ...}``) reports.

    ``overloaded_error``, ``rate_limit_error`` and ``api_error`` are classified
    as the statuses they stand for (529, 429, 500); any other is transient.
    """
    kind = error.get("type") if isinstance(error, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    kind = kind if isinstance(kind, str) else "error"
    detail = kind if message is None else f"{kind}: {message}"
    return TransientError(
        f"provider error: {excerpt(detail)}", status_code=_ERROR_STATUSES.get(kind)
    )


def _is_error(body: dict[str, Any]) -> bool:
    return body.get("type") == "error" or body.get("error") is not None


def _input_counts(usage: dict[str, Any], what: str) -> tuple[int, int, int]:
    """(input, cache writes, cache reads): together, the prompt the provider counted."""
    return (
        opt_int(usage.get("input_tokens"), f"{what}.input_tokens"),
        opt_int(usage.get("cache_creation_input_tokens"), f"{what}.cache_creation_input_tokens"),
        opt_int(usage.get("cache_read_input_tokens"), f"{what}.cache_read_input_tokens"),
    )


def _usage(value: Any) -> Usage:
    """A message's usage: cached prompt tokens are prompt tokens too."""
    usage = req_obj(value, "usage")
    prompt = sum(_input_counts(usage, "usage"))
    completion = opt_int(usage.get("output_tokens"), "usage.output_tokens")
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


def _arguments(value: Any, what: str) -> str:
    """A ``tool_use`` input as the JSON text of OpenAI's tool-call arguments."""
    return json.dumps(req_obj(value, what), ensure_ascii=False)


def parse_messages_response(body: Any, *, legacy: bool = False) -> ParsedChat:
    """Read a Messages API answer; any shape but the promised one is a malformed body.

    Text blocks are joined, ``tool_use`` blocks become tool calls; other
    blocks (thinking, server tools) have no place in the chat answer and are
    skipped. An error object raises its classified failure (``provider_error``).

    ``legacy``: the answer is to a call that offered ``functions``
    (``answers_legacy_functions``), read as an OpenAI source answers one: a
    ``function_call`` call with an empty id, finished as ``function_call``.
    Anthropic's ``toolu_`` id is dropped: the legacy protocol has no ids (a
    ``function`` message answers the call by coming after it, and the
    request side pairs the two by position), so a caller holding the id
    could use it nowhere, and the same answer would read differently by the
    source that served it.
    """
    answer = req_obj(body, "body")
    if _is_error(answer):
        raise provider_error(answer.get("error"))
    texts: list[str] = []
    calls: list[ToolCall] = []
    for i, raw_block in enumerate(req_list(answer.get("content"), "content")):
        what = f"content[{i}]"
        block = req_obj(raw_block, what)
        kind = block.get("type")
        if kind == "text":
            texts.append(req_str(block.get("text"), f"{what}.text"))
        elif kind == "tool_use":
            call_id = req_str(block.get("id"), f"{what}.id")
            calls.append(
                ToolCall(
                    id="" if legacy else call_id,
                    name=req_str(block.get("name"), f"{what}.name"),
                    arguments=_arguments(block.get("input"), f"{what}.input"),
                    type=_FUNCTION_CALL if legacy else "function",
                )
            )
        elif not isinstance(kind, str):
            raise malformed_body(f"{what}.type is not a string")
    raw_usage = answer.get("usage")
    text = "".join(texts)
    finish = finish_reason(opt_str(answer.get("stop_reason"), "stop_reason"), legacy=legacy)
    return ParsedChat(
        text=text,
        finish_reason=finish,
        tool_calls=tuple(calls),
        usage=Usage() if raw_usage is None else _usage(raw_usage),
        raw=answer,
        # The Messages API answers one choice.
        choices=(Choice(0, text, tuple(calls), finish),),
    )


def streamed_arguments(joined: str) -> str:
    """A ``tool_use`` input streamed as partial JSON, written as a completion's input is.

    The joined ``input_json_delta`` pieces are the model's own JSON text
    (compact or spaced; empty for an empty input), while a completion's
    input arrives parsed and is written with ``json.dumps``: re-written the
    same way, a streamed answer's tool calls equal the completion's. Text
    that does not parse is returned as received.
    """
    if not joined.strip():
        return "{}"
    try:
        value = json.loads(joined)
    except (ValueError, RecursionError):
        return joined
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else joined


# --- The stream ----------------------------------------------------------------------------


def event_model(event: Any) -> str | None:
    """The model a stream names: in its ``message_start`` event, else ``None``."""
    if type(event) is dict and event.get("type") == "message_start":
        return response_model(event.get("message"))
    return None


def event_has_content(event: Any) -> bool:
    """Whether a stream event ends the TTFT: it carries content, not just the message's frame.

    Content: a ``content_block_delta`` with text, tool input or thinking, the
    start of a ``tool_use`` block, a ``message_delta`` with a stop reason, or
    an error (or an event not shaped as one), which must surface at once.
    ``message_start``, an empty text block's start, ``ping`` and the ``*_stop``
    events are not. Called on the first events of a stream only; never raises.
    """
    if type(event) is not dict:
        return True
    kind = event.get("type")
    if kind == "content_block_delta":
        delta = event.get("delta")
        if type(delta) is not dict:
            return True
        return bool(delta.get("text") or delta.get("partial_json") or delta.get("thinking"))
    if kind == "content_block_start":
        block = event.get("content_block")
        if type(block) is not dict:
            return True
        return block.get("type") == "tool_use" or bool(block.get("text"))
    if kind == "message_delta":
        delta = event.get("delta")
        return type(delta) is not dict or delta.get("stop_reason") is not None
    return kind == "error" or type(kind) is not str


def _block_index(event: dict[str, Any], what: str) -> int:
    """The ``index`` of a content block event."""
    index = event.get("index")
    if isinstance(index, bool) or not isinstance(index, int):
        raise malformed_body(f"{what}.index is not an integer")
    return index


class MessagesStreamReader:
    """The events of one Messages API stream read into ``ChatChunk``s, as ``parse_chat_chunk`` does.

    Stateful, one per stream: the prompt's token counts come in
    ``message_start`` and the completion's in ``message_delta``, and tool calls
    are numbered among themselves (a ``ToolCallDelta.index`` is the n-th
    ``tool_use`` block, as OpenAI numbers tool calls), not among all blocks.
    Events that carry nothing for the caller (``ping``, ``message_stop``, a
    thinking delta, the input of a server tool Anthropic runs itself, event
    types added to the API later) read as an empty chunk, which the chat
    client does not deliver. ``legacy``: the stream answers a call that
    offered ``functions``, read as ``parse_messages_response`` reads its
    answer: every tool-call piece typed ``function_call``, no id, and the
    ``function_call`` finish.
    """

    __slots__ = (
        "_cache_read",
        "_cache_write",
        "_call_type",
        "_input",
        "_legacy",
        "_others",
        "_tools",
    )

    def __init__(self, *, legacy: bool = False) -> None:
        self._legacy = legacy
        self._call_type = _FUNCTION_CALL if legacy else None
        """The type every tool-call piece names: ``function_call`` for a legacy answer."""
        self._input = 0
        self._cache_write = 0
        self._cache_read = 0
        self._tools: dict[int, int] = {}
        """Content block index -> the tool call's own index."""
        self._others: set[int] = set()
        """Indexes of the other blocks started: a ``server_tool_use`` one streams its input too."""

    def read(self, event: Any, source: str = "") -> ChatChunk:
        """The chunk of one event; an ``error`` event raises its classified failure."""
        if type(event) is not dict:
            raise malformed_body("event is not an object")
        kind = event.get("type")
        if kind == "content_block_delta":
            return self._block_delta(event, source)
        if kind == "content_block_start":
            return self._block_start(event, source)
        if kind == "message_delta":
            return self._message_delta(event, source)
        if kind == "message_start":
            message = req_obj(event.get("message"), "message_start.message")
            usage = message.get("usage")
            if usage is not None:
                counts = _input_counts(req_obj(usage, "message.usage"), "message.usage")
                self._input, self._cache_write, self._cache_read = counts
        elif kind == "error":
            raise provider_error(event.get("error"))
        elif type(kind) is not str:
            raise malformed_body("event.type is not a string")
        return ChatChunk("", (), None, source, None)

    def _block_delta(self, event: dict[str, Any], source: str) -> ChatChunk:
        delta = req_obj(event.get("delta"), "content_block_delta.delta")
        kind = delta.get("type")
        if kind == "text_delta":
            text = req_str(delta.get("text"), "content_block_delta.delta.text")
            return ChatChunk(text, (), None, source, None)
        if kind == "input_json_delta":
            index = _block_index(event, "content_block_delta")
            call = self._tools.get(index)
            if call is None:
                if index in self._others:
                    # A server tool's input (web search, code execution): Anthropic runs it.
                    return ChatChunk("", (), None, source, None)
                raise malformed_body(f"input_json_delta for block {index}, not a started block")
            partial = req_str(delta.get("partial_json"), "content_block_delta.delta.partial_json")
            piece = ToolCallDelta(call, arguments=partial, type=self._call_type)
            return ChatChunk("", (piece,), None, source, None)
        return ChatChunk("", (), None, source, None)

    def _block_start(self, event: dict[str, Any], source: str) -> ChatChunk:
        block = req_obj(event.get("content_block"), "content_block_start.content_block")
        kind = block.get("type")
        if kind == "tool_use":
            index = _block_index(event, "content_block_start")
            call = self._tools.setdefault(index, len(self._tools))
            call_id = req_str(block.get("id"), "content_block.id")
            delta = ToolCallDelta(
                call,
                id=None if self._legacy else call_id,
                name=req_str(block.get("name"), "content_block.name"),
                arguments="",
                type=self._call_type,
            )
            return ChatChunk("", (delta,), None, source, None)
        started = event.get("index")
        if type(started) is int:
            self._others.add(started)
        text = opt_str(block.get("text"), "content_block.text") if kind == "text" else None
        return ChatChunk(text or "", (), None, source, None)

    def _message_delta(self, event: dict[str, Any], source: str) -> ChatChunk:
        delta = req_obj(event.get("delta") or {}, "message_delta.delta")
        finish = finish_reason(
            opt_str(delta.get("stop_reason"), "message_delta.stop_reason"), legacy=self._legacy
        )
        raw_usage = event.get("usage")
        usage = None
        if raw_usage is not None:
            counts = req_obj(raw_usage, "message_delta.usage")
            # Cumulative counts: the input ones, when present, replace those of message_start.
            if counts.get("input_tokens") is not None:
                self._input = opt_int(counts["input_tokens"], "message_delta.usage.input_tokens")
            if counts.get("cache_creation_input_tokens") is not None:
                self._cache_write = opt_int(
                    counts["cache_creation_input_tokens"],
                    "message_delta.usage.cache_creation_input_tokens",
                )
            if counts.get("cache_read_input_tokens") is not None:
                self._cache_read = opt_int(
                    counts["cache_read_input_tokens"],
                    "message_delta.usage.cache_read_input_tokens",
                )
            prompt = self._input + self._cache_write + self._cache_read
            completion = opt_int(counts.get("output_tokens"), "message_delta.usage.output_tokens")
            usage = Usage(prompt, completion, prompt + completion)
        return ChatChunk("", (), finish, source, usage)
