"""What an upstream's response headers say about its limits, read at the wire's edge.

Real providers announce their limits in several dialects
(research-wiki/guides/providers.md has the table, with each provider's page):

==========================================  ======================  ==========================
header                                      sent by                 read as
==========================================  ======================  ==========================
``retry-after-ms``                          OpenAI, Azure           back-off, milliseconds
``retry-after``                             everyone (RFC 9110)     back-off, seconds or HTTP date
``llm_provider-retry-after(-ms)``           LiteLLM (forwarded)     back-off, as above
``x-ratelimit-remaining-requests|tokens``   OpenAI, Azure, LiteLLM  what is left in the window
``x-ratelimit-reset-requests|tokens``       OpenAI, Azure, LiteLLM  Go duration (``"6m0s"``)
``llm_provider-x-ratelimit-*``              LiteLLM (forwarded)     as above
``anthropic-ratelimit-requests-*``          Anthropic               remaining; reset RFC 3339
``anthropic-ratelimit-(input-|output-)``
``tokens-*``                                Anthropic               likewise; the tightest kept
==========================================  ======================  ==========================

``read_hint`` walks a response's headers once and returns a ``ServerHint``.
Nothing here decides what the governance does with it: a failure's back-off
(``ServerHint.back_off_s``) paces the source, and a success that announces
exhaustion (``ServerHint.exhausted_for_s``) pauses it until the reset; both
are applied by the loop, clamped to the scope's stall window. A value that
cannot be read is ignored with a debug log: a malformed header from a
struggling upstream must never turn an answer into a crash.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Final

from polygateway.governance.pacer import DEFAULT_RATE_LIMIT_PACE_S

__all__ = [
    "ServerHint",
    "parse_remaining",
    "parse_reset_duration",
    "parse_reset_time",
    "parse_retry_after",
    "read_hint",
    "retry_after_from_headers",
]

_log = logging.getLogger("polygateway.transport")

_DECIMAL = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")
_INTEGER = re.compile(r"\+?\d+")
_COUNT_DIGITS = 18
"""The most significant digits of a remaining count; a 64-bit integer holds 18 in full."""
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

    Accepts delta-seconds (``"120"``, ``"1.5"``) and HTTP dates (RFC 9110
    section 10.2.3); a negative delta or a date in the past gives 0. Anything
    else gives ``None``.
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
    return _until(when, now_wall)


def _until(when: datetime, now_wall: float) -> float | None:
    """Seconds from ``now_wall`` to ``when`` (0 if past), or ``None`` when not representable."""
    try:
        delta = when.timestamp() - now_wall
    except (OverflowError, OSError, ValueError):
        return None
    if not math.isfinite(delta):
        return None
    return max(0.0, delta)


def parse_reset_duration(value: str) -> float | None:
    """Seconds an ``x-ratelimit-reset-*`` value names: ``"1s"``, ``"6m0s"``, ``"17ms"``, ``"0.5"``.

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


def parse_reset_time(value: str, now_wall: float) -> float | None:
    """Seconds until an RFC 3339 time (Anthropic's ``anthropic-ratelimit-*-reset``), 0 if past."""
    text = value.strip()
    if not text or "T" not in text.upper():
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None
    if when.tzinfo is None:
        # RFC 3339 requires an offset; a bare time is read as UTC rather than local.
        when = when.replace(tzinfo=UTC)
    return _until(when, now_wall)


def parse_remaining(value: str) -> int | None:
    """A count of requests or tokens left: a non-negative integer, else ``None``.

    A count of more than ``_COUNT_DIGITS`` significant digits is none a
    provider means, and is unreadable: read as it is, it would overflow a
    float, or (past 4,300 digits) make ``int`` itself raise.
    """
    text = value.strip()
    if not _INTEGER.fullmatch(text) or len(text.lstrip("+0")) > _COUNT_DIGITS:
        return None
    return int(text)


