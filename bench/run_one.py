"""One measured run of one configuration, in a fresh process; prints one JSON object.

    python -m bench.run_one CONFIG --scenario chat --n 2000 --concurrency 64 --sim-url URL

The client is built and warmed up first (pools filled, code paths hot, start-up
garbage collected), then
the measured loop runs between two ``getrusage(RUSAGE_SELF)`` readings: the
CPU figure is this process's user + system time for exactly the measured
calls. Off-machine connections are refused by an audit hook, so a library
that phones home fails loudly instead of hanging the run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import resource
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench.clients import CONFIGS, Client, Target
from bench.redis_counts import RedisCounter

__all__ = ["main", "percentile"]

SCENARIOS = ("chat", "loop", "stream", "scale", "embed", "storm")
_LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost", None})
_SCALE_LIMIT = 100
"""The scale scenario's concurrency bound: PolyGateway's max_concurrency, raw clients' semaphore."""
_EMBED_CONCURRENCY = 8
"""Embedding batches in flight: PolyGateway's max_concurrency, raw clients' semaphore."""
_ROUND_TRIP_SAMPLE = 50
"""Calls, one at a time after the measured loop, whose Redis round trips MONITOR counts."""


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def _cpu_s() -> float:
    """User + system CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _status_mib() -> dict[str, float]:
    """Current (VmRSS) and peak (VmHWM) resident memory in MiB, from /proc/self/status."""
    out: dict[str, float] = {}
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) / 1024
    except OSError:
        # Not Linux: fall back to ru_maxrss (KiB on Linux, bytes on macOS) for both.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out = {"VmRSS": peak, "VmHWM": peak}
    return out


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark so VmHWM covers the measured loop only (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _refuse_off_machine(event: str, args: tuple[Any, ...]) -> None:
    """Audit hook: no connection and no name lookup leaves 127.0.0.1."""
    if event == "socket.connect":
        address = args[1]
        if isinstance(address, tuple) and address[0] not in _LOOPBACK:
            raise PermissionError(f"benchmark: off-machine connection refused: {address[:2]!r}")
    elif event == "socket.getaddrinfo":
        host = args[0].decode() if isinstance(args[0], bytes) else args[0]
        if host not in _LOOPBACK:
            raise PermissionError(f"benchmark: off-machine name lookup refused: {host!r}")


async def _run_calls(
    op: Callable[[], Awaitable[None]], n: int, concurrency: int
) -> tuple[list[float], list[str]]:
    """Run ``op`` ``n`` times with ``concurrency`` workers; latencies and error descriptions."""
    latencies: list[float] = []
    errors: list[str] = []
    todo = iter(range(n))
    perf = time.perf_counter

    async def worker() -> None:
        # One shared iterator: workers take the next call as soon as they are free.
        for _ in todo:
            t0 = perf()
            try:
                await op()
            except Exception as exc:  # a failed call is a result here, not a crash
                errors.append(f"{type(exc).__name__}: {str(exc)[:160]}")
                continue
            latencies.append(perf() - t0)

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, n)))))
    return latencies, errors


async def _run_all_at_once(
    op: Callable[[], Awaitable[None]], n: int, bound: int | None
) -> tuple[list[float], list[str]]:
    """Submit ``n`` calls at once (raw clients behind a semaphore of ``bound``)."""
    latencies: list[float] = []
    errors: list[str] = []
    gate = asyncio.Semaphore(bound) if bound is not None else None
    perf = time.perf_counter

    async def one() -> None:
        t0 = perf()
        try:
            if gate is None:
                await op()
            else:
                async with gate:
                    await op()
        except Exception as exc:  # a failed call is a result here, not a crash
            errors.append(f"{type(exc).__name__}: {str(exc)[:160]}")
            return
        latencies.append(perf() - t0)

    await asyncio.gather(*(one() for _ in range(n)))
    return latencies, errors


def _summary(latencies: list[float], errors: list[str]) -> dict[str, Any]:
    """Latency percentiles and the errors seen."""
    kinds: dict[str, int] = {}
    for e in errors:
        kinds[e] = kinds.get(e, 0) + 1
    return {
        "ok": len(latencies),
        "errors": len(errors),
        "error_kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])[:5]),
        "p50_ms": percentile(latencies, 50) * 1000,
        "p99_ms": percentile(latencies, 99) * 1000,
    }


async def _measure(client: Client, args: argparse.Namespace, target: Target) -> dict[str, Any]:
    """Warm up, then measure the scenario; returns the figures."""
    n, concurrency, scenario = args.n, args.concurrency, args.scenario
    counter = None
    if getattr(client, "backend", "") == "redis" and target.redis_url is not None:
        # Without a URL, ``client.start`` refuses the configuration with the reason.
        counter = RedisCounter(target.redis_url)
    if counter is not None:
        counter.flush()
    await client.start(target)
    out: dict[str, Any] = {}
    try:
        bound = None if client.governed else _SCALE_LIMIT
        texts: list[str] = []
        if scenario in ("chat", "loop"):
            warm = max(concurrency, min(200, n // 10))
            await _run_calls(client.chat, warm, concurrency)
        elif scenario == "stream":

            async def warm_stream() -> None:
                await client.stream(time.perf_counter())

            await _run_calls(warm_stream, max(concurrency, min(50, n // 10)), concurrency)
        elif scenario == "scale":
            await _run_all_at_once(client.chat, max(_SCALE_LIMIT, min(1000, n // 10)), bound)
        elif scenario == "embed":
            texts = [f"short text number {i} to embed" for i in range(n)]
            await client.embed(texts[: min(n, 16 * target.batch_size)], _EMBED_CONCURRENCY)
        # The storm has no warm-up: a warm-up would already pace or cool down its sources.
        # Every configuration starts its measured loop with the start-up garbage collected:
        # otherwise whichever library made more objects at import and warm-up pays for the
        # process's first full collection inside the window (~16 ms, 16 us a call over 1,000),
        # a start-up cost billed as a per-call one. Collections the calls themselves cause
        # still land in the window.
        gc.collect()
        if counter is not None:
            counter.reset()
        _reset_peak_rss()
        ttfts: list[float] = []
        chunks = 0
        vectors = 0
        cpu0, t0 = _cpu_s(), time.perf_counter()
        if scenario in ("chat", "loop"):
            latencies, errors = await _run_calls(client.chat, n, concurrency)
        elif scenario == "stream":

            async def one_stream() -> None:
                nonlocal chunks
                ttft, count = await client.stream(time.perf_counter())
                ttfts.append(ttft)
                chunks += count

            latencies, errors = await _run_calls(one_stream, n, concurrency)
        elif scenario == "scale":
            latencies, errors = await _run_all_at_once(client.chat, n, bound)
        elif scenario == "embed":
            vectors = await client.embed(texts, _EMBED_CONCURRENCY)
            latencies, errors = [time.perf_counter() - t0], []
        else:  # storm
            latencies, errors = await _run_all_at_once(client.chat, n, None)
        cpu1, t1 = _cpu_s(), time.perf_counter()
        memory = _status_mib()
        cpu, wall = cpu1 - cpu0, t1 - t0
        out.update(
            cpu_s=cpu,
            wall_s=wall,
            cpu_us_per_op=cpu / n * 1e6,
            ops_per_s=n / wall if wall > 0 else float("nan"),
            rss_mib=memory["VmRSS"],
            peak_rss_mib=memory["VmHWM"],
            **_summary(latencies, errors),
        )
        if scenario == "stream":
            good = [t for t in ttfts if t >= 0]
            out.update(
                chunks=chunks,
                chunks_per_stream=chunks / max(1, len(ttfts)),
                cpu_us_per_chunk=cpu / max(1, chunks) * 1e6,
                ttft_p50_ms=percentile(good, 50) * 1000,
                ttft_p99_ms=percentile(good, 99) * 1000,
            )
        if scenario == "embed":
            out.update(
                vectors=vectors,
                texts_per_s=n / wall if wall > 0 else float("nan"),
                cpu_us_per_text=cpu / n * 1e6,
            )
        if counter is not None:
            # Releases still in flight when the loop ended are counted too.
            await asyncio.sleep(0.2)
            commands = counter.read()
            out.update(
                redis_commands=commands,
                redis_commands_per_call=sum(commands.values()) / n,
                redis_script_calls_per_call=counter.script_calls(commands) / n,
            )
            if scenario in ("chat", "loop"):
                out.update(await counter.round_trips(client.chat, min(n, _ROUND_TRIP_SAMPLE)))
    finally:
        await client.aclose()
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench.run_one``."""
    parser = argparse.ArgumentParser(prog="python -m bench.run_one")
    parser.add_argument("config", choices=sorted(CONFIGS))
    parser.add_argument("--scenario", choices=SCENARIOS, default="chat")
    parser.add_argument("--n", type=int, default=2000, help="calls, streams or texts")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--sim-url", required=True)
    parser.add_argument("--sources", default="a,b", help="simulator sources, comma-separated")
    parser.add_argument("--max-concurrency", type=int, default=64, help="per PolyGateway source")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--cpu", type=int, default=None, help="pin this process to one CPU")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one measurement and print its JSON on the last line of stdout."""
    args = build_parser().parse_args(argv)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    sys.addaudithook(_refuse_off_machine)
    target = Target(
        sim_url=args.sim_url.rstrip("/"),
        sources=tuple(s for s in args.sources.split(",") if s),
        scenario=args.scenario,
        max_concurrency=args.max_concurrency,
        redis_url=args.redis_url,
    )
    client = CONFIGS[args.config]()
    result = asyncio.run(_measure(client, args, target))
    result.update(
        config=args.config,
        scenario=args.scenario,
        n=args.n,
        concurrency=args.concurrency,
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
