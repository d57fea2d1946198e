"""What kind of file a caller handed in, by its magic bytes, and what to call it on the wire.

Shared by the OCR wire formats: MonkeyOCR refuses a multipart part whose file
name does not end in .pdf, .jpg, .jpeg or .png, and a vision model needs the
right media type in its data URL, so both name the upload from its content,
never from whatever name the caller may have had.
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = ["FileKind", "detect_kind", "filename_for", "media_type_for"]

FileKind = Literal["pdf", "png", "jpeg"]

_MAGIC: Final[tuple[tuple[bytes, FileKind], ...]] = (
    (b"%PDF-", "pdf"),
    (b"\x89PNG\r\n\x1a\n", "png"),
    (b"\xff\xd8\xff", "jpeg"),
)
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
    """``"pdf"``, ``"png"`` or ``"jpeg"`` by magic bytes; ``None`` for anything else."""
    for magic, kind in _MAGIC:
        if data.startswith(magic):
            return kind
    return None


def filename_for(kind: FileKind) -> str:
    """The multipart file name of an upload of ``kind`` (its suffix is what servers check)."""
    return _FILENAMES[kind]


def media_type_for(kind: FileKind) -> str:
    """The media type of ``kind``, for a part's Content-Type or a data URL."""
    return _MEDIA_TYPES[kind]
