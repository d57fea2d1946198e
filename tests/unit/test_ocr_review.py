"""OcrClient against answers real vision models and MonkeyOCR give, over httpx's wire.

A transcription is only handed back when it is the whole text the model
read: one cut at the token limit, filtered or refused is a named failure,
never a short ``TextResult`` that looks complete. Uploads are named and
routed by their content, whatever their file name says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from _batch_clients import mock_wire, monkey, on_clock, vision
from _batch_clients import ocr_settings as make_settings

from polygateway.config import GatewaySettings
from polygateway.errors import AllSourcesExhausted, RequestRejected
from polygateway.ocr import OcrClient
from polygateway.testing import FakeClock

SCOPE = "ocr"
DATA = Path(__file__).resolve().parents[1] / "data"
PNG = (DATA / "page.png").read_bytes()
PDF = (DATA / "invoice.pdf").read_bytes()
JPEG = (DATA / "grey.jpg").read_bytes()

Handler = Callable[[httpx.Request], httpx.Response]


def client(settings: GatewaySettings, upstream: Handler) -> OcrClient:
    """An OcrClient whose real httpx transport sends through httpx.MockTransport."""
    return on_clock(
        OcrClient, settings, SCOPE, mock_wire(settings, SCOPE, upstream), FakeClock(), seed=3
    )


def completion(
    content: str | None, finish_reason: str = "stop", refusal: str | None = None
) -> dict[str, Any]:
    """A chat completion as an OpenAI-compatible vision model answers it."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1733000000,
        "model": "Qwen2.5-VL-7B-Instruct",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": refusal},
                "finish_reason": finish_reason,
            }
        ],
        "usage": {"prompt_tokens": 101, "completion_tokens": 12, "total_tokens": 113},
    }


class Upstream:
    """Plays the vision answers in turn (the last one again); MonkeyOCR always reads the text."""

    def __init__(self, *answers: dict[str, Any]) -> None:
        self.answers = list(answers) or [completion("Invoice No. 2024-0117")]
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if request.url.path.endswith("/chat/completions"):
            body = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
            return httpx.Response(200, json=body)
        return httpx.Response(
            200,
            json={"success": True, "task_type": "text", "content": "from monkey", "message": ""},
        )

    def part_filename(self, index: int) -> str | None:
        """The multipart file name of request ``index``."""
        found = re.search(rb'name="file"; filename="([^"]*)"', self.requests[index].content)
        return found.group(1).decode() if found else None

    def data_url_type(self, index: int) -> str:
        """The media type of the image data URL request ``index`` sent."""
        body = json.loads(self.requests[index].content)
        url: str = body["messages"][0]["content"][1]["image_url"]["url"]
        return url.split(";", 1)[0].removeprefix("data:")


# --- A transcription is whole, or a named failure ----------------------------------------


async def test_whole_transcription_is_served() -> None:
    """``finish_reason: stop`` is the whole text, served as is."""
    upstream = Upstream(completion("Invoice No. 2024-0117"))
    ocr = client(make_settings(vision()), upstream)
    result = await ocr.recognize_text(PNG)
    assert result.text == "Invoice No. 2024-0117"
    assert result.source == "vision"


async def test_image_without_text_is_served_empty() -> None:
    """An image with nothing to read is an empty transcription, not a failure."""
    ocr = client(make_settings(vision()), Upstream(completion("")))
    assert (await ocr.recognize_text(PNG)).text == ""


@pytest.mark.parametrize(
    ("answer", "cause"),
    [
        (completion("Invoice No. 20", finish_reason="length"), "finish_reason=length"),
        (completion("", finish_reason="content_filter"), "finish_reason=content_filter"),
        (completion(None, refusal="I can't help with that."), "refused"),
    ],
)
async def test_cut_filtered_or_refused_transcription_is_never_served_as_whole(
    answer: dict[str, Any], cause: str
) -> None:
    """A transcription cut, filtered or refused fails typed, its cause named, after retries."""
    upstream = Upstream(answer)
    ocr = client(make_settings(vision(), max_attempts=2), upstream)
    with pytest.raises(AllSourcesExhausted) as caught:
        await ocr.recognize_text(PNG)
    assert caught.value.reason == "retry_exhausted"
    assert len(upstream.requests) == 2
    assert cause in str(caught.value.attempts[-1].error)


