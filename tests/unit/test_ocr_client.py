"""OcrClient: both protocols over httpx.MockTransport, upload checks, failures, stall, cancel."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from _batch_clients import mock_wire, monkey, on_clock, vision
from _batch_clients import ocr_settings as make_settings
from _closing import closing
from _permit_thief import PermitThief

from polygateway.backends.memory import MemoryBackend
from polygateway.config import GatewaySettings
from polygateway.errors import AllSourcesExhausted, ConfigError, GatewayError, RequestRejected
from polygateway.middleware.waiting import room_for
from polygateway.models import LayoutBlock
from polygateway.ocr import OcrClient, describe_content
from polygateway.testing import (
    FakeClock,
    FakeTransport,
    Gate,
    Hang,
    Outcome,
    Recorder,
    TransientError,
)

SCOPE = "ocr"
DATA = Path(__file__).resolve().parents[1] / "data"
PNG = (DATA / "page.png").read_bytes()
PDF = (DATA / "invoice.pdf").read_bytes()
JPEG = (DATA / "grey.jpg").read_bytes()
TEXT_FILE = b"Meeting notes\n- ship the OCR client\n- review the batch limits\n"

# --- Real-shaped answers ---------------------------------------------------------------

# MonkeyOCR's TaskResponse for POST /ocr/text.
OCR_TEXT_OK = {
    "success": True,
    "task_type": "text",
    "content": "Invoice No. 2024-0117\nTotal: 1,250.00 EUR",
    "message": "Text extraction completed successfully",
}

# A MinerU-style content list, as MonkeyOCR writes *_content_list.json.
CONTENT_LIST = [
    {"type": "text", "text": "Invoice", "text_level": 1, "page_idx": 0, "bbox": [72, 60, 300, 96]},
    {"type": "text", "text": "Invoice No. 2024-0117", "page_idx": 0, "bbox": [72, 110, 400, 130]},
    {
        "type": "table",
        "img_path": "images/5e2a.jpg",
        "table_caption": ["Items"],
        "table_footnote": [],
        "table_body": "<table><tr><td>Widget</td><td>1,250.00</td></tr></table>",
        "page_idx": 0,
        "bbox": [72, 140, 540, 260],
    },
]

# MonkeyOCR's answer to POST /parse?return_type=content_list_json.
PARSE_OK = {
    "success": True,
    "message": "PDF parsing (standard) completed successfully - returning content_list_json",
    "output_dir": "/tmp/monkeyocr_parse_8c1d_/invoice_3a9f",
    "files": ["invoice_3a9f_content_list.json", "invoice_3a9f.md"],
    "download_url": None,
    "content": json.dumps(CONTENT_LIST),
    "content_type": "application/json",
}

EXPECTED_BLOCKS = (
    LayoutBlock("title", "Invoice", (72.0, 60.0, 300.0, 96.0), 0),
    LayoutBlock("text", "Invoice No. 2024-0117", (72.0, 110.0, 400.0, 130.0), 0),
    LayoutBlock(
        "table",
        "<table><tr><td>Widget</td><td>1,250.00</td></tr></table>",
        (72.0, 140.0, 540.0, 260.0),
        0,
    ),
)

OCR_FAILED = {
    "success": False,
    "task_type": "text",
    "content": "",
    "message": "OCR task failed: CUDA out of memory",
}


def vision_completion(text: str) -> dict[str, Any]:
    """A vLLM chat completion as a vision model serving OpenAI's API answers it."""
    return {
        "id": "chatcmpl-7f3e9a1c2b",
        "object": "chat.completion",
        "created": 1733000000,
        "model": "Qwen2.5-VL-7B-Instruct",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "reasoning_content": None,
                    "tool_calls": [],
                },
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 101, "total_tokens": 113, "completion_tokens": 12},
        "prompt_logprobs": None,
    }


# --- Settings and clients --------------------------------------------------------------


Handler = Callable[[httpx.Request], httpx.Response]

_ACCEPTED_SUFFIXES = (".pdf", ".jpg", ".jpeg", ".png")


