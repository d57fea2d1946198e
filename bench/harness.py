"""Plan the runs, interleave them over rounds, and reduce them to medians.

Every job is one fresh client process (``bench.run_one`` or
``bench.import_probe``). Round ``r`` runs every job once, in the plan's order
rotated by ``r`` places, so no configuration always runs first or last
(after a cold simulator, or while something else on the machine is busy).
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.clients import CONFIGS, missing_modules
from bench.machine import describe_machine
from bench.services import Services

__all__ = [
    "SCENARIO_CONFIGS",
    "Job",
    "Plan",
    "command_lines",
    "end_meta",
    "make_plan",
    "reduce_runs",
    "run_meta",
    "run_rounds",
    "source_revision",
]

SCENARIO_CONFIGS: dict[str, tuple[str, ...]] = {
    "chat": (
        "raw_httpx",
        "raw_aiohttp",
        "openai_sdk",
        "litellm_router",
        "pgw_memory_httpx",
        "pgw_memory_aiohttp",
        "pgw_redis_httpx",
        "pgw_redis_aiohttp",
    ),
    # PolyGateway over a transport that answers at once: what the governance loop itself costs.
    "loop": ("pgw_memory_instant", "pgw_redis_instant"),
    # The loop alone again, with each emitter: what telemetry costs a call.
    "telemetry": (
        "pgw_memory_instant",
        "pgw_instant_null",
        "pgw_instant_bare",
        "pgw_instant_logging",
        "pgw_instant_prometheus",
        "pgw_instant_otel_noop",
        "pgw_instant_otel_sdk",
    ),
    "stream": ("raw_httpx", "raw_aiohttp", "pgw_memory_httpx", "pgw_memory_aiohttp"),
    # aiohttp only: httpx's own per-call cost grows with open connections and would hide ours.
    "scale": ("raw_aiohttp", "pgw_memory_aiohttp"),
    "embed": ("raw_httpx", "raw_aiohttp", "pgw_memory_httpx", "pgw_memory_aiohttp"),
    "storm": (
        "raw_httpx",
        "openai_sdk",
        "litellm_router_default",
        "litellm_router",
        "pgw_memory_httpx",
    ),
}
"""Which configurations each scenario compares, in table order."""

IMPORT_MODULES = ("-", "polygateway", "polygateway.chat", "httpx", "aiohttp", "openai", "litellm")
"""Modules whose import cost is measured (``-`` is bare Python)."""

_RUN_AS = {"telemetry": "loop"}
"""Scenarios measured by another's code in ``bench.run_one`` (same calls, their own table)."""

_SCENARIO_SOURCES = {
    "chat": "a,b",
    "loop": "a,b",
    "telemetry": "a,b",
    "stream": "s",
    "scale": "a",
    "embed": "a",
    "storm": "x,y",
}
_SCENARIO_MAX_CONCURRENCY = {
    "chat": 64,
    "loop": 64,
    "telemetry": 64,
    "stream": 64,
    "scale": 100,
    "embed": 8,
    "storm": 64,
}


@dataclass(frozen=True, slots=True)
class Job:
    """One measurement: a configuration in a scenario at a size and a concurrency."""

    scenario: str
    config: str
    n: int = 0
    concurrency: int = 1

    @property
    def key(self) -> str:
        """A stable name for this job's results."""
        if self.scenario == "import":
            return f"import/{self.config}"
        return f"{self.scenario}/{self.config}/n{self.n}/c{self.concurrency}"

    def command(self, python: str, services: Services) -> list[str]:
        """The client process's command line."""
        if self.scenario == "import":
            return [python, "-m", "bench.import_probe", self.config]
        cmd = [
            python,
            "-m",
            "bench.run_one",
            self.config,
            "--scenario",
            _RUN_AS.get(self.scenario, self.scenario),
            "--n",
            str(self.n),
            "--concurrency",
            str(self.concurrency),
            "--sim-url",
            services.sim_url,
            "--sources",
            _SCENARIO_SOURCES[self.scenario],
            "--max-concurrency",
            str(_SCENARIO_MAX_CONCURRENCY[self.scenario]),
        ]
        if services.redis_url is not None:
            cmd += ["--redis-url", services.redis_url]
        if services.client_cpu is not None:
            cmd += ["--cpu", str(services.client_cpu)]
        return cmd


