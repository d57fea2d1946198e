"""OCR through an OpenAI-compatible vision chat model: one image in, its text out.

A thin layer over ``openai.py`` (no second copy of the chat wire format): a
fixed transcription instruction plus the image as a ``data:`` URL content
part, read back as the completion's text. Images only: PDFs are MonkeyOCR's
job, and the OCR client rejects them before any request is built.

A transcription is the answer only when it is whole: one cut at the token
limit, withheld by a content filter or refused would pass for the full text
of the image, so each is a transient failure naming its cause (retried, maybe
on a source with a larger limit, then ``AllSourcesExhausted``).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from polygateway.transport.files import FileKind, media_type_for
from polygateway.transport.http import HintSink, HttpRequest, TransientError, excerpt
from polygateway.transport.openai import ParsedChat, chat_request, parse_chat_response

if TYPE_CHECKING:
    from polygateway.config import SourceConfig

__all__ = [
    "INSTRUCTION",
    "image_messages",
    "parse_text_response",
    "text_request",
    "transcription",
]

INSTRUCTION: Final = "Transcribe all text in this image exactly. Output only the text."
"""What the model is asked to do: verbatim text, no commentary."""

# Transcription wants the most likely reading, not a creative one.
_PARAMS: Final = {"temperature": 0}

# Finish reasons of an answer that is not the image's whole text, and what each means.
_CUT: Final = "cut at the token limit"
_NOT_WHOLE: Final[dict[str, str]] = {
    "length": _CUT,
    "max_tokens": _CUT,
    "content_filter": "withheld by a content filter",
}


def image_messages(data: bytes, kind: FileKind) -> list[dict[str, Any]]:
    """The chat messages asking for the text of one image."""
    if kind == "pdf":
        raise ValueError("vision OCR takes images only (png, jpeg), not a PDF")
    url = f"data:{media_type_for(kind)};base64,{base64.b64encode(data).decode('ascii')}"
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": INSTRUCTION},
                {"type": "image_url", "image_url": {"url": url}},
            ],
        }
    ]


def text_request(
    source: SourceConfig,
    data: bytes,
    kind: FileKind,
    *,
    timeout_s: float,
    on_hint: HintSink | None = None,
    extra_headers: Mapping[str, str] | None = None,
) -> HttpRequest:
    """The chat completion request transcribing one image at ``source``.

    ``extra_headers`` (trace context) are added as ``chat_request`` adds them.

    Raises:
        ValueError: for a PDF (the client must reject it before this point).
    """
    params = _PARAMS
    if source.max_output_tokens is not None:
        params = {**_PARAMS, "max_tokens": source.max_output_tokens}
    return chat_request(
        source,
        image_messages(data, kind),
        params,
        stream=False,
        timeout_s=timeout_s,
        on_hint=on_hint,
        extra_headers=extra_headers,
    )


def transcription(parsed: ParsedChat) -> str:
    """The text of a read answer, if whole; a cut, filtered or refused one is transient."""
    if parsed.refusal is not None:
        raise TransientError(
            f"vision OCR: the model refused: {excerpt(parsed.refusal)}", failure="transient"
        )
    reason = parsed.finish_reason
    if reason is not None and (why := _NOT_WHOLE.get(reason)) is not None:
        hint = " (the source's max_output_tokens gives it room)" if why == _CUT else ""
        raise TransientError(
            f"vision OCR: the transcription was {why} (finish_reason={reason}){hint}",
            failure="transient",
        )
    return parsed.text


def parse_text_response(body: Any) -> str:
    """The whole transcription of a chat completion answer; any other answer is transient."""
    return transcription(parse_chat_response(body))
