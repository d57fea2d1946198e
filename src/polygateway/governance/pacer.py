"""The pacer: how long an answer's back-off pauses its source, fleet-wide.

The upstream's own headers say how long to leave a source alone
(``transport/hints.py`` reads them into relative seconds); this module says
what the governance makes of that figure. A pause sets the source's "not
before" deadline to ``now + pause`` (never earlier than one already set):

- a 429 always pauses, by its hint or ``DEFAULT_RATE_LIMIT_PACE_S``;
- a transient failure (503, 529, ...) pauses only when the upstream named a back-off;
- a success pauses when it announced that the source's window is exhausted.

A pause set by a failure ends with one probe (``source_state``): once it
lapses, the source admits a single attempt fleet-wide, whose success reopens
it and whose 429 starts the next pause, so a permanently limited source sees
one request per hinted interval however many calls wait. A success's pause
needs no probe: the source has served, and said when its window resets.
"""

from __future__ import annotations

import math

__all__ = [
    "DEFAULT_RATE_LIMIT_PACE_S",
    "MAX_PACE_S",
    "pace_for",
    "pause_for",
]

DEFAULT_RATE_LIMIT_PACE_S = 1.0
"""Pace of a 429 that named no back-off of its own."""

MAX_PACE_S = 3600.0
"""Longest pace honoured: an absurd Retry-After must not park a source for days."""


def pace_for(retry_after_s: float | None) -> float:
    """How long to pace a source after a 429: the asked back-off, default 1 s, capped at 1 h."""
    if retry_after_s is None or math.isnan(retry_after_s):
        return DEFAULT_RATE_LIMIT_PACE_S
    return min(MAX_PACE_S, max(0.0, retry_after_s))


def pause_for(rate_limited: bool, retry_after_s: float | None) -> float | None:
    """The pause an outcome sets, or ``None``: a 429 always pauses, anything else only when hinted.

    A hint that is not a number (``nan``) counts as no hint.
    """
    if rate_limited:
        return pace_for(retry_after_s)
    if retry_after_s is None or math.isnan(retry_after_s):
        return None
    return min(MAX_PACE_S, max(0.0, retry_after_s))
