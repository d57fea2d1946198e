"""The OCR client: ``recognize_text()`` and ``parse_layout()`` through the one governance loop.

An OCR scope runs the loop of ``middleware/retry.py`` with
``exempt_429=False`` (its default for ``kind = "ocr"``): every failure is
charged to ``max_attempts``, there is no main-loop stall check, and the stall
rule inside ``_on_no_runnable`` is metered by the call's ``StallClock``
(research-wiki/designs/stall-budget.md §3). This module validates the upload and speaks the
two wire formats; it has no loop of its own.

Two protocols serve an OCR scope:

- ``monkey_ocr``: ``POST /ocr/text`` and ``POST /parse`` with the upload as
  the multipart part ``file``. The server picks its decoder from the part's
  file name, so the name always comes from the detected content (the
  caller's ``filename`` is only a hint for messages).
- ``vision_ocr``: an OpenAI-compatible vision model given the image as a
  data URL; images only, and ``recognize_text`` only. A transcription cut at
  the token limit, filtered or refused is a transient failure, never a
  shorter text passed off as the whole.

Each call runs on the sources that can take it: a PDF or a ``parse_layout``
call goes to ``monkey_ocr`` sources only, and a source whose
``max_upload_bytes`` the upload exceeds is left out. When no source can take
the call, it is refused with ``RequestRejected`` naming the reason before any
request, as is an upload that is not an image or PDF (by magic bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal

from polygateway.errors import RequestRejected
from polygateway.middleware.lifecycle import GovernedClient, priority_shares, reserved_permits
from polygateway.middleware.retry import RetryMW
from polygateway.models import LayoutBlock, LayoutResult, TextResult
from polygateway.transport import monkey_ocr, vision_ocr
from polygateway.transport.files import FileKind, detect_kind, filename_for
from polygateway.transport.openai import estimate_chat_tokens, parse_chat_response

if TYPE_CHECKING:
    from polygateway.config import SourceConfig
    from polygateway.middleware.attempt import AttemptContext, Served

__all__ = ["OcrClient", "describe_content"]

_Op = Literal["recognize_text", "parse_layout"]

# Magic bytes of common files that are neither an image OCR reads nor a PDF,
# so a refusal can say what the caller actually sent.
_OTHER_MAGIC: Final[tuple[tuple[bytes, str], ...]] = (
    (b"GIF87a", "a GIF image"),
    (b"GIF89a", "a GIF image"),
    (b"II*\x00", "a TIFF image"),
    (b"MM\x00*", "a TIFF image"),
    (b"PK\x03\x04", "a ZIP archive (e.g. docx, xlsx)"),
    (b"\x1f\x8b", "a gzip archive"),
    (b"\xd0\xcf\x11\xe0", "an OLE2 document (e.g. doc, xls)"),
)

# The vision prompt as estimate_chat_tokens sees it: the instruction plus one
# image part (counted as a flat image price, not by its base64 length).
_VISION_ESTIMATE_MESSAGES: Final = (
    {
        "role": "user",
        "content": [{"type": "text", "text": vision_ocr.INSTRUCTION}, {"type": "image_url"}],
    },
)


def describe_content(data: bytes) -> str:
    """What ``data`` looks like, for a refusal message: a file type, text, or unknown binary."""
    if not data:
        return "empty input"
    for magic, what in _OTHER_MAGIC:
        if data.startswith(magic):
            return what
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "a WebP image"
    head = data[:4096]
    if b"\x00" not in head:
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as exc:
            # A multi-byte character cut by the 4096-byte window is still text.
            if exc.start < len(head) - 3:
                return "unrecognised binary data"
        return "text"
    return "unrecognised binary data"


@dataclass(frozen=True, slots=True)
class _Upload:
    """A validated upload: its bytes, detected kind, and the sources that can take it."""

    data: bytes
    kind: FileKind
    sources: tuple[SourceConfig, ...]


@dataclass(frozen=True, slots=True)
class _Read:
    """What one OCR attempt came to, before the client adds source and attempts."""

    text: str
    blocks: tuple[LayoutBlock, ...]
    markdown: str
    raw: Any


class OcrClient(GovernedClient):
    """Text recognition and layout parsing of images and PDFs, through the one governance loop."""

    KIND: ClassVar[str] = "ocr"
    DEFAULT_SCOPE: ClassVar[str] = "ocr"

    def _setup(self) -> None:
        """The lazily built loops over subsets of the scope's sources."""
        # Loops over a subset of the scope's sources (a PDF in a scope that also
        # has vision sources, say), built on first need: the same RetryMW class
        # on the same backend, scope and waiting room, only fewer candidates.
        self._subset_loops: dict[tuple[str, ...], RetryMW] = {}

    async def recognize_text(
        self,
        image_or_pdf_bytes: bytes,
        filename: str | None = None,
        *,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        priority_class: str | None = None,
        tenant: str | None = None,
    ) -> TextResult:
        """The text of an image (PNG, JPEG) or PDF.

        ``filename`` is only a hint for messages: the upload is named from its
        detected content.

        Raises:
            RequestRejected: not an image or PDF, too large for every source, a
                PDF in a scope of vision sources only (all before any
                request), or a source answered 400/413/422.
            AllSourcesExhausted: the loop gave up (``reason`` says why; a vision
                transcription cut at the token limit, filtered or refused on
                every attempt ends here, its cause in ``attempts``).
            GovernanceBackendError: the shared state failed (fail closed).
            GatewayError: the client is closed.
        """
        upload = self._check(image_or_pdf_bytes, filename, "recognize_text")
        flow = self._mw.check_flow(priority_class, tenant, "ocr.recognize_text")
        served = await self._run(upload, "recognize_text", fail_fast, deadline_s, flow)
        read = served.value
        return TextResult(
            text=read.text, source=served.source, attempts=served.attempts, raw=read.raw
        )

    async def parse_layout(
        self,
        image_or_pdf_bytes: bytes,
        filename: str | None = None,
        *,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        priority_class: str | None = None,
        tenant: str | None = None,
    ) -> LayoutResult:
        """Typed blocks (type, text, bbox, page) in reading order, and the same as markdown.

        Served by ``monkey_ocr`` sources only (a vision model gives no layout).

        Raises:
            RequestRejected: not an image or PDF, too large for every source, a
                scope without a ``monkey_ocr`` source (all before any request),
                or a source answered 400/413/422.
            AllSourcesExhausted: the loop gave up (``reason`` says why).
            GovernanceBackendError: the shared state failed (fail closed).
            GatewayError: the client is closed.
        """
        upload = self._check(image_or_pdf_bytes, filename, "parse_layout")
        flow = self._mw.check_flow(priority_class, tenant, "ocr.parse_layout")
        served = await self._run(upload, "parse_layout", fail_fast, deadline_s, flow)
        read = served.value
        return LayoutResult(
            blocks=read.blocks,
            markdown=read.markdown,
            source=served.source,
            attempts=served.attempts,
            raw=read.raw,
        )

    # --- before any request --------------------------------------------------------

    def _check(self, data: object, filename: str | None, op: _Op) -> _Upload:
        """The upload and the sources that can take it, or ``RequestRejected`` saying why not."""
        scope = self._scope
        if not isinstance(data, bytes | bytearray | memoryview):
            raise RequestRejected(
                f"ocr.{op}: the upload must be bytes, not {type(data).__name__}", scope=scope
            )
        payload = bytes(data)
        hint = f" ({filename!r})" if isinstance(filename, str) and filename else ""
        kind = detect_kind(payload)
        if kind is None:
            raise RequestRejected(
                f"ocr.{op}: the upload{hint} is not an image (png, jpeg) or PDF: "
                f"its content looks like {describe_content(payload)}",
                scope=scope,
            )
        sources: Sequence[SourceConfig] = self._config.sources
        if op == "parse_layout":
            sources = [s for s in sources if s.protocol == "monkey_ocr"]
            if not sources:
                raise RequestRejected(
                    "ocr.parse_layout needs a monkey_ocr source: vision_ocr sources only "
                    "read the text of images",
                    scope=scope,
                    sources=self._mw.sources,
                )
        elif kind == "pdf":
            sources = [s for s in sources if s.protocol == "monkey_ocr"]
            if not sources:
                raise RequestRejected(
                    f"ocr.{op}: the upload{hint} is a PDF, and vision_ocr sources take images "
                    "only (png, jpeg)",
                    scope=scope,
                    sources=self._mw.sources,
                )
        fitting = tuple(s for s in sources if len(payload) <= s.max_upload_bytes)
        if not fitting:
            largest = max(s.max_upload_bytes for s in sources)
            raise RequestRejected(
                f"ocr.{op}: the upload{hint} is {len(payload)} bytes, over the "
                f"max_upload_bytes of every source that could take it (at most {largest})",
                scope=scope,
                sources=tuple(s.name for s in sources),
            )
        return _Upload(payload, kind, fitting)

    def _loop_for(self, sources: tuple[SourceConfig, ...]) -> RetryMW:
        """The scope's loop, or the same loop over fewer sources when some cannot take a call.

        Every loop of the scope shares its FIFO waiting room, so in a mixed
        scope a PDF at the head waits for a MonkeyOCR permit while image calls
        behind it wait their turn: head-of-line order, kept for fairness.
        """
        if len(sources) == len(self._config.sources):
            return self._mw
        key = tuple(s.name for s in sources)
        loop = self._subset_loops.get(key)
        if loop is None:
            loop = self._subset_loops[key] = RetryMW(
                scope=self._scope,
                sources=sources,
                policy=self._mw.policy,
                backend=self._backend,
                now=self._now,
                sleep=self._sleep,
                rng=self._rng,
                emitter=self._emitter,
                priority_classes=priority_shares(self._config),
                default_priority_class=self._config.default_priority_class,
                reserved_permits=reserved_permits(self._config),
            )
        return loop

    # --- through the loop ----------------------------------------------------------

    async def _run(
        self,
        upload: _Upload,
        op: _Op,
        fail_fast: bool,
        deadline_s: float | None,
        flow: tuple[str, str],
    ) -> Served[_Read]:
        """One governed call, on the sources that can take the upload."""
        transport = self._transport
        data, kind = upload.data, upload.kind

        async def attempt(source: SourceConfig, ctx: AttemptContext) -> _Read:
            if source.protocol == "vision_ocr":
                request = vision_ocr.text_request(
                    source,
                    data,
                    kind,
                    timeout_s=ctx.timeout_s,
                    on_hint=ctx.see_hint,
                    extra_headers=ctx.headers,
                )
                parsed = parse_chat_response(await transport.send(request))
                ctx.usage = parsed.usage
                ctx.response_model = parsed.response_model()
                ctx.finish_reasons = parsed.finish_reasons()
                return _Read(vision_ocr.transcription(parsed), (), "", parsed.raw)
            name = filename_for(kind)
            if op == "parse_layout":
                request = monkey_ocr.parse_request(
                    source, data, name, timeout_s=ctx.timeout_s, extra_headers=ctx.headers
                )
                body = await transport.send(request)
                blocks, markdown = monkey_ocr.parse_layout_response(body)
                return _Read("", blocks, markdown, body)
            request = monkey_ocr.text_request(
                source, data, name, timeout_s=ctx.timeout_s, extra_headers=ctx.headers
            )
            body = await transport.send(request)
            return _Read(monkey_ocr.parse_text_response(body), (), "", body)

        call = self._life.begin()
        try:
            async with call.running():
                return await self._loop_for(upload.sources).run(
                    attempt,
                    cost_tokens=_cost(upload),
                    fail_fast=fail_fast,
                    deadline_s=deadline_s,
                    op_name=f"ocr.{op}",
                    priority_class=flow[0],
                    tenant=flow[1],
                )
        finally:
            self._life.end(call)


def _cost(upload: _Upload) -> int:
    """The tpm reservation: a vision prompt's estimate when a vision source may serve, else 0.

    MonkeyOCR reports no tokens, so a tpm limit on it would mean nothing.
    """
    if upload.kind == "pdf" or all(s.protocol != "vision_ocr" for s in upload.sources):
        return 0
    return estimate_chat_tokens(_VISION_ESTIMATE_MESSAGES)
