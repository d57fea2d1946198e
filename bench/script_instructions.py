"""Instructions Redis executes per governed call's two scripts, counted by callgrind.

    python -m bench.script_instructions [--pairs 1000] [--sources 200] [--against CHECKOUT]
                                        [--server redis-server]

``python -m bench.script_cost`` reads Redis's CPU time, which this shared
machine moves by a quarter from one second to the next. This tool counts the
instructions instead: the same server binary, scripts and calls execute the
same instructions whatever else the machine is doing, so two versions of the
scripts compare to a fraction of a percent in one run
(research-wiki/designs/script-cost.md, "Counting instructions").

Each case runs a private redis-server under ``valgrind --tool=callgrind``
(loopback, a temporary directory, no persistence, ``hz 1`` so that the
server's timer adds next to nothing while valgrind slows the run), with the
call layout of ``bench.script_cost`` (rpm and tpm set, a success released
with tokens reported, the wake-up tail, every source but the last full and
marked), twice: with ``--pairs / 5`` and with ``--pairs`` interleaved
ACQUIRE + RELEASE pairs after the same warm-up (and, for ``1 source, 50
leases live``, 50 ACQUIREs then their RELEASEs, as a busy source holds its
leases). The difference of the two
totals over the difference of the pairs is what one pair costs: starting and
stopping the server cancel out. ``INCR + DECR`` is the issue's baseline;
``its commands alone`` (1 source) is ``bench.script_cost``'s floor of the
semantics' calls, so the current row less it is what the scripts' own Lua
costs.

``--runs`` adds, at 1 source, the experiment of ``bench.script_cost``'s batch
table that serves several calls in one script run, reading the state once
(``state_once``), at each of its sizes: a pair's share of a run; and the real
scripts with their ACQUIREs and RELEASEs in runs of those sizes (``backends/redis/runs.py``).

``--against`` names another checkout (a directory with
``src/polygateway/backends/redis/scripts.py``, e.g. from ``git archive``)
whose scripts are counted beside the current ones; they must take the same
call layout (every reply is checked). ``--server`` counts another server
binary (a Valkey build, say).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench.script_cost import (
    _CALLS_ACQUIRE,
    _CALLS_RELEASE,
    BATCH,
    BATCH_SIZES,
    _check,
    _fill,
    _Scope,
    in_runs,
    state_once,
)
from bench.services import _free_port, _ping
from polygateway.backends.redis import scripts

__all__ = ["callgrind_total", "count", "main"]

_START_TIMEOUT_S = 60.0
"""A server under valgrind starts in a few seconds; a loaded machine takes longer."""


@dataclass(frozen=True, slots=True)
class Scripts:
    """One version of ACQUIRE and RELEASE, and where it came from."""

    label: str
    acquire: str
    release: str


CALLS = Scripts("its commands alone, no logic", _CALLS_ACQUIRE, _CALLS_RELEASE)
"""``bench.script_cost``'s floor of the semantics' calls: a 1-source grant's and its
success's commands, constant arguments, no Lua around them."""


def _load(checkout: Path) -> Scripts:
    """The scripts of another checkout (its ``scripts.py`` imports nothing of the package)."""
    path = checkout / "src" / "polygateway" / "backends" / "redis" / "scripts.py"
    spec = importlib.util.spec_from_file_location("_against_scripts", path)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"no scripts at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return Scripts(f"scripts of {checkout}", module.ACQUIRE, module.RELEASE)


def callgrind_total(text: str) -> int:
    """The instruction total of a callgrind output file (its ``summary:`` or ``totals:``)."""
    for line in text.splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise ValueError("no summary line in the callgrind output")


def _instructions(server: str, drive: Callable[[redis.Redis], None]) -> int:
    """Instructions a callgrind-run server executes from its start to its shutdown."""
    with tempfile.TemporaryDirectory(prefix="bench-cg-") as directory:
        out = Path(directory) / "callgrind.out"
        port = _free_port()
        command = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", server]
        command += ["--port", str(port), "--bind", "127.0.0.1", "--dir", directory]
        command += ["--save", "", "--appendonly", "no", "--hz", "1"]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=port)
        try:
            deadline = time.monotonic() + _START_TIMEOUT_S
            while not _ping(port):
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"{server} did not start under valgrind")
                time.sleep(0.1)  # edge: waiting for a real process
            drive(client)
            with contextlib.suppress(redis.ConnectionError):  # it closes as it stops
                client.shutdown(nosave=True)
            process.wait(timeout=_START_TIMEOUT_S)
        finally:
            client.close()
            if process.poll() is None:
                process.kill()
                process.wait()
        return callgrind_total(out.read_text())


