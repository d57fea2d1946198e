"""The MonkeyOCR wire format: uploads named by content, real-shaped answers read, failures kept."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import SecretStr

from polygateway.config import SourceConfig
from polygateway.models import LayoutBlock
from polygateway.transport.files import detect_kind, filename_for, media_type_for
from polygateway.transport.http import TransientError
from polygateway.transport.monkey_ocr import (
    parse_layout_response,
    parse_request,
    parse_text_response,
    text_request,
)

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"
JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF"
PDF = b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n"


def Source(**fields: Any) -> SourceConfig:
    """A MonkeyOCR source as the wire format gets it from settings."""
    defaults: dict[str, Any] = {
        "name": "monkey",
        "protocol": "monkey_ocr",
        "base_url": "http://127.0.0.1:7861",
    }
    return SourceConfig(**(defaults | fields))


# --- detect_kind / filename_for ---


@pytest.mark.parametrize(
    ("data", "kind", "name", "media"),
    [
        (PDF, "pdf", "document.pdf", "application/pdf"),
        (PNG, "png", "image.png", "image/png"),
        (JPEG, "jpeg", "image.jpg", "image/jpeg"),
    ],
)
def test_detect_kind_by_magic_bytes(data: bytes, kind: str, name: str, media: str) -> None:
    """PDF, PNG and JPEG are told apart by magic bytes and named with an accepted suffix."""
    detected = detect_kind(data)
    assert detected == kind
    assert detected is not None
    assert filename_for(detected) == name
    assert media_type_for(detected) == media


@pytest.mark.parametrize(
    "data", [b"", b"hello world", b"GIF89a....", b"PK\x03\x04", b"notes: %PDF-1.4"]
)
def test_detect_kind_refuses_other_content(data: bytes) -> None:
    """Text (even quoting a PDF header), GIF, ZIP, empty input: not an image or PDF."""
    assert detect_kind(data) is None


# --- Requests ---


def test_text_request_uploads_file_part_to_ocr_text() -> None:
    """POST {base}/ocr/text, multipart part 'file' with its name and media type, no JSON body."""
    request = text_request(Source(), PNG, "image.png", timeout_s=60.0)
    assert request.url == "http://127.0.0.1:7861/ocr/text"
    assert request.method == "POST"
    assert request.files == {"file": ("image.png", PNG, "image/png")}
    assert request.json is None
    assert request.params is None
    assert request.timeout_s == 60.0
    assert "Content-Type" not in request.headers  # the client writes the multipart boundary


def test_parse_request_asks_for_content_list_json() -> None:
    """POST {base}/parse?return_type=content_list_json with the PDF as part 'file'."""
    request = parse_request(Source(base_url="http://h:1/"), PDF, "document.pdf", timeout_s=300.0)
    assert request.url == "http://h:1/parse"
    assert request.params == {"return_type": "content_list_json"}
    assert request.files == {"file": ("document.pdf", PDF, "application/pdf")}


def test_upload_sends_bearer_key_when_configured() -> None:
    """A key configured for a MonkeyOCR source behind a proxy goes as Bearer; extras follow."""
    source = Source(api_key=SecretStr("k-123456"), headers={"X-Team": "ocr"})
    request = text_request(source, JPEG, "image.jpg", timeout_s=1.0)
    assert request.headers == {"Authorization": "Bearer k-123456", "X-Team": "ocr"}


# --- /ocr/text answers ---

# Shape of MonkeyOCR's TaskResponse, as its FastAPI server answers /ocr/text.
OCR_TEXT_OK = {
    "success": True,
    "task_type": "text",
    "content": "Invoice No. 2024-0117\nTotal: 1,250.00 EUR",
    "message": "Text extraction completed successfully",
}


def test_parse_text_response_returns_content() -> None:
    """The recognised text is the answer's content."""
    assert parse_text_response(OCR_TEXT_OK) == "Invoice No. 2024-0117\nTotal: 1,250.00 EUR"


def test_success_false_is_transient_keeping_the_message() -> None:
    """success: false is a transient failure whose message keeps the provider's reason."""
    body = {
        "success": False,
        "task_type": "text",
        "content": "",
        "message": "OCR task failed: CUDA out of memory",
    }
    with pytest.raises(TransientError, match="CUDA out of memory") as info:
        parse_text_response(body)
    assert info.value.failure == "transient"


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {},
        {"success": "yes", "content": "x"},
        {"success": True},
        {"success": True, "content": 3},
    ],
)
def test_malformed_text_answer_is_transient(body: Any) -> None:
    """A missing success flag or non-string content is a malformed body."""
    with pytest.raises(TransientError, match="malformed body"):
        parse_text_response(body)


# --- /parse answers ---

