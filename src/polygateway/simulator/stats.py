"""What the simulator saw, per source: requests, outcomes, concurrency and arrival times.

Tests and the demo report read frozen ``SourceStats`` snapshots; the server
writes into one mutable ``SourceRecorder`` per source. Times are the server's
real monotonic clock: the simulator is a real server, not policy code.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

__all__ = [
    "OUTCOMES",
    "Outcome",
    "SourceRecorder",
    "SourceStats",
    "format_stats",
]

Outcome = Literal[
    "ok",
    "429",
    "5xx",
    "hang",
    "reset",
    "malformed",
    "error_body",
    "truncated",
    "bad_request",
    "shutdown",
]
"""How one request ended, as the simulator played it."""

OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)


@dataclass(frozen=True, slots=True)
class SourceStats:
    """A snapshot of one source's record.

    Attributes:
        name: the source.
        requests: requests that reached the source (every outcome).
        by_route: requests per route (``chat``, ``chat_stream``, ``embeddings``,
            ``ocr_text``, ``parse``), whatever the wire (an Anthropic ``/v1/messages``
            and an Azure deployment's chat count as ``chat``).
        by_outcome: requests per ``Outcome``.
        by_status: answers per HTTP status sent (hangs and resets that sent none are absent).
        limits_hit: 429s per cause (``random``, ``rpm``, ``requests``, ``tokens``,
            ``concurrency``).
        current_concurrent: requests open at the moment of the snapshot.
        max_concurrent: most requests open at once since the record began.
        arrivals: monotonic arrival time (``time.monotonic()``) of each request
            that reached the source, in order, whatever its outcome.
        since: monotonic time the record began (creation or ``reset_stats``).
        traceparents: the W3C ``traceparent`` header of each request that carried
            one, in arrival order (what a client's trace propagation sent; no
            other header is kept: they may hold keys).
    """

    name: str
    requests: int
    by_route: Mapping[str, int]
    by_outcome: Mapping[str, int]
    by_status: Mapping[int, int]
    limits_hit: Mapping[str, int]
    current_concurrent: int
    max_concurrent: int
    arrivals: tuple[float, ...]
    since: float
    traceparents: tuple[str, ...] = ()

    def outcome(self, outcome: Outcome) -> int:
        """Requests that ended with ``outcome`` (0 when none did)."""
        return self.by_outcome.get(outcome, 0)

    def arrivals_between(self, start: float, end: float) -> int:
        """Requests that arrived in ``[start, end)`` (monotonic times): counts a time window."""
        return bisect.bisect_left(self.arrivals, end) - bisect.bisect_left(self.arrivals, start)

    def per_minute(self) -> dict[int, int]:
        """Arrivals per minute since the record began, keyed by minute index (0, 1, ...)."""
        counts: Counter[int] = Counter(int((t - self.since) // 60.0) for t in self.arrivals)
        return dict(sorted(counts.items()))

    def max_in_window(self, window_s: float = 60.0) -> int:
        """The most arrivals inside any window of ``window_s`` seconds: checks a rate limit."""
        best = 0
        for i, start in enumerate(self.arrivals):
            # Arrivals are in order, so the window starting at ``start`` ends at a bisect.
            end = bisect.bisect_left(self.arrivals, start + window_s, lo=i)
            best = max(best, end - i)
        return best


@dataclass(slots=True)
class SourceRecorder:
    """The live, mutable record of one source; the server is its only writer."""

    name: str
    now: Callable[[], float] = time.monotonic  # edge: the simulator is a real server
    requests: int = 0
    by_route: Counter[str] = field(default_factory=Counter)
    by_outcome: Counter[str] = field(default_factory=Counter)
    by_status: Counter[int] = field(default_factory=Counter)
    limits_hit: Counter[str] = field(default_factory=Counter)
    current_concurrent: int = 0
    max_concurrent: int = 0
    arrivals: list[float] = field(default_factory=list)
    since: float = 0.0
    traceparents: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        """Start the record at creation time."""
        self.since = self.now()

    def arrive(self, route: str, traceparent: str | None = None) -> None:
        """Count a request that reached the source and is now open (with its ``traceparent``)."""
        if traceparent is not None:
            self.traceparents.append(traceparent)
        self.requests += 1
        self.by_route[route] += 1
        self.arrivals.append(self.now())
        self.current_concurrent += 1
        self.max_concurrent = max(self.max_concurrent, self.current_concurrent)

    def leave(self) -> None:
        """A request's response is finished (sent, failed or abandoned)."""
        self.current_concurrent -= 1

    def finish(self, outcome: Outcome, status: int | None = None) -> None:
        """Record how a request ended and, when one was sent, its status."""
        self.by_outcome[outcome] += 1
        if status is not None:
            self.by_status[status] += 1

    def clear(self) -> None:
        """Forget everything seen so far; requests still open stay counted as open."""
        self.requests = 0
        self.by_route.clear()
        self.by_outcome.clear()
        self.by_status.clear()
        self.limits_hit.clear()
        self.max_concurrent = self.current_concurrent
        self.arrivals.clear()
        self.traceparents.clear()
        self.since = self.now()

    def snapshot(self) -> SourceStats:
        """A frozen copy, safe to keep while the server goes on."""
        return SourceStats(
            name=self.name,
            requests=self.requests,
            by_route=dict(self.by_route),
            by_outcome=dict(self.by_outcome),
            by_status=dict(self.by_status),
            limits_hit=dict(self.limits_hit),
            current_concurrent=self.current_concurrent,
            max_concurrent=self.max_concurrent,
            arrivals=tuple(self.arrivals),
            since=self.since,
            traceparents=tuple(self.traceparents),
        )


def format_stats(stats: Iterable[SourceStats]) -> str:
    """A plain-text table of what each source saw, for the command line and reports."""
    shown: tuple[Outcome, ...] = ("ok", "429", "5xx", "hang", "reset", "malformed", "truncated")
    header = ["source", "requests", *shown, "max conc", "max/min"]
    rows = [header]
    for s in stats:
        rows.append(
            [
                s.name,
                str(s.requests),
                *(str(s.outcome(o)) for o in shown),
                str(s.max_concurrent),
                str(s.max_in_window(60.0)),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)
