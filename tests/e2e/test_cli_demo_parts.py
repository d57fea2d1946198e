"""The demo's own parts that its report relies on: sample files, trip counting, percentiles."""

from __future__ import annotations

import re
import struct
import zlib
from typing import Literal

from polygateway.backends.base import ScopeSnapshot, SourceSnapshot
from polygateway.cli.demo_report import TripCounter, percentile
from polygateway.cli.samples import tiny_pdf, tiny_png
from polygateway.transport.files import detect_kind

Breaker = Literal["closed", "open", "half_open"]


def snap(breaker: Breaker, reopen_in_s: float | None, name: str = "failing") -> ScopeSnapshot:
    """A one-source snapshot with the given breaker state."""
    source = SourceSnapshot(
        name=name,
        in_flight=0,
        limit=4.0,
        breaker=breaker,
        consecutive_failures=0,
        trips=1,
        reopen_in_s=reopen_in_s,
        paced_for_s=None,
        rpm_tokens=None,
        tpm_tokens=None,
    )
    return ScopeSnapshot(scope="demo-chat", progress_age_s=1.0, sources=(source,))


def test_tiny_png_is_a_well_formed_png_with_valid_chunk_crcs() -> None:
    """The generated PNG: signature, IHDR size, every chunk's CRC, pixels that inflate."""
    data = tiny_png(16, 8)
    assert detect_kind(data) == "png"
    at, tags = 8, []
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        tag, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        assert crc == zlib.crc32(tag + body) & 0xFFFFFFFF
        tags.append(tag)
        if tag == b"IHDR":
            assert struct.unpack(">II", body[:8]) == (16, 8)
        if tag == b"IDAT":
            assert len(zlib.decompress(body)) == 8 * (1 + 16 * 3)
        at += 12 + length
    assert tags == [b"IHDR", b"IDAT", b"IEND"]


def test_tiny_pdf_cross_reference_table_points_at_each_object() -> None:
    """The generated PDF: every xref offset lands on its ``N 0 obj`` and startxref on ``xref``."""
    data = tiny_pdf("hello")
    assert detect_kind(data) == "pdf"
    assert data.rstrip().endswith(b"%%EOF")
    found = re.search(rb"startxref\n(\d+)", data)
    assert found is not None
    startxref = int(found.group(1))
    assert data[startxref:].startswith(b"xref\n0 6\n")
    offsets = [int(m) for m in re.findall(rb"(\d{10}) 00000 n", data)]
    assert len(offsets) == 5
    for number, offset in enumerate(offsets, start=1):
        assert data[offset:].startswith(b"%d 0 obj" % number)
    assert b"(hello) Tj" in data


def test_trip_counter_counts_each_open_period_once() -> None:
    """Many samples of one open period count one trip; a later reopening counts another."""
    trips = TripCounter()
    trips.observe(snap("closed", None), 0.0)
    for t in (1.0, 1.2, 1.4, 2.9):  # open until 3.0: one trip, seen four times
        trips.observe(snap("open", 3.0 - t), t)
    trips.observe(snap("half_open", None), 3.1)
    assert trips.trips[("demo-chat", "failing")] == 1
    trips.observe(snap("open", 4.0), 3.2)  # failed probe: open again until 7.2
    trips.observe(snap("open", 3.8), 3.4)
    assert trips.trips[("demo-chat", "failing")] == 2
    assert trips.trips[("demo-chat", "healthy")] == 0


def test_percentile_is_nearest_rank_and_none_when_empty() -> None:
    """p50 and p99 by nearest rank; no samples give ``None``."""
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([0.3], 99) == 0.3
    assert percentile([], 50) is None
