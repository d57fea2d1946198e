"""``python -m bench.fleet`` (``make bench-fleet``): processes sharing one scope on one Redis.

For each fleet size N (default 1, 8 and 50) it starts N worker processes
(``bench/fleet_worker.py``), each a ``ChatClient`` on one private
redis-server, all contending for one scope of one source with ``permits``
permits whose upstream (the simulator, in this process, on 127.0.0.1)
answers in ``latency`` seconds. The total number of callers is the same for
every N (split evenly over the processes), so N = 1 is "the same load in one
process" the fleet rows are compared with. Each process makes one call per
caller before the measured window: its first calls build its HTTP client,
which is start-up, not waiting. Before the fleet rows, one process
makes calls that never wait (fewer callers than permits): what a call costs
Redis when nothing contends, and its round trips, counted by the server.

Figures (per N): Redis CPU per served call (``INFO cpu`` before and after,
divided by the calls served), calls/s per Redis core (its inverse), scripts
per served call (``INFO commandstats``: polls included), round trips per call
that did not wait (counted per call in the workers), polls per waiting process
per second (acquires refused, over the seconds each process had a call
waiting), each process's served calls against the mean, and the wait of a
call (from its start to its grant) at p50 and p99.

Results go to ``bench/results/fleet.json`` and to one marked section of
``research-wiki/BENCHMARKS.md`` (``make bench`` keeps that section as it is).
Sizes come from the command line or ``BENCH_FLEET_N`` (``1,8,50``),
``BENCH_FLEET_SECONDS`` (20) and ``BENCH_FLEET_CALLERS`` (200, in all).
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.fleet_worker import Json, Worker
from bench.harness import end_meta, log_stderr, run_meta
from bench.redis_counts import RedisCounter
from bench.report import DASH, X, fmt_number, md_table, replace_section
from bench.run_one import percentile
from bench.services import private_redis
from polygateway.simulator import FaultProfile, SimulatedUpstream

__all__ = ["COLUMNS", "FleetSizes", "evaluate", "main", "measure", "render_section"]

SCOPE = "fleet"
_NOTES = Path(__file__).with_name("fleet_notes.md")
"""What a person read in the last run (written by hand, like ``notes.md`` for the rest)."""
_API_KEY = "sk-bench-fleet-0123456789"
_SHARE_BOUND = 0.25
"""The issue's target: every process's served calls within ±25% of the mean."""
_P99_BOUND = 2.0
"""The issue's target: the fleet's p99 wait within 2x the same load's in one process."""
_WARM_CALLS = 20
_BEGIN = (
    "<!-- begin:fleet (written by `make bench-fleet`, bench/fleet.py; "
    "`make bench` keeps it as it is) -->"
)
_KNOBS = (
    "PYTHONPATH",
    "BENCH_REVISION",
    "BENCH_FLEET_N",
    "BENCH_FLEET_SECONDS",
    "BENCH_FLEET_CALLERS",
)

COLUMNS = (
    ("processes", "processes"),
    ("callers_per_process", "callers per process"),
    ("served", "calls served"),
    ("calls_per_s", "calls/s"),
    ("redis_cpu_us_per_call", "Redis CPU µs/call"),
    ("calls_per_s_per_redis_core", "calls/s per Redis core"),
    ("scripts_per_call", "Redis scripts per call"),
    ("round_trips_per_non_waiting_call", "round trips per non-waiting call"),
    ("polls_per_waiting_process_per_s", "polls per waiting process per s"),
    ("served_per_process", f"served per process, min{DASH}max"),
    ("share_of_mean", "min / max share of the mean"),
    ("wait_p50_ms", "wait p50 ms"),
    ("wait_p99_ms", "wait p99 ms"),
    ("wait_p99_vs_one_process", f"p99 {X} one process"),
    ("upstream_max_concurrent", "upstream max concurrent"),
    ("failed", "failed"),
)
"""Each row's fields and the table's headers, in order (the smoke test checks every one)."""


@dataclass(frozen=True, slots=True)
class FleetSizes:
    """What one run measures."""

    processes: tuple[int, ...]
    callers: int
    """Callers in all, split evenly over the processes of each fleet."""
    permits: int
    seconds: float
    latency_s: float
    poll_s: float
    sample_calls: int
    """Calls of the uncontended sample (the Redis CPU and scripts of a call that never waits)."""
    monitor_calls: int
    """Calls, one at a time, whose round trips ``MONITOR`` counts."""
    start_timeout_s: float


