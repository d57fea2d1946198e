"""What the serial hand-off of a scope's waiting room costs (research-wiki/RELIABILITY.md).

    python -m bench.handoff_probe

Only the head of a scope's FIFO asks for a permit; a grant promotes the next
head, which asks in turn. This probe measures, on the memory backend with an
upstream played in-process (``FakeTransport``: no HTTP, an ``asyncio.sleep``
per request), in this process's idle event loop:

- the hand-off: calls queued behind one permit against an instant upstream,
  minus the same calls run one after another (which never queue), per call;
- the permits kept busy: ``calls x latency / wall time`` for a burst of calls
  on a scope of 50 permits, with a 50 ms and a 2 ms upstream.

Prints one JSON object. Figures depend on the machine; the ratios do not much.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.testing import Delay, FakeClock, FakeTransport, chat_completion, gateway_settings

__all__ = ["main"]

MESSAGES = [{"role": "user", "content": "hi"}]


def _client(permits: int, latency_s: float) -> ChatClient:
    """A chat client on the real clock whose upstream answers after ``latency_s``."""
    settings = gateway_settings(
        {"name": "a", "max_concurrency": permits, "timeout_s": 60.0}, poll_interval_s=0.5
    )
    transport = FakeTransport(
        clock=FakeClock(), sleep=asyncio.sleep, default=Delay(latency_s, chat_completion())
    )
    return ChatClient(settings, backend=MemoryBackend(), transport=transport, rng=random.Random(1))


async def _burst(client: ChatClient, calls: int) -> float:
    """Wall seconds for ``calls`` calls submitted at once."""
    started = time.perf_counter()
    await asyncio.gather(*(client.complete(MESSAGES) for _ in range(calls)))
    return time.perf_counter() - started


async def _one_by_one(client: ChatClient, calls: int) -> float:
    """Wall seconds for ``calls`` calls run one after another (none ever waits)."""
    started = time.perf_counter()
    for _ in range(calls):
        await client.complete(MESSAGES)
    return time.perf_counter() - started


async def _probe() -> dict[str, Any]:
    calls = 2000
    async with _client(1, 0.0) as client:
        await _one_by_one(client, 200)  # warm up
        alone = await _one_by_one(client, calls)
        queued = await _burst(client, calls)
    busy: dict[str, float] = {}
    for latency_ms in (50, 2):
        async with _client(50, latency_ms / 1000) as client:
            await _burst(client, 200)  # warm up
            n = 5000 if latency_ms == 2 else 1000
            wall = await _burst(client, n)
        busy[f"{latency_ms}ms"] = round(n * latency_ms / 1000 / wall, 1)
    return {
        "handoff_us_per_call": round((queued - alone) / calls * 1e6, 1),
        "call_alone_us": round(alone / calls * 1e6, 1),
        "busy_permits_of_50": busy,
    }


def main() -> int:
    """Run the probe and print its figures."""
    print(json.dumps(asyncio.run(_probe())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
