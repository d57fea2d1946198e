"""The simulated upstream as an ASGI app: each source imitates a provider's wire, with faults.

Every source lives under its own path prefix. Its ``wire`` decides which
routes it serves and how every answer looks:

- ``openai``, ``litellm``, ``vllm``: ``/{source}/v1/chat/completions`` and
  ``/{source}/v1/embeddings``;
- ``azure``: ``/{source}/openai/deployments/{deployment}/chat/completions``
  and ``.../embeddings``, with a required ``api-version`` query parameter;
- ``anthropic``: ``/{source}/v1/messages`` (``x-api-key`` and
  ``anthropic-version`` required, ``max_tokens`` required, each ``tool_use``
  answered first in the next message);
- every source: MonkeyOCR's ``/{source}/ocr/text`` and ``/{source}/parse``.

A request is checked at the gate (route, ``api-version``, key headers: 401 /
404 like the real service), read and validated (400, on ``openai`` and
``azure`` for more than 2048 embeddings inputs too), then admitted by the
source's server-side limits (429 with the wire's headers), then plays at most
one random fault drawn from the source's seeded generator, then waits its
latency and answers. Every answer of a limited source carries the wire's
rate-limit headers (research-wiki/guides/providers.md lists them).

Faults on the wire, in every wire's shapes:

- ``429`` / ``5xx``: an error status with the wire's error body (429 carries
  Retry-After; a 5xx too when ``retry_after_on_5xx``).
- ``hang``: no answer until ``hang_s`` passes, the client leaves, or the server shuts down.
- ``reset``: the headers and half the body, then the connection is dropped. The app
  raises ``InjectedReset`` after starting the response, and uvicorn closes the
  transport: a client sees ``httpx.RemoteProtocolError`` (body shorter than its
  Content-Length, or a chunked stream cut short).
- ``malformed`` / ``error_body``: a 200 whose body is not JSON, or is an error
  object; in a stream, an event that is not JSON, or an error event (in band
  after some content on the ``anthropic`` and ``litellm`` wires, before any
  content on the others).
- ``truncate``: a stream that stops cleanly halfway, without its finish events.

A stream sends what the provider sends at once (the OpenAI role chunk;
Anthropic's ``message_start``, ``content_block_start`` and ``ping``), then
waits ``ttft_s`` (on the ``vllm`` wire with ``: keep-alive`` comments), then
the content. Streams are written with Starlette's ``StreamingResponse``
rather than sse-starlette: sse-starlette starts a process-wide shutdown
watcher task that outlives the server, and an embedded simulator must leave
no task behind.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from email.message import Message
from email.parser import BytesParser
from email.policy import HTTP
from pathlib import PurePosixPath
from typing import Any, Final, Literal

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from polygateway.simulator.limits import RateState, SlidingWindow
from polygateway.simulator.payloads import (
    OCR_SUFFIXES,
    ChatReply,
    StreamPlan,
    anthropic_events,
    anthropic_message,
    chat_chunks,
    chat_completion,
    chat_reply,
    embeddings_response,
    input_tokens,
    ocr_text_response,
    parse_response,
)
from polygateway.simulator.profiles import Fault, FaultProfile, Wire
from polygateway.simulator.stats import Outcome, SourceRecorder
from polygateway.simulator.wires import (
    DONE,
    KEEPALIVE,
    OPENAI_SHAPED,
    Style,
    back_off_headers,
    content_filtered,
    error_in_200,
    error_response,
    forwarded,
    identity_headers,
    malformed_body,
    malformed_event,
    mid_stream_errors,
    rate_limit_headers,
    request_id,
    sse,
    stream_error,
)

__all__ = [
    "InjectedReset",
    "ResetLogFilter",
    "SimulatorState",
    "build_app",
]

_Family = Literal["openai", "azure", "anthropic", "monkey_ocr"]
"""Which provider's routes an endpoint belongs to."""

_FAMILY_WIRES: Mapping[_Family, frozenset[Wire]] = {
    "openai": frozenset({"openai", "litellm", "vllm"}),
    "azure": frozenset({"azure"}),
    "anthropic": frozenset({"anthropic"}),
}
_STREAM_OUTCOMES: dict[Fault | None, Outcome] = {
    "reset": "reset",
    "truncate": "truncated",
    "malformed": "malformed",
    "error_body": "error_body",
}
_AZURE_DENIED = (
    "Access denied due to invalid subscription key or wrong API endpoint. Make sure to "
    "provide a valid key for an active subscription and use a correct regional API "
    "endpoint for your resource."
)


