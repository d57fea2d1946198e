"""OpenAI's file and audio content parts on the Anthropic wire.

OpenAI takes a PDF as a ``file`` part (``file_data``, a base64 ``data:`` URL,
and a ``filename``); the Messages API takes it as a ``document`` block with a
base64 source (its ``title`` optional). Sent as it is, the OpenAI part is a
400 from the Messages API; an ``input_audio`` part likewise, since the API
takes no audio, and a ``file_id`` names a file of OpenAI's Files API that an
Anthropic source cannot read. Those are refused before anything is sent,
naming the part.
"""

from __future__ import annotations

from typing import Any

import pytest
from _anthropic_source import claude_source

from polygateway.testing import TransientError
from polygateway.transport.anthropic import messages_request

PDF = "JVBERi0xLjQKJcfsj6IK"


def _user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "Summarize it."}]}]


def _blocks(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    request = messages_request(claude_source(), _user(*parts), {}, stream=False, timeout_s=30.0)
    content: list[dict[str, Any]] = request.json["messages"][0]["content"]
    return content


def _refused(*parts: dict[str, Any]) -> str:
    with pytest.raises(TransientError) as caught:
        _blocks(*parts)
    assert caught.value.failure == "request_rejected"
    assert "sk-ant" not in str(caught.value)
    return str(caught.value)


def test_a_pdf_file_part_is_a_document_block_titled_by_its_filename() -> None:
    part = {
        "type": "file",
        "file": {"file_data": f"data:application/pdf;base64,{PDF}", "filename": "report.pdf"},
    }
    document, text = _blocks(part)
    assert document == {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": PDF},
        "title": "report.pdf",
    }
    assert text == {"type": "text", "text": "Summarize it."}


def test_a_pdf_without_a_filename_has_no_title() -> None:
    part = {"type": "file", "file": {"file_data": f"data:application/pdf;base64,{PDF}"}}
    (document, _) = _blocks(part)
    assert "title" not in document
    assert document["source"]["data"] == PDF


def test_a_file_of_openais_files_api_is_refused_naming_it() -> None:
    message = _refused({"type": "file", "file": {"file_id": "file-abc123"}})
    assert "messages[0].content[0].file" in message
    assert "file_id" in message
    assert "file_data" in message


@pytest.mark.parametrize(
    "file_data",
    [
        "data:image/png;base64,iVBORw0KGgo=",
        "data:application/pdf,plain-not-base64",
        "JVBERi0xLjQK",
    ],
)
def test_a_file_that_is_no_base64_pdf_is_refused(file_data: str) -> None:
    message = _refused({"type": "file", "file": {"file_data": file_data}})
    assert "messages[0].content[0].file" in message
    assert "PDF" in message


def test_audio_is_refused_naming_the_part() -> None:
    message = _refused({"type": "input_audio", "input_audio": {"data": "UklGR", "format": "wav"}})
    assert "messages[0].content[0]" in message
    assert "audio" in message
