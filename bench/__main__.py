"""``python -m bench``: run every scenario, write the results JSON and the wiki page.

    python -m bench                         # the full run (make bench)
    python -m bench --n 20 --rounds 1 ...   # a smoke run (tests/integration/test_bench_smoke.py)

Sizes default to the issue's (500 streams, 1,000 and 10,000 waiting calls,
100,000 texts, a 20-call storm, 3 rounds) except the chat scenario: 1,000
calls per run instead of 2,000, so that the whole run, LiteLLM's 8 ms of CPU
per call included, fits in ten minutes on a two-core machine. ``BENCH_N`` and
``BENCH_ROUNDS`` in the environment change the chat size and the rounds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import (
    SCENARIO_CONFIGS,
    Sizes,
    command_lines,
    job_table,
    log_stderr,
    make_plan,
    reduce_runs,
    run_rounds,
    source_revision,
)
from bench.machine import describe_machine, package_versions
from bench.report import render, write_page
from bench.services import running_services

SCENARIOS = ("chat", "loop", "telemetry", "stream", "scale", "embed", "storm", "import")


def _ints(text: str) -> tuple[int, ...]:
    """``"1,64"`` -> ``(1, 64)``."""
    return tuple(int(x) for x in text.split(",") if x.strip())


def _names(text: str) -> tuple[str, ...]:
    """``"a, b"`` -> ``("a", "b")``."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    env = os.environ
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=int(env.get("BENCH_N") or 1000), help="chat calls")
    p.add_argument("--rounds", type=int, default=int(env.get("BENCH_ROUNDS") or 3))
    p.add_argument("--concurrencies", type=_ints, default=(1, 64))
    p.add_argument("--stream-n", type=int, default=500)
    p.add_argument("--stream-concurrency", type=int, default=1)
    p.add_argument("--scale-ns", type=_ints, default=(1000, 10000))
    p.add_argument("--embed-n", type=int, default=100_000)
    p.add_argument("--storm-n", type=int, default=20)
    p.add_argument("--scenarios", type=_names, default=SCENARIOS)
    p.add_argument(
        "--configs",
        type=_names,
        default=None,
        help="configurations to run (default: every one this venv can import)",
    )
    p.add_argument("--out", type=Path, default=Path("research-wiki/BENCHMARKS.md"))
    p.add_argument("--results", type=Path, default=Path("bench/results/latest.json"))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per client process")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and write the page; non-zero exit when every job failed."""
    args_list = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(args_list)
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    if args.configs is not None:
        known = {c for cs in SCENARIO_CONFIGS.values() for c in cs}
        bad = set(args.configs) - known
        if bad:
            raise SystemExit(f"unknown configuration(s): {', '.join(sorted(bad))}")
    sizes = Sizes(
        chat_n=args.n,
        concurrencies=args.concurrencies,
        stream_n=args.stream_n,
        stream_concurrency=args.stream_concurrency,
        scale_ns=args.scale_ns,
        embed_n=args.embed_n,
        storm_n=args.storm_n,
    )
    started = time.monotonic()
    # Before the harness pins itself to one CPU below: the machine as the run found it.
    machine = describe_machine()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M")
    command, inner = command_lines(
        "bench", "bench", args_list, ("PYTHONPATH", "BENCH_REVISION", "BENCH_N", "BENCH_ROUNDS")
    )
    # The polygateway measured is the one this interpreter imports (an editable install here).
    import polygateway

    revision = source_revision(Path(polygateway.__file__).resolve().parents[2])
    wants_redis = args.configs is None or any("redis" in c for c in args.configs)
    with running_services(redis=wants_redis) as services:
        if services.service_cpu is not None:
            # The harness mostly waits; keep even that off the clients' core.
            os.sched_setaffinity(0, {services.service_cpu})
        plan = make_plan(sizes, args.scenarios, args.configs, redis_missing=services.redis_missing)
        log_stderr(
            f"bench: {len(plan.jobs)} jobs x {args.rounds} rounds; simulator {services.sim_url}, "
            f"redis {services.redis_url or services.redis_missing}"
        )
        runs = run_rounds(
            plan.jobs, args.rounds, sys.executable, services, timeout_s=args.timeout, log=log_stderr
        )
        layout = {"service_cpu": services.service_cpu, "client_cpu": services.client_cpu}
    medians = {key: reduce_runs(results) for key, results in runs.items()}
    results: dict[str, Any] = {
        "meta": {
            "date": date,
            "command": command,
            "inner_command": inner,
            "revision": revision,
            "polygateway_path": str(Path(polygateway.__file__).resolve().parent),
            "duration_s": time.monotonic() - started,
            "rounds": args.rounds,
            "sizes": {
                "chat_n": sizes.chat_n,
                "concurrencies": list(sizes.concurrencies),
                "stream_n": sizes.stream_n,
                "stream_concurrency": sizes.stream_concurrency,
                "scale_ns": list(sizes.scale_ns),
                "embed_n": sizes.embed_n,
                "storm_n": sizes.storm_n,
            },
            "layout": layout,
            "machine": machine,
            "versions": package_versions(),
            "skipped": plan.skipped,
            "jobs": job_table(plan.jobs),
        },
        "medians": medians,
        "runs": runs,
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    write_page(args.out, render(results))
    log_stderr(
        f"bench: wrote {args.out} and {args.results} in {results['meta']['duration_s']:.0f} s"
    )
    failed_everywhere = [k for k, m in medians.items() if m.get("rounds", 0) == 0]
    for key in failed_everywhere:
        log_stderr(f"bench: every round of {key} failed: {medians[key]['failures'][:1]}")
    return 1 if plan.jobs and len(failed_everywhere) == len(plan.jobs) else 0


if __name__ == "__main__":
    sys.exit(main())
