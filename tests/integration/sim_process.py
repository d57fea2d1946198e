"""The simulator in a process of its own, for the suites where the client's CPU is what counts.

In one process the simulator and the gateway share one core and one event
loop; the load and cancellation suites push thousands of calls, so the
upstream runs in a child process (the machine's other core) and is asked for
its record over a pipe. Run as a script it is that child::

    python sim_process.py '{"a": {"latency_s": 0.002}}' SEED

It prints ``PORT <n>`` once listening, then answers one JSON line per command
read on stdin: ``stats NAME``, ``reset``, ``quit``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import Any

START_DEADLINE_S = 20.0
"""Longest wait for the child to listen (an interpreter start plus imports)."""
REPLY_DEADLINE_S = 10.0
"""Longest wait for one answer on the pipe."""


class SimProcess:
    """A ``SimulatedUpstream`` in a child process; ``async with`` starts and stops it."""

    def __init__(self, sources: Mapping[str, Mapping[str, Any]], *, seed: int = 0) -> None:
        self._sources = {name: dict(profile) for name, profile in sources.items()}
        self._seed = seed
        self._proc: asyncio.subprocess.Process | None = None
        self.port = 0

    async def __aenter__(self) -> SimProcess:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(Path(__file__).resolve()),
            json.dumps(self._sources),
            str(self._seed),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            line = await self._line(START_DEADLINE_S)
            assert line.startswith("PORT "), f"the simulator process said {line!r}"
            self.port = int(line.split()[1])
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stop()

    def base_url(self, name: str) -> str:
        """A source's OpenAI base URL, as a client configures it."""
        return f"http://127.0.0.1:{self.port}/{name}/v1"

    async def _line(self, deadline_s: float) -> str:
        assert self._proc is not None
        assert self._proc.stdout is not None
        async with asyncio.timeout(deadline_s):
            raw = await self._proc.stdout.readline()
        if not raw:
            raise RuntimeError("the simulator process exited")
        return raw.decode().strip()

    async def _ask(self, command: str) -> Any:
        assert self._proc is not None
        assert self._proc.stdin is not None
        self._proc.stdin.write(command.encode() + b"\n")
        await self._proc.stdin.drain()
        return json.loads(await self._line(REPLY_DEADLINE_S))

    async def stats(self, name: str) -> dict[str, Any]:
        """What source ``name`` saw (``SourceStats`` as a dict; arrivals are left out)."""
        reply: dict[str, Any] = await self._ask(f"stats {name}")
        return reply

    async def reset(self) -> None:
        """Forget what every source has seen."""
        await self._ask("reset")

    async def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.returncode is None:
            try:
                assert proc.stdin is not None
                proc.stdin.write(b"quit\n")
                await proc.stdin.drain()
                async with asyncio.timeout(REPLY_DEADLINE_S):
                    await proc.wait()
            except (TimeoutError, ConnectionError):
                proc.kill()
                await proc.wait()


# -- the child ---------------------------------------------------------------------


async def _child(sources: dict[str, dict[str, Any]], seed: int) -> None:
    from polygateway.simulator import FaultProfile, SimulatedUpstream

    profiles = {name: FaultProfile(**kwargs) for name, kwargs in sources.items()}
    async with SimulatedUpstream(profiles, seed=seed) as sim:
        print(f"PORT {sim.port}", flush=True)
        while True:
            command = (await asyncio.to_thread(sys.stdin.readline)).split()
            if not command or command[0] == "quit":
                return
            if command[0] == "stats":
                stats = asdict(sim.stats(command[1]))
                stats.pop("arrivals")
                stats["by_status"] = {str(k): v for k, v in stats["by_status"].items()}
                print(json.dumps(stats), flush=True)
            elif command[0] == "reset":
                sim.reset_stats()
                print("{}", flush=True)
            else:
                print(json.dumps({"error": f"unknown command {command[0]!r}"}), flush=True)


if __name__ == "__main__":
    asyncio.run(_child(json.loads(sys.argv[1]), int(sys.argv[2])))
