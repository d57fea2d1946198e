"""The simulated upstream as an ASGI app: OpenAI and MonkeyOCR routes per source, with faults.

Every source lives under its own path prefix (``/{source}/v1/chat/completions``,
``/{source}/v1/embeddings``, ``/{source}/ocr/text``, ``/{source}/parse``). A
request is read and validated (400 like the real service), then admitted by
the source's server-side limits (429 like a real provider), then plays at
most one random fault drawn from the source's seeded generator, then waits
its latency and answers.

Faults on the wire:

- ``429`` / ``5xx``: an error status with a JSON error body (429 carries Retry-After).
- ``hang``: no answer until ``hang_s`` passes, the client leaves, or the server shuts down.
- ``reset``: the headers and half the body, then the connection is dropped. The app
  raises ``InjectedReset`` after starting the response, and uvicorn closes the
  transport: a client sees ``httpx.RemoteProtocolError`` (body shorter than its
  Content-Length, or a chunked stream cut short).
- ``malformed`` / ``error_body``: a 200 whose body is not JSON, or is an error object.
- ``truncate``: a stream that stops cleanly halfway, without finish_reason and ``[DONE]``.

Streams are written with Starlette's ``StreamingResponse`` rather than
sse-starlette: sse-starlette starts a process-wide shutdown watcher task that
outlives the server, and an embedded simulator must leave no task behind.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import math
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from email.message import Message
from email.parser import BytesParser
from email.policy import HTTP
from pathlib import PurePosixPath
from typing import Any, Literal

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from polygateway.simulator.payloads import (
    OCR_SUFFIXES,
    ChatReply,
    chat_chunks,
    chat_completion,
    chat_reply,
    embeddings_response,
    ocr_text_response,
    parse_response,
)
from polygateway.simulator.profiles import Fault, FaultProfile
from polygateway.simulator.stats import Outcome, SourceRecorder

__all__ = [
    "InjectedReset",
    "ResetLogFilter",
    "SimulatorState",
    "build_app",
]

_Style = Literal["openai", "monkey_ocr"]
_STREAM_OUTCOMES: dict[Fault | None, Outcome] = {
    "reset": "reset",
    "truncate": "truncated",
    "malformed": "malformed",
    "error_body": "error_body",
}
_MALFORMED = b'{"id": "sim-malformed", "object": "chat.completion", "choices": [{"index": 0,'


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
    window: deque[float] = field(default_factory=deque)
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


def _error(
    style: _Style, status: int, message: str, headers: Mapping[str, str] | None = None
) -> Response:
    """An error answer in the route's own shape: OpenAI's error object or FastAPI's detail."""
    body: dict[str, Any]
    if style == "openai":
        kind, code = ("server_error", None) if status >= 500 else ("invalid_request_error", None)
        if status == 429:
            kind = code = "rate_limit_exceeded"
        body = {"error": {"message": message, "type": kind, "code": code}}
    else:
        body = {"detail": message}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def _retry_after(seconds: float, style: str) -> dict[str, str]:
    """Retry-After in the profile's style, plus OpenAI's ``retry-after-ms``."""
    if style == "http-date":
        value = email.utils.formatdate(time.time() + seconds, usegmt=True)  # edge: wall clock
    else:
        value = str(max(0, math.ceil(seconds)))
    return {"retry-after": value, "retry-after-ms": str(round(seconds * 1000))}


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
    """A validated request: how to answer it well, and how its error body looks."""

    build: Callable[[], dict[str, Any]]
    error_body: dict[str, Any]
    reply: ChatReply | None = None
    include_usage: bool = False


_Parser = Callable[[Request, bytes, _Source], Awaitable[_Job | Response]]


def _sse(obj: Any) -> bytes:
    """One SSE event carrying JSON (or the ``[DONE]`` sentinel when given a str)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _json_body(body: bytes) -> dict[str, Any] | None:
    """The request body as a JSON object, or None when it is not one."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