class Upstream:
    """MonkeyOCR and a vision model as httpx.MockTransport sees them; keeps every request."""

    def __init__(self, *, vision_text: str = "Invoice No. 2024-0117") -> None:
        self.requests: list[httpx.Request] = []
        self.vision_text = vision_text
        self.monkey_answers: list[dict[str, Any]] = []  # played first, then the OK answers

    def part_filename(self, request: httpx.Request) -> str | None:
        """The file name of the multipart part ``file``."""
        found = re.search(rb'name="file"; filename="([^"]*)"', request.content)
        return found.group(1).decode() if found else None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        path = request.url.path
        if path.endswith("/chat/completions"):
            return httpx.Response(200, json=vision_completion(self.vision_text))
        filename = self.part_filename(request)
        if filename is None or not filename.lower().endswith(_ACCEPTED_SUFFIXES):
            # What MonkeyOCR's server says to a part it cannot decode.
            return httpx.Response(400, json={"detail": "Unsupported file type"})
        if self.monkey_answers:
            return httpx.Response(200, json=self.monkey_answers.pop(0))
        if path.endswith("/ocr/text"):
            return httpx.Response(200, json=OCR_TEXT_OK)
        if path.endswith("/parse") and request.url.params.get("return_type") == (
            "content_list_json"
        ):
            return httpx.Response(200, json=PARSE_OK)
        return httpx.Response(404, json={"detail": "Not Found"})


def mock_client(
    settings: GatewaySettings, upstream: Handler, *, clock: FakeClock | None = None
) -> OcrClient:
    """An OcrClient whose real httpx transport sends through httpx.MockTransport."""
    clock = clock if clock is not None else FakeClock()
    return on_clock(OcrClient, settings, SCOPE, mock_wire(settings, SCOPE, upstream), clock, seed=3)


def fake_client(
    script: Sequence[Outcome],
    *,
    settings: GatewaySettings | None = None,
    clock: FakeClock,
    backend: MemoryBackend,
    sleep: Any = None,
    recorder: Recorder | None = None,
) -> tuple[OcrClient, FakeTransport]:
    """An OcrClient on a FakeTransport, for timing and cancellation."""
    transport = FakeTransport(script, clock=clock)
    client = closing(
        OcrClient(
            settings if settings is not None else make_settings(),
            SCOPE,
            backend=backend,
            transport=transport,
            now=clock,
            sleep=sleep if sleep is not None else clock.sleep,
            rng=random.Random(3),
            emitter=recorder,
        )
    )
    return client, transport


# --- MonkeyOCR over MockTransport --------------------------------------------------------


async def test_monkey_recognize_text_names_the_part_from_the_detected_type() -> None:
    """A PNG goes to POST /ocr/text as part 'file' named image.png, whatever its caller's name."""
    upstream = Upstream()
    async with mock_client(make_settings(), upstream) as ocr:
        result = await ocr.recognize_text(PNG, filename="scan.tiff")
    assert result.text == "Invoice No. 2024-0117\nTotal: 1,250.00 EUR"
    assert result.source == "monkey"
    assert [a.outcome for a in result.attempts] == ["success"]
    (request,) = upstream.requests
    assert request.method == "POST"
    assert request.url.path == "/monkey/ocr/text"
    assert upstream.part_filename(request) == "image.png"
    assert b"Content-Type: image/png" in request.content
    assert PNG in request.content


@pytest.mark.parametrize(
    ("data", "part_name"),
    [(PDF, "document.pdf"), (PNG, "image.png"), (JPEG, "image.jpg")],
)
async def test_monkey_parse_layout_of_pdf_and_images(data: bytes, part_name: str) -> None:
    """A PDF, a PNG and a JPEG are each parsed into typed blocks and markdown via /parse."""
    upstream = Upstream()
    async with mock_client(make_settings(), upstream) as ocr:
        result = await ocr.parse_layout(data)
    assert result.blocks == EXPECTED_BLOCKS
    assert result.markdown == (
        "# Invoice\n\nInvoice No. 2024-0117\n\nItems\n\n"
        "<table><tr><td>Widget</td><td>1,250.00</td></tr></table>\n"
    )
    assert result.source == "monkey"
    (request,) = upstream.requests
    assert request.url.path == "/monkey/parse"
    assert request.url.params["return_type"] == "content_list_json"
    assert upstream.part_filename(request) == part_name