async def test_cut_transcription_is_retried_and_a_whole_one_served() -> None:
    """A cut answer is not final: the next attempt's whole transcription is served."""
    upstream = Upstream(
        completion("Invoice No. 20", finish_reason="length"), completion("Invoice No. 2024-0117")
    )
    ocr = client(make_settings(vision(), max_attempts=3), upstream)
    result = await ocr.recognize_text(PNG)
    assert result.text == "Invoice No. 2024-0117"
    assert [a.outcome for a in result.attempts] == ["transient", "success"]


# --- Named and routed by content, whatever the file name --------------------------------


async def test_png_named_pdf_goes_to_a_vision_source_as_png() -> None:
    """A PNG called ``scan.pdf`` is sent as ``image/png``: the name is only a hint."""
    upstream = Upstream()
    ocr = client(make_settings(vision()), upstream)
    await ocr.recognize_text(PNG, "scan.pdf")
    assert upstream.data_url_type(0) == "image/png"


async def test_pdf_named_png_goes_only_to_monkey_ocr_named_as_a_pdf() -> None:
    """A PDF called ``photo.png`` in a mixed scope skips the vision source, its part .pdf."""
    upstream = Upstream()
    ocr = client(make_settings(vision(priority=0), monkey(priority=1)), upstream)
    result = await ocr.recognize_text(PDF, "photo.png")
    assert result.source == "monkey"
    assert [r.url.path for r in upstream.requests] == ["/monkey/ocr/text"]
    assert upstream.part_filename(0) == "document.pdf"


async def test_pdf_named_png_in_a_vision_only_scope_is_refused_naming_the_pdf() -> None:
    """The refusal says the upload is a PDF, though its name says PNG, before any request."""
    upstream = Upstream()
    ocr = client(make_settings(vision()), upstream)
    with pytest.raises(RequestRejected, match=r"\('photo.png'\) is a PDF"):
        await ocr.recognize_text(PDF, "photo.png")
    assert upstream.requests == []


@pytest.mark.parametrize(
    ("data", "looks_like"),
    [
        (b"<html><body>Not found</body></html>", "text"),
        (b"GIF89a\x01\x00\x01\x00", "a GIF image"),
        (b"PK\x03\x04rest-of-a-docx", "a ZIP archive"),
        (b"", "empty input"),
    ],
)
async def test_not_an_image_or_pdf_named_pdf_is_refused_before_any_request(
    data: bytes, looks_like: str
) -> None:
    """An error page or archive saved as ``.pdf`` is refused, naming what it looks like."""
    upstream = Upstream()
    ocr = client(make_settings(monkey()), upstream)
    with pytest.raises(RequestRejected, match=looks_like):
        await ocr.recognize_text(data, "report.pdf")
    assert upstream.requests == []


@pytest.mark.parametrize(
    "prefix",
    [b"\xef\xbb\xbf", b"\r\n\r\n", b"\x1b%-12345X@PJL JOB\r\n", b" " * 1000],
    ids=["utf8-bom", "blank-lines", "pjl-header", "1000-spaces"],
)
async def test_pdf_with_leading_bytes_readers_accept_is_sent_as_a_pdf(prefix: bytes) -> None:
    """A PDF whose header comes within its first 1024 bytes (as Acrobat reads it) is a PDF."""
    upstream = Upstream()
    ocr = client(make_settings(monkey()), upstream)
    result = await ocr.recognize_text(prefix + PDF, "report.pdf")
    assert result.text == "from monkey"
    assert upstream.part_filename(0) == "document.pdf"
    assert prefix + PDF in upstream.requests[0].content


@pytest.mark.parametrize(
    "data",
    [
        b" " * 1025 + PDF,
        b"Notes on the %PDF- header, which any text may quote.\n",
        b"Our spec: a file starts with %PDF-1.7 then a binary comment line.\n",
    ],
    ids=["header-past-1024", "header-without-version", "quoted-in-text"],
)
async def test_text_quoting_a_pdf_header_is_still_refused(data: bytes) -> None:
    """Only a versioned header within 1024 bytes, after no text, makes a PDF: prose is refused."""
    upstream = Upstream()
    ocr = client(make_settings(monkey()), upstream)
    with pytest.raises(RequestRejected, match="not an image"):
        await ocr.recognize_text(data, "notes.pdf")
    assert upstream.requests == []
