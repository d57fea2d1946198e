"""What the demo watches and reports: attempt records, breaker trips, call results, tables.

The numbers come from three independent witnesses, so the report cannot
flatter the gateway: the clients' own telemetry (one ``AttemptRecord`` per
attempt, through the ``Emitter`` protocol), the backend's snapshots (breaker
state, sampled), and the simulator's record of what it really did on the
wire (429s, 5xx, resets).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from polygateway.backends.base import ScopeSnapshot
from polygateway.cli import render
from polygateway.models import AttemptRecord

if TYPE_CHECKING:
    from rich.table import Table

    from polygateway.simulator.stats import SourceStats

__all__ = [
    "LEGEND",
    "CallResult",
    "DemoEmitter",
    "TripCounter",
    "calls_json",
    "calls_table",
    "end_table",
    "percentile",
    "simulator_json",
    "sources_json",
    "sources_table",
]

# Two trips of one breaker are at least one cool-down apart (the second can only
# follow the first's end), and the shortest demo cool-down is seconds long: a
# reopening estimate that moved less than this is the same trip seen again.
_SAME_TRIP_S = 0.5


class DemoEmitter:
    """Keeps every attempt record and live counts per scope for the progress bars."""

    __slots__ = ("by_scope", "records")

    def __init__(self) -> None:
        self.records: list[AttemptRecord] = []
        self.by_scope: defaultdict[str, Counter[str]] = defaultdict(Counter)

    def emit_attempt(self, record: AttemptRecord) -> None:
        """Keep the record; quick, never raises."""
        self.records.append(record)
        self.by_scope[record.scope][record.outcome] += 1

    def attempts_note(self, scope: str) -> str:
        """One scope's attempts so far and what they met, for its own progress bar."""
        o = self.by_scope[scope]
        return f"attempts {sum(o.values())}, 429s {o['rate_limited']}, transient {o['transient']}"


class TripCounter:
    """Counts breaker trips from sampled snapshots.

    A trip opens a breaker until ``open_until``, at least one cool-down (seconds)
    ahead; a snapshot taken while it is open shows ``reopen_in_s``, so
    ``sampled_at + reopen_in_s`` names the trip. Sampling a few times per
    second therefore sees every trip once: a new trip has a later ``open_until``.
    """

    __slots__ = ("_open_until", "trips")

    def __init__(self) -> None:
        self._open_until: dict[tuple[str, str], float] = {}
        self.trips: Counter[tuple[str, str]] = Counter()

    def observe(self, snap: ScopeSnapshot, sampled_at: float) -> None:
        """Fold one snapshot (taken at ``sampled_at``, the sampler's clock) into the counts."""
        for source in snap.sources:
            if source.breaker != "open" or source.reopen_in_s is None:
                continue
            key = (snap.scope, source.name)
            until = sampled_at + source.reopen_in_s
            last = self._open_until.get(key)
            if last is None or until > last + _SAME_TRIP_S:
                self.trips[key] += 1
            self._open_until[key] = until if last is None else max(last, until)


