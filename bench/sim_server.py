"""The benchmark's upstream: one simulator process serving every source the scenarios need.

Run as ``python -m bench.sim_server --port 0``; it prints ``READY <url>`` on
stdout once it accepts connections and serves until SIGTERM. It runs in its
own process (pinned to its own core by the harness) so its CPU is never
counted against a client.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from polygateway.simulator import PROFILES, FaultProfile, SimulatedUpstream

__all__ = ["SOURCES", "main"]

_ZERO = PROFILES["zero_latency"]

SOURCES: dict[str, FaultProfile] = {
    # Two instant, faultless sources: the chat, scale and embedding scenarios.
    "a": _ZERO,
    "b": _ZERO,
    # An instant source whose streams carry 50 content chunks.
    "s": FaultProfile(stream_chunks=50),
    # The 429 storm: a quarter of all answers are 429 with Retry-After: 1.
    "x": FaultProfile(rate_429=0.25, retry_after_s=1.0),
    "y": FaultProfile(rate_429=0.25, retry_after_s=1.0),
}
"""Source name -> profile; clients address them as ``{url}/{name}/v1``."""


async def _serve(port: int, seed: int) -> None:
    """Serve until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with SimulatedUpstream(SOURCES, port=port, seed=seed) as sim:
        print(f"READY {sim.url}", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m bench.sim_server``."""
    parser = argparse.ArgumentParser(prog="python -m bench.sim_server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.port, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
