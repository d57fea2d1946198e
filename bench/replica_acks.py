"""What ``redis_replica_acks = 1`` costs an acquire (research-wiki/BENCHMARKS.md, its own section).

    python -m bench.replica_acks [--pairs 2000] [--rounds 5] [--write research-wiki/BENCHMARKS.md]

Starts a private primary and one replica (``redis-server`` on free loopback
ports, no persistence), then measures, in this process, acquire + release
pairs on one source through two ``RedisBackend`` objects on the same
primary: one with the opt-in off (no ``WAIT`` is sent) and one with
``replica_acks=1`` (``EVALSHA`` + ``WAIT 1`` written together). The two are
interleaved round by round, the order alternating, and every figure is the
median over rounds:

- one caller: wall time of one pair (p50, p99 of the round), client CPU per pair;
- 16 callers at once on a source of 16 permits: pairs per second, which shows
  that each ``WAIT`` holds the process's one connection for a replica round
  trip, so acquires queue behind one another.

The replica is on the same machine: its round trip is loopback's plus the
replica's turn, so across a network every ``WAIT`` costs that network's
round trip more. Prints one JSON object; ``--write PAGE`` also puts the
figures in PAGE's ``replica-acks`` section (``bench.report.replace_section``),
which ``make bench`` keeps as it is.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

import polygateway
from bench.report import X, replace_section
from polygateway.backends.base import AttemptOutcome, SourceSpec
from polygateway.backends.redis import RedisBackend

__all__ = ["main"]

SCOPE = "bench"
SUCCESS = AttemptOutcome("success")
CONCURRENCY = 16


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def _servers(directory: Path) -> Iterator[int]:
    """A primary and a replica that acknowledges it; yields the primary's port."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (`make redis-server`)")
    ports = (_free_port(), _free_port())
    processes = []
    for index, port in enumerate(ports):
        argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        argv += ["--appendonly", "no", "--dir", str(directory), "--repl-diskless-sync-delay", "0"]
        if index:
            argv += ["--replicaof", "127.0.0.1", str(ports[0])]
        processes.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL))
    try:
        primary = redis.Redis(port=ports[0], socket_timeout=5.0)
        deadline = time.monotonic() + 20
        while True:  # acknowledging: its offset heard (a WAIT may count it at 0 before)
            try:
                primary.set("replica-check", 1)
                acknowledged = primary.wait(1, 100) == 1
                heard = primary.info("replication").get("slave0", {}).get("offset")
                if acknowledged and heard:
                    break
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the replica did not come up within 20 s")
            time.sleep(0.05)
        primary.delete("replica-check")
        primary.close()
        yield ports[0]
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=10)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _one_caller(backend: RedisBackend, spec: SourceSpec, pairs: int) -> dict[str, float]:
    """``pairs`` acquire + release pairs one after another: latency per pair, CPU per pair."""
    took: list[float] = []
    cpu = _cpu_s()
    for _ in range(pairs):
        started = time.perf_counter()
        lease = (await backend.acquire(SCOPE, [spec], ttl_s=60.0)).lease
        assert lease is not None
        await backend.release(lease, SUCCESS)
        took.append(time.perf_counter() - started)
    cpu = _cpu_s() - cpu
    took.sort()
    return {
        "p50_us": took[len(took) // 2] * 1e6,
        "p99_us": took[min(len(took) - 1, int(len(took) * 0.99))] * 1e6,
        "cpu_us": cpu / pairs * 1e6,
    }


async def _many_callers(backend: RedisBackend, spec: SourceSpec, pairs: int) -> float:
    """``pairs`` pairs shared by ``CONCURRENCY`` callers at once: pairs per second."""
    per_caller = pairs // CONCURRENCY

    async def caller() -> None:
        for _ in range(per_caller):
            lease = (await backend.acquire(SCOPE, [spec], ttl_s=60.0)).lease
            assert lease is not None
            await backend.release(lease, SUCCESS)

    started = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(CONCURRENCY)))
    return per_caller * CONCURRENCY / (time.perf_counter() - started)