@dataclass(frozen=True, slots=True)
class CallResult:
    """How one demo call ended."""

    kind: str
    index: int
    label: str
    served: bool
    latency_s: float
    attempts: int
    streamed: bool = False
    error: str | None = None
    message: str | None = None


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` percentile (0-100) of ``values``; ``None`` when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 1)


@dataclass(slots=True)
class _SourceRow:
    scope: str
    source: str
    attempts: int = 0
    successes: int = 0
    rate_limited: int = 0
    transient: int = 0
    other: int = 0
    retries: int = 0
    latencies: list[float] = field(default_factory=list)


def sources_json(
    records: Sequence[AttemptRecord],
    trips: Mapping[tuple[str, str], int],
    order: Sequence[tuple[str, str]],
) -> list[dict[str, Any]]:
    """Per (scope, source): attempts and how they ended, retries, trips, latency percentiles."""
    rows: dict[tuple[str, str], _SourceRow] = {key: _SourceRow(*key) for key in order}
    for r in records:
        key = (r.scope, r.source)
        row = rows.get(key)
        if row is None:
            row = rows[key] = _SourceRow(*key)
        row.attempts += 1
        row.latencies.append(r.latency_s)
        if r.attempt > 1:
            row.retries += 1
        if r.outcome == "success":
            row.successes += 1
        elif r.outcome == "rate_limited":
            row.rate_limited += 1
        elif r.outcome == "transient":
            row.transient += 1
        else:
            row.other += 1
    return [
        {
            "scope": row.scope,
            "source": row.source,
            "attempts": row.attempts,
            "successes": row.successes,
            "rate_limited": row.rate_limited,
            "transient": row.transient,
            "other_failures": row.other,
            "retries": row.retries,
            "breaker_trips": trips.get((row.scope, row.source), 0),
            "p50_ms": _ms(percentile(row.latencies, 50)),
            "p99_ms": _ms(percentile(row.latencies, 99)),
        }
        for row in rows.values()
    ]


def sources_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    """The per-source table a person reads at the end of the demo."""
    table = render.make_table(
        "per source (what the gateway did)",
        (
            "scope",
            "source",
            "attempts",
            "ok",
            "429s",
            "transient",
            "breaker trips",
            "retries",
            "p50 ms",
            "p99 ms",
        ),
        right_from=2,
    )
    table.show_edge = False  # the last screen holds every table and the verdict: no blank edges
    for row in rows:
        table.add_row(
            row["scope"],
            row["source"],
            str(row["attempts"]),
            str(row["successes"]),
            str(row["rate_limited"]),
            str(row["transient"] + row["other_failures"]),
            str(row["breaker_trips"]),
            str(row["retries"]),
            render.fmt_num(row["p50_ms"]),
            render.fmt_num(row["p99_ms"]),
        )
    return table


def calls_json(
    results: Sequence[CallResult], scopes: Mapping[str, str], planned: Mapping[str, int]
) -> dict[str, dict[str, Any]]:
    """Per kind of call: how many were planned, served and failed, with call latency."""
    by_kind: dict[str, list[CallResult]] = defaultdict(list)
    for result in results:
        by_kind[result.kind].append(result)
    out: dict[str, dict[str, Any]] = {}
    for kind, scope in scopes.items():
        done = by_kind.get(kind, [])
        served = [r for r in done if r.served]
        latencies = [r.latency_s for r in served]
        out[kind] = {
            "scope": scope,
            "planned": planned.get(kind, 0),
            "finished": len(done),
            "served": len(served),
            "failed": len(done) - len(served),
            "streamed": sum(1 for r in done if r.streamed),
            "attempts": sum(r.attempts for r in done),
            "p50_ms": _ms(percentile(latencies, 50)),
            "p99_ms": _ms(percentile(latencies, 99)),
        }
    return out


def calls_table(calls: Mapping[str, Mapping[str, Any]]) -> Table:
    """Per kind of call: served out of planned, attempts spent, call latency."""
    table = render.make_table(
        "per client (what the application saw)",
        ("client", "scope", "calls", "served", "failed", "attempts", "p50 ms", "p99 ms"),
        right_from=2,
    )
    table.show_edge = False
    for kind, row in calls.items():
        calls_cell = str(row["planned"])
        if row["streamed"]:
            calls_cell += f" ({row['streamed']} streamed)"
        table.add_row(
            kind,
            row["scope"],
            calls_cell,
            str(row["served"]),
            str(row["failed"]),
            str(row["attempts"]),
            render.fmt_num(row["p50_ms"]),
            render.fmt_num(row["p99_ms"]),
        )
    return table


def simulator_json(stats: Mapping[str, SourceStats]) -> dict[str, dict[str, Any]]:
    """What the simulator did on the wire, per simulated source."""
    return {
        name: {
            "requests": s.requests,
            "by_outcome": dict(s.by_outcome),
            "by_status": {str(k): v for k, v in s.by_status.items()},
            "limits_hit": dict(s.limits_hit),
            "max_concurrent": s.max_concurrent,
        }
        for name, s in stats.items()
    }


def end_table(
    stats: Mapping[str, Mapping[str, Any]],
    final: Sequence[ScopeSnapshot],
    order: Sequence[tuple[str, str, str]],
    max_concurrency: Mapping[str, int],
) -> Table:
    """Per source: what the simulator answered on the wire, and its governance state at the end.

    ``order`` holds (scope, source, simulated source name) per row.
    """
    table = render.make_table(
        "simulated upstream (what it answered on the wire) and governance state at the end",
        (
            "scope",
            "source",
            "requests",
            "ok",
            "429s",
            "5xx",
            "resets",
            "limit / max",
            "breaker",
            "paced for",
        ),
        right_from=2,
    )
    table.show_edge = False
    state = {(snap.scope, s.name): s for snap in final for s in snap.sources}
    for scope, source, sim_name in order:
        wire = stats.get(sim_name, {})
        outcome = wire.get("by_outcome", {})
        live = state.get((scope, source))
        if live is None:
            limit, breaker, paced = "-", "-", "-"
        else:
            limit = f"{live.limit:.1f} / {max_concurrency.get(source, '?')}"
            breaker = live.breaker.replace("_", "-")
            if live.reopen_in_s is not None:
                breaker += f" {live.reopen_in_s:.1f} s"
            paced = render.fmt_seconds(live.paced_for_s)
        table.add_row(
            scope,
            source,
            str(wire.get("requests", 0)),
            str(outcome.get("ok", 0)),
            str(outcome.get("429", 0)),
            str(outcome.get("5xx", 0)),
            str(outcome.get("reset", 0)),
            limit,
            breaker,
            paced,
        )
    return table


LEGEND = (
    "p50 / p99 ms: median / 99th-percentile latency, per client of whole calls, "
    "per source of one attempt",
    "retries: attempts that were a call's 2nd or later try; transient: 5xx, resets, timeouts",
    "requests .. resets: what the simulator itself answered; "
    "breaker 'open 2.9 s': it reopens in 2.9 s",
    "limit / max: AIMD concurrency limit (+1/limit per success, x0.7 on a 429 or 503) "
    "/ max_concurrency",
    "paced for: time before the source may be called again, from its last 429's Retry-After",
)
"""One line per figure of the last screen that its column title does not explain."""