async def test_monkey_success_false_is_retried_and_then_served() -> None:
    """success: false is a transient failure: the loop retries and the next answer serves."""
    upstream = Upstream()
    upstream.monkey_answers.append(OCR_FAILED)
    async with mock_client(make_settings(), upstream) as ocr:
        result = await ocr.recognize_text(PDF)
    assert result.text == OCR_TEXT_OK["content"]
    assert [a.outcome for a in result.attempts] == ["transient", "success"]
    assert "CUDA out of memory" in (result.attempts[0].error or "")


async def test_monkey_success_false_every_time_keeps_the_provider_message() -> None:
    """When every attempt says success: false, the final error's attempts keep the message."""
    upstream = Upstream()
    upstream.monkey_answers.extend([OCR_FAILED] * 3)
    async with mock_client(make_settings(max_attempts=3), upstream) as ocr:
        with pytest.raises(AllSourcesExhausted) as info:
            await ocr.recognize_text(PNG)
    assert info.value.reason == "retry_exhausted"
    assert len(info.value.attempts) == 3
    assert all("CUDA out of memory" in (a.error or "") for a in info.value.attempts)


async def test_unparseable_body_is_transient() -> None:
    """A 200 whose body is not JSON is a malformed answer, retried like any transient failure."""
    bodies = iter([httpx.Response(200, text="<html>502 Bad Gateway</html>")])

    def upstream(request: httpx.Request) -> httpx.Response:
        return next(bodies, httpx.Response(200, json=OCR_TEXT_OK))

    async with mock_client(make_settings(), upstream) as ocr:
        result = await ocr.recognize_text(PNG)
    assert result.text == OCR_TEXT_OK["content"]
    assert [a.outcome for a in result.attempts] == ["transient", "success"]
    assert "not JSON" in (result.attempts[0].error or "")