async def _probe(port: int, pairs: int, rounds: int) -> dict[str, Any]:
    url = f"redis://127.0.0.1:{port}/0"
    spec = SourceSpec(name="a", max_concurrency=CONCURRENCY)
    backends = {
        "off": RedisBackend(url, socket_timeout_s=1.0),
        "acks=1": RedisBackend(url, socket_timeout_s=1.0, replica_acks=1),
    }
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in backends}
    try:
        for backend in backends.values():  # warm up: connections, scripts, caches
            await _one_caller(backend, spec, 200)
        for number in range(rounds):
            order = list(backends) if number % 2 == 0 else list(reversed(backends))
            for name in order:
                row = await _one_caller(backends[name], spec, pairs)
                row["pairs_per_s_c16"] = await _many_callers(backends[name], spec, pairs)
                for key, value in row.items():
                    figures[name].setdefault(key, []).append(value)
    finally:
        for backend in backends.values():
            await backend.aclose()
    return {
        "pairs_per_round": pairs,
        "rounds": rounds,
        "median": {
            name: {key: round(statistics.median(values), 1) for key, values in rows.items()}
            for name, rows in figures.items()
        },
    }


_ROWS = (
    ("p50_us", "acquire + release, one caller: p50 (µs)"),
    ("p99_us", "acquire + release, one caller: p99 (µs)"),
    ("cpu_us", "client CPU per pair, one caller (µs)"),
    ("pairs_per_s_c16", f"pairs per second, {CONCURRENCY} callers at once"),
)


def section(result: dict[str, Any], command: str) -> str:
    """The page's ``replica-acks`` section for ``result``."""
    off, on = result["median"]["off"], result["median"]["acks=1"]
    lines = [
        "<!-- begin:replica-acks (written by `python -m bench.replica_acks --write`,"
        " bench/replica_acks.py; `make bench` keeps it as it is) -->",
        "## Redis: what `redis_replica_acks = 1` costs an acquire",
        "",
        f"- **Date:** {result['date']} (UTC); redis-server {result['redis_server']};"
        f" PolyGateway imported from `{result['polygateway']}`.",
        f"- **Command:** `{command}`",
        "- **Setup:** a private primary and one replica on this machine (loopback, no"
        " persistence); two `RedisBackend`s on the primary, one source of"
        f" {CONCURRENCY} permits: the default (no `WAIT` sent) and `replica_acks=1` (each"
        " ACQUIRE written with `WAIT 1 500` behind it, one round trip). The two are"
        f" interleaved over {result['rounds']} rounds of {result['pairs_per_round']} pairs,"
        " the order alternating; medians over rounds. Releases are written behind.",
        "",
        "| measure | off (default) | `redis_replica_acks = 1` | ratio |",
        "|---|---:|---:|---:|",
    ]
    for key, label in _ROWS:
        ratio = on[key] / off[key] if off[key] else float("nan")
        lines.append(f"| {label} | {off[key]:,.1f} | {on[key]:,.1f} | {ratio:.2f}{X} |")
    lines += [
        "",
        "With the opt-in each acquire waits for the replica to acknowledge it, and",
        "`WAIT` holds the process's one connection meanwhile: commands queue behind",
        "it, so acquires of one process no longer overlap (the 16-caller row). The",
        "script's reply comes back at once and the `WAIT`'s after the replica, so",
        "the client reads twice per acquire (the CPU row). Here",
        "the replica is a loopback hop away; across a network add that network's",
        "round trip to every acquire, and divide a process's acquires per second",
        'accordingly. research-wiki/guides/redis-fleet.md ("Replica lag") says what',
        "it buys.",
        "<!-- end:replica-acks -->",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Start the servers, run the probe, print its figures (and write its section)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--write", type=Path, help="the page whose section to write")
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else argv
    path = os.environ.get("PYTHONPATH")
    command = " ".join(
        (*((f"PYTHONPATH={path}",) if path else ()), "python -m bench.replica_acks", *given)
    )
    with tempfile.TemporaryDirectory() as directory, _servers(Path(directory)) as port:
        result = asyncio.run(_probe(port, args.pairs, args.rounds))
    version = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, check=False
    ).stdout.split()[2]
    result = {
        "redis_server": version.removeprefix("v="),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "polygateway": str(Path(polygateway.__file__).parent),
        **result,
    }
    print(json.dumps(result))
    if args.write is not None:
        page = args.write.read_text(encoding="utf-8")
        args.write.write_text(replace_section(page, section(result, command)), "utf-8")
        print(f"wrote the replica-acks section of {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