class InjectedReset(Exception):
    """Raised on purpose after a response started, so the server drops the connection."""


class ResetLogFilter(logging.Filter):
    """Drops uvicorn's error record for an ``InjectedReset``: a planned fault is not a bug."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep every record but the one logging an injected reset."""
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, InjectedReset)


@dataclass(slots=True)
class _Source:
    """One simulated source: its profile, its dice, its limits and its record."""

    name: str
    profile: FaultProfile
    rng: random.Random
    recorder: SourceRecorder
    requests: SlidingWindow = field(default_factory=SlidingWindow)
    tokens: SlidingWindow = field(default_factory=SlidingWindow)
    admitted: int = 0
    served: int = 0

    def draw(self) -> Fault | None:
        """At most one random fault for this request, walking the cumulative rates."""
        u = self.rng.random()
        for fault, rate in self.profile.fault_rates().items():
            if u < rate:
                return fault
            u -= rate
        return None

    def latency(self) -> float:
        """This request's delay before its headers: uniform on mean ± jitter, floored at 0."""
        p = self.profile
        if p.latency_jitter_s <= 0:
            return p.latency_s
        return max(
            0.0,
            self.rng.uniform(p.latency_s - p.latency_jitter_s, p.latency_s + p.latency_jitter_s),
        )

    def rate(self, now: float) -> RateState:
        """What this source's server-side limits report at ``now``."""
        profile = self.profile
        requests = tokens = None
        if (window := profile.request_window()) is not None:
            limit, span = window
            requests = self.requests.quota(limit, now, span)
        if profile.token_limit is not None:
            tokens = self.tokens.quota(profile.token_limit, now, profile.token_window_s)
        return RateState(requests, tokens)