async def test_server_400_is_request_rejected_without_retry() -> None:
    """A 400 from the server is the request's fault: RequestRejected after one request."""

    seen: list[httpx.Request] = []

    def recording(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(400, json={"detail": "Unsupported file type"})

    async with mock_client(make_settings(), recording) as ocr:
        with pytest.raises(RequestRejected) as info:
            await ocr.parse_layout(PDF)
    assert info.value.status_code == 400
    assert len(seen) == 1


# --- vision_ocr over MockTransport --------------------------------------------------------


async def test_vision_recognize_text_sends_image_as_data_url() -> None:
    """A JPEG goes to /chat/completions as a data URL with the fixed instruction; text returns."""
    upstream = Upstream(vision_text="WIDGET 1,250.00")
    async with mock_client(make_settings(vision()), upstream) as ocr:
        result = await ocr.recognize_text(JPEG)
    assert result.text == "WIDGET 1,250.00"
    assert result.source == "vision"
    (request,) = upstream.requests
    assert request.url.path == "/vision/v1/chat/completions"
    body = json.loads(request.content)
    assert body["model"] == "Qwen2.5-VL-7B-Instruct"
    parts = body["messages"][0]["content"]
    assert parts[0]["type"] == "text"
    assert "Transcribe" in parts[0]["text"]
    url = parts[1]["image_url"]["url"]
    assert url.startswith("data:image/jpeg;base64,")
    assert base64.b64decode(url.split(",", 1)[1]) == JPEG


async def test_vision_refuses_a_pdf_before_any_request() -> None:
    """A PDF in a vision-only scope is RequestRejected naming why, before any request."""
    upstream = Upstream()
    async with mock_client(make_settings(vision()), upstream) as ocr:
        with pytest.raises(RequestRejected, match=r"is a PDF.*images only"):
            await ocr.recognize_text(PDF, filename="invoice.pdf")
    assert upstream.requests == []


async def test_vision_refuses_parse_layout_before_any_request() -> None:
    """parse_layout in a vision-only scope is RequestRejected naming why, before any request."""
    upstream = Upstream()
    async with mock_client(make_settings(vision()), upstream) as ocr:
        with pytest.raises(RequestRejected, match="parse_layout needs a monkey_ocr source"):
            await ocr.parse_layout(PNG)
    assert upstream.requests == []


async def test_mixed_scope_sends_each_call_only_to_sources_that_can_take_it() -> None:
    """Vision first by priority: a PNG goes to vision, a PDF and a layout call go to MonkeyOCR."""
    upstream = Upstream()
    settings = make_settings(vision(priority=0), monkey(priority=1))
    async with mock_client(settings, upstream) as ocr:
        image = await ocr.recognize_text(PNG)
        document = await ocr.recognize_text(PDF)
        layout = await ocr.parse_layout(PNG)
    assert (image.source, document.source, layout.source) == ("vision", "monkey", "monkey")
    assert [r.url.path for r in upstream.requests] == [
        "/vision/v1/chat/completions",
        "/monkey/ocr/text",
        "/monkey/parse",
    ]


async def test_a_call_on_a_subset_of_sources_still_reaches_the_emitter() -> None:
    """A PDF in a mixed scope runs on MonkeyOCR alone, and its attempt is still emitted."""
    settings = make_settings(vision(priority=0), monkey(priority=1))
    clock = FakeClock()
    recorder = Recorder()
    transport = mock_wire(settings, SCOPE, Upstream())
    async with on_clock(
        OcrClient, settings, SCOPE, transport, clock, seed=3, emitter=recorder
    ) as ocr:
        await ocr.recognize_text(PDF)
    assert [(r.source, r.outcome) for r in recorder.records] == [("monkey", "success")]


# --- Uploads refused before any request ---------------------------------------------------


@pytest.mark.parametrize(
    ("data", "filename", "match"),
    [
        (TEXT_FILE, "notes.txt", r"upload \('notes.txt'\) is not an image .* looks like text"),
        (b"GIF89a\x01\x00\x01\x00", None, "looks like a GIF image"),
        (b"PK\x03\x04rest-of-a-docx", "report.docx", "looks like a ZIP archive"),
        (b"", None, "looks like empty input"),
        (b"\x00\x01\x02\x03binary", None, "looks like unrecognised binary data"),
    ],
)
async def test_not_an_image_or_pdf_is_rejected_naming_the_detected_type(
    data: bytes, filename: str | None, match: str
) -> None:
    """Content that is not PNG, JPEG or PDF is refused before any request, saying what it is."""
    upstream = Upstream()
    async with mock_client(make_settings(monkey(), vision()), upstream) as ocr:
        with pytest.raises(RequestRejected, match=match):
            await ocr.recognize_text(data, filename=filename)
        with pytest.raises(RequestRejected, match=match):
            await ocr.parse_layout(data, filename=filename)
    assert upstream.requests == []


def test_describe_content_keeps_text_cut_mid_character() -> None:
    """Text whose 4096-byte head ends inside a multi-byte character still reads as text."""
    assert describe_content(("x" * 4095 + "é").encode()) == "text"
    assert describe_content(b"\xff\xfe\xfd\xfc" + b"a" * 10) == "unrecognised binary data"


async def test_non_bytes_upload_is_rejected_before_any_request() -> None:
    """A str or path instead of bytes is refused up front."""
    upstream = Upstream()
    async with mock_client(make_settings(), upstream) as ocr:
        with pytest.raises(RequestRejected, match="must be bytes, not str"):
            await ocr.recognize_text("page.png")  # a str, as a caller might pass a path
    assert upstream.requests == []


async def test_upload_over_max_upload_bytes_is_rejected_before_any_request() -> None:
    """An upload larger than every source's max_upload_bytes is refused up front."""
    upstream = Upstream()
    async with mock_client(make_settings(monkey(max_upload_bytes=500)), upstream) as ocr:
        with pytest.raises(RequestRejected, match=r"is 598 bytes, over the max_upload_bytes"):
            await ocr.parse_layout(PDF)
        small = await ocr.recognize_text(PNG)  # 73 bytes: fits
    assert small.source == "monkey"
    assert len(upstream.requests) == 1


async def test_a_source_too_small_for_the_upload_is_skipped() -> None:
    """A source whose max_upload_bytes the upload exceeds is left out; another one serves."""
    upstream = Upstream()
    settings = make_settings(
        monkey("small", priority=0, max_upload_bytes=100), monkey("big", priority=1)
    )
    async with mock_client(settings, upstream) as ocr:
        result = await ocr.parse_layout(PDF)
    assert result.source == "big"
    assert [r.url.path for r in upstream.requests] == ["/big/parse"]


# --- The stall budget bills non-productive time only -----------------------------------


async def test_single_timeout_does_not_exhaust_stall_budget() -> None:
    """A 350 s timeout, then one no-runnable round (the test holds the only permit), then success.

    Under a wall-clock stall meter the call would end 'stalled': more than
    stall_window_s (300) has passed and the scope has never served (age inf).
    """
    clock = FakeClock()
    start = clock()
    backend = MemoryBackend(now=clock)
    sleep = PermitThief(backend, clock, SCOPE, "monkey")

    recorder = Recorder()
    settings = make_settings(monkey(max_concurrency=1, timeout_s=350), stall_window_s=300)
    ocr, transport = fake_client(
        [Hang(), OCR_TEXT_OK],
        settings=settings,
        clock=clock,
        backend=backend,
        sleep=sleep,
        recorder=recorder,
    )
    result = await ocr.recognize_text(PNG)
    assert result.text == OCR_TEXT_OK["content"]
    assert sleep.no_runnable_rounds == 1
    assert clock() - start > 300.0  # the wall clock alone is past the stall window
    assert recorder.outcomes() == ["transient", "success"]
    assert len(transport.requests) == 2


# --- Cancellation --------------------------------------------------------------------------


async def test_cancel_during_transport_releases_permit() -> None:
    """Cancelling while the upload is in flight frees the permit; CancelledError passes through."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    gate = Gate(OCR_TEXT_OK)
    recorder = Recorder()
    ocr, transport = fake_client([gate], clock=clock, backend=backend, recorder=recorder)
    task = asyncio.create_task(ocr.parse_layout(PDF))
    await gate.wait_entered(1)
    assert (await backend.snapshot(SCOPE)).in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await backend.snapshot(SCOPE)).in_flight == 0
    assert transport.in_flight == 0
    assert recorder.outcomes() == ["cancelled"]


async def test_cancel_during_backoff_releases_permit() -> None:
    """Cancelling during the back-off after a 503 leaves no permit held and nobody queued."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    in_backoff = asyncio.Event()

    async def sleep(seconds: float) -> None:
        in_backoff.set()
        await asyncio.Event().wait()  # a back-off that only a cancellation ends

    recorder = Recorder()
    ocr, transport = fake_client(
        [TransientError("HTTP 503 from monkey", status_code=503)],
        clock=clock,
        backend=backend,
        sleep=sleep,
        recorder=recorder,
    )
    task = asyncio.create_task(ocr.recognize_text(JPEG))
    await in_backoff.wait()
    assert (await backend.snapshot(SCOPE)).in_flight == 0  # released before the back-off
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await backend.snapshot(SCOPE)).in_flight == 0
    assert room_for(backend, SCOPE).empty
    assert transport.in_flight == 0
    assert recorder.outcomes() == ["transient"]


# --- Construction and life --------------------------------------------------------------


async def test_from_settings_as_context_manager_then_closed() -> None:
    """from_settings binds the 'ocr' scope; after the block the client refuses new calls."""
    clock = FakeClock()
    transport = FakeTransport([OCR_TEXT_OK], clock=clock)
    async with OcrClient.from_settings(
        make_settings(), transport=transport, now=clock, sleep=clock.sleep
    ) as ocr:
        assert ocr.scope == SCOPE
        assert (await ocr.recognize_text(PNG)).text == OCR_TEXT_OK["content"]
    assert ocr.closed
    assert transport.closed
    with pytest.raises(GatewayError, match="client closed"):
        await ocr.recognize_text(PNG)


def test_scope_of_another_kind_is_a_config_error() -> None:
    """An OcrClient on an embed scope fails at construction with ConfigError."""
    settings = GatewaySettings(
        _env_file=None,
        scopes={
            "embed": {
                "kind": "embed",
                "sources": [{"name": "e", "protocol": "openai", "base_url": "http://127.0.0.1:9"}],
            }
        },
    )
    with pytest.raises(ConfigError, match="kind 'embed'"):
        OcrClient(settings, "embed", transport=FakeTransport())
