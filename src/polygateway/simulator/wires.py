"""What each imitated provider puts around the bodies: errors, rate-limit headers, back-off, SSE.

One function per concern, each deciding by the source's wire, so a fault is
played once and looks like each provider's. The shapes and header formats
follow the providers' public documentation, summarised with its addresses in
research-wiki/guides/providers.md:

- ``openai``: errors ``{"error": {message, type, param, code}}``; every
  response of a limited source carries ``x-ratelimit-{limit,remaining,reset}-
  {requests,tokens}`` (resets as Go durations: ``17ms``, ``1s``, ``6m0s``);
  back-off in ``retry-after`` and ``retry-after-ms``; every answer names its
  request in ``x-request-id`` and its time in ``openai-processing-ms``.
- ``azure``: the same bodies annotated by its content filter
  (``prompt_filter_results``, a stream's first chunk holding them alone;
  ``content_filter_results`` in each choice), but its gateway errors (401,
  404, 429) are ``{"error": {"code": "<status>", "message"}}``; only
  ``x-ratelimit-remaining-{requests,tokens}``.
- ``anthropic``: errors ``{"type": "error", "error": {type, message},
  "request_id"}``; ``anthropic-ratelimit-{requests,tokens}-{limit,remaining,
  reset}`` (reset as an RFC 3339 time); back-off in ``retry-after`` only;
  every answer names its request in ``request-id`` (the body's ``request_id``);
  named SSE events, errors mid-stream as ``event: error``.
- ``litellm``: OpenAI's, plus every provider header again under the
  ``llm_provider-`` prefix; stream errors in band as ``data: {"error": ...}``.
- ``vllm``: OpenAI's bodies, no rate-limit headers; ``: keep-alive`` comments.
"""

from __future__ import annotations

import email.utils
import json
import math
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Literal

from starlette.responses import JSONResponse

from polygateway.simulator.limits import Quota, RateState
from polygateway.simulator.payloads import Event
from polygateway.simulator.profiles import RetryAfterStyle, Wire

__all__ = [
    "DONE",
    "KEEPALIVE",
    "OPENAI_SHAPED",
    "Style",
    "back_off_headers",
    "content_filtered",
    "error_body",
    "error_in_200",
    "error_response",
    "forwarded",
    "go_duration",
    "identity_headers",
    "malformed_body",
    "malformed_event",
    "mid_stream_errors",
    "rate_limit_headers",
    "request_id",
    "rfc3339",
    "sse",
    "stream_error",
]

Style = Literal["openai", "azure", "anthropic", "litellm", "vllm", "monkey_ocr"]
"""The shape of a route's answers: a wire, or MonkeyOCR's for the OCR routes."""

OPENAI_SHAPED: frozenset[Wire] = frozenset({"openai", "azure", "litellm", "vllm"})
"""Wires that speak OpenAI's chat completion bodies and chunks."""

_MS_BACK_OFF: frozenset[Wire] = frozenset({"openai", "azure", "litellm"})
_ANTHROPIC_ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
_AZURE_GATEWAY_STATUSES = frozenset({401, 404, 429})

KEEPALIVE = b": keep-alive\n\n"
"""An SSE comment line: every SSE parser skips it; proxies see bytes flowing."""

DONE: Event = (None, "[DONE]")
"""The sentinel that ends an OpenAI-shaped stream."""


def content_filtered(wire: Wire) -> bool:
    """Whether ``wire``'s chat answers carry content filter annotations: Azure's do."""
    return wire == "azure"


def go_duration(seconds: float) -> str:
    """A duration as Go prints it, as OpenAI's reset headers do: ``17ms``, ``1.5s``, ``6m0s``.

    Rounded up to the millisecond, so a client that waits it out is never early.
    """
    ms = math.ceil(max(0.0, seconds) * 1000 - 1e-6)
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    out = f"{hours}h" if hours else ""
    if hours or minutes:
        out += f"{minutes}m"
    return f"{out}{secs}s"