class SimulatorState:
    """The sources of one server and the signal that it is shutting down."""

    def __init__(
        self,
        sources: Mapping[str, FaultProfile],
        *,
        seed: int = 0,
        now: Callable[[], float] = time.monotonic,  # edge: the simulator is a real server
    ) -> None:
        self.seed = seed
        self.now = now
        self.sources: dict[str, _Source] = {}
        # Set at shutdown: every pause, hang and stream of this server ends at once.
        self.closing = asyncio.Event()
        for name, profile in sources.items():
            self.set_profile(name, profile)

    def set_profile(self, name: str, profile: FaultProfile) -> None:
        """Give ``name`` a new profile (adding the source if new); record and dice carry on."""
        if not name or "/" in name:
            raise ValueError(f"a source name must be a non-empty path segment, not {name!r}")
        current = self.sources.get(name)
        if current is not None:
            current.profile = profile
            return
        self.sources[name] = _Source(
            name=name,
            profile=profile,
            # A string seed hashes deterministically, so each source has its own repeatable dice.
            rng=random.Random(f"{self.seed}/{name}"),
            recorder=SourceRecorder(name, now=self.now),
        )

    async def pause(self, seconds: float) -> bool:
        """Sleep ``seconds`` unless the server shuts down first; True if it is shutting down."""
        if seconds <= 0 or self.closing.is_set():
            return self.closing.is_set()
        try:
            async with asyncio.timeout(seconds):
                await self.closing.wait()
        except TimeoutError:
            return False
        return True

    async def hold(self, receive: Receive, seconds: float) -> Literal["closing", "gone", "elapsed"]:
        """Wait like a hung upstream: until ``seconds`` pass, the client leaves, or shutdown."""
        closing = asyncio.ensure_future(self.closing.wait())
        gone = asyncio.ensure_future(_until_disconnected(receive))
        try:
            done, _ = await asyncio.wait(
                {closing, gone}, timeout=seconds, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            closing.cancel()
            gone.cancel()
            # Both watchers were ours to cancel; their results or cancellations are not news.
            await asyncio.gather(closing, gone, return_exceptions=True)
        if closing in done:
            return "closing"
        if gone in done:
            return "gone"
        return "elapsed"


async def _until_disconnected(receive: Receive) -> None:
    """Return when the client closes its connection (the body has already been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _ResetResponse(Response):
    """Headers announcing the whole body, half of it, then a dropped connection."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the start and a partial body, then raise so the server drops the transport."""
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        await send(
            {
                "type": "http.response.body",
                "body": self.body[: len(self.body) // 2],
                "more_body": True,
            }
        )
        raise InjectedReset("simulated connection reset")


class _Gone(Response):
    """The answer to a client that already left: uvicorn drops anything sent to it."""

    def __init__(self) -> None:
        super().__init__(b"", status_code=499)


@dataclass(slots=True)
class _Job:
    """A validated request: how to answer it well, how its error body looks, what it costs."""

    build: Callable[[], dict[str, Any]]
    error_body: dict[str, Any]
    plan: StreamPlan | None = None
    reply_id: str = ""
    tokens: int = 0


_Parser = Callable[[Request, bytes, _Source], Awaitable[_Job | Response]]


def _json_body(body: bytes) -> dict[str, Any] | None:
    """The request body as a JSON object, or None when it is not one."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _stated_request_id(response: Response) -> str | None:
    """The ``request_id`` an Anthropic error body states: its ``request-id`` header repeats it."""
    if not isinstance(response, JSONResponse):
        return None
    data = _json_body(bytes(response.body))
    rid = data.get("request_id") if data is not None else None
    return rid if isinstance(rid, str) else None


def _same(given: str | None, expected: str) -> bool:
    """Whether a presented key is the expected one, compared in constant time."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def _gate(request: Request, family: _Family, profile: FaultProfile) -> Response | None:
    """What the provider refuses before reading the body: wrong route, version or key."""
    wire = profile.wire
    if wire not in _FAMILY_WIRES[family]:
        message = (
            "Resource not found" if wire == "azure" else f"no {request.url.path} on a {wire} source"
        )
        return error_response(wire, 404, message)
    if wire == "azure" and not request.query_params.get("api-version"):
        # Azure answers a request without api-version as a route it does not know.
        return error_response(wire, 404, "Resource not found")
    headers, key = request.headers, profile.api_key
    if wire == "anthropic":
        given = headers.get("x-api-key")
        if not given:
            return error_response(wire, 401, "x-api-key header is required")
        if key is not None and not _same(given, key):
            return error_response(wire, 401, "invalid x-api-key")
        if not headers.get("anthropic-version"):
            return error_response(wire, 400, "anthropic-version: header is required")
        return None
    if key is None:
        return None
    if wire == "azure":
        return (
            None if _same(headers.get("api-key"), key) else error_response(wire, 401, _AZURE_DENIED)
        )
    authorization = headers.get("authorization")
    if _same(authorization, f"Bearer {key}"):
        return None
    if authorization is None:
        return error_response(wire, 401, "You didn't provide an API key.")
    return error_response(wire, 401, "Incorrect API key provided.")


def _reply(data: Mapping[str, Any], source: _Source, *, filtered: bool = False) -> ChatReply:
    """The reply to a valid chat request, numbered in the source's sequence.

    ``filtered``: the answer is streamed under the source's asynchronous
    content filter, which flags its ``azure_filter_flags``.
    """
    source.served += 1
    return chat_reply(
        data,
        source=source.name,
        request_no=source.served,
        created=int(time.time()),  # edge: wall clock, as OpenAI's ``created``
        min_words=source.profile.stream_chunks,
        flags=source.profile.azure_filter_flags if filtered else (),
    )


def _functions_fault(data: Mapping[str, Any]) -> str | None:
    """What OpenAI refuses in a request's legacy ``functions`` / ``function_call``, or None."""
    functions = data.get("functions")
    choice = data.get("function_call")
    if functions is not None and (
        not isinstance(functions, list)
        or not functions
        or not all(isinstance(f, dict) and isinstance(f.get("name"), str) for f in functions)
    ):
        return "Invalid 'functions': expected a non-empty array of objects with a 'name'."
    if choice is None:
        return None
    if functions is None:
        return "Invalid value for 'function_call': only allowed when 'functions' are specified."
    if choice in ("auto", "none"):
        return None
    name = choice.get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        return "Invalid value for 'function_call': expected 'auto', 'none' or {'name': ...}."
    if all(f["name"] != name for f in functions):
        return f"Invalid value for 'function_call': no function named {name!r} in 'functions'."
    return None


async def _parse_chat(request: Request, body: bytes, source: _Source) -> _Job | Response:
    """Validate a chat completion request (OpenAI-shaped wires) and prepare its reply."""
    wire = source.profile.wire
    data = _json_body(body)
    if data is None or not isinstance(data.get("messages"), list) or not data["messages"]:
        return error_response(wire, 400, "'messages' must be a non-empty list")
    if (fault := _functions_fault(data)) is not None:
        return error_response(wire, 400, fault)
    deployment = request.path_params.get("deployment")
    if deployment and not isinstance(data.get("model"), str):
        # Azure names the model by its deployment, in the path.
        data = {**data, "model": deployment}
    filtered = content_filtered(wire)
    streamed = bool(data.get("stream"))
    asynchronous = filtered and source.profile.azure_filter == "asynchronous"
    reply = _reply(data, source, filtered=asynchronous and streamed)
    plan = None
    if streamed:
        options = data.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        plan = chat_chunks(
            reply,
            chunks=source.profile.stream_chunks,
            include_usage=include_usage,
            content_filter=filtered,
            asynchronous_filter=asynchronous,
        )
    return _Job(
        build=lambda: chat_completion(reply, content_filter=filtered),
        error_body=error_in_200(wire),
        plan=plan,
        reply_id=reply.id,
        tokens=reply.total_tokens,
    )


def _blocks_of(message: Any) -> list[Any]:
    """A Messages API message's content blocks; string content has none of interest here."""
    content = message.get("content") if isinstance(message, dict) else None
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def _unanswered_tool_use(messages: list[Any]) -> str | None:
    """The Messages API's 400 for a ``tool_use`` its next message does not answer first, if any.

    The API wants every ``tool_use`` id of a message answered by a
    ``tool_result`` block in the message right after it, the results ahead
    of any other block there; a client mapping an OpenAI conversation, where
    a user message may stand between a call and its result, must move the
    result there (``transport/anthropic.py``).
    """
    for i, message in enumerate(messages):
        uses = [b.get("id") for b in _blocks_of(message) if b.get("type") == "tool_use"]
        if not uses:
            continue
        answered = set()
        after = messages[i + 1] if i + 1 < len(messages) else None
        if isinstance(after, dict) and after.get("role") == "user":
            for block in _blocks_of(after):
                if block.get("type") != "tool_result":
                    break
                answered.add(block.get("tool_use_id"))
        missing = [str(use) for use in uses if use not in answered]
        if missing:
            return (
                f"messages.{i}: `tool_use` ids were found without `tool_result` blocks"
                f" immediately after: {', '.join(missing)}. Each `tool_use` block must have"
                " a corresponding `tool_result` block in the next message."
            )
    return None


_MESSAGES_API_FIELDS: Final = frozenset(
    {
        "cache_control",
        "container",
        "context_management",
        "inference_geo",
        "max_tokens",
        "mcp_servers",
        "messages",
        "metadata",
        "model",
        "output_config",
        "service_tier",
        "stop_sequences",
        "stream",
        "system",
        "temperature",
        "thinking",
        "tool_choice",
        "tools",
        "top_k",
        "top_p",
    }
)
"""The Messages API's request fields; any other is refused as an extra input."""


_OPENAI_PART_TYPES: Final = frozenset({"image_url", "input_audio", "file"})
"""OpenAI's content part types that are no Messages API block (its own are image, document)."""


def _not_messages_api(data: dict[str, Any]) -> str | None:
    """The Messages API's 400 for a field it does not define, or a value out of its range.

    The API refuses extra inputs (OpenAI's ``seed``, ``functions``, ... among them),
    a ``metadata`` field other than ``user_id`` and a content block of OpenAI's part
    types; ``temperature`` runs from 0 to 1.
    """
    for name in data:
        if name not in _MESSAGES_API_FIELDS:
            return f"{name}: Extra inputs are not permitted"
    metadata = data.get("metadata")
    if isinstance(metadata, dict):
        for name in metadata:
            if name != "user_id":
                return f"metadata.{name}: Extra inputs are not permitted"
    messages = data.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        for j, block in enumerate(_blocks_of(message) if isinstance(message, dict) else []):
            kind = block.get("type")
            if kind in _OPENAI_PART_TYPES:
                return (
                    f"messages.{i}.content.{j}: Input tag {kind!r} found using 'type' does not"
                    " match any of the expected tags"
                )
    temperature = data.get("temperature")
    if isinstance(temperature, int | float) and temperature > 1:
        return "temperature: Input should be less than or equal to 1"
    if isinstance(temperature, int | float) and temperature < 0:
        return "temperature: Input should be greater than or equal to 0"
    return None


async def _parse_messages(request: Request, body: bytes, source: _Source) -> _Job | Response:
    """Validate an Anthropic Messages request (``max_tokens`` required) and prepare its reply."""
    data = _json_body(body)
    if data is None:
        return error_response("anthropic", 400, "the request body is not a JSON object")
    if not isinstance(data.get("messages"), list) or not data["messages"]:
        return error_response("anthropic", 400, "messages: Field required")
    if (refused := _not_messages_api(data)) is not None:
        return error_response("anthropic", 400, refused)
    if (unanswered := _unanswered_tool_use(data["messages"])) is not None:
        return error_response("anthropic", 400, unanswered)
    max_tokens = data.get("max_tokens")
    if max_tokens is None:
        return error_response("anthropic", 400, "max_tokens: Field required")
    if type(max_tokens) is not int or max_tokens < 1:
        return error_response(
            "anthropic", 400, "max_tokens: Input should be a valid integer greater than 0"
        )
    reply = _reply(data, source)
    plan = (
        anthropic_events(reply, chunks=source.profile.stream_chunks) if data.get("stream") else None
    )
    return _Job(
        build=lambda: anthropic_message(reply),
        error_body=error_in_200("anthropic"),
        plan=plan,
        reply_id=reply.id,
        tokens=reply.total_tokens,
    )


_MAX_INPUTS = 2048
"""Inputs one embeddings request may hold on OpenAI and Azure OpenAI, as both document.

vLLM documents no such limit, and a LiteLLM proxy passes on what its backend answers.
"""

_TOO_MANY_INPUTS: dict[Wire, str] = {
    "openai": "Invalid 'input': array length must be 2048 or less.",
    "azure": "Too many inputs. The max number of inputs is 2048.",
}
"""The 400 message of a request over ``_MAX_INPUTS``, in each capping wire's words."""


async def _parse_embeddings(request: Request, body: bytes, source: _Source) -> _Job | Response:
    """Validate an embeddings request (a string or a non-empty list of strings)."""
    wire = source.profile.wire
    data = _json_body(body)
    raw = data.get("input") if data is not None else None
    inputs = [raw] if isinstance(raw, str) else raw
    if (
        not isinstance(inputs, list)
        or not inputs
        or not all(isinstance(t, str) and t for t in inputs)
    ):
        return error_response(
            wire, 400, "'input' must be a non-empty string or list of non-empty strings"
        )
    too_many = _TOO_MANY_INPUTS.get(wire)
    if too_many is not None and len(inputs) > _MAX_INPUTS:
        return error_response(wire, 400, too_many)
    assert data is not None  # for mypy: a valid input came from a body
    model = data.get("model")
    if not isinstance(model, str):
        model = request.path_params.get("deployment") or "sim-embedding"
    fmt = data.get("encoding_format") or "float"
    dim = source.profile.embedding_dim
    return _Job(
        build=lambda: embeddings_response(inputs, model=str(model), dim=dim, encoding_format=fmt),
        error_body=error_in_200(wire),
        tokens=input_tokens(inputs),
    )


def _multipart_file(request: Request, body: bytes) -> tuple[str, bytes] | None:
    """The ``file`` part of a multipart/form-data body: its file name and bytes."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        return None
    # The stdlib MIME parser reads form data once it is given the request's Content-Type.
    message = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    if not message.is_multipart():
        return None
    for part in message.walk():
        if part is message or not isinstance(part, Message):
            continue
        if part.get_param("name", header="content-disposition") != "file":
            continue
        payload = part.get_payload(decode=True)
        return part.get_filename() or "", payload if isinstance(payload, bytes) else b""
    return None


def _ocr_parser(task: Literal["text", "parse"]) -> _Parser:
    """A MonkeyOCR request parser: one ``file`` part whose name says image or PDF."""

    async def parse(request: Request, body: bytes, source: _Source) -> _Job | Response:
        upload = _multipart_file(request, body)
        if upload is None:
            return error_response(
                "monkey_ocr", 422, "field 'file' is required (multipart/form-data)"
            )
        filename, data = upload
        suffix = PurePosixPath(filename).suffix.lower()
        if suffix not in OCR_SUFFIXES:
            allowed = ", ".join(sorted(OCR_SUFFIXES))
            return error_response(
                "monkey_ocr", 400, f"Unsupported file type: {suffix!r}. Allowed: {allowed}"
            )
        if task == "text":
            return _Job(
                build=lambda: ocr_text_response(filename, data),
                error_body={
                    "success": False,
                    "task_type": "text",
                    "content": "",
                    "message": "OCR task failed: simulated failure",
                },
            )
        return_type = request.query_params.get("return_type")
        return _Job(
            build=lambda: parse_response(filename, data, return_type),
            error_body={"success": False, "message": "Parsing failed: simulated failure"},
        )

    return parse


async def _first_token_wait(state: SimulatorState, profile: FaultProfile) -> AsyncIterator[bytes]:
    """Wait out ``ttft_s``; on the ``vllm`` wire, say ``: keep-alive`` while waiting.

    A comment goes out after every ``keepalive_s`` of silence, and one just
    before the first content if the wait was shorter. Ends early at shutdown
    (the caller checks ``state.closing``).
    """
    left = profile.ttft_s
    if profile.wire != "vllm":
        await state.pause(left)
        return
    said = False
    while left > profile.keepalive_s:
        if await state.pause(profile.keepalive_s):
            return
        left -= profile.keepalive_s
        said = True
        yield KEEPALIVE
    if await state.pause(left):
        return
    if not said:
        yield KEEPALIVE


class _Endpoint:
    """One route of every source: gate, validate, admit, play the fault, answer, record."""

    __slots__ = ("family", "parse", "route", "state")

    def __init__(self, state: SimulatorState, route: str, family: _Family, parse: _Parser) -> None:
        self.state = state
        self.route = route
        self.family: _Family = family
        self.parse = parse

    def _style(self, source: _Source | None) -> Style:
        """The shape of this route's answers: MonkeyOCR's, else the source's wire."""
        if self.family == "monkey_ocr":
            return "monkey_ocr"
        if source is None:
            return self.family
        return source.profile.wire

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one request; the source's open-request count covers the whole response."""
        arrived = self.state.now()
        request = Request(scope, receive)
        source = self.state.sources.get(request.path_params["source"])
        if source is None:
            unknown = request.path_params["source"]
            style = self._style(None)
            unknown_source = error_response(style, 404, f"unknown source {unknown!r}")
            self._name(unknown_source, style, None, arrived)
            await unknown_source(scope, receive, send)
            return
        style = self._style(source)
        recorder = source.recorder
        admitted = False
        route = self.route
        try:
            body = await request.body()
        except ClientDisconnect:
            return  # the client left while sending its request: nothing to answer
        job: _Job | Response | None = None
        if self.family != "monkey_ocr":
            job = _gate(request, self.family, source.profile)
        if job is None:
            job = await self.parse(request, body, source)
        if isinstance(job, _Job) and job.plan is not None:
            route = f"{route}_stream"
        recorder.arrive(route, request.headers.get("traceparent"))
        try:
            if isinstance(job, Response):
                recorder.finish("bad_request", job.status_code)
                response = job
            else:
                refusal, headers = self._admit(source, job, style)
                if refusal is not None:
                    response = refusal
                else:
                    admitted = True
                    response = await self._play(request, source, job, style, headers)
            self._name(response, style, source, arrived)
            await response(scope, receive, send)
        finally:
            if admitted:
                source.admitted -= 1
            recorder.leave()

    def _name(
        self, response: Response, style: Style, source: _Source | None, arrived: float
    ) -> None:
        """Put the request-id headers of ``style`` on ``response``, timed from ``arrived``."""
        elapsed_ms = round(max(0.0, self.state.now() - arrived) * 1000)
        rid = _stated_request_id(response) if style == "anthropic" else None
        headers = identity_headers(style, rid or request_id(style), elapsed_ms)
        if source is not None:
            headers = self._out(source, style, headers)
        response.headers.update(headers)

    def _out(self, source: _Source, style: Style, headers: Mapping[str, str]) -> dict[str, str]:
        """The headers as the source's wire returns them (LiteLLM's forwarded copies)."""
        if style == "monkey_ocr":
            return dict(headers)
        return forwarded(source.profile.wire, headers)

    def _rate_headers(self, source: _Source, style: Style, now: float) -> dict[str, str]:
        """The wire's rate-limit headers of a source at ``now`` (none on OCR routes)."""
        if style == "monkey_ocr":
            return {}
        wall = time.time()  # edge: Anthropic's resets are wall-clock times
        return rate_limit_headers(source.profile.wire, source.rate(now), wall)

    def _admit(
        self, source: _Source, job: _Job, style: Style
    ) -> tuple[Response | None, dict[str, str]]:
        """Apply the server-side limits: a 429 when one is exceeded, else take a place.

        Returns the refusal (or None) and the rate-limit headers every answer
        to this request carries, counted after this request.
        """
        profile, recorder = source.profile, source.recorder
        wire = profile.wire
        now = self.state.now()

        def refuse(cause: str, wait_s: float, message: str, kind: str | None = None) -> Response:
            recorder.limits_hit[cause] += 1
            recorder.finish("429", 429)
            headers = self._rate_headers(source, style, now)
            headers |= back_off_headers(wire, wait_s, floor_s=1)
            return error_response(style, 429, message, self._out(source, style, headers), kind=kind)

        if profile.max_concurrency is not None and source.admitted >= profile.max_concurrency:
            return refuse("concurrency", 1.0, "too many concurrent requests"), {}
        if (window := profile.request_window()) is not None:
            limit, span = window
            wait = source.requests.wait_for(1, limit, now, span)
            if wait > 0:
                cause = "rpm" if profile.rpm_limit is not None else "requests"
                return refuse(cause, wait, "rate limit reached for requests", "requests"), {}
        if profile.token_limit is not None:
            wait = source.tokens.wait_for(
                job.tokens, profile.token_limit, now, profile.token_window_s
            )
            if wait > 0:
                return refuse("tokens", wait, "rate limit reached for tokens", "tokens"), {}
        # Only a limited quantity is logged: an unlimited one would grow without end.
        if window is not None:
            source.requests.spend(now, 1)
        if profile.token_limit is not None:
            source.tokens.spend(now, job.tokens)
        source.admitted += 1
        return None, self._rate_headers(source, style, now)

    async def _play(
        self, request: Request, source: _Source, job: _Job, style: Style, headers: dict[str, str]
    ) -> Response:
        """Play this request's random fault, or answer it well."""
        profile, recorder = source.profile, source.recorder
        wire = profile.wire
        fault = source.draw()
        if fault == "429":
            recorder.limits_hit["random"] += 1
            recorder.finish("429", 429)
            if profile.retry_after_s is not None:
                headers = headers | back_off_headers(
                    wire, profile.retry_after_s, style=profile.retry_after_style
                )
            return error_response(
                style, 429, "rate limit reached", self._out(source, style, headers)
            )
        if await self.state.pause(source.latency()):
            return self._shutting_down(source, style)
        hung = fault == "hang"
        if hung:
            recorder.finish("hang")
            ended = await self.state.hold(request.receive, profile.hang_s)
            if ended == "closing":
                return self._shutting_down(source, style, record=False)
            if ended == "gone":
                return _Gone()
            # A hang that outlived ``hang_s`` was a very slow answer after all.
            fault = None
        out = self._out(source, style, headers)
        if fault == "5xx":
            status = source.rng.choice(profile.statuses_5xx)
            recorder.finish("5xx", status)
            if profile.retry_after_on_5xx and profile.retry_after_s is not None:
                back_off = back_off_headers(
                    wire, profile.retry_after_s, style=profile.retry_after_style
                )
                out = self._out(source, style, headers | back_off)
            message = "Overloaded" if status == 529 else "simulated upstream error"
            return error_response(style, status, message, out)
        if job.plan is not None:
            return self._stream(source, job, fault, record=not hung, headers=out)
        if fault == "malformed":
            recorder.finish("malformed", 200)
            return Response(malformed_body(style), media_type="application/json", headers=out)
        if fault == "error_body":
            recorder.finish("error_body", 200)
            return JSONResponse(job.error_body, headers=out)
        if fault == "reset":
            recorder.finish("reset", 200)
            return _ResetResponse(
                json.dumps(job.build()).encode(), media_type="application/json", headers=out
            )
        if hung:
            recorder.by_status[200] += 1
        else:
            recorder.finish("ok", 200)
        return JSONResponse(job.build(), headers=out)

    def _shutting_down(self, source: _Source, style: Style, *, record: bool = True) -> Response:
        """The answer to a request still waiting when the server stops."""
        if record:
            source.recorder.finish("shutdown", 503)
        else:
            source.recorder.by_status[503] += 1
        return error_response(style, 503, "simulator shutting down", {"connection": "close"})

    def _stream(
        self,
        source: _Source,
        job: _Job,
        fault: Fault | None,
        *,
        record: bool,
        headers: Mapping[str, str],
    ) -> Response:
        """A stream in the wire's events, cut short or broken when the fault says so."""
        profile, recorder = source.profile, source.recorder
        plan = job.plan
        assert plan is not None  # only jobs that asked for a stream come here
        if record:
            recorder.finish(_STREAM_OUTCOMES.get(fault, "ok"), 200)
        else:
            recorder.by_status[200] += 1
        wire = profile.wire
        state = self.state
        # A broken stream stops halfway through its content, never before the first of it.
        cut = max(1, len(plan.body) // 2)
        broken = fault in ("reset", "truncate") or (
            fault == "error_body" and mid_stream_errors(wire)
        )
        events = plan.body[:cut] if broken else plan.body + plan.tail

        async def body() -> AsyncIterator[bytes]:
            for event in plan.head:
                yield sse(event)
            async for comment in _first_token_wait(state, profile):
                yield comment
            if state.closing.is_set():
                return
            if fault == "malformed":
                yield malformed_event(wire, job.reply_id)
                return
            if fault == "error_body" and not broken:
                yield sse(stream_error(wire))
                return
            for i, event in enumerate(events):
                if i and await state.pause(profile.chunk_interval_s):
                    return
                yield sse(event)
            if fault == "reset":
                raise InjectedReset("simulated connection reset mid-stream")
            if fault == "error_body":
                yield sse(stream_error(wire))
            elif fault != "truncate" and wire in OPENAI_SHAPED:
                yield sse(DONE)

        return StreamingResponse(
            body(),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", **headers},
        )


def build_app(state: SimulatorState) -> Starlette:
    """The ASGI app serving every source of ``state``."""
    chat = _Endpoint(state, "chat", "openai", _parse_chat)
    embeddings = _Endpoint(state, "embeddings", "openai", _parse_embeddings)
    azure_chat = _Endpoint(state, "chat", "azure", _parse_chat)
    azure_embeddings = _Endpoint(state, "embeddings", "azure", _parse_embeddings)
    messages = _Endpoint(state, "chat", "anthropic", _parse_messages)
    ocr_text = _Endpoint(state, "ocr_text", "monkey_ocr", _ocr_parser("text"))
    parse = _Endpoint(state, "parse", "monkey_ocr", _ocr_parser("parse"))
    deployment = "/{source}/openai/deployments/{deployment}"
    return Starlette(
        routes=[
            Route("/{source}/v1/chat/completions", chat, methods=["POST"]),
            Route("/{source}/v1/embeddings", embeddings, methods=["POST"]),
            Route(f"{deployment}/chat/completions", azure_chat, methods=["POST"]),
            Route(f"{deployment}/embeddings", azure_embeddings, methods=["POST"]),
            Route("/{source}/v1/messages", messages, methods=["POST"]),
            Route("/{source}/ocr/text", ocr_text, methods=["POST"]),
            Route("/{source}/parse", parse, methods=["POST"]),
        ]
    )
