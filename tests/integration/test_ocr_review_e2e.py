"""OCR uploads named by content end to end: simulator on 127.0.0.1, real client, both transports.

The simulator's MonkeyOCR answers with the part's file name and the size of
what it received, so each test sees what went over the socket: a PDF whose
header follows a BOM or blank lines goes out whole as ``document.pdf``, a
PNG called ``.pdf`` as ``image.png``, and an error page saved as ``.pdf``
never leaves the process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from polygateway.backends.memory import MemoryBackend
from polygateway.cli.demo import tiny_pdf, tiny_png
from polygateway.config import GatewaySettings, ScopeConfig, SourceConfig
from polygateway.errors import RequestRejected
from polygateway.ocr import OcrClient
from polygateway.simulator import FaultProfile, SimulatedUpstream

# Bounds the tests' own waits, never a timing under test.
BOUND_S = 20.0


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedUpstream]:
    """One healthy MonkeyOCR source, ``monkey``."""
    async with SimulatedUpstream({"monkey": FaultProfile()}, seed=7) as upstream:
        yield upstream


def settings(sim: SimulatedUpstream, transport: str) -> GatewaySettings:
    """One ocr scope over the simulator's MonkeyOCR source."""
    source = SourceConfig(
        name="monkey",
        protocol="monkey_ocr",
        base_url=sim.base_url("monkey", "monkey_ocr"),
        timeout_s=5.0,
    )
    return GatewaySettings(
        _env_file=None,
        scopes={"ocr": ScopeConfig(kind="ocr", sources=(source,))},  # type: ignore[arg-type]
        transport=transport,
    )


@pytest.mark.parametrize("prefix", [b"\xef\xbb\xbf", b"\r\n\r\n"], ids=["utf8-bom", "blank-lines"])
async def test_pdf_after_leading_bytes_goes_out_whole_as_a_pdf(
    sim: SimulatedUpstream, transport: str, prefix: bytes
) -> None:
    """The server receives every byte, leading ones included, in a part named document.pdf."""
    upload = prefix + tiny_pdf()
    async with OcrClient(settings(sim, transport), "ocr", backend=MemoryBackend()) as ocr:
        async with asyncio.timeout(BOUND_S):
            result = await ocr.recognize_text(upload, "report.pdf")
    assert result.text.startswith("Recognized text of document.pdf")
    assert f"{len(upload)} bytes" in result.text


async def test_png_called_pdf_goes_out_as_image_png(sim: SimulatedUpstream, transport: str) -> None:
    """The caller's file name is only a hint: the part is named from the content."""
    async with OcrClient(settings(sim, transport), "ocr", backend=MemoryBackend()) as ocr:
        async with asyncio.timeout(BOUND_S):
            result = await ocr.recognize_text(tiny_png(), "scan.pdf")
    assert result.text.startswith("Recognized text of image.png")


async def test_error_page_saved_as_pdf_never_reaches_the_server(
    sim: SimulatedUpstream, transport: str
) -> None:
    """An HTML error page called ``.pdf`` is refused as text before any request."""
    page = b"<!DOCTYPE html><html><body><h1>502 Bad Gateway</h1></body></html>\n"
    async with OcrClient(settings(sim, transport), "ocr", backend=MemoryBackend()) as ocr:
        with pytest.raises(RequestRejected, match="looks like text"):
            await ocr.parse_layout(page, "report.pdf")
    assert sim.stats("monkey").requests == 0