@dataclass(frozen=True, slots=True)
class ServerHint:
    """What one response's headers said about the source's limits; every time in seconds from now.

    ``retry_after_s`` is an explicit back-off (``retry-after`` and its
    variants); the remaining counts and their resets describe the rate
    windows (``None``: not announced).
    """

    retry_after_s: float | None = None
    remaining_requests: int | None = None
    remaining_tokens: int | None = None
    requests_reset_s: float | None = None
    tokens_reset_s: float | None = None

    def back_off_s(self, *, rate_limited: bool) -> float | None:
        """How long a failed answer asks the source to be left alone, or ``None``.

        An explicit ``retry-after`` wins. A 429 without one falls back on the
        window resets: the reset of the exhausted window when the answer says
        which, else the later of the two. Other statuses back off only when
        told to explicitly: their windows say nothing about an outage.
        """
        if self.retry_after_s is not None:
            return self.retry_after_s
        if not rate_limited:
            return None
        exhausted = self._exhausted_resets(next_cost_tokens=1, unknown_reset_s=None)
        if exhausted is not None:
            return exhausted
        resets = [r for r in (self.requests_reset_s, self.tokens_reset_s) if r is not None]
        return max(resets) if resets else None

    def exhausted_for_s(self, next_cost_tokens: int) -> float | None:
        """How long a successful answer announces the source cannot take the next call, or ``None``.

        The requests window is exhausted at 0 remaining; the tokens window
        when fewer remain than ``next_cost_tokens`` (the estimate of the call
        just served stands in for the next one). The pause lasts until the
        exhausted window's reset; a window announced spent without its reset
        (Azure sends none) pauses for ``DEFAULT_RATE_LIMIT_PACE_S``, as a 429
        without a hint would.
        """
        return self._exhausted_resets(
            next_cost_tokens=max(1, next_cost_tokens), unknown_reset_s=DEFAULT_RATE_LIMIT_PACE_S
        )

    def _exhausted_resets(
        self, *, next_cost_tokens: int, unknown_reset_s: float | None
    ) -> float | None:
        """The latest reset among the windows that cannot serve ``next_cost_tokens``."""
        resets: list[float | None] = []
        if self.remaining_requests is not None and self.remaining_requests <= 0:
            resets.append(self.requests_reset_s)
        if self.remaining_tokens is not None and self.remaining_tokens < next_cost_tokens:
            resets.append(self.tokens_reset_s)
        known = [r if r is not None else unknown_reset_s for r in resets]
        found = [r for r in known if r is not None]
        return max(found) if found else None


_Field = str
"""One of: retry_ms, retry, remaining_requests, remaining_tokens, reset_requests, reset_tokens."""

_FIELDS: Final[Mapping[str, tuple[_Field, int]]] = {
    # name -> (what it is, rank): among headers saying the same thing, the lowest rank wins.
    "retry-after-ms": ("retry_ms", 0),
    "retry-after": ("retry", 1),
    "llm_provider-retry-after-ms": ("retry_ms", 2),
    "llm_provider-retry-after": ("retry", 3),
    "x-ratelimit-remaining-requests": ("remaining_requests", 0),
    "x-ratelimit-remaining-tokens": ("remaining_tokens", 0),
    "x-ratelimit-reset-requests": ("reset_requests", 0),
    "x-ratelimit-reset-tokens": ("reset_tokens", 0),
    "llm_provider-x-ratelimit-remaining-requests": ("remaining_requests", 1),
    "llm_provider-x-ratelimit-remaining-tokens": ("remaining_tokens", 1),
    "llm_provider-x-ratelimit-reset-requests": ("reset_requests", 1),
    "llm_provider-x-ratelimit-reset-tokens": ("reset_tokens", 1),
    "anthropic-ratelimit-requests-remaining": ("remaining_requests", 2),
    "anthropic-ratelimit-requests-reset": ("reset_requests_at", 2),
    "anthropic-ratelimit-tokens-remaining": ("remaining_tokens", 2),
    "anthropic-ratelimit-tokens-reset": ("reset_tokens_at", 2),
    "anthropic-ratelimit-input-tokens-remaining": ("remaining_tokens", 3),
    "anthropic-ratelimit-input-tokens-reset": ("reset_tokens_at", 3),
    "anthropic-ratelimit-output-tokens-remaining": ("remaining_tokens", 4),
    "anthropic-ratelimit-output-tokens-reset": ("reset_tokens_at", 4),
}
"""Every header a hint is read from, lowercased. Anthropic's token windows (total, input,
output) each get a rank of their own: the tightest of them is kept (``_tightest``)."""

