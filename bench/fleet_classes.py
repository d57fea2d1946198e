"""``python -m bench.fleet_classes`` (``make bench-classes``): priority classes across a fleet.

Two scenarios, each on one private redis-server with worker processes
(``bench/fleet_worker.py``) sharing one scope of ``permits`` permits whose
upstream (the simulator, in this process) answers in ``latency`` seconds:

1. **Interactive under a batch flood.** ``batch_processes`` processes keep the
   scope saturated with batch calls (``batch_callers`` callers each, so far
   more calls wait than there are permits) for ``seconds``, while one more
   process makes one interactive call per second. Run twice: with the classes
   declared (``interactive`` share 9, ``batch`` share 1) and without them
   (today's FIFO: one class, arrival order per process, turns per process).
   Each interactive call's wait (start to grant) is set against one upstream
   attempt (the batch calls' median attempt) plus 10%.
2. **Shares.** Four processes, two calling class ``high`` (share 3) and two
   ``low`` (share 1), all saturated for ``seconds``: the calls granted to each
   class while both run, against 3:1. Then ``high`` stops: the time from its
   last call's end until ``low`` holds every permit, against one attempt.

The batch load is chat calls (the worker's), standing in for an embedding
job: to the governance loop a call is a call. Round trips per waiting call
per second: backend operations of the calls that waited, over their seconds
of waiting. Results go to ``bench/results/fleet_classes.json`` and to one
marked section of ``research-wiki/BENCHMARKS.md``. Sizes: the command line,
or ``BENCH_CLASSES_SECONDS`` (60).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.fleet_worker import Json, Worker
from bench.harness import end_meta, log_stderr, run_meta
from bench.report import X, fmt_number, md_table, replace_section
from bench.run_one import percentile
from bench.services import private_redis
from polygateway.simulator import FaultProfile, SimulatedUpstream

__all__ = ["Sizes", "main", "measure", "render_section"]

SCOPE = "classes"
_API_KEY = "sk-bench-classes-0123456789"
_WAIT_BOUND = 1.1
"""The issue's target: an interactive call waits at most one attempt plus 10%."""
_SHARE_BOUND = 0.10
"""The issue's target: served counts within 10% of 3:1."""
_BEGIN = (
    "<!-- begin:fleet-classes (written by `make bench-classes`, bench/fleet_classes.py; "
    "`make bench` keeps it as it is) -->"
)
_KNOBS = ("PYTHONPATH", "BENCH_REVISION", "BENCH_CLASSES_SECONDS")


@dataclass(frozen=True, slots=True)
class Sizes:
    """What one run measures."""

    seconds: float
    permits: int
    latency_s: float
    batch_processes: int
    batch_callers: int
    share_callers: int
    poll_s: float
    start_timeout_s: float


def _config(sim: SimulatedUpstream, redis_url: str, sizes: Sizes, classes: Json | None) -> Json:
    """A worker's config: one scope of one source, counting operations; ``classes`` if given."""
    source = {
        "name": "a",
        "protocol": "openai",
        "base_url": sim.base_url("a"),
        "model": "sim",
        "api_key": _API_KEY,
        "max_concurrency": sizes.permits,
    }
    scope: Json = {"kind": "chat", "sources": [source]}
    if classes is not None:
        scope["priority_classes"] = {name: {"share": share} for name, share in classes.items()}
        scope["default_priority_class"] = min(classes, key=lambda name: classes[name])
    settings = {
        "backend": "redis",
        "redis_url": redis_url,
        "poll_interval_s": sizes.poll_s,
        "stall_window_s": 3600.0,  # long waits are the point: the stall rule must not end them
        "scopes": {SCOPE: scope},
    }
    return {"settings": settings, "scope": SCOPE, "count_operations": True}


async def _start(n: int, config: Json, workdir: Path, timeout_s: float) -> list[Worker]:
    started = await asyncio.gather(
        *(Worker.start(config, workdir, start_timeout_s=timeout_s) for _ in range(n)),
        return_exceptions=True,
    )
    workers = [w for w in started if isinstance(w, Worker)]
    failure = next((w for w in started if isinstance(w, BaseException)), None)
    if failure is not None:
        await asyncio.gather(*(w.stop() for w in workers))
        raise failure
    return workers