@dataclass(slots=True)
class Plan:
    """The jobs of a run, and what was left out with the reason."""

    jobs: list[Job] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Sizes:
    """How big each scenario is."""

    chat_n: int = 1000
    concurrencies: tuple[int, ...] = (1, 64)
    stream_n: int = 500
    stream_concurrency: int = 1
    scale_ns: tuple[int, ...] = (1000, 10000)
    embed_n: int = 100_000
    storm_n: int = 20


def make_plan(
    sizes: Sizes,
    scenarios: Iterable[str],
    configs: Iterable[str] | None,
    *,
    redis_missing: str | None,
) -> Plan:
    """Every job of the selected scenarios and configurations that this venv can run."""
    wanted = set(configs) if configs is not None else set(CONFIGS)
    plan = Plan()

    def usable(name: str) -> bool:
        if name not in wanted:
            return False
        missing = missing_modules(name)
        if missing:
            plan.skipped[name] = f"not installed in this venv: {', '.join(missing)}"
            return False
        if "redis" in name and redis_missing is not None:
            plan.skipped[name] = redis_missing
            return False
        return True

    for scenario in scenarios:
        if scenario == "import":
            plan.jobs += [Job("import", m) for m in IMPORT_MODULES if _importable(m)]
            plan.skipped.update(
                {f"import {m}": "not installed" for m in IMPORT_MODULES if not _importable(m)}
            )
            continue
        for name in SCENARIO_CONFIGS[scenario]:
            if not usable(name):
                continue
            if scenario in ("chat", "loop", "telemetry"):
                plan.jobs += [Job(scenario, name, sizes.chat_n, c) for c in sizes.concurrencies]
            elif scenario == "stream":
                plan.jobs.append(Job("stream", name, sizes.stream_n, sizes.stream_concurrency))
            elif scenario == "scale":
                plan.jobs += [Job("scale", name, n, n) for n in sizes.scale_ns]
            elif scenario == "embed":
                plan.jobs.append(Job("embed", name, sizes.embed_n, 8))
            elif scenario == "storm":
                plan.jobs.append(Job("storm", name, sizes.storm_n, sizes.storm_n))
    return plan


def _importable(module: str) -> bool:
    """Whether ``module`` (``-`` = nothing) can be imported here."""
    if module == "-":
        return True
    from importlib.util import find_spec

    return find_spec(module.partition(".")[0]) is not None


def run_job(job: Job, python: str, services: Services, timeout_s: float) -> dict[str, Any]:
    """Run one job's process; its JSON, or ``{"failed": ...}`` with the end of its stderr."""
    started = time.perf_counter()
    try:
        done = subprocess.run(
            job.command(python, services),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {timeout_s:g} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        return {"failed": f"exit {done.returncode}: {tail[-400:]}"}
    try:
        result: dict[str, Any] = json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"failed": f"no JSON on the last line: {lines[-1][:200]!r}"}
    result["process_s"] = time.perf_counter() - started
    errors = int(result.get("errors", 0))
    if errors and job.scenario != "storm":
        # Outside the storm every call must succeed: figures of failed calls are not a
        # measurement of the configuration, so the round is reported and left out.
        top = next(iter(result.get("error_kinds") or {}), "")
        result["failed"] = f"{errors} of {job.n} calls failed: {top[:200]}"
    return result