async def _parse_chat(request: Request, body: bytes, source: _Source) -> _Job | Response:
    """Validate a chat completion request and prepare its reply."""
    data = _json_body(body)
    if data is None or not isinstance(data.get("messages"), list) or not data["messages"]:
        return _error("openai", 400, "'messages' must be a non-empty list")
    source.served += 1
    stream = bool(data.get("stream"))
    options = data.get("stream_options")
    reply = chat_reply(
        data,
        source=source.name,
        request_no=source.served,
        created=int(time.time()),  # edge: wall clock, as OpenAI's ``created``
        min_words=source.profile.stream_chunks,
    )
    return _Job(
        build=lambda: chat_completion(reply),
        error_body={
            "error": {"message": "simulated upstream error", "type": "server_error", "code": None}
        },
        reply=reply if stream else None,
        include_usage=isinstance(options, dict) and bool(options.get("include_usage")),
    )


async def _parse_embeddings(request: Request, body: bytes, source: _Source) -> _Job | Response:
    """Validate an embeddings request (a string or a non-empty list of strings)."""
    data = _json_body(body)
    raw = data.get("input") if data is not None else None
    inputs = [raw] if isinstance(raw, str) else raw
    if (
        not isinstance(inputs, list)
        or not inputs
        or not all(isinstance(t, str) and t for t in inputs)
    ):
        return _error(
            "openai", 400, "'input' must be a non-empty string or list of non-empty strings"
        )
    assert data is not None  # for mypy: a valid input came from a body
    model = data.get("model") if isinstance(data.get("model"), str) else "sim-embedding"
    fmt = data.get("encoding_format") or "float"
    dim = source.profile.embedding_dim
    return _Job(
        build=lambda: embeddings_response(inputs, model=str(model), dim=dim, encoding_format=fmt),
        error_body={
            "error": {"message": "simulated upstream error", "type": "server_error", "code": None}
        },
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
            return _error("monkey_ocr", 422, "field 'file' is required (multipart/form-data)")
        filename, data = upload
        suffix = PurePosixPath(filename).suffix.lower()
        if suffix not in OCR_SUFFIXES:
            allowed = ", ".join(sorted(OCR_SUFFIXES))
            return _error(
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


class _Endpoint:
    """One route of every source: validate, admit, play the fault, answer, record."""

    __slots__ = ("parse", "route", "state", "style")

    def __init__(self, state: SimulatorState, route: str, style: _Style, parse: _Parser) -> None:
        self.state = state
        self.route = route
        self.style: _Style = style
        self.parse = parse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one request; the source's open-request count covers the whole response."""
        request = Request(scope, receive)
        source = self.state.sources.get(request.path_params["source"])
        if source is None:
            unknown = request.path_params["source"]
            await _error(self.style, 404, f"unknown source {unknown!r}")(scope, receive, send)
            return
        recorder = source.recorder
        admitted = False
        route = self.route
        try:
            body = await request.body()
        except ClientDisconnect:
            return  # the client left while sending its request: nothing to answer
        job = await self.parse(request, body, source)
        if isinstance(job, _Job) and job.reply is not None:
            route = "chat_stream"
        recorder.arrive(route)
        try:
            if isinstance(job, Response):
                recorder.finish("bad_request", job.status_code)
                response = job
            elif (refusal := self._admit(source)) is not None:
                response = refusal
            else:
                admitted = True
                response = await self._play(request, source, job)
            await response(scope, receive, send)
        finally:
            if admitted:
                source.admitted -= 1
            recorder.leave()

    def _admit(self, source: _Source) -> Response | None:
        """Apply the server-side limits; a 429 when one is exceeded, else take a place."""
        profile, recorder = source.profile, source.recorder
        if profile.max_concurrency is not None and source.admitted >= profile.max_concurrency:
            recorder.limits_hit["concurrency"] += 1
            recorder.finish("429", 429)
            return _error(self.style, 429, "too many concurrent requests", {"retry-after": "1"})
        now = self.state.now()
        window = source.window
        while window and window[0] <= now - 60.0:
            window.popleft()
        if profile.rpm_limit is not None and len(window) >= profile.rpm_limit:
            recorder.limits_hit["rpm"] += 1
            recorder.finish("429", 429)
            wait = window[0] + 60.0 - now
            headers = {
                "retry-after": str(max(1, math.ceil(wait))),
                "retry-after-ms": str(round(wait * 1000)),
            }
            return _error(self.style, 429, "rate limit reached: requests per minute", headers)
        window.append(now)
        source.admitted += 1
        return None

    async def _play(self, request: Request, source: _Source, job: _Job) -> Response:
        """Play this request's random fault, or answer it well."""
        profile, recorder = source.profile, source.recorder
        fault = source.draw()
        if fault == "429":
            recorder.limits_hit["random"] += 1
            recorder.finish("429", 429)
            headers = {}
            if profile.retry_after_s is not None:
                headers = _retry_after(profile.retry_after_s, profile.retry_after_style)
            return _error(self.style, 429, "rate limit reached", headers)
        if await self.state.pause(source.latency()):
            return self._shutting_down(source)
        hung = fault == "hang"
        if hung:
            recorder.finish("hang")
            ended = await self.state.hold(request.receive, profile.hang_s)
            if ended == "closing":
                return self._shutting_down(source, record=False)
            if ended == "gone":
                return _Gone()
            # A hang that outlived ``hang_s`` was a very slow answer after all.
            fault = None
        if fault == "5xx":
            status = source.rng.choice(profile.statuses_5xx)
            recorder.finish("5xx", status)
            return _error(self.style, status, "simulated upstream error")
        if job.reply is not None:
            return self._stream(source, job, fault, record=not hung)
        if fault == "malformed":
            recorder.finish("malformed", 200)
            return Response(_MALFORMED, media_type="application/json")
        if fault == "error_body":
            recorder.finish("error_body", 200)
            return JSONResponse(job.error_body)
        if fault == "reset":
            recorder.finish("reset", 200)
            return _ResetResponse(json.dumps(job.build()).encode(), media_type="application/json")
        if hung:
            recorder.by_status[200] += 1
        else:
            recorder.finish("ok", 200)
        return JSONResponse(job.build())

    def _shutting_down(self, source: _Source, *, record: bool = True) -> Response:
        """The answer to a request still waiting when the server stops."""
        if record:
            source.recorder.finish("shutdown", 503)
        else:
            source.recorder.by_status[503] += 1
        return _error(self.style, 503, "simulator shutting down", {"connection": "close"})

    def _stream(self, source: _Source, job: _Job, fault: Fault | None, *, record: bool) -> Response:
        """An SSE chat stream, cut short or broken when the fault says so."""
        profile, recorder = source.profile, source.recorder
        reply = job.reply
        assert reply is not None  # only chat jobs that asked for a stream come here
        if record:
            recorder.finish(_STREAM_OUTCOMES.get(fault, "ok"), 200)
        else:
            recorder.by_status[200] += 1
        events = chat_chunks(reply, chunks=profile.stream_chunks, include_usage=job.include_usage)
        state = self.state

        async def body() -> AsyncIterator[bytes]:
            if await state.pause(profile.ttft_s):
                return
            if fault == "malformed":
                yield b'data: {"id": "' + reply.id.encode() + b'", "choices": [\n\n'
                return
            if fault == "error_body":
                yield _sse(
                    {"error": {"message": "simulated upstream error", "type": "server_error"}}
                )
                return
            # A broken stream stops halfway through its content, never before the first chunk.
            stop = max(2, len(events) // 2) if fault in ("reset", "truncate") else len(events)
            for i, event in enumerate(events[:stop]):
                if i and await state.pause(profile.chunk_interval_s):
                    return
                yield _sse(event)
            if fault == "reset":
                raise InjectedReset("simulated connection reset mid-stream")
            if fault != "truncate":
                yield _sse("[DONE]")

        return StreamingResponse(
            body(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
        )


def build_app(state: SimulatorState) -> Starlette:
    """The ASGI app serving every source of ``state``."""
    chat = _Endpoint(state, "chat", "openai", _parse_chat)
    embeddings = _Endpoint(state, "embeddings", "openai", _parse_embeddings)
    ocr_text = _Endpoint(state, "ocr_text", "monkey_ocr", _ocr_parser("text"))
    parse = _Endpoint(state, "parse", "monkey_ocr", _ocr_parser("parse"))
    return Starlette(
        routes=[
            Route("/{source}/v1/chat/completions", chat, methods=["POST"]),
            Route("/{source}/v1/embeddings", embeddings, methods=["POST"]),
            Route("/{source}/ocr/text", ocr_text, methods=["POST"]),
            Route("/{source}/parse", parse, methods=["POST"]),
        ]
    )
