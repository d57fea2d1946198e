"""A random walk of arrivals, releases and cancellations through the loop with priority classes.

Shared by the memory backend's property test (``tests/unit/test_priority_reserved.py``)
and the Redis backend's (``tests/integration/test_priority_fleet.py``): after every
step, the permits each class counts as in use equal its attempts in flight, never
negative, within the scope's limit, and what the backend holds agrees; at the end
everything is back to zero.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

from hypothesis import strategies as st

from polygateway.backends.base import Backend
from polygateway.config import SourceConfig
from polygateway.middleware.policy import LoopPolicy
from polygateway.middleware.retry import RetryMW
from polygateway.middleware.waiting import room_for
from polygateway.testing import FakeClock, FakeTimers, TransientError

SCOPE = "chat"
CLASSES = ("a", "b", "c")
LIMIT = 3

STEP = st.one_of(
    st.tuples(st.just("arrive"), st.sampled_from(CLASSES), st.sampled_from(("x", "y"))),
    st.tuples(st.just("release"), st.integers(0, 40), st.booleans()),
    st.tuples(st.just("cancel"), st.integers(0, 40), st.just(False)),
)


def _loop(clock: FakeClock, timers: FakeTimers, backend: Backend) -> RetryMW:
    return RetryMW(
        scope=SCOPE,
        sources=(
            SourceConfig(
                name="s",
                protocol="openai",
                base_url="http://upstream.test/v1",
                max_concurrency=LIMIT,
            ),
        ),
        policy=LoopPolicy(poll_interval_s=1.0, stall_window_s=3600.0),
        backend=backend,
        now=clock,
        sleep=timers.sleep,
        rng=random.Random(3),
        priority_classes={"a": 3.0, "b": 1.0, "c": 0.5},
        default_priority_class="a",
        reserved_permits={"b": 1, "c": 1},
    )


async def walk(
    steps: list[tuple[Any, ...]],
    clock: FakeClock,
    backend: Backend,
    settle: Callable[[], Awaitable[None]],
    leases_held: Callable[[Backend], Awaitable[int]],
) -> None:
    """Run ``steps``; ``settle`` lets the loop (and the backend) catch up after each.

    ``leases_held``: the permits the backend counts as held by calls (a
    fleet's hand-off placeholders are not calls).
    """
    timers = FakeTimers(clock)
    mw = _loop(clock, timers, backend)
    room = room_for(backend, SCOPE)
    running: dict[int, tuple[str, asyncio.Future[bool]]] = {}
    tasks: list[asyncio.Task[Any]] = []

    def attempt_for(index: int, klass: str) -> Any:
        async def attempt(source: Any, ctx: Any) -> str:
            done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            running[index] = (klass, done)
            try:
                if not await done:
                    raise TransientError("x", status_code=503)
            finally:
                del running[index]
            return "ok"

        return attempt

    async def check() -> None:
        await settle()
        in_flight = dict.fromkeys(CLASSES, 0)
        for klass, _ in running.values():
            in_flight[klass] += 1
        counts = {k: u for k, (_, u) in room.by_class().items()}
        assert min(counts.values()) >= 0
        assert counts == in_flight
        assert sum(counts.values()) <= LIMIT
        assert await leases_held(backend) == sum(counts.values())

    for step in steps:
        kind, what, how = step
        if kind == "arrive":
            index = len(tasks)
            tasks.append(
                asyncio.create_task(
                    mw.run(attempt_for(index, what), priority_class=what, tenant=how)
                )
            )
        elif kind == "release" and running:
            key = sorted(running)[what % len(running)]
            future = running[key][1]
            if not future.done():
                future.set_result(how)
        elif kind == "cancel" and tasks:
            tasks[what % len(tasks)].cancel()
        await check()
    # Let everything finish: every attempt succeeds from now on.
    for _ in range(200):
        for _, future in list(running.values()):
            if not future.done():
                future.set_result(True)
        await settle()
        if all(t.done() for t in tasks):
            break
        await timers.advance(1.0)  # back-offs after failures, heads' polls
    await asyncio.gather(*tasks, return_exceptions=True)
    await check()
    assert all(u == 0 and w == 0 for w, u in room.by_class().values())
    assert await leases_held(backend) == 0
