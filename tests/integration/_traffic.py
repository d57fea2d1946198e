"""Nonstop chat traffic for the Redis fault tests: callers calling in a loop, each outcome kept.

Shared by ``test_redis_faults.py`` (one client, a fault injected into the one
Redis) and ``test_redis_failover_soak.py`` (a client per process, Sentinel
failovers): each caller calls until ``stop``; a call that fails closed (one of
``fails_closed``) is recorded by its error's class name and the caller pauses
``requeue_s`` before the next, as an application would; any other error fails
``run``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from polygateway.chat import ChatClient
from polygateway.errors import GatewayError


@dataclass
class Outcome:
    """One call as its caller saw it."""

    started: float
    ended: float
    kind: str  # "ok" or the error's class name


@dataclass
class Traffic:
    """``callers`` callers per client, calling its scope in a loop until told to stop."""

    clients: list[ChatClient]
    callers: int
    requeue_s: float
    fails_closed: tuple[type[BaseException], ...] = (GatewayError,)
    call_bound_s: float | None = None
    """Each call's own bound (a hung call fails the run rather than stalling it)."""
    options: dict[str, Any] = field(default_factory=dict)
    """More keywords of every ``complete`` (``deadline_s``, say)."""
    outcomes: list[Outcome] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def _caller(self, chat: ChatClient, n: int) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            started = time.monotonic()
            try:
                async with asyncio.timeout(self.call_bound_s):
                    await chat.complete(
                        [{"role": "user", "content": f"c{n} #{i}"}], max_tokens=4, **self.options
                    )
                kind = "ok"
            except self.fails_closed as exc:
                kind = type(exc).__name__
            self.outcomes.append(Outcome(started, time.monotonic(), kind))
            if kind != "ok":
                await asyncio.sleep(self.requeue_s)

    async def run(self) -> None:
        """Run every caller until ``stop``; an error not in ``fails_closed`` fails here."""
        await asyncio.gather(
            *(
                self._caller(chat, p * self.callers + n)
                for p, chat in enumerate(self.clients)
                for n in range(self.callers)
            )
        )

    def first_ok(self, started_after: float) -> Outcome | None:
        """The first served call that started after ``started_after``."""
        return next(
            (o for o in self.outcomes if o.kind == "ok" and o.started >= started_after), None
        )

    def between(self, start: float, end: float) -> Counter[str]:
        """Calls that ended in ``[start, end)``, by kind."""
        return Counter(o.kind for o in self.outcomes if start <= o.ended < end)
