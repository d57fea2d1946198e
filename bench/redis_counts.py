"""What a benchmark's redis-server executed, counted by the server itself."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["RedisCounter"]

_SETTLE_S = 0.05
"""Pause between the last counted call and MONITOR's end marker."""


class RedisCounter:
    """What the benchmark's redis-server executed, in its own words.

    ``INFO commandstats`` counts every command, including those a Lua script
    runs inside the server, so during the measured loop it gives script calls
    (``EVALSHA``) and total commands per call. Round trips are counted apart,
    on a sample of calls after the loop, with ``MONITOR`` (run by
    ``redis-cli`` in its own process): it tags commands run by scripts
    ``[0 lua]``, so every other line is one command a client sent.
    """

    _IGNORED = ("info", "config", "flushall", "ping", "hello", "client", "monitor")
    _SCRIPT_CALLS = frozenset({"evalsha", "eval", "evalsha_ro", "eval_ro", "fcall", "fcall_ro"})

    def __init__(self, url: str) -> None:
        import redis

        self._url = url
        self._client = redis.Redis.from_url(url)

    def flush(self) -> None:
        """Forget every key of earlier runs."""
        self._client.flushall()

    def reset(self) -> None:
        """Zero the server's command statistics."""
        self._client.config_resetstat()

    def read(self) -> dict[str, int]:
        """Calls per command since ``reset``, the benchmark's own commands left out."""
        stats = self._client.info("commandstats")
        out: dict[str, int] = {}
        for key, value in stats.items():
            command = key.removeprefix("cmdstat_")
            if command.partition("|")[0] not in self._IGNORED:
                out[command] = int(value["calls"])
        return out

    def cpu_s(self) -> float:
        """The server's CPU seconds so far (``INFO cpu``: user + system, all its threads)."""
        cpu = self._client.info("cpu")
        return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])

    def script_calls(self, commands: dict[str, int]) -> int:
        """How many of ``commands`` were script invocations (each one round trip)."""
        return sum(v for k, v in commands.items() if k in self._SCRIPT_CALLS)

    async def round_trips(self, op: Callable[[], Awaitable[None]], calls: int) -> dict[str, Any]:
        """Run ``op`` ``calls`` times, one at a time, under MONITOR; client commands per call."""
        import shutil

        cli = shutil.which("redis-cli")
        if cli is None:
            return {"redis_round_trips_note": "redis-cli not installed: no MONITOR sample"}
        monitor = await asyncio.create_subprocess_exec(
            cli,
            "-u",
            self._url,
            "monitor",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        assert monitor.stdout is not None
        lines: list[str] = []
        try:
            first = (await monitor.stdout.readline()).decode().strip()
            if first != "OK":
                return {"redis_round_trips_note": f"MONITOR did not start: {first!r}"}
            for _ in range(calls):
                await op()
            # A release is written behind, maybe by another process: let the last one land.
            await asyncio.sleep(_SETTLE_S)
            # MONITOR echoes asynchronously: a marker command says everything before it arrived.
            self._client.echo("bench-monitor-end")
            while True:
                line = (await monitor.stdout.readline()).decode()
                if not line or "bench-monitor-end" in line:
                    break
                lines.append(line)
        finally:
            monitor.terminate()
            await monitor.wait()
        sent: dict[str, int] = {}
        for line in lines:
            # 1700000000.123456 [0 127.0.0.1:40000] "evalsha" "..." ; script commands say [0 lua]
            _, _, rest = line.partition(" [")
            where, _, command = rest.partition("] ")
            if where.endswith(" lua"):
                continue
            name = command.split(" ", 1)[0].strip('"').lower()
            sent[name] = sent.get(name, 0) + 1
        return {
            "redis_round_trips_per_call": sum(sent.values()) / calls,
            "redis_round_trip_commands": sent,
            "redis_round_trip_sample": calls,
        }
