"""The aiohttp transport's SSE parser: the spec's corner cases, and agreement with httpx-sse."""

from __future__ import annotations

from httpx_sse._decoders import SSEDecoder, SSELineDecoder
from hypothesis import given, settings
from hypothesis import strategies as st

from polygateway.transport.sse import SSEParser


def _parse(*chunks: bytes) -> list[str]:
    parser = SSEParser()
    out: list[str] = []
    for chunk in chunks:
        out.extend(parser.feed_bytes(chunk))
    parser.close()
    return out


def test_data_lines_join_with_newline_and_blank_line_dispatches() -> None:
    """Consecutive data lines are one event joined by LF; a blank line ends it."""
    assert _parse(b"data: a\ndata: b\n\ndata: c\n\n") == ["a\nb", "c"]


def test_comments_and_other_fields_are_ignored() -> None:
    """Comments, event, id and retry lines do not produce data events."""
    assert _parse(b": ping\n\nevent: x\nid: 7\nretry: 10\n\ndata: y\n\n") == ["y"]


def test_one_leading_space_is_removed_only() -> None:
    """'data:x', 'data: x' and 'data:  x' give 'x', 'x' and ' x'."""
    assert _parse(b"data:x\n\ndata: x\n\ndata:  x\n\n") == ["x", "x", " x"]


def test_line_endings_crlf_cr_lf_all_end_lines() -> None:
    """CRLF, CR and LF each end a line."""
    assert _parse(b"data: a\r\n\r\ndata: b\r\rdata: c\n\n") == ["a", "b", "c"]


def test_crlf_split_across_chunks_is_one_line_end() -> None:
    """A CR at the end of one chunk and LF at the start of the next make one line end."""
    assert _parse(b"data: a\r", b"\n\r", b"\ndata: b\r\n", b"\r\n") == ["a", "b"]


def test_multibyte_character_split_across_chunks() -> None:
    """A UTF-8 character cut between chunks is decoded whole."""
    raw = "data: 你好\n\n".encode()
    assert _parse(raw[:7], raw[7:]) == ["你好"]


def test_leading_bom_is_dropped() -> None:
    """A UTF-8 BOM at the start of the stream is not part of the first field name."""
    assert _parse(b"\xef\xbb\xbfdata: a\n\n") == ["a"]


def test_unterminated_final_event_is_discarded() -> None:
    """An event not closed by a blank line before EOF is not dispatched."""
    assert _parse(b"data: a\n\ndata: partial\n") == ["a"]


def test_field_without_colon_is_empty_data() -> None:
    """A bare 'data' line is a data field with an empty value."""
    assert _parse(b"data\ndata: x\n\n") == ["\nx"]


# --- Agreement with httpx-sse on random streams and random chunkings ---

_value = st.text(
    alphabet=st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=12
)
_line = st.one_of(
    st.builds(lambda v: f"data: {v}", _value),
    st.builds(lambda v: f"data:{v}", _value),
    st.builds(lambda v: f"event: {v}", _value),
    st.builds(lambda v: f"id: {v}", _value.filter(lambda v: "\0" not in v)),
    st.builds(lambda v: f": {v}", _value),
    st.just("data"),
    st.just("retry: 100"),
    st.just(""),
)
_newline = st.sampled_from(["\n", "\r\n", "\r"])


def _httpx_sse(chunks: list[str]) -> list[str]:
    """The data of every event httpx-sse decodes from the same text."""
    lines_decoder = SSELineDecoder()
    decoder = SSEDecoder()
    lines: list[str] = []
    for chunk in chunks:
        lines.extend(lines_decoder.decode(chunk))
    lines.extend(lines_decoder.flush())
    out = []
    for line in lines:
        sse = decoder.decode(line.rstrip("\n"))
        if sse is not None:
            out.append(sse.data)
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(_line, _newline), max_size=30),
    st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_parser_agrees_with_httpx_sse(lines: list[tuple[str, str]], cuts: list[int]) -> None:
    """For any stream and any chunking, the non-empty data events equal httpx-sse's."""
    text = "".join(line + newline for line, newline in lines)
    raw = text.encode()
    points = sorted({min(c, len(raw)) for c in cuts})
    byte_chunks = [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True)]
    char_points = sorted({min(c, len(text)) for c in cuts})
    text_chunks = [
        text[a:b] for a, b in zip([0, *char_points], [*char_points, len(text)], strict=True)
    ]
    expected = [d for d in _httpx_sse([c for c in text_chunks if c]) if d]
    assert [d for d in _parse(*byte_chunks) if d] == expected


def test_line_split_over_many_chunks_is_joined_once() -> None:
    """A line cut into single characters, with CR and CRLF ends, parses as if whole."""
    raw = b"\xef\xbb\xbfdata: abc\r\ndata: d\r\r: c\rdata:  e\n\r\n"
    assert _parse(*(raw[i : i + 1] for i in range(len(raw)))) == ["abc\nd", " e"]
    assert _parse(raw) == ["abc\nd", " e"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_line, _newline), max_size=20), st.integers(min_value=1, max_value=5))
def test_any_fixed_chunk_size_gives_the_same_events(
    lines: list[tuple[str, str]], size: int
) -> None:
    """Feeding the stream in chunks of any size (down to one byte) changes no event."""
    raw = "".join(line + newline for line, newline in lines).encode()
    assert _parse(*(raw[i : i + size] for i in range(0, len(raw), size))) == _parse(raw)
