"""The MonkeyOCR wire format: ``POST /ocr/text`` and ``POST /parse`` (content list JSON).

Pure functions, no I/O. MonkeyOCR's FastAPI server answers

- ``/ocr/text`` (multipart ``file``) with ``{success, task_type, content, message}``;
- ``/parse?return_type=content_list_json`` with ``{success, message, content,
  content_type, ...}``, where ``content`` is the *text* of a MinerU-style
  content list: items ``{type, text | table_body | img_path, page_idx,
  bbox?, text_level?, *_caption?}`` in reading order.

The server picks its decoder from the part's file name and refuses names not
ending in .pdf, .jpg, .jpeg or .png: callers name the part with
``files.filename_for(detect_kind(data))``. A ``success: false`` answer is a
transient failure that keeps the provider's message.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from polygateway.models import LayoutBlock
from polygateway.transport.files import detect_kind, filename_for, media_type_for
from polygateway.transport.http import HttpRequest, TransientError, excerpt
from polygateway.transport.wire import (
    add_headers,
    endpoint,
    malformed_body,
    opt_int,
    req_list,
    req_obj,
    req_str,
    source_headers,
)

if TYPE_CHECKING:
    from polygateway.config import SourceConfig

__all__ = [
    "detect_kind",
    "filename_for",
    "layout_markdown",
    "parse_layout_response",
    "parse_request",
    "parse_text_response",
    "text_request",
]

_CONTENT_LIST = "content_list_json"
_OCTET_STREAM = "application/octet-stream"


def _upload(
    source: SourceConfig,
    path: str,
    data: bytes,
    filename: str,
    *,
    timeout_s: float,
    params: dict[str, str] | None = None,
    extra_headers: Mapping[str, str] | None = None,
) -> HttpRequest:
    """A multipart upload of ``data`` as the ``file`` part; the client sets the boundary.

    ``extra_headers`` (trace context) are added where the request has no
    header of the name (``wire.add_headers``).
    """
    kind = detect_kind(data)
    media_type = media_type_for(kind) if kind is not None else _OCTET_STREAM
    headers = source_headers(source)
    if extra_headers:
        add_headers(headers, extra_headers)
    return HttpRequest(
        source=source.name,
        url=endpoint(source, path),
        timeout_s=timeout_s,
        headers=headers,
        files={"file": (filename, data, media_type)},
        params=params,
        connect_timeout_s=source.connect_timeout_s,
    )


def text_request(
    source: SourceConfig,
    data: bytes,
    filename: str,
    *,
    timeout_s: float,
    extra_headers: Mapping[str, str] | None = None,
) -> HttpRequest:
    """The request recognising the text of one image or PDF (``POST {base_url}/ocr/text``)."""
    return _upload(
        source, "ocr/text", data, filename, timeout_s=timeout_s, extra_headers=extra_headers
    )


def parse_request(
    source: SourceConfig,
    data: bytes,
    filename: str,
    *,
    timeout_s: float,
    extra_headers: Mapping[str, str] | None = None,
) -> HttpRequest:
    """The request parsing a document's layout (``POST {base_url}/parse``, content list JSON)."""
    return _upload(
        source,
        "parse",
        data,
        filename,
        timeout_s=timeout_s,
        params={"return_type": _CONTENT_LIST},
        extra_headers=extra_headers,
    )


def _checked(body: Any) -> dict[str, Any]:
    """The answer object, once its ``success`` flag says it worked."""
    answer = req_obj(body, "body")
    success = answer.get("success")
    if not isinstance(success, bool):
        raise malformed_body("success is not a boolean")
    if not success:
        message = answer.get("message")
        detail = excerpt(str(message)) if message else "no message"
        raise TransientError(f"MonkeyOCR failed: {detail}", failure="transient")
    return answer


def parse_text_response(body: Any) -> str:
    """The recognised text of an ``/ocr/text`` answer."""
    return req_str(_checked(body).get("content"), "content")