def _baseline(pairs: int) -> Callable[[redis.Redis], None]:
    def drive(client: redis.Redis) -> None:
        for start in range(0, pairs, BATCH):
            pipe = client.pipeline(transaction=False)
            for _ in range(min(BATCH, pairs - start)):
                pipe.incr("bench-counter")
                pipe.decr("bench-counter")
            pipe.execute()

    return drive


def _pairs(
    version: Scripts, sources: int, pairs: int, real: Scripts | None = None, live: bool = False
) -> Callable[[redis.Redis], None]:
    """Pairs of ``version``, after a warm-up by ``real`` (the version itself by default):
    first sight of every source, the spec set stored, the full sources marked. Each
    ACQUIRE followed by its RELEASE, one lease live at a time; with ``live``, ``BATCH``
    ACQUIREs, then their RELEASEs, as a source at ``max_concurrency = BATCH`` holds its
    leases under load (``bench.script_cost``'s split run)."""

    def drive(client: redis.Redis) -> None:
        acquire = client.script_load(version.acquire)
        release = client.script_load(version.release)
        warm = real or version
        warm_acquire, warm_release = (
            client.script_load(warm.acquire),
            client.script_load(warm.release),
        )
        scope = _Scope("instructions", sources)
        _fill(client, scope, warm_acquire)
        for lease in ("warm-0", "warm-1"):
            _check([client.evalsha(warm_acquire, *scope.acquire(lease))], sources, "acquire")
            _check([client.evalsha(warm_release, *scope.release(lease))], None, "release")
        for start in range(0, pairs, BATCH):
            ids = [f"{i:012x}bench" for i in range(start, min(start + BATCH, pairs))]
            if live:
                pipe = client.pipeline(transaction=False)
                for lease in ids:
                    pipe.evalsha(acquire, *scope.acquire(lease))
                _check(pipe.execute(), sources, "acquire")
                pipe = client.pipeline(transaction=False)
                for lease in ids:
                    pipe.evalsha(release, *scope.release(lease))
                _check(pipe.execute(), None, "release")
                continue
            pipe = client.pipeline(transaction=False)
            for lease in ids:
                pipe.evalsha(acquire, *scope.acquire(lease))
                pipe.evalsha(release, *scope.release(lease))
            replies = pipe.execute()
            _check(replies[0::2], sources, "acquire")
            _check(replies[1::2], None, "release")

    return drive


