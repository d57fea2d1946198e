"""The exceptions PolyGateway raises to its callers.

The tree::

    GatewayError
    ├── ConfigError                 bad settings, raised at load / construction (also a ValueError)
    ├── RequestRejected             the request itself is invalid (400/413/422, bad input):
    │                               no retry, no other source
    ├── StreamInterrupted           a stream failed after chunks reached the caller
    ├── ResponseParseError          the answer does not validate as the call's response_model:
    │                               .text, .errors; the model's answer, so no retry
    └── GatewayUnavailableError     the scope cannot serve now; callers requeue later
        ├── AllSourcesExhausted     .reason in {"retry_exhausted", "stalled", "no_runnable",
        │                           "deadline"}, .retry_after_s, .attempts
        └── GovernanceBackendError  the backend failed; fail closed, nothing runs ungoverned

Every error carries ``.scope`` and ``.sources`` (a tuple of source names) and,
for embedding calls, ``.batch`` (the ``(start, stop)`` input indices of the
failing batch) and ``.partial`` (every vector the call computed, positioned as
the input, with the failed spans named). Messages are built from names,
reasons and status codes only: no secret, URL credential or header value ever
enters one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from polygateway.models import AttemptRecord, ChatResponse, PartialEmbeddingResponse

__all__ = [
    "AllSourcesExhausted",
    "ConfigError",
    "ExhaustedReason",
    "GatewayError",
    "GatewayUnavailableError",
    "GovernanceBackendError",
    "RequestRejected",
    "ResponseParseError",
    "StreamInterrupted",
]

ExhaustedReason = Literal["retry_exhausted", "stalled", "no_runnable", "deadline"]


class GatewayError(Exception):
    """Root of every error PolyGateway raises to its callers."""

    def __init__(
        self,
        message: str,
        *,
        scope: str | None = None,
        sources: Sequence[str] = (),
        batch: tuple[int, int] | None = None,
        partial: PartialEmbeddingResponse | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.scope = scope
        self.sources: tuple[str, ...] = tuple(sources)
        self.batch = batch
        # An embedding call's vectors outlive its failure: resume from failed_spans.
        self.partial = partial

    def __str__(self) -> str:
        parts = [self.message]
        if self.scope is not None:
            parts.append(f"scope={self.scope!r}")
        if self.sources:
            parts.append(f"sources={list(self.sources)!r}")
        if self.batch is not None:
            parts.append(f"batch={self.batch!r}")
        if self.partial is not None:
            kept = sum(v is not None for v in self.partial.vectors)
            parts.append(f"partial={kept}/{len(self.partial.vectors)} vectors")
        return parts[0] if len(parts) == 1 else f"{parts[0]} ({', '.join(parts[1:])})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class ConfigError(GatewayError, ValueError):
    """Bad settings: names the field and where its value came from (a file, a variable).

    ``env`` is the environment variable the bad value came from, if one did;
    ``path`` is then the ``.env`` file that set it, or ``None`` for the process
    environment.
    """

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        path: str | None = None,
        scope: str | None = None,
        sources: Sequence[str] = (),
        env: str | None = None,
    ) -> None:
        self.field = field
        self.path = path
        self.env = env
        where = []
        if field:
            where.append(f"field {field!r}")
        if env:
            where.append(f"from {env} in {path}" if path else f"from environment variable {env}")
        elif path:
            where.append(f"in {path}")
        full = f"{message} [{' '.join(where)}]" if where else message
        super().__init__(full, scope=scope, sources=sources)


class RequestRejected(GatewayError):
    """The request itself is invalid; no other source would accept it."""

    def __init__(
        self,
        message: str,
        *,
        scope: str | None = None,
        sources: Sequence[str] = (),
        status_code: int | None = None,
        batch: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(message, scope=scope, sources=sources, batch=batch)
        self.status_code = status_code


class StreamInterrupted(GatewayError):
    """A stream failed after chunks reached the caller; never silently retried."""

    def __init__(
        self,
        message: str,
        *,
        scope: str | None = None,
        sources: Sequence[str] = (),
        chunks_delivered: int = 0,
    ) -> None:
        super().__init__(message, scope=scope, sources=sources)
        self.chunks_delivered = chunks_delivered


class ResponseParseError(GatewayError):
    """The answer does not validate as the call's ``response_model``.

    The source served (its permit was released as a success) and the model
    answered, just not in the shape asked for: another source would be asked
    the same question at the same cost, so the call is not retried and the
    caller decides (rephrase, raise ``max_tokens``, accept the text).
    ``text`` is the answer as received (for an Anthropic source, the forced
    tool's input as JSON), ``errors`` pydantic's validation errors
    (``ValidationError.errors()``: ``type``, ``loc``, ``msg``, ``input``), and
    ``response`` the whole ``ChatResponse``, usage and attempts included.
    The message names the first error's place and kind, never the answer.
    A model that refused to answer raises it too, with no ``errors`` and the
    refusal in ``response.refusal``.
    """

    def __init__(
        self,
        message: str,
        *,
        text: str,
        errors: Sequence[Mapping[str, Any]],
        response: ChatResponse[None] | None = None,
        scope: str | None = None,
        sources: Sequence[str] = (),
    ) -> None:
        super().__init__(message, scope=scope, sources=sources)
        self.text = text
        self.errors: tuple[Mapping[str, Any], ...] = tuple(errors)
        self.response = response


class GatewayUnavailableError(GatewayError):
    """The scope cannot serve now; the caller should requeue the work later."""


class AllSourcesExhausted(GatewayUnavailableError):
    """The governance loop gave up on this call; ``reason`` says which rule ended it."""

    def __init__(
        self,
        message: str,
        *,
        reason: ExhaustedReason,
        scope: str | None = None,
        sources: Sequence[str] = (),
        retry_after_s: float | None = None,
        attempts: Sequence[AttemptRecord] = (),
        batch: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(message, scope=scope, sources=sources, batch=batch)
        self.reason: ExhaustedReason = reason
        self.retry_after_s = retry_after_s
        self.attempts: tuple[AttemptRecord, ...] = tuple(attempts)

    def __str__(self) -> str:
        extra = f"reason={self.reason!r}"
        if self.retry_after_s is not None:
            extra += f", retry_after_s={self.retry_after_s:.3f}"
        extra += f", attempts={len(self.attempts)}"
        return f"{super().__str__()} [{extra}]"


class GovernanceBackendError(GatewayUnavailableError):
    """The shared-state backend failed; the call fails closed instead of running ungoverned."""

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        scope: str | None = None,
        sources: Sequence[str] = (),
    ) -> None:
        super().__init__(f"{message} (operation={operation})", scope=scope, sources=sources)
        self.operation = operation