def _strings(value: Any) -> list[str]:
    """A caption field: a string or a list of strings (anything else is ignored)."""
    if isinstance(value, str):
        return [value] if value.strip() else []
    if isinstance(value, list):
        return [v for v in value if isinstance(v, str) and v.strip()]
    return []


def _bbox(value: Any) -> tuple[float, float, float, float] | None:
    """``[x0, y0, x1, y1]`` as a tuple; an absent or odd box is simply unknown."""
    if not isinstance(value, list) or len(value) != 4:
        return None
    if not all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value
    ):
        return None
    x0, y0, x1, y1 = (float(v) for v in value)
    return (x0, y0, x1, y1)


def _strip_dollars(text: str) -> str:
    """LaTeX of an equation without the ``$$`` fences MinerU sometimes leaves on it."""
    text = text.strip()
    if text.startswith("$$") and text.endswith("$$") and len(text) >= 4:
        text = text[2:-2].strip()
    return text


def _block(item: dict[str, Any], i: int) -> tuple[LayoutBlock, str]:
    """One content-list item as a block and its markdown."""
    what = f"content[{i}]"
    kind = item.get("type")
    page = opt_int(item.get("page_idx"), f"{what}.page_idx")
    bbox = _bbox(item.get("bbox"))
    level = opt_int(item.get("text_level"), f"{what}.text_level")
    if kind in ("text", "title"):
        text = req_str(item.get("text", ""), f"{what}.text")
        if kind == "title" or level > 0:
            level = min(max(level, 1), 6)
            return LayoutBlock("title", text, bbox, page), f"{'#' * level} {text.strip()}"
        return LayoutBlock("text", text, bbox, page), text.strip()
    if kind == "table":
        body = req_str(item.get("table_body") or "", f"{what}.table_body")
        captions = _strings(item.get("table_caption"))
        footnotes = _strings(item.get("table_footnote"))
        markdown = "\n\n".join([*captions, body.strip(), *footnotes])
        return LayoutBlock("table", body, bbox, page), markdown
    if kind == "image":
        captions = _strings(item.get("img_caption")) or _strings(item.get("image_caption"))
        caption = " ".join(c.strip() for c in captions)
        path = item.get("img_path") if isinstance(item.get("img_path"), str) else ""
        markdown = f"![{caption}]({path})" if path else caption
        return LayoutBlock("image", caption, bbox, page), markdown
    if kind == "equation":
        latex = _strip_dollars(req_str(item.get("text", ""), f"{what}.text"))
        return LayoutBlock("equation", latex, bbox, page), f"$$\n{latex}\n$$" if latex else ""
    # Types this reader does not know (headers, footers, code in newer MinerU)
    # still carry text worth keeping.
    raw_text = item.get("text")
    text = raw_text if isinstance(raw_text, str) else ""
    return LayoutBlock("other", text, bbox, page), text.strip()


def layout_markdown(items: list[Any]) -> tuple[tuple[LayoutBlock, ...], str]:
    """Blocks and markdown of a decoded content list, in its reading order."""
    blocks = []
    pieces = []
    for i, raw_item in enumerate(items):
        block, markdown = _block(req_obj(raw_item, f"content[{i}]"), i)
        blocks.append(block)
        if markdown.strip():
            pieces.append(markdown)
    return tuple(blocks), "\n\n".join(pieces) + ("\n" if pieces else "")


def parse_layout_response(body: Any) -> tuple[tuple[LayoutBlock, ...], str]:
    """Blocks and markdown of a ``/parse`` answer with ``return_type=content_list_json``.

    The server reports a missing content list as a *successful* plain-text
    answer; that is a malformed body here, as is content that is not a JSON array.
    """
    answer = _checked(body)
    content = req_str(answer.get("content"), "content")
    content_type = answer.get("content_type")
    if isinstance(content_type, str) and "json" not in content_type.lower():
        raise malformed_body(f"content is {content_type}: {excerpt(content)}")
    try:
        items = json.loads(content)
    except (ValueError, RecursionError) as exc:
        raise malformed_body("content is not JSON") from exc
    return layout_markdown(req_list(items, "content"))