def _config(sim: SimulatedUpstream, redis_url: str, sizes: FleetSizes) -> Json:
    """A worker's config: one scope, one source of ``permits`` permits, counting operations."""
    source = {
        "name": "a",
        "protocol": "openai",
        "base_url": sim.base_url("a"),
        "model": "sim",
        "api_key": _API_KEY,
        "max_concurrency": sizes.permits,
    }
    settings = {
        "backend": "redis",
        "redis_url": redis_url,
        "poll_interval_s": sizes.poll_s,
        # Long waits are the point here: the stall rule must not end them.
        "stall_window_s": 3600.0,
        "scopes": {SCOPE: {"kind": "chat", "sources": [source]}},
    }
    return {"settings": settings, "scope": SCOPE, "count_operations": True}


def _upstream(sizes: FleetSizes) -> SimulatedUpstream:
    """The simulated upstream of one phase (fresh, so its counts are the phase's)."""
    profile = FaultProfile(latency_s=sizes.latency_s, latency_jitter_s=sizes.latency_s / 5)
    return SimulatedUpstream({"a": profile})


async def _start(n: int, config: Json, workdir: Path, timeout_s: float) -> list[Worker]:
    """``n`` workers started at once; if any fails to start, the others are stopped."""
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


def _ops(record: Json) -> int:
    """The backend operations (each one round trip) a call made."""
    return int(record.get("acquires", 0) + record.get("releases", 0) + record.get("other", 0))


def _waited(record: Json) -> bool:
    """Whether a call waited: queued behind others, or refused at least once."""
    return bool(record.get("queued_behind", 0) or record.get("denied", 0))


def _waiting_s(records: list[Json]) -> float:
    """Seconds in which the process had at least one call waiting (union of the waits)."""
    spans: list[tuple[float, float]] = sorted(
        (r["started"], r["acquired"] if "acquired" in r else r["ended"])
        for r in records
        if r.get("denied", 0)
    )
    total, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


