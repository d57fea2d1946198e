"""Vision OCR through an OpenAI-compatible chat model: the image as a data URL, text read back."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from pydantic import SecretStr

from polygateway.config import SourceConfig
from polygateway.transport.http import TransientError
from polygateway.transport.openai import chat_request
from polygateway.transport.vision_ocr import (
    INSTRUCTION,
    image_messages,
    parse_text_response,
    text_request,
)

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDRpixels"
JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIFpixels"


def Source(**fields: Any) -> SourceConfig:
    """A vision-model source as the wire format gets it from settings (key already resolved)."""
    defaults: dict[str, Any] = {
        "name": "vlm",
        "protocol": "vision_ocr",
        "base_url": "http://127.0.0.1:8002/v1",
        "model": "qwen2.5-vl-7b",
        "api_key": SecretStr("sk-vision-000"),
    }
    return SourceConfig(**(defaults | fields))


def _image_url(request_json: dict[str, Any]) -> str:
    (message,) = request_json["messages"]
    text_part, image_part = message["content"]
    assert text_part == {"type": "text", "text": INSTRUCTION}
    url: str = image_part["image_url"]["url"]
    return url


def test_text_request_is_a_chat_completion_with_instruction_and_png_data_url() -> None:
    """The image goes as a base64 PNG data URL after the fixed instruction, at temperature 0."""
    request = text_request(Source(), PNG, "png", timeout_s=45.0)
    assert request.url == "http://127.0.0.1:8002/v1/chat/completions"
    assert request.json["model"] == "qwen2.5-vl-7b"
    assert request.json["stream"] is False
    assert request.json["temperature"] == 0
    assert request.timeout_s == 45.0
    url = _image_url(request.json)
    prefix = "data:image/png;base64,"
    assert url.startswith(prefix)
    assert base64.b64decode(url[len(prefix) :]) == PNG


def test_jpeg_gets_jpeg_media_type() -> None:
    """A JPEG is announced as image/jpeg."""
    url = _image_url(text_request(Source(), JPEG, "jpeg", timeout_s=1.0).json)
    assert url.startswith("data:image/jpeg;base64,")


def test_request_is_exactly_the_openai_chat_request() -> None:
    """Vision OCR reuses openai.chat_request: same URL, headers and body, no second copy."""
    built = text_request(Source(), PNG, "png", timeout_s=5.0)
    direct = chat_request(
        Source(), image_messages(PNG, "png"), {"temperature": 0}, stream=False, timeout_s=5.0
    )
    assert built == direct


def test_pdf_is_refused_before_any_request() -> None:
    """A PDF is not vision OCR's job: ValueError, the client rejects it earlier."""
    with pytest.raises(ValueError, match="PDF"):
        text_request(Source(), b"%PDF-1.7", "pdf", timeout_s=1.0)


def test_parse_text_response_returns_completion_text() -> None:
    """The transcription is the completion's text."""
    body = {
        "choices": [
            {
                "message": {"role": "assistant", "content": "STOP\nNo parking"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 800, "completion_tokens": 5, "total_tokens": 805},
    }
    assert parse_text_response(body) == "STOP\nNo parking"


def test_malformed_answer_is_transient() -> None:
    """A completion without choices is a transient malformed body."""
    with pytest.raises(TransientError, match="malformed body"):
        parse_text_response({"id": "x"})


def test_max_output_tokens_is_sent_as_max_tokens() -> None:
    """A server's small default cut can be lifted: the source's bound goes as max_tokens."""
    request = text_request(Source(max_output_tokens=4096), PNG, "png", timeout_s=5.0)
    assert request.json["max_tokens"] == 4096
    assert "max_tokens" not in text_request(Source(), PNG, "png", timeout_s=5.0).json


def test_a_cut_transcription_names_the_setting_that_gives_room() -> None:
    body = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Invoice"},
                "finish_reason": "length",
            }
        ]
    }
    with pytest.raises(TransientError, match="max_output_tokens"):
        parse_text_response(body)


@pytest.mark.parametrize("protocol", ["openai", "anthropic", "monkey_ocr"])
def test_max_output_tokens_is_refused_on_other_protocols(protocol: str) -> None:
    """Only a vision OCR source sends it: elsewhere it would be ignored without a word."""
    from polygateway.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="max_output_tokens"):
        Source(protocol=protocol, max_output_tokens=100)


@pytest.mark.parametrize("value", [0, -1, True, "100", 1.5])
def test_max_output_tokens_must_be_a_positive_whole_number(value: object) -> None:
    from polygateway.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="max_output_tokens"):
        Source(max_output_tokens=value)
