"""Request and response types of the three clients, and the attempt record telemetry emits.

Frozen, slotted dataclasses: they sit on the hot path and are handed to user
code, which must not be able to change what the gateway recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "AttemptRecord",
    "ChatChunk",
    "ChatResponse",
    "EmbeddingResponse",
    "FailureClass",
    "LayoutBlock",
    "LayoutResult",
    "TextResult",
    "ToolCall",
    "ToolCallDelta",
    "Usage",
]

FailureClass = Literal["rate_limited", "transient", "source_misconfigured", "request_rejected"]
"""What a failed attempt was, per the classification table of DESIGN.md section 4."""


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts as the provider reported them (0 when it did not)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


@dataclass(frozen=True, slots=True)
class AttemptRecord:
    """One real request to one source, as emitted by telemetry and kept on results and errors.

    ``outcome`` is ``"success"``, a failure class, or ``"cancelled"``.
    Times are seconds of the injected monotonic clock; ``ttft_s`` is set for streams.
    """

    call_id: str
    scope: str
    source: str
    attempt: int
    outcome: str
    status_code: int | None
    latency_s: float
    ttft_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    permit_wait_s: float = 0.0
    stalled_s: float = 0.0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A complete tool call of a chat answer."""

    id: str
    name: str
    arguments: str
    type: str = "function"


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a tool call in a stream; ``index`` ties the pieces together."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass(frozen=True, slots=True)
class ChatResponse:
    """The answer of ``ChatClient.complete``; ``raw`` is the provider's JSON."""

    text: str
    source: str
    finish_reason: str | None
    tool_calls: tuple[ToolCall, ...]
    usage: Usage
    attempts: tuple[AttemptRecord, ...]
    raw: dict[str, Any] = field(repr=False)


@dataclass(frozen=True, slots=True)
class ChatChunk:
    """One piece of a streamed chat answer."""

    text: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finish_reason: str | None = None
    source: str = ""
    usage: Usage | None = None


@dataclass(frozen=True, slots=True)
class EmbeddingResponse:
    """Vectors in input order; ``sources`` names the source of each batch in order."""

    vectors: list[list[float]]
    usage: Usage
    sources: tuple[str, ...] = ()
    batches: tuple[tuple[int, int], ...] = ()
    attempts: tuple[AttemptRecord, ...] = ()


@dataclass(frozen=True, slots=True)
class TextResult:
    """Plain text recognised in an image or document."""

    text: str
    source: str
    attempts: tuple[AttemptRecord, ...] = ()
    raw: Any = field(default=None, repr=False)


BlockType = Literal["text", "title", "image", "table", "equation", "other"]


@dataclass(frozen=True, slots=True)
class LayoutBlock:
    """One typed block of a parsed document; ``page`` counts from 0."""

    type: str
    text: str
    bbox: tuple[float, float, float, float] | None
    page: int


@dataclass(frozen=True, slots=True)
class LayoutResult:
    """A parsed document: typed blocks in reading order, and the same as markdown."""

    blocks: tuple[LayoutBlock, ...]
    markdown: str
    source: str
    attempts: tuple[AttemptRecord, ...] = ()
    raw: Any = field(default=None, repr=False)