def _granted(records: list[Json]) -> list[Json]:
    return [r for r in records if r.get("ok") and "acquired" in r]


def _attempt_s(records: list[Json]) -> float:
    """The median upstream attempt of served calls: grant to end."""
    attempts: list[float] = [r["ended"] - r["acquired"] for r in _granted(records)]
    return statistics.median(attempts)


def _round_trips_per_waiting_s(records: list[Json]) -> float | None:
    """Backend operations of the calls that waited, over the seconds they waited."""
    waited = [r for r in _granted(records) if r.get("denied") or r.get("queued_behind")]
    seconds = sum(r["acquired"] - r["started"] for r in waited)
    ops = sum(r.get("acquires", 0) + r.get("releases", 0) + r.get("other", 0) for r in waited)
    return ops / seconds if seconds > 0 else None


async def _flood(sizes: Sizes, redis_url: str, workdir: Path, with_classes: bool) -> Json:
    """Scenario 1, once: batch processes saturate the scope, one process asks once a second."""
    classes = {"interactive": 9.0, "batch": 1.0} if with_classes else None
    profile = FaultProfile(latency_s=sizes.latency_s, latency_jitter_s=sizes.latency_s / 10)
    async with SimulatedUpstream({"a": profile}) as sim:
        config = _config(sim, redis_url, sizes, classes)
        workers = await _start(sizes.batch_processes + 1, config, workdir, sizes.start_timeout_s)
        try:
            start_at = time.monotonic() + 1.0
            flow = {"priority_class": "batch"} if with_classes else {}
            batch = [
                w.records(
                    "run",
                    start_at=start_at,
                    duration_s=sizes.seconds,
                    concurrency=sizes.batch_callers,
                    **flow,
                )
                for w in workers[1:]
            ]
            flow = {"priority_class": "interactive"} if with_classes else {}
            interactive = workers[0].records(
                "run", start_at=start_at + 2.0, duration_s=sizes.seconds - 4.0, every_s=1.0, **flow
            )
            runs = await asyncio.gather(interactive, *batch)
            upstream_max = sim.stats("a").max_concurrent
        finally:
            await asyncio.gather(*(w.stop() for w in workers))
    asked, batch_records = runs[0], [r for run in runs[1:] for r in run]
    attempt = _attempt_s(batch_records)
    waits = [r["acquired"] - r["started"] for r in _granted(asked)]
    return {
        "classes": with_classes,
        "interactive_calls": len(asked),
        "interactive_failed": len(asked) - len(waits),
        "batch_served": len(_granted(batch_records)),
        "attempt_ms": attempt * 1000,
        "wait_p50_ms": percentile(waits, 50) * 1000 if waits else None,
        "wait_max_ms": max(waits) * 1000 if waits else None,
        "within_bound": sum(w <= _WAIT_BOUND * attempt for w in waits),
        "round_trips_per_waiting_call_s": _round_trips_per_waiting_s(batch_records),
        "upstream_max_concurrent": upstream_max,
    }


async def _shares(sizes: Sizes, redis_url: str, workdir: Path) -> Json:
    """Scenario 2: two processes per class, shares 3:1; then the share-3 class stops."""
    classes = {"high": 3.0, "low": 1.0}
    profile = FaultProfile(latency_s=sizes.latency_s, latency_jitter_s=sizes.latency_s / 10)
    async with SimulatedUpstream({"a": profile}) as sim:
        config = _config(sim, redis_url, sizes, classes)
        workers = await _start(4, config, workdir, sizes.start_timeout_s)
        try:
            start_at = time.monotonic() + 1.0
            tail_s = max(5.0, 10 * sizes.latency_s)

            def run(worker: Worker, klass: str, seconds: float) -> asyncio.Future[list[Json]]:
                return asyncio.ensure_future(
                    worker.records(
                        "run",
                        start_at=start_at,
                        duration_s=seconds,
                        concurrency=sizes.share_callers,
                        priority_class=klass,
                    )
                )

            high = [run(w, "high", sizes.seconds) for w in workers[:2]]
            low = [run(w, "low", sizes.seconds + tail_s) for w in workers[2:]]
            runs = await asyncio.gather(*high, *low)
            upstream_max = sim.stats("a").max_concurrent
        finally:
            await asyncio.gather(*(w.stop() for w in workers))
    high_records = _granted([r for run in runs[:2] for r in run])
    low_records = _granted([r for run in runs[2:] for r in run])
    both_until = start_at + sizes.seconds
    granted_high = sum(start_at <= r["acquired"] < both_until for r in high_records)
    granted_low = sum(start_at <= r["acquired"] < both_until for r in low_records)
    high_ended = max(r["ended"] for r in high_records)
    full_after = _first_full(low_records, high_ended, sizes.permits)
    attempt = _attempt_s(high_records + low_records)
    return {
        "granted_high": granted_high,
        "granted_low": granted_low,
        "ratio": granted_high / granted_low if granted_low else None,
        "attempt_ms": attempt * 1000,
        "low_full_after_ms": None if full_after is None else full_after * 1000,
        "upstream_max_concurrent": upstream_max,
    }


