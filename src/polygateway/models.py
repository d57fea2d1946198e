"""Request and response types of the three clients, and the attempt record telemetry emits.

Frozen, slotted dataclasses: they sit on the hot path and are handed to user
code, which must not be able to change what the gateway recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Literal

from typing_extensions import TypeVar

__all__ = [
    "AttemptRecord",
    "CallOutcome",
    "CallRecord",
    "ChatChunk",
    "ChatResponse",
    "Choice",
    "EmbeddingProgress",
    "EmbeddingResponse",
    "FailureClass",
    "LayoutBlock",
    "LayoutResult",
    "PartialEmbeddingResponse",
    "TextResult",
    "ToolCall",
    "ToolCallDelta",
    "Usage",
]

ParsedT = TypeVar("ParsedT", covariant=True, default=Any)
"""What ``ChatResponse.parsed`` holds: the call's ``response_model`` instance, ``None`` without one.

The default (``Any``) keeps a bare ``ChatResponse`` annotation valid under
``mypy --strict``; ``ChatClient.complete`` returns ``ChatResponse[Model]``
when given ``response_model=Model`` and ``ChatResponse[None]`` otherwise.
"""

FailureClass = Literal["rate_limited", "transient", "source_misconfigured", "request_rejected"]
"""What a failed attempt was, per the classification table of research-wiki/ARCHITECTURE.md §2b."""


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
    ``response_model`` is the model the answer names (a provider may serve an
    alias with a dated model), and ``finish_reasons`` the finish reason of
    each choice, as far as the attempt read them: metadata, never content.
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
    response_model: str | None = None
    finish_reasons: tuple[str, ...] = ()


CallOutcome = Literal[
    "served",
    "retry_exhausted",
    "stalled",
    "no_runnable",
    "deadline",
    "rejected",
    "interrupted",
    "cancelled",
    "backend_error",
    "error",
]
"""How a call through the loop ended: ``served``, the ``reason`` of ``AllSourcesExhausted``,
``rejected`` (``RequestRejected``), ``interrupted`` (a stream cut after chunks reached the
caller), ``cancelled`` (the caller or the client's close), ``backend_error``
(``GovernanceBackendError``), or ``error`` (anything else)."""


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One call through the governance loop, from its start to its end, whatever the end.

    Emitted once per call (``Emitter.emit_call``), also for calls that never
    reached a source (``no_runnable``, ``stalled``, ``deadline`` before any
    attempt). ``operation`` is the client's operation (``chat.complete``,
    ``chat.stream``, ``embed``, ``ocr.recognize_text``, ...); an embedding
    call runs one loop call per batch, so it yields one record per batch.
    ``waited_s`` is time spent waiting: in the scope's queue, in back-offs and
    pauses; ``stalled_s`` is the non-productive time the stall rule counts.
    Tokens add up every attempt's usage.
    """

    call_id: str
    scope: str
    operation: str
    outcome: CallOutcome
    attempts: int
    source: str | None
    duration_s: float
    waited_s: float
    stalled_s: float
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A complete tool call of a chat answer.

    ``type`` says how the call is sent back: ``function`` (a tool call),
    ``custom`` (a free-form tool's, ``arguments`` its plain-text input), or
    ``function_call`` (the answer to a request's legacy ``functions``: the
    message's ``function_call``, without an id, answered by a ``function``
    message).
    """

    id: str
    name: str
    arguments: str
    type: str = "function"


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a tool call in a stream; ``index`` ties the pieces together.

    ``type`` is the call's ``ToolCall.type`` when the piece names it (a
    legacy ``delta.function_call`` piece always does), ``None`` otherwise.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None
    type: str | None = None


@dataclass(frozen=True, slots=True)
class Choice:
    """One of the answers of a chat completion (``n > 1`` asks for several); ``index`` as sent.

    ``refusal`` is the model's refusal message when it declined to answer
    (OpenAI's ``message.refusal``), ``None`` otherwise.
    """

    index: int
    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None
    refusal: str | None = None


@dataclass(frozen=True, slots=True)
class ChatResponse(Generic[ParsedT]):
    """The answer of ``ChatClient.complete`` (or of ``ChatStream.response()``).

    ``text``, ``tool_calls`` and ``finish_reason`` are those of the first
    choice; ``choices`` holds every choice the provider returned (one unless
    the call asked for ``n > 1``). ``parsed`` is the answer validated as the
    call's ``response_model`` (``None`` without one). ``raw`` is the
    provider's JSON; for a stream, a ``chat.completion`` object built from
    its chunks (``ChatStream.response``). ``refusal`` is the first choice's
    refusal message (OpenAI's ``message.refusal``, e.g. a structured-output
    request the model declined), ``None`` when the model answered: a refusal
    is a served answer, not a failure, so it is read here rather than raised.
    """

    text: str
    source: str
    finish_reason: str | None
    tool_calls: tuple[ToolCall, ...]
    usage: Usage
    attempts: tuple[AttemptRecord, ...]
    raw: dict[str, Any] = field(repr=False)
    choices: tuple[Choice, ...] = field(default=(), repr=False)
    # None is the value without a response_model, where ParsedT is None (or Any, its
    # default); mypy cannot see that a default of None fits every use of the class.
    parsed: ParsedT = None  # type: ignore[assignment]
    refusal: str | None = None


@dataclass(frozen=True, slots=True)
class ChatChunk:
    """One piece of a streamed chat answer; ``refusal`` a piece of a refusal (``delta.refusal``)."""

    text: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finish_reason: str | None = None
    source: str = ""
    usage: Usage | None = None
    refusal: str | None = None


@dataclass(frozen=True, slots=True)
class EmbeddingResponse:
    """Vectors in input order; ``sources`` names the source of each batch in order."""

    vectors: list[list[float]]
    usage: Usage
    sources: tuple[str, ...] = ()
    batches: tuple[tuple[int, int], ...] = ()
    attempts: tuple[AttemptRecord, ...] = ()

    @property
    def failed_spans(self) -> tuple[tuple[int, int], ...]:
        """Always empty: read alike on both responses, and a complete one has no failed batch."""
        return ()


@dataclass(frozen=True, slots=True)
class PartialEmbeddingResponse:
    """What ``embed(..., partial=True)`` returns, and a failed call's error holds as ``.partial``.

    ``vectors`` is positioned as the input, ``None`` for each text of a failed
    batch; ``failed_spans`` are the ``(start, stop)`` input indices of those
    batches, in input order, so embedding exactly those texts again completes
    the set. ``sources`` lines up with ``batches``, ``""`` for a failed batch;
    ``usage`` counts the served batches; ``attempts`` holds every attempt the
    failed batches' errors recorded too.
    """

    vectors: list[list[float] | None]
    usage: Usage
    failed_spans: tuple[tuple[int, int], ...] = ()
    sources: tuple[str, ...] = ()
    batches: tuple[tuple[int, int], ...] = ()
    attempts: tuple[AttemptRecord, ...] = ()


@dataclass(frozen=True, slots=True)
class EmbeddingProgress:
    """Where one ``embed()`` call stands, handed to its ``on_progress`` as each batch finishes.

    A batch is done once it is served or has failed for good (after its
    retries), so ``texts_done`` reaches ``texts_total`` when the call ends,
    failures included; ``texts_failed`` and ``batches_failed`` say how much of
    it has no vectors. Every count only grows from one report to the next.
    """

    texts_done: int
    texts_total: int
    texts_failed: int
    batches_done: int
    batches_total: int
    batches_failed: int


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