async def _uncontended(
    sizes: FleetSizes, redis_url: str, counter: RedisCounter, workdir: Path
) -> Json:
    """One process, fewer callers than permits: a call's cost to Redis and its round trips."""
    callers = max(1, sizes.permits // 2)
    async with _upstream(sizes) as sim:
        counter.flush()
        (worker,) = await _start(1, _config(sim, redis_url, sizes), workdir, sizes.start_timeout_s)
        try:
            await worker.records("calls", n=_WARM_CALLS, concurrency=1)
            counter.reset()
            cpu_before = counter.cpu_s()
            records = await worker.records("calls", n=sizes.sample_calls, concurrency=callers)
            cpu_s = counter.cpu_s() - cpu_before
            commands = counter.read()

            async def one_call() -> None:
                await worker.records("calls", n=1, concurrency=1)

            sample = await counter.round_trips(one_call, sizes.monitor_calls)
        finally:
            await worker.stop()
    served = sum(1 for r in records if r["ok"])
    sent: dict[str, int] = dict(sample.get("redis_round_trip_commands", {}))
    # The wake-up subscription's keep-alive (after 10 s of silence), not a call's.
    pings = sent.pop("ping", 0)
    return {
        "callers": callers,
        "calls": len(records),
        "served": served,
        "waited": sum(1 for r in records if _waited(r)),
        "redis_cpu_us_per_call": cpu_s / served * 1e6 if served else None,
        "scripts_per_call": counter.script_calls(commands) / served if served else None,
        "commands_per_call": sum(commands.values()) / served if served else None,
        "client_round_trips_per_call": statistics.fmean(map(_ops, records)) if records else None,
        "round_trips_per_call": sum(sent.values()) / sizes.monitor_calls if sample else None,
        "round_trip_commands": sent,
        "round_trip_pings": pings,
        "round_trip_note": sample.get("redis_round_trips_note"),
    }


async def _fleet(
    n: int, sizes: FleetSizes, redis_url: str, counter: RedisCounter, workdir: Path
) -> Json:
    """N processes contending for the scope for ``seconds``; one row of the table."""
    per = max(1, round(sizes.callers / n))
    async with _upstream(sizes) as sim:
        counter.flush()
        config = _config(sim, redis_url, sizes)
        workers = await _start(n, config, workdir, sizes.start_timeout_s)
        try:
            # Each worker's first calls build its HTTP client and open its connections
            # (tens of ms of CPU per process): paid before the window, so that N cold
            # interpreters starting at once on a small machine are not read as waiting.
            await asyncio.gather(*(w.records("calls", n=per, concurrency=per) for w in workers))
            start_at = time.monotonic() + 1.0
            answers = [
                asyncio.ensure_future(
                    w.records("run", start_at=start_at, duration_s=sizes.seconds, concurrency=per)
                )
                for w in workers
            ]
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
            counter.reset()
            cpu_before, began = counter.cpu_s(), time.monotonic()
            runs = await asyncio.gather(*answers)
            window_s = time.monotonic() - began
            cpu_s = counter.cpu_s() - cpu_before
            commands = counter.read()
            upstream_max = sim.stats("a").max_concurrent
        finally:
            await asyncio.gather(*(w.stop() for w in workers))
    return _row(n, per, runs, window_s, cpu_s, counter.script_calls(commands), upstream_max)


def _row(
    n: int,
    per: int,
    runs: list[list[Json]],
    window_s: float,
    cpu_s: float,
    scripts: int,
    upstream_max: int,
) -> Json:
    """The figures of one fleet from its call records and the server's counts."""
    served = sorted(sum(1 for r in run if r["ok"]) for run in runs)
    ok = [r for run in runs for r in run if r["ok"]]
    total = len(ok)
    mean = total / n
    waits_ms = [(r["acquired"] - r["started"]) * 1000 for r in ok if "acquired" in r]
    fast = [r for r in ok if not _waited(r)]
    denied = sum(r.get("denied", 0) for run in runs for r in run)
    waiting_s = sum(_waiting_s(run) for run in runs)
    return {
        "processes": n,
        "callers_per_process": per,
        "callers": per * n,
        "served": total,
        "failed": sum(1 for run in runs for r in run if not r["ok"]),
        "window_s": window_s,
        "calls_per_s": total / window_s,
        "redis_cpu_s": cpu_s,
        "redis_cpu_us_per_call": cpu_s / total * 1e6 if total else None,
        "calls_per_s_per_redis_core": total / cpu_s if cpu_s > 0 else None,
        "scripts_per_call": scripts / total if total else None,
        "non_waiting_calls": len(fast),
        "round_trips_per_non_waiting_call": (statistics.fmean(map(_ops, fast)) if fast else None),
        "denied_acquires": denied,
        "waiting_process_s": waiting_s,
        "polls_per_waiting_process_per_s": denied / waiting_s if waiting_s > 0 else None,
        "served_per_process": served,
        "share_min": served[0] / mean if mean else None,
        "share_max": served[-1] / mean if mean else None,
        "wait_p50_ms": percentile(waits_ms, 50) if waits_ms else None,
        "wait_p99_ms": percentile(waits_ms, 99) if waits_ms else None,
        "upstream_max_concurrent": upstream_max,
    }


async def measure(sizes: FleetSizes, log: Callable[[str], None] = log_stderr) -> Json:
    """The uncontended sample, then one row per fleet size, on one private redis-server."""
    with private_redis() as redis_url, tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
        counter = RedisCounter(redis_url)
        workdir = Path(tmp)
        log(f"bench-fleet: uncontended sample on {redis_url}")
        uncontended = await _uncontended(sizes, redis_url, counter, workdir)
        rows = []
        for n in sizes.processes:
            log(f"bench-fleet: {n} process(es) for {sizes.seconds:g} s")
            row = await _fleet(n, sizes, redis_url, counter, workdir)
            log(
                f"bench-fleet: {n}: {row['served']} served, "
                f"{fmt_number(row['redis_cpu_us_per_call'])} us Redis CPU/call, "
                f"shares {row['share_min']:.2f}-{row['share_max']:.2f}, "
                f"p99 wait {fmt_number(row['wait_p99_ms'])} ms"
            )
            rows.append(row)
    one = next((r for r in rows if r["processes"] == 1), None)
    for row in rows:
        same_load = one is not None and one["callers"] == row["callers"]
        row["wait_p99_vs_one_process"] = (
            row["wait_p99_ms"] / one["wait_p99_ms"]
            if same_load and one is not None and row["wait_p99_ms"] and one["wait_p99_ms"]
            else None
        )
    return {"uncontended": uncontended, "rows": rows}


def evaluate(rows: list[Json]) -> list[Json]:
    """The issue's two targets, judged on the largest fleet of the run (50 by default)."""
    fleets = [r for r in rows if r["processes"] > 1]
    big = max(fleets, key=lambda r: r["processes"]) if fleets else None
    n = big["processes"] if big else "N"
    share: bool | None = None
    ratio: bool | None = None
    share_text = p99_text = "not measured"
    if big is not None and big["share_min"] is not None:
        low, high = big["share_min"], big["share_max"]
        share = low >= 1 - _SHARE_BOUND and high <= 1 + _SHARE_BOUND
        share_text = (
            f"{low:.2f}{DASH}{high:.2f} of the mean "
            f"({big['served_per_process'][0]}{DASH}{big['served_per_process'][-1]} calls)"
        )
    if big is not None and big["wait_p99_vs_one_process"] is not None:
        ratio = big["wait_p99_vs_one_process"] <= _P99_BOUND
        one = next(r for r in rows if r["processes"] == 1)
        p99_text = (
            f"{big['wait_p99_vs_one_process']:.2f}{X} "
            f"({fmt_number(big['wait_p99_ms'])} / {fmt_number(one['wait_p99_ms'])} ms)"
        )
    return [
        {
            "id": "fleet-shares",
            "target": f"{n} processes contending: every process's served calls within "
            f"±{_SHARE_BOUND:.0%} of the mean",
            "measured": share_text,
            "met": share,
        },
        {
            "id": "fleet-p99-wait",
            "target": f"{n} processes contending: p99 wait ≤ {_P99_BOUND:g}{X} the same "
            "load in one process",
            "measured": p99_text,
            "met": ratio,
        },
    ]


def _cell(row: Json, field: str) -> str:
    """One table cell of ``row``."""
    value = row.get(field)
    if field == "served_per_process":
        return f"{value[0]:,}{DASH}{value[-1]:,}" if value else "—"
    if field == "share_of_mean":
        low, high = row.get("share_min"), row.get("share_max")
        return "—" if low is None or high is None else f"{low:.2f}{DASH}{high:.2f}"
    if field == "wait_p99_vs_one_process":
        return "—" if value is None else f"{value:.2f}{X}"
    if field in ("scripts_per_call", "round_trips_per_non_waiting_call"):
        return fmt_number(value, 2)
    if field == "polls_per_waiting_process_per_s":
        return fmt_number(value, 1)
    if field in ("redis_cpu_us_per_call", "wait_p50_ms", "wait_p99_ms", "calls_per_s"):
        return fmt_number(value, 0 if value is None or value >= 100 else 1)
    return fmt_number(value)


def render_section(results: Json) -> str:
    """The page's fleet section, markers included."""
    meta, measured = results["meta"], results["measured"]
    sizes, machine, un = meta["sizes"], meta["machine"], measured["uncontended"]
    rows = measured["rows"]
    table = md_table(
        [header for _, header in COLUMNS],
        [[_cell(row, field) for field, _ in COLUMNS] for row in rows],
    )
    verdicts = md_table(
        ["target", "measured", "verdict"],
        [
            [
                c["target"],
                c["measured"],
                "not measured" if c["met"] is None else "met" if c["met"] else "**missed**",
            ]
            for c in results["checks"]
        ],
    )
    load = meta["load_average"]
    notes = [
        f"- Load average (1 min) before the run: {load['before']:.1f}, on {machine['nproc']} "
        "logical CPUs: the machine's other work. During the run the fleet's own processes add "
        f"to it ({load['after']:.1f} at its end). Every worker, the simulator and redis-server "
        "share the CPUs, so a busy machine stretches waits and inflates CPU figures.",
    ]
    if meta.get("note"):
        notes.append(f"- {meta['note']}")
    reading = _NOTES.read_text(encoding="utf-8").strip() if _NOTES.exists() else ""
    rt = un["round_trips_per_call"]
    runs = "" if meta["inner_command"] == meta["command"] else f" (runs `{meta['inner_command']}`)"
    latency_ms = sizes["latency_s"] * 1000
    return f"""{_BEGIN}
## Fleet: processes contending for one scope on one Redis

- **Date:** {meta["date"]} (UTC); the run took {meta["duration_s"] / 60:.1f} min.
- **Command:** `{meta["command"]}`{runs}.
- **PolyGateway measured:** commit {meta["revision"]}, imported from
  `{meta["polygateway_path"]}`.
- **Machine:** {machine["cpu_model"]}, {machine["nproc"]} logical CPUs, Python
  {machine["python"]}, redis-server {machine.get("redis_server") or "unknown"}; nothing pinned:
  the workers, the simulator and redis-server share every CPU.
- **Load:** one scope, one source of `max_concurrency={sizes["permits"]}`, upstream latency
  {latency_ms:.0f} ± {latency_ms / 5:.0f} ms (the simulator, in the harness's process);
  {sizes["callers"]} callers in all, split evenly over the processes, each calling again as
  soon as its call ends, for {sizes["seconds"]:g} s per fleet size, once every process
  has made one call per caller (its HTTP client built, its connections open);
  `poll_interval_s = {sizes["poll_s"]:g}`, stall rule off (`stall_window_s = 3600`).

Each fleet runs against one private redis-server (loopback, no persistence). Redis
CPU is the server's `used_cpu_user + used_cpu_sys` (`INFO cpu`) over the run,
divided by the calls served; "calls/s per Redis core" is its inverse. "Redis
scripts per call" is `EVALSHA` runs over calls served (`INFO commandstats`):
every refused poll is one more. A call "waits" when it queued behind others in
its process or was refused at least once; "round trips per non-waiting call"
counts the backend operations each other call made (acquire, release, and any
renewal or progress read), counted in the worker. "Polls per waiting process
per s" is the acquires refused, over the seconds in which each process had a
refused call waiting. The wait of a call runs from its start to its grant.
"p99 {X} one process" compares a fleet's p99 wait with the one-process row
(the same callers in all).

{table}

**A call that does not wait** (one process, {un["callers"]} caller(s), {un["served"]:,}
calls, {un["waited"]} of them waited): {fmt_number(un["redis_cpu_us_per_call"])} µs of Redis
CPU per call; {fmt_number(un["scripts_per_call"], 2)} scripts and
{fmt_number(un["commands_per_call"], 1)} commands (those the scripts run included) per call
by `INFO commandstats`; **{fmt_number(rt, 2)} round trips per call** by `MONITOR` over
{sizes["monitor_calls"]} calls made one at a time (commands sent:
{un["round_trip_commands"] or "none"}; keep-alive pings of the wake-up subscription left
out: {un["round_trip_pings"]}).

{verdicts}

Notes:

{chr(10).join(notes)}{chr(10) * 2 + reading if reading else ""}
<!-- end:fleet -->
"""


def _ints(text: str) -> tuple[int, ...]:
    """``"1,8,50"`` -> ``(1, 8, 50)``."""
    return tuple(int(x) for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    """The command line; sizes default to the environment's ``BENCH_FLEET_*``."""
    env = os.environ
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n")[0])
    p.add_argument(
        "--n",
        type=_ints,
        default=env.get("BENCH_FLEET_N") or "1,8,50",  # a string default goes through ``type``
        help="fleet sizes (processes), comma-separated",
    )
    p.add_argument("--seconds", type=float, default=float(env.get("BENCH_FLEET_SECONDS") or 20))
    p.add_argument("--callers", type=int, default=int(env.get("BENCH_FLEET_CALLERS") or 200))
    p.add_argument("--permits", type=int, default=20)
    p.add_argument("--latency", type=float, default=0.05, help="upstream latency, seconds")
    p.add_argument("--poll", type=float, default=0.5, help="poll_interval_s")
    p.add_argument("--sample-calls", type=int, default=200)
    p.add_argument("--monitor-calls", type=int, default=50)
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds per fleet start")
    p.add_argument("--note", default=env.get("BENCH_FLEET_NOTE") or "", help="a note for the page")
    p.add_argument(
        "--out",
        default="research-wiki/BENCHMARKS.md",
        help="the page whose fleet section is rewritten; - prints the section instead",
    )
    p.add_argument("--results", type=Path, default=Path("bench/results/fleet.json"))
    p.add_argument(
        "--from-results",
        type=Path,
        default=None,
        help="measure nothing: render the section again from a saved results file",
    )
    return p


def _write_section(out: str, section: str) -> None:
    """Put ``section`` in place of the page's fleet section (``-``: print it instead)."""
    if out == "-":
        print(section)
        return
    path = Path(out)
    page = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(replace_section(page, section), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """Measure, write the results and the page's section; non-zero when a call failed."""
    args_list = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(args_list)
    if args.from_results is not None:
        results = json.loads(args.from_results.read_text(encoding="utf-8"))
        _write_section(args.out, render_section(results))
        return 0
    sizes = FleetSizes(
        processes=args.n,
        callers=args.callers,
        permits=args.permits,
        seconds=args.seconds,
        latency_s=args.latency,
        poll_s=args.poll,
        sample_calls=args.sample_calls,
        monitor_calls=args.monitor_calls,
        start_timeout_s=args.start_timeout,
    )
    meta = run_meta("bench.fleet", "bench-fleet", args_list, _KNOBS, sizes, args.note)
    measured = asyncio.run(measure(sizes))
    end_meta(meta)
    results = {"meta": meta, "measured": measured, "checks": evaluate(measured["rows"])}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    _write_section(args.out, render_section(results))
    log_stderr(f"bench-fleet: wrote {args.out} and {args.results}")
    failed = sum(r["failed"] for r in measured["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
