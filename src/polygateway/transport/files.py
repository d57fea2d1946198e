"""What kind of file a caller handed in, by its magic bytes, and what to call it on the wire.

Shared by the OCR wire formats: MonkeyOCR refuses a multipart part whose file
name does not end in .pdf, .jpg, .jpeg or .png, and a vision model needs the
right media type in its data URL, so both name the upload from its content,
never from whatever name the caller may have had.
"""

from __future__ import annotations

import re
from typing import Final, Literal

__all__ = ["FileKind", "detect_kind", "filename_for", "media_type_for"]

FileKind = Literal["pdf", "png", "jpeg"]

_MAGIC: Final[tuple[tuple[bytes, FileKind], ...]] = (
    (b"%PDF-", "pdf"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"\xff\xd8\xff", "jpeg"),
)
# A PDF header after leading bytes (a UTF-8 BOM, blank lines, a printer's PJL
# job line), as readers accept it: within the first 1024 bytes (Acrobat's rule),
# versioned, and first on its line, so prose quoting "%PDF-1.7" is not a PDF.
_PDF_HEADER_WITHIN: Final = 1024
_LATE_PDF_HEADER: Final = re.compile(rb"(?:\A|[\r\n])[\x00\t\f \xef\xbb\xbf]*(%PDF-\d\.\d)")

_FILENAMES: Final[dict[FileKind, str]] = {
    "pdf": "document.pdf",
    "png": "image.png",
    "jpeg": "image.jpg",
}
_MEDIA_TYPES: Final[dict[FileKind, str]] = {
    "pdf": "application/pdf",
    "png": "image/png",
    "jpeg": "image/jpeg",
}


def detect_kind(data: bytes) -> FileKind | None:
    """``"pdf"``, ``"png"`` or ``"jpeg"`` by magic bytes; ``None`` for anything else.

    A PDF's header may follow a few leading bytes, as PDF readers allow
    (``_LATE_PDF_HEADER``); the upload is still sent as it is.
    """
    for magic, kind in _MAGIC:
        if data.startswith(magic):
            return kind
    found = _LATE_PDF_HEADER.search(data, 0, _PDF_HEADER_WITHIN + len(b"%PDF-1.7"))
    if found is not None and found.start(1) < _PDF_HEADER_WITHIN:
        return "pdf"
    return None


def filename_for(kind: FileKind) -> str:
    """The multipart file name of an upload of ``kind`` (its suffix is what servers check)."""
    return _FILENAMES[kind]


def media_type_for(kind: FileKind) -> str:
    """The media type of ``kind``, for a part's Content-Type or a data URL."""
    return _MEDIA_TYPES[kind]
