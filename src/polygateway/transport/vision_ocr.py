"""OCR through an OpenAI-compatible vision chat model: one image in, its text out.

A thin layer over ``openai.py`` (no second copy of the chat wire format): a
fixed transcription instruction plus the image as a ``data:`` URL content
part, read back as the completion's text. Images only: PDFs are MonkeyOCR's
job, and the OCR client rejects them before any request is built.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from polygateway.transport.files import FileKind, media_type_for
from polygateway.transport.http import HintSink, HttpRequest
from polygateway.transport.openai import chat_request, parse_chat_response

if TYPE_CHECKING:
    from polygateway.config import SourceConfig

__all__ = ["INSTRUCTION", "image_messages", "parse_text_response", "text_request"]

INSTRUCTION: Final = "Transcribe all text in this image exactly. Output only the text."
"""What the model is asked to do: verbatim text, no commentary."""

# Transcription wants the most likely reading, not a creative one.
_PARAMS: Final = {"temperature": 0}


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
    return chat_request(
        source,
        image_messages(data, kind),
        _PARAMS,
        stream=False,
        timeout_s=timeout_s,
        on_hint=on_hint,
        extra_headers=extra_headers,
    )


def parse_text_response(body: Any) -> str:
    """The transcription of a chat completion answer; malformed answers are transient."""
    return parse_chat_response(body).text