def _runs(calls: int, pairs: int, *, real: bool = False) -> Callable[[redis.Redis], None]:
    """``pairs`` grants and successes at one source, ``calls`` a run, after the real scripts'
    warm-up: by the experiment ``bench.script_cost.state_once`` (the state read once a
    run, each call decided on it), or with ``real`` by the real scripts, ACQUIREs and
    RELEASEs in runs (``backends/redis/runs.py``)."""

    def drive(client: redis.Redis) -> None:
        warm_acquire, warm_release = (
            client.script_load(s) for s in (scripts.ACQUIRE, scripts.RELEASE)
        )
        if real:
            acquire, release = warm_acquire, warm_release
        else:
            acquire, release = (client.script_load(s) for s in state_once(calls))
        scope = _Scope("instructions", 1)
        for lease in ("warm-0", "warm-1"):
            _check([client.evalsha(warm_acquire, *scope.acquire(lease))], 1, "acquire")
            _check([client.evalsha(warm_release, *scope.release(lease))], None, "release")
        runs, per_pipe = max(1, pairs // calls), max(1, BATCH // calls)
        for start in range(0, runs, per_pipe):
            pipe = client.pipeline(transaction=False)
            for serial in range(start, min(start + per_pipe, runs)):
                if real:
                    ids = [f"{serial:08x}{i:04x}bench" for i in range(calls)]
                    pipe.evalsha(acquire, *in_runs(scope.acquire(ids[0]), ids, (2, 3, 4)))
                    args = in_runs(scope.release(ids[0]), ids, (2, 3, 4, 5, 6, 7))
                    pipe.evalsha(release, *args)
                else:
                    pipe.evalsha(acquire, *scope.acquire(f"{serial:012x}bench"))
                    pipe.evalsha(release, *scope.release(f"{serial:012x}bench"))
            replies = pipe.execute()
            for k in range(0, len(replies), 2):
                # A real run of several replies a list; the experiment one reply a run.
                several = real and calls > 1
                _check(replies[k] if several else [replies[k]], 1, "acquire")
                _check(replies[k + 1] if several else [replies[k + 1]], None, "release")

    return drive


def count(
    server: str, drive_for: Callable[[int], Callable[[redis.Redis], None]], pairs: int
) -> int:
    """Instructions per pair: two runs of different lengths, differenced."""
    short = max(1, pairs // 5)
    few = _instructions(server, drive_for(short))
    many = _instructions(server, drive_for(pairs))
    return round((many - few) / (pairs - short))


def measure(
    server: str, versions: Sequence[Scripts], *, pairs: int, sources: int, runs: bool = False
) -> list[dict[str, Any]]:
    baseline = count(server, _baseline, pairs)
    rows: list[dict[str, Any]] = [
        {"case": "INCR + DECR", "version": "baseline", "instructions": baseline}
    ]
    cases = [("1 source", 1), ("2 sources, 1st full", 2)]
    cases.append((f"{sources} sources, {sources - 1} full", sources))
    for case, n in cases:
        for version in versions:
            per_pair = count(server, functools.partial(_pairs, version, n), pairs)
            rows.append({"case": case, "version": version.label, "instructions": per_pair})
        if n == 1:
            # The commands alone, on the state the current scripts keep: what the logic
            # around them costs is the current row less this one.
            per_pair = count(server, lambda p: _pairs(CALLS, 1, p, real=versions[0]), pairs)
            rows.append({"case": case, "version": CALLS.label, "instructions": per_pair})
            for version in versions:
                per_pair = count(server, functools.partial(_pairs, version, 1, live=True), pairs)
                rows.append(
                    {
                        "case": f"1 source, {BATCH} leases live",
                        "version": version.label,
                        "instructions": per_pair,
                    }
                )
    if runs:
        # Several calls a script run (script-cost.md, "Several calls per script run"): a pair's
        # share of a run of the experiment, per size.
        for calls in BATCH_SIZES:
            per_pair = count(server, functools.partial(_runs, calls), pairs)
            label = f"state read once, {calls} call{'s' if calls > 1 else ''} a run"
            rows.append({"case": "1 source", "version": label, "instructions": per_pair})
        for calls in BATCH_SIZES[1:]:
            per_pair = count(server, functools.partial(_runs, calls, real=True), pairs)
            label = f"ACQUIRE and RELEASE in runs of {calls}"
            rows.append({"case": "1 source", "version": label, "instructions": per_pair})
    for row in rows:
        row["x INCR+DECR"] = row["instructions"] / baseline
    return rows


def render(rows: Sequence[dict[str, Any]], server: str, pairs: int) -> str:
    lines = [
        f"Instructions per ACQUIRE + RELEASE pair ({server} under callgrind, {pairs} pairs"
        " less a fifth as many)",
        "",
        "| case | scripts | instructions per pair | x INCR+DECR |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['version']} | {row['instructions']:,} |"
            f" {row['x INCR+DECR']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.script_instructions", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--pairs", type=int, default=1000, help="pairs of the longer run")
    parser.add_argument("--sources", type=int, default=200, help="sources of the walk case")
    parser.add_argument("--against", type=Path, help="another checkout's scripts, beside")
    parser.add_argument("--server", default="redis-server", help="the server binary")
    parser.add_argument(
        "--runs", action="store_true", help="also the experiment of several calls a script run"
    )
    args = parser.parse_args(argv)
    if args.pairs < 5 or args.sources < 3:
        parser.error("--pairs must be at least 5 and --sources at least 3")
    whole = 5 * max(BATCH_SIZES)
    if args.runs and args.pairs % whole:
        # Both runs of a count (``--pairs`` and a fifth of it) whole runs of every size.
        parser.error(f"with --runs, --pairs must be a multiple of {whole}")
    server = shutil.which(args.server)
    if server is None or shutil.which("valgrind") is None:
        print("needs valgrind and the server binary (apt-get install valgrind)", file=sys.stderr)
        return 2
    versions = [Scripts("current", scripts.ACQUIRE, scripts.RELEASE)]
    if args.against is not None:
        versions.append(_load(args.against))
    print(
        render(
            measure(server, versions, pairs=args.pairs, sources=args.sources, runs=args.runs),
            server,
            args.pairs,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
