"""Measure how evenly a contending fleet shares one scope: per-process served calls.

Not a test (pytest does not collect it): a measurement for
research-wiki/guides/redis-fleet.md. It starts its own ``redis-server`` on a
free loopback port and the simulated upstream in this process, then N
``_fleet_worker.py`` processes, each running ``concurrency`` callers for
``duration`` seconds against one source of ``permits`` permits, and prints
each process's served calls and the spread. The polygateway the workers run
is whichever ``import polygateway`` finds (set ``PYTHONPATH`` to measure
another tree)::

    python tests/integration/fleet_spread.py --processes 8 --permits 4 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_redis_fleet import Worker

from polygateway.simulator import FaultProfile, SimulatedUpstream


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def measure(args: argparse.Namespace) -> dict[str, object]:
    port = _free_port()
    workdir = Path(tempfile.mkdtemp(prefix="fleet-spread-"))
    server = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
        ],
        stdout=subprocess.DEVNULL,
    )
    workers: list[Worker] = []
    try:
        time.sleep(0.3)
        profile = FaultProfile(latency_s=args.latency, latency_jitter_s=args.latency / 5)
        async with SimulatedUpstream({"a": profile}) as sim:
            source = {
                "name": "a",
                "protocol": "openai",
                "base_url": sim.base_url("a"),
                "model": "sim",
                "api_key": "sk-spread-0123456789",
                "max_concurrency": args.permits,
            }
            settings = {
                "backend": "redis",
                "redis_url": f"redis://127.0.0.1:{port}",
                "poll_interval_s": args.poll,
                "stall_window_s": 3600.0,
                "scopes": {"fleet": {"kind": "chat", "sources": [source]}},
            }
            config = {"settings": settings, "scope": "fleet"}
            workers = list(
                await asyncio.gather(
                    *(Worker.start(config, workdir) for _ in range(args.processes))
                )
            )
            start_at = time.monotonic() + 1.0
            runs = await asyncio.gather(
                *(
                    w.records(
                        "run",
                        start_at=start_at,
                        duration_s=args.duration,
                        concurrency=args.concurrency,
                    )
                    for w in workers
                )
            )
            max_concurrent = sim.stats("a").max_concurrent
    finally:
        await asyncio.gather(*(w.stop() for w in workers))
        server.terminate()
        server.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    served = sorted(sum(r["ok"] for r in run) for run in runs)
    waits = sorted(r["ended"] - r["started"] for run in runs for r in run if r["ok"])
    mean = statistics.fmean(served)
    return {
        "processes": args.processes,
        "permits": args.permits,
        "served_per_process": served,
        "total": sum(served),
        "min_over_mean": round(served[0] / mean, 3),
        "max_over_mean": round(served[-1] / mean, 3),
        "call_p50_s": round(waits[len(waits) // 2], 3),
        "call_p99_s": round(waits[int(len(waits) * 0.99)], 3),
        "failed": sum(not r["ok"] for run in runs for r in run),
        "upstream_max_concurrent": max_concurrent,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--permits", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4, help="callers per process")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--poll", type=float, default=0.5, help="poll_interval_s")
    print(json.dumps(asyncio.run(measure(parser.parse_args()))))


if __name__ == "__main__":
    main()