_PREFIXES: Final = ("retry-after", "x-ratelimit-", "llm_provider-", "anthropic-ratelimit-")
"""Cheap first test on a header name before the table is consulted."""


def _parsed(kind: _Field, value: str, now_wall: float) -> float | None:
    """One header's value read as its kind says; ``None`` when unreadable."""
    if kind == "retry_ms":
        ms = _decimal(value)
        return None if ms is None else max(0.0, ms) / 1000.0
    if kind == "retry":
        return parse_retry_after(value, now_wall)
    if kind in ("remaining_requests", "remaining_tokens"):
        count = parse_remaining(value)
        return None if count is None else float(count)
    if kind in ("reset_requests", "reset_tokens"):
        return parse_reset_duration(value)
    return parse_reset_time(value, now_wall)


def read_hint(headers: Mapping[str, str], now_wall: float) -> ServerHint | None:
    """The limits a response's headers announce, or ``None`` when they announce none.

    One pass over the headers (names compared lowercased); among several
    headers saying the same thing the first-ranked readable one wins, except
    Anthropic's token windows, of which the tightest is kept. ``now_wall``
    (epoch seconds) resolves dates.
    """
    found: dict[str, tuple[int, float]] = {}
    tokens: list[tuple[int, float]] = []
    token_resets: dict[int, float] = {}
    for raw_name, raw_value in headers.items():
        name = str(raw_name).lower()
        if not name.startswith(_PREFIXES):
            continue
        entry = _FIELDS.get(name)
        if entry is None:
            continue
        kind, rank = entry
        value = _parsed(kind, str(raw_value), now_wall)
        if value is None:
            _log.debug("ignored an unreadable %s header: %.40r", name, str(raw_value))
            continue
        if name.startswith("anthropic-ratelimit-") and "tokens" in name:
            if kind == "remaining_tokens":
                tokens.append((rank, value))
            else:
                token_resets[rank] = value
            continue
        key = kind.removesuffix("_at")
        held = found.get(key)
        if held is None or rank < held[0]:
            found[key] = (rank, value)
    if tokens and "remaining_tokens" not in found:
        rank, left = min(tokens, key=lambda t: t[1])
        found["remaining_tokens"] = (rank, left)
        if rank in token_resets:
            found["reset_tokens"] = (rank, token_resets[rank])
    if not found:
        return None

    def get(key: str) -> float | None:
        held = found.get(key)
        return None if held is None else held[1]

    retry_ms, retry = found.get("retry_ms"), found.get("retry")
    explicit = [held for held in (retry_ms, retry) if held is not None]
    retry_after = min(explicit)[1] if explicit else None
    requests_left = get("remaining_requests")
    tokens_left = get("remaining_tokens")
    return ServerHint(
        retry_after_s=retry_after,
        remaining_requests=None if requests_left is None else int(requests_left),
        remaining_tokens=None if tokens_left is None else int(tokens_left),
        requests_reset_s=get("reset_requests"),
        tokens_reset_s=get("reset_tokens"),
    )


def retry_after_from_headers(
    headers: Mapping[str, str], now_wall: float, *, rate_limited: bool = True
) -> float | None:
    """The back-off a failed answer's headers ask for, in seconds, or ``None``."""
    hint = read_hint(headers, now_wall)
    return None if hint is None else hint.back_off_s(rate_limited=rate_limited)