def rfc3339(wall: float) -> str:
    """An RFC 3339 UTC time, whole seconds rounded up (as in Anthropic's examples)."""
    return datetime.fromtimestamp(math.ceil(wall), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _quota_headers(wire: Wire, what: str, quota: Quota, now_wall: float) -> dict[str, str]:
    """The headers of one limited quantity (``requests`` or ``tokens``) on ``wire``."""
    if wire == "anthropic":
        base = f"anthropic-ratelimit-{what}-"
        return {
            base + "limit": str(quota.limit),
            base + "remaining": str(quota.remaining),
            base + "reset": rfc3339(now_wall + quota.reset_s),
        }
    if wire == "vllm":
        return {}
    if wire == "azure":
        return {f"x-ratelimit-remaining-{what}": str(quota.remaining)}
    return {
        f"x-ratelimit-limit-{what}": str(quota.limit),
        f"x-ratelimit-remaining-{what}": str(quota.remaining),
        f"x-ratelimit-reset-{what}": go_duration(quota.reset_s),
    }


def rate_limit_headers(wire: Wire, rate: RateState, now_wall: float) -> dict[str, str]:
    """The rate-limit headers a response of a limited source carries on ``wire``.

    A quantity without a server-side limit is left out: there is nothing to
    report, and a bare 429 stays bare (``vllm`` never sends any).
    """
    headers: dict[str, str] = {}
    if rate.requests is not None:
        headers |= _quota_headers(wire, "requests", rate.requests, now_wall)
    if rate.tokens is not None:
        headers |= _quota_headers(wire, "tokens", rate.tokens, now_wall)
    return headers


def back_off_headers(
    wire: Wire, seconds: float, *, style: RetryAfterStyle = "seconds", floor_s: int = 0
) -> dict[str, str]:
    """How long to stay away: ``retry-after`` (whole seconds or an HTTP date), plus
    ``retry-after-ms`` on the wires that send it.

    Args:
        floor_s: the least whole seconds ``retry-after`` says (a window that frees
            in 0.2 s still answers 1, as a provider's integer header would).
    """
    if style == "http-date":
        value = email.utils.formatdate(time.time() + seconds, usegmt=True)  # edge: wall clock
    else:
        value = str(max(floor_s, math.ceil(seconds)))
    headers = {"retry-after": value}
    if wire in _MS_BACK_OFF:
        headers["retry-after-ms"] = str(round(seconds * 1000))
    return headers


def request_id(style: Style) -> str:
    """A fresh id of one request, in the form ``style`` names it (OpenAI: ``req_`` and 32 hex)."""
    if style == "anthropic":
        return f"req_sim{uuid.uuid4().hex[:21]}"
    return f"req_{uuid.uuid4().hex}"


def identity_headers(style: Style, rid: str, processing_ms: int) -> dict[str, str]:
    """The headers naming a request on every answer in ``style``, whatever its status.

    OpenAI sends ``x-request-id`` and ``openai-processing-ms`` (the time it took
    to answer); a LiteLLM proxy of it forwards them. Anthropic sends
    ``request-id``, the id its error bodies repeat as ``request_id``. vLLM and
    Azure send neither here: vLLM only when started with request-id headers
    enabled.
    """
    if style in ("openai", "litellm"):
        return {"x-request-id": rid, "openai-processing-ms": str(processing_ms)}
    if style == "anthropic":
        return {"request-id": rid}
    return {}


def forwarded(wire: Wire, headers: Mapping[str, str]) -> dict[str, str]:
    """The provider headers as ``wire`` returns them: LiteLLM adds an ``llm_provider-`` copy."""
    out = dict(headers)
    if wire == "litellm":
        out |= {f"llm_provider-{name}": value for name, value in headers.items()}
    return out


def _openai_error(status: int, message: str, kind: str | None) -> dict[str, Any]:
    """OpenAI's error object for ``status``."""
    code: str | None = None
    if status == 429:
        kind, code = kind or "requests", "rate_limit_exceeded"
    elif status == 401:
        kind, code = "invalid_request_error", "invalid_api_key"
    elif status >= 500:
        kind = "server_error"
    else:
        kind = kind or "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_body(
    style: Style, status: int, message: str, *, kind: str | None = None
) -> dict[str, Any]:
    """The body of an error answer in ``style``.

    Args:
        kind: OpenAI's ``type`` of a 429 (``requests`` or ``tokens``).
    """
    if style == "monkey_ocr":
        return {"detail": message}
    if style == "anthropic":
        error_type = _ANTHROPIC_ERRORS.get(status, "api_error")
        return {
            "type": "error",
            "error": {"type": error_type, "message": message},
            "request_id": request_id("anthropic"),
        }
    if style == "azure" and status in _AZURE_GATEWAY_STATUSES:
        return {"error": {"code": str(status), "message": message}}
    body = _openai_error(status, message, kind)
    if style == "litellm":
        # LiteLLM's proxy reports the status as a string code.
        body["error"]["code"] = str(status)
    return body


def error_response(
    style: Style,
    status: int,
    message: str,
    headers: Mapping[str, str] | None = None,
    *,
    kind: str | None = None,
) -> JSONResponse:
    """An error answer in ``style``, with ``headers``."""
    return JSONResponse(
        error_body(style, status, message, kind=kind),
        status_code=status,
        headers=dict(headers or {}),
    )


def error_in_200(wire: Wire) -> dict[str, Any]:
    """The body of the ``error_body`` fault: a 200 whose JSON is an error object."""
    if wire == "anthropic":
        return error_body("anthropic", 500, "simulated upstream error")
    return _openai_error(500, "simulated upstream error", None)


def mid_stream_errors(wire: Wire) -> bool:
    """Whether the ``error_body`` fault of a stream comes after some content.

    Anthropic (``event: error``) and LiteLLM (``data: {"error": ...}``) report a
    failure that happens while streaming in band, after the 200 and some
    content; the others play it before any content, where a client can still
    fail over.
    """
    return wire in ("anthropic", "litellm")


def stream_error(wire: Wire) -> Event:
    """The in-band error event of the ``error_body`` fault of a stream on ``wire``.

    OpenAI's is its whole error object (``message``, ``type``, ``param``,
    ``code``) as the data of an unnamed event.
    """
    if wire == "anthropic":
        data = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
        return "error", data
    if wire == "litellm":
        message = "litellm.ServiceUnavailableError: simulated upstream error"
        return None, {"error": {"message": message, "type": None, "param": None, "code": "503"}}
    return None, _openai_error(500, "simulated upstream error", None)


def malformed_body(style: Style) -> bytes:
    """A 200 body that claims JSON and breaks off: the ``malformed`` fault."""
    if style == "anthropic":
        return b'{"id": "msg_sim-malformed", "type": "message", "content": [{"type":'
    return b'{"id": "sim-malformed", "object": "chat.completion", "choices": [{"index": 0,'


def malformed_event(wire: Wire, reply_id: str) -> bytes:
    """An SSE event whose data is not JSON: the ``malformed`` fault of a stream."""
    if wire == "anthropic":
        return b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0,\n\n'
    return b'data: {"id": "' + reply_id.encode() + b'", "choices": [\n\n'


def sse(event: Event) -> bytes:
    """One SSE event: ``event:`` (when named) and ``data:``, JSON or the ``[DONE]`` sentinel."""
    name, data = event
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {name}\n" if name is not None else ""
    return f"{head}data: {text}\n\n".encode()