def run_rounds(
    jobs: Sequence[Job],
    rounds: int,
    python: str,
    services: Services,
    *,
    timeout_s: float = 900.0,
    log: Callable[[str], None] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Run every job once per round, rotating the order each round; results by job key."""
    out: dict[str, list[dict[str, Any]]] = {job.key: [] for job in jobs}
    total = rounds * len(jobs)
    done = 0
    for r in range(rounds):
        shift = r % len(jobs) if jobs else 0
        for job in [*jobs[shift:], *jobs[:shift]]:
            result = run_job(job, python, services, timeout_s)
            result["round"] = r
            out[job.key].append(result)
            done += 1
            if log is not None:
                what = result.get("failed") or _headline(result)
                log(f"[{done}/{total}] round {r + 1} {job.key}: {what}")
    return out


def source_revision(root: Path) -> str:
    """The commit measured, and whether ``src/`` differed from it (a developer's tree)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        # An exported tree (git archive) says what it is through the environment.
        return os.environ.get("BENCH_REVISION") or "unknown (not a git checkout)"
    return f"{head} with uncommitted changes in src/" if dirty else f"{head} (clean src/)"


def _headline(result: dict[str, Any]) -> str:
    """One short line about a result, for the progress log."""
    if "import_s" in result:
        return f"{result['import_s'] * 1000:.0f} ms, +{result['rss_over_bare_mib']:.1f} MiB"
    return (
        f"{result['cpu_us_per_op']:.0f} us CPU/op, {result['ops_per_s']:.0f}/s, "
        f"{result['errors']} errors"
    )


def reduce_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the numeric figures over rounds, spreads of the main one, errors summed."""
    good = [r for r in runs if "failed" not in r]
    out: dict[str, Any] = {
        "rounds": len(good),
        "failures": [r["failed"] for r in runs if "failed" in r],
    }
    if not good:
        return out
    keys = {k for r in good for k, v in r.items() if _number(v)}
    for key in sorted(keys):
        values = [float(r[key]) for r in good if _number(r.get(key))]
        out[key] = statistics.median(values)
    for key in ("cpu_us_per_op", "cpu_us_per_chunk", "import_s", "rss_over_bare_mib"):
        values = [float(r[key]) for r in good if _number(r.get(key))]
        if values:
            out[f"{key}_min"] = min(values)
            out[f"{key}_max"] = max(values)
    for key in ("errors", "ok"):
        if key in keys:
            out[f"{key}_total"] = sum(int(r[key]) for r in good)
    kinds: dict[str, int] = {}
    for r in good:
        for kind, count in (r.get("error_kinds") or {}).items():
            kinds[kind] = kinds.get(kind, 0) + count
    out["error_kinds"] = kinds
    if any("redis_commands" in r for r in good):
        out["redis_commands"] = good[-1].get("redis_commands", {})
    extras = sorted({m for r in good for m in r.get("extras_loaded", ())})
    if extras or any("extras_loaded" in r for r in good):
        out["extras_loaded"] = extras
    return out


def _number(value: object) -> bool:
    """A plain number (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def job_table(jobs: Sequence[Job]) -> list[dict[str, Any]]:
    """The plan as plain data, for the results file."""
    return [{**asdict(job), "key": job.key} for job in jobs]


def command_lines(
    module: str, target: str, argv: list[str], knobs: tuple[str, ...]
) -> tuple[str, str]:
    """(the command a person typed, the interpreter command it ran), for the page.

    Under make, the command is ``make <target>`` with the ``knobs`` set in the environment.
    """
    python = os.path.relpath(sys.executable)
    if python.startswith(".."):
        python = sys.executable
    inner = shlex.join([python, "-m", module, *argv])
    if "MAKELEVEL" in os.environ:
        knob_values = [f"{k}={os.environ[k]}" for k in knobs if os.environ.get(k)]
        return shlex.join([*knob_values, "make", target]), inner
    return inner, inner


def log_stderr(line: str) -> None:
    """Progress on stderr, so stdout stays clean."""
    print(line, file=sys.stderr, flush=True)


def run_meta(
    module: str, target: str, argv: list[str], knobs: tuple[str, ...], sizes: Any, note: str
) -> dict[str, Any]:
    """What a benchmark's page says of its run, taken as it starts; ``end_meta`` completes it.

    The command (``command_lines``), date, source revision, machine, sizes (a
    dataclass), the note, and the load average and clock at the start.
    """
    import datetime

    import polygateway

    command, inner = command_lines(module, target, argv, knobs)
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "command": command,
        "inner_command": inner,
        "revision": source_revision(Path(polygateway.__file__).resolve().parents[2]),
        "polygateway_path": str(Path(polygateway.__file__).resolve().parent),
        "machine": describe_machine(),
        "sizes": asdict(sizes),
        "note": note,
        "started": time.monotonic(),
        "load_average": {"before": os.getloadavg()[0]},
    }


def end_meta(meta: dict[str, Any]) -> None:
    """The run's duration and the load average at its end, into ``run_meta``'s record."""
    meta["duration_s"] = time.monotonic() - meta.pop("started")
    meta["load_average"]["after"] = os.getloadavg()[0]