# A MinerU-style content list as MonkeyOCR writes *_content_list.json.
CONTENT_LIST: list[dict[str, Any]] = [
    {
        "type": "text",
        "text": "Quarterly Report",
        "text_level": 1,
        "page_idx": 0,
        "bbox": [72, 60, 540, 96],
    },
    {
        "type": "text",
        "text": "Revenue grew in every region.",
        "page_idx": 0,
        "bbox": [72, 110, 540, 150],
    },
    {
        "type": "table",
        "img_path": "images/3f1c.jpg",
        "table_caption": ["Table 1: Revenue by region"],
        "table_footnote": [],
        "table_body": "<table><tr><td>EU</td><td>12</td></tr></table>",
        "page_idx": 0,
        "bbox": [72, 160, 540, 300],
    },
    {
        "type": "equation",
        "img_path": "images/9a0b.jpg",
        "text": "$$\nE = mc^2\n$$",
        "text_format": "latex",
        "page_idx": 1,
    },
    {
        "type": "image",
        "img_path": "images/77de.jpg",
        "img_caption": ["Figure 1: Growth"],
        "img_footnote": [],
        "page_idx": 1,
        "bbox": [100.5, 200.0, 400.0, 380.25],
    },
    {"type": "title", "text": "Outlook", "text_level": 2, "page_idx": 1},
    {"type": "text", "text": "", "page_idx": 1},
]

PARSE_OK = {
    "success": True,
    "message": "PDF parsing (standard) completed successfully - returning content_list_json",
    "output_dir": "/tmp/monkeyocr_parse_1a2b3c4d_/report_5e6f7a8b",
    "files": ["report_5e6f7a8b_content_list.json", "report_5e6f7a8b.md"],
    "download_url": None,
    "content": json.dumps(CONTENT_LIST, ensure_ascii=False),
    "content_type": "application/json",
}


def test_parse_layout_builds_typed_blocks() -> None:
    """Each content-list item becomes a LayoutBlock with type, text, bbox tuple or None, page."""
    blocks, _ = parse_layout_response(PARSE_OK)
    assert blocks == (
        LayoutBlock("title", "Quarterly Report", (72.0, 60.0, 540.0, 96.0), 0),
        LayoutBlock("text", "Revenue grew in every region.", (72.0, 110.0, 540.0, 150.0), 0),
        LayoutBlock(
            "table",
            "<table><tr><td>EU</td><td>12</td></tr></table>",
            (72.0, 160.0, 540.0, 300.0),
            0,
        ),
        LayoutBlock("equation", "E = mc^2", None, 1),
        LayoutBlock("image", "Figure 1: Growth", (100.5, 200.0, 400.0, 380.25), 1),
        LayoutBlock("title", "Outlook", None, 1),
        LayoutBlock("text", "", None, 1),
    )


def test_parse_layout_builds_markdown_in_reading_order() -> None:
    """Titles as '#' * level, tables as caption + body, equations fenced in $$, images linked."""
    _, markdown = parse_layout_response(PARSE_OK)
    assert markdown == (
        "# Quarterly Report\n\n"
        "Revenue grew in every region.\n\n"
        "Table 1: Revenue by region\n\n"
        "<table><tr><td>EU</td><td>12</td></tr></table>\n\n"
        "$$\nE = mc^2\n$$\n\n"
        "![Figure 1: Growth](images/77de.jpg)\n\n"
        "## Outlook\n"
    )


def test_unknown_item_type_is_kept_as_other() -> None:
    """A type this reader does not know keeps its text as an 'other' block."""
    body = dict(
        PARSE_OK, content=json.dumps([{"type": "page_footer", "text": "p. 3", "page_idx": 2}])
    )
    blocks, markdown = parse_layout_response(body)
    assert blocks == (LayoutBlock("other", "p. 3", None, 2),)
    assert markdown == "p. 3\n"


def test_missing_content_list_reported_as_success_is_malformed() -> None:
    """The server's 'No content_list.json file found' plain-text success is a malformed body."""
    body = dict(PARSE_OK, content="No content_list.json file found", content_type="text/plain")
    with pytest.raises(TransientError, match="malformed body") as info:
        parse_layout_response(body)
    assert "No content_list.json" in str(info.value)


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        "[" * 100_000 + "]" * 100_000,  # nested past the parser's depth
        json.dumps({"type": "text"}),
        json.dumps(["text"]),
        json.dumps([{"type": "text", "text": 5}]),
        json.dumps([{"type": "text", "text": "x", "page_idx": "0"}]),
    ],
)
def test_bad_content_list_is_malformed(content: str) -> None:
    """Content that is not a JSON array of well-typed items is a malformed body."""
    with pytest.raises(TransientError, match="malformed body"):
        parse_layout_response(dict(PARSE_OK, content=content))


def test_parse_failure_is_transient_keeping_the_message() -> None:
    """success: false on /parse keeps the provider's message."""
    body = {"success": False, "message": "Parsing failed: PDF is encrypted"}
    with pytest.raises(TransientError, match="PDF is encrypted"):
        parse_layout_response(body)