def _first_full(records: list[Json], since: float, permits: int) -> float | None:
    """Seconds after ``since`` until ``permits`` of these calls held a permit at once."""
    events: list[tuple[float, int]] = sorted(
        [(r["acquired"], 1) for r in records] + [(r["ended"], -1) for r in records],
        key=lambda e: (e[0], e[1]),
    )
    held = 0
    for at, step in events:
        held += step
        if at >= since and held >= permits:
            return at - since
    return None


async def measure(sizes: Sizes) -> Json:
    """Both scenarios, each on a fresh private redis-server."""
    results: Json = {}
    with tempfile.TemporaryDirectory(prefix="classes-") as tmp:
        workdir = Path(tmp)
        for with_classes in (True, False):
            with private_redis() as url:
                label = "classes" if with_classes else "fifo"
                log_stderr(f"bench-classes: flood, {label}, {sizes.seconds:g} s")
                results[f"flood_{label}"] = await _flood(sizes, url, workdir, with_classes)
        with private_redis() as url:
            log_stderr(f"bench-classes: shares 3:1, {sizes.seconds:g} s")
            results["shares"] = await _shares(sizes, url, workdir)
    return results


def _verdict(met: bool) -> str:
    return "**met**" if met else "**missed**"


def render_section(results: Json) -> str:
    """The page's section: the command, both scenarios, the verdicts."""
    meta, m = results["meta"], results["measured"]
    sizes, machine = meta["sizes"], meta["machine"]
    rows = []
    for key in ("flood_classes", "flood_fifo"):
        r = m[key]
        rows.append(
            [
                "interactive 9 : batch 1" if r["classes"] else "no classes (FIFO)",
                str(r["interactive_calls"]),
                f"{r['within_bound']} / {r['interactive_calls'] - r['interactive_failed']}",
                fmt_number(r["wait_p50_ms"]),
                fmt_number(r["wait_max_ms"]),
                fmt_number(r["attempt_ms"]),
                fmt_number(r["round_trips_per_waiting_call_s"]),
                str(r["batch_served"]),
                str(r["upstream_max_concurrent"]),
            ]
        )
    flood = md_table(
        [
            "classes",
            "interactive calls",
            f"waits ≤ {_WAIT_BOUND:g}{X} attempt",
            "wait p50 ms",
            "wait max ms",
            "attempt ms (median)",
            "round trips per waiting call per s",
            "batch calls served",
            "upstream max concurrent",
        ],
        rows,
    )
    s = m["shares"]
    ratio = s["ratio"]
    shares = md_table(
        [
            "granted high (share 3)",
            "granted low (share 1)",
            "ratio",
            "low holds every permit after high stops, ms",
            "attempt ms (median)",
            "upstream max concurrent",
        ],
        [
            [
                str(s["granted_high"]),
                str(s["granted_low"]),
                fmt_number(ratio, 2),
                fmt_number(s["low_full_after_ms"]),
                fmt_number(s["attempt_ms"]),
                str(s["upstream_max_concurrent"]),
            ]
        ],
    )
    fc = m["flood_classes"]
    served = fc["interactive_calls"] - fc["interactive_failed"]
    wait_met = served > 0 and fc["within_bound"] == served
    ratio_met = ratio is not None and abs(ratio / 3.0 - 1) <= _SHARE_BOUND
    full = s["low_full_after_ms"]
    lend_met = full is not None and full <= s["attempt_ms"]
    checks = md_table(
        ["target (issue 19)", "measured", "verdict"],
        [
            [
                "every interactive call waits ≤ one attempt + 10% (classes on)",
                f"{fc['within_bound']} of {served}; max {fmt_number(fc['wait_max_ms'])} ms "
                f"vs {fmt_number(_WAIT_BOUND * fc['attempt_ms'])} ms",
                _verdict(wait_met),
            ],
            [
                "shares 3:1 across 4 processes, within 10%",
                f"{fmt_number(ratio, 2)} : 1",
                _verdict(ratio_met),
            ],
            [
                "share-1 class holds every permit within one attempt of the share-3 class stopping",
                f"{fmt_number(full)} ms vs {fmt_number(s['attempt_ms'])} ms",
                _verdict(lend_met),
            ],
        ],
    )
    return "\n".join(
        [
            _BEGIN,
            "## Priority classes across a fleet (issue 19)",
            "",
            f"- **Command:** `{meta['command']}` (inner: `{meta['inner_command']}`)",
            f"- **Date:** {meta['date']} UTC. **Commit:** {meta['revision']}. "
            f"**Run took:** {meta['duration_s']:.0f} s; load average "
            f"{meta['load_average']['before']:.1f} before, "
            f"{meta['load_average']['after']:.1f} after.",
            f"- **Machine:** {machine['cpu_model']}, {machine['nproc']} logical CPUs, Python "
            f"{machine['python']}, redis-server {machine.get('redis_server') or 'unknown'}; the "
            "worker processes, the simulator and Redis share those CPUs.",
            f"- **Sizes:** {sizes['seconds']:g} s per scenario, {sizes['permits']} permits, "
            f"upstream {sizes['latency_s'] * 1000:g} ms; flood: {sizes['batch_processes']} "
            f"batch processes {X} {sizes['batch_callers']} callers, one interactive call per "
            f"second from a fifth process; shares: 2 + 2 processes {X} {sizes['share_callers']} "
            "callers. Batch calls are chat calls standing in for an embedding job.",
            "",
            "Interactive under a batch flood (both runs in this one command):",
            "",
            flood,
            "",
            "Shares 3:1 across four processes, then the share-3 class stops:",
            "",
            shares,
            "",
            checks,
            "",
            "Tenants (1,000 calls of one tenant queued, 10 of another arriving after) are "
            "shown by `tests/integration/test_priority_fleet.py` on both backends.",
            "<!-- end:fleet-classes -->",
        ]
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_classes", description=__doc__)
    seconds = float(os.environ.get("BENCH_CLASSES_SECONDS") or 60)
    parser.add_argument("--seconds", type=float, default=seconds)
    parser.add_argument("--permits", type=int, default=20)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--batch-processes", type=int, default=4)
    parser.add_argument("--batch-callers", type=int, default=25)
    parser.add_argument("--share-callers", type=int, default=20)
    parser.add_argument("--poll", type=float, default=0.5)
    parser.add_argument("--start-timeout", type=float, default=60.0)
    parser.add_argument("--note", default="")
    parser.add_argument("--results", type=Path, default=Path("bench/results/fleet_classes.json"))
    parser.add_argument("--out", default="research-wiki/BENCHMARKS.md")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Measure, write the results and the page's section; non-zero when a call failed."""
    args_list = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(args_list)
    sizes = Sizes(
        seconds=args.seconds,
        permits=args.permits,
        latency_s=args.latency,
        batch_processes=args.batch_processes,
        batch_callers=args.batch_callers,
        share_callers=args.share_callers,
        poll_s=args.poll,
        start_timeout_s=args.start_timeout,
    )
    meta = run_meta("bench.fleet_classes", "bench-classes", args_list, _KNOBS, sizes, args.note)
    measured = asyncio.run(measure(sizes))
    end_meta(meta)
    results = {"meta": meta, "measured": measured}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    section = render_section(results)
    if args.out == "-":
        print(section)
    else:
        path = Path(args.out)
        page = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
        path.write_text(replace_section(page, section), encoding="utf-8")
    log_stderr(f"bench-classes: wrote {args.out} and {args.results}")
    failed = sum(m.get("interactive_failed", 0) for m in measured.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
