"""An incremental ``text/event-stream`` parser for the aiohttp transport (data fields only).

Why hand-written: httpx-sse, the parser the httpx transport uses, works on
httpx responses and keeps its decoder private; the aiohttp SSE clients on PyPI
(aiohttp-sse-client, last release 2021; aiohttp-sse-client2, 2023) are
unmaintained. The event-stream grammar is small, so this follows the WHATWG
HTML "event stream interpretation" rules directly, for the one field
PolyGateway reads:

- lines end at CRLF, LF or CR, also when a CRLF is split across two chunks;
- a leading U+FEFF BOM is dropped; lines starting with ``:`` are comments;
- ``field: value`` loses one space after the colon; a line without a colon
  is a field with an empty value;
- ``data`` lines accumulate, joined by ``\\n``; a blank line dispatches the
  event if any data was seen; ``event``, ``id``, ``retry`` and unknown
  fields are ignored (the OpenAI stream format uses data only);
- at end of stream an event not yet closed by a blank line is discarded.

The tests feed it byte-for-byte the same streams as httpx-sse and compare.
"""

from __future__ import annotations

import codecs

__all__ = ["SSEParser"]

_BOM = "\ufeff"


class SSEParser:
    """Feed decoded text in any chunking; get back the ``data`` of each completed event."""

    __slots__ = ("_data", "_decoder", "_line", "_skip_lf", "_started")

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._line: list[str] = []
        self._data: list[str] | None = None
        self._skip_lf = False
        self._started = False

    def feed_bytes(self, chunk: bytes) -> list[str]:
        """Decode a chunk of the body (UTF-8, a character may straddle chunks) and parse it."""
        return self.feed(self._decoder.decode(chunk))

    def feed(self, text: str) -> list[str]:
        """Parse more text; returns the data of every event it completed, in order.

        Line-wise: line ends are found by C-level ``str`` methods, never by a
        Python loop over characters (a chunk event is hundreds of characters).
        """
        if not text:
            return []
        if not self._started:
            self._started = True
            if text.startswith(_BOM):
                text = text[1:]
                if not text:
                    return []
        if self._skip_lf:
            self._skip_lf = False
            if text[0] == "\n":
                # The LF of a CRLF whose CR ended the previous chunk's last line.
                text = text[1:]
                if not text:
                    return []
        if "\r" in text:
            # A CR at the very end may be the first half of a CRLF split across chunks.
            self._skip_lf = text[-1] == "\r"
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        lines = text.split("\n")
        # The last piece is a line not yet ended (empty when the text ended with one).
        tail = lines.pop()
        events: list[str] = []
        if lines:
            if self._line:
                self._line.append(lines[0])
                lines[0] = "".join(self._line)
                self._line.clear()
            for line in lines:
                self._end_line(line, events)
        if tail:
            self._line.append(tail)
        return events

    def _end_line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data is not None:
                events.append("\n".join(self._data))
            self._data = None
            return
        if line[0] == ":":
            return
        name, colon, value = line.partition(":")
        if name != "data":
            return
        if colon and value.startswith(" "):
            value = value[1:]
        if self._data is None:
            self._data = [value]
        else:
            self._data.append(value)

    def close(self) -> None:
        """End of stream: an event not closed by a blank line is discarded, per the spec."""
        self._line.clear()
        self._data = None
