"""The pacer: how long a 429 asks a source to be left alone, from the upstream's own headers.

A rate-limited answer carries its back-off in one of several forms:
``retry-after-ms`` (milliseconds), ``Retry-After`` (delta-seconds or an HTTP
date, RFC 9110 section 10.2.3), or OpenAI-style ``x-ratelimit-reset-requests``
/ ``x-ratelimit-reset-tokens`` (Go durations such as ``"6m0s"``). These pure
parsers turn any of them into relative seconds; what they cannot read they
ignore (``None``), because a malformed header from a struggling upstream must
never turn a 429 into a crash. The backend then sets the source's "not before"
deadline to ``now + pace_for(retry_after_s)``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from datetime import UTC
from email.utils import parsedate_to_datetime

__all__ = [
    "DEFAULT_RATE_LIMIT_PACE_S",
    "MAX_PACE_S",
    "pace_for",
    "parse_reset_duration",
    "parse_retry_after",
    "retry_after_from_headers",
]

DEFAULT_RATE_LIMIT_PACE_S = 1.0
"""Pace of a 429 that named no back-off of its own."""

MAX_PACE_S = 3600.0
"""Longest pace honoured: an absurd Retry-After must not park a source for days."""

_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|h|m|s)")
_UNIT_S = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def _decimal(value: str) -> float | None:
    """A plain decimal number, or ``None``; stricter than ``float`` (no "nan", "inf", "1_0")."""
    text = value.strip()
    if not _DECIMAL.fullmatch(text):
        return None
    number = float(text)
    return number if math.isfinite(number) else None


def parse_retry_after(value: str, now_wall: float) -> float | None:
    """Seconds a ``Retry-After`` value asks for, relative to ``now_wall`` (epoch seconds).

    Accepts delta-seconds (``"120"``, ``"1.5"``) and HTTP dates; a negative
    delta or a date in the past gives 0. Anything else gives ``None``.
    """
    number = _decimal(value)
    if number is not None:
        return max(0.0, number)
    try:
        when = parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        # RFC 9110 dates are always GMT; "-0000" parses as naive.
        when = when.replace(tzinfo=UTC)
    try:
        delta = when.timestamp() - now_wall
    except (OverflowError, OSError, ValueError):
        return None
    if not math.isfinite(delta):
        return None
    return max(0.0, delta)


def parse_reset_duration(value: str) -> float | None:
    """Seconds an ``x-ratelimit-reset-*`` value names: ``"1s"``, ``"6m0s"``, ``"20ms"``, ``"0.5"``.

    A bare number is seconds; otherwise a Go duration (``h``, ``m``, ``s``,
    ``ms``, ``us``, ``ns`` parts). Anything else gives ``None``.
    """
    text = value.strip()
    if not text:
        return None
    number = _decimal(text)
    if number is not None:
        return max(0.0, number)
    total = 0.0
    pos = 0
    while pos < len(text):
        part = _DURATION_PART.match(text, pos)
        if part is None:
            return None
        total += float(part.group(1)) * _UNIT_S[part.group(2)]
        pos = part.end()
    return total if math.isfinite(total) else None


def retry_after_from_headers(headers: Mapping[str, str], now_wall: float) -> float | None:
    """The back-off a response's headers ask for, in seconds, or ``None`` when none is readable.

    Looked up case-insensitively, first readable wins: ``retry-after-ms``,
    ``retry-after``, then the larger of ``x-ratelimit-reset-requests`` and
    ``x-ratelimit-reset-tokens``.
    """
    lowered = {str(k).lower(): str(v) for k, v in headers.items()}
    raw_ms = lowered.get("retry-after-ms")
    if raw_ms is not None:
        ms = _decimal(raw_ms)
        if ms is not None:
            return max(0.0, ms) / 1000.0
    raw = lowered.get("retry-after")
    if raw is not None:
        seconds = parse_retry_after(raw, now_wall)
        if seconds is not None:
            return seconds
    resets = [
        parsed
        for key in ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens")
        if (text := lowered.get(key)) is not None
        and (parsed := parse_reset_duration(text)) is not None
    ]
    return max(resets) if resets else None


def pace_for(retry_after_s: float | None) -> float:
    """How long to pace a source after a 429: the asked back-off, default 1 s, capped at 1 h."""
    if retry_after_s is None or math.isnan(retry_after_s):
        return DEFAULT_RATE_LIMIT_PACE_S
    return min(MAX_PACE_S, max(0.0, retry_after_s))
