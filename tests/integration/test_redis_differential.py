"""Differential test: the Redis Lua scripts make exactly the decisions of the Python policies.

The same random sequence of operations (acquires over random candidate lists
of up to eight of six sources, costs and TTLs; releases with random outcomes,
Retry-After and token usage; renewals; a source's limits changed between two
acquires, as a fleet mid-deploy or a reloaded config sends them, its
``max_concurrency`` raised or lowered; clock steps)
(and bursts of acquires asking together and of releases in a row, which Redis
takes in runs)
drives a ``MemoryBackend`` and a ``RedisBackend``, each
on its own ``FakeClock``, advanced together. After every step both must agree
on every decision (granted source, each rejection's source, reason and reopen
time, renew results) and on every observable field (progress age and the
snapshot of every source).
"""

from __future__ import annotations

import asyncio
import math
import uuid

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from polygateway.backends.base import (
    AcquireResult,
    AttemptOutcome,
    Lease,
    OutcomeKind,
    ScopeSnapshot,
    SourceSpec,
)
from polygateway.backends.memory import MemoryBackend
from polygateway.backends.redis import RedisBackend
from polygateway.testing import FakeClock

NAMES = ("s1", "s2", "s3", "s4", "s5", "s6")
KINDS: tuple[OutcomeKind, ...] = (
    "success",
    "success",
    "transient",
    "transient",
    "rate_limited",
    "source_misconfigured",
    "request_rejected",
    "cancelled",
)
TTLS = (0.5, 2.0, 7.0)
OPS = (
    "acquire",
    "acquire",
    "acquire",
    "burst",
    "release",
    "release",
    "releases",
    "renew",
    "respec",
    "advance",
)
STEPS = (0.0, 0.1, 0.5, 1.0, 2.0, 2.5, 7.0, 40.0, 400.0)


def _close(a: float | None, b: float | None) -> bool:
    """Equal up to 1e-6 (floats travel through text); ``None`` and ``inf`` only to themselves."""
    if a is None or b is None:
        return a is b
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)


@st.composite
def _spec(draw: st.DrawFn, name: str) -> SourceSpec:
    """A source's limits: small enough that every check refuses now and then."""
    cooldown = draw(st.sampled_from((0.5, 1.0, 3.0)))
    return SourceSpec(
        name=name,
        max_concurrency=draw(st.integers(1, 4)),
        rpm=draw(st.sampled_from((None, 6.0, 60.0, 150.0))),
        rpm_burst=draw(st.sampled_from((None, 1.0, 2.5))),
        tpm=draw(st.sampled_from((None, 600.0, 6000.0))),
        tpm_burst=draw(st.sampled_from((None, 50.0, 333.3))),
        breaker_failures=draw(st.integers(1, 3)),
        cooldown_s=cooldown,
        cooldown_max_s=cooldown * draw(st.sampled_from((1, 3, 8))),
    )


_OUTCOME = st.builds(
    AttemptOutcome,
    kind=st.sampled_from(KINDS),
    aimd_decrease=st.booleans(),
    retry_after_s=st.one_of(
        st.none(),
        st.sampled_from((0.0, -1.0, math.nan, math.inf, 1e9)),
        st.floats(0.0, 12.0),
    ),
    tokens_used=st.one_of(st.none(), st.integers(0, 400)),
)


def _assert_same_acquire(mem: AcquireResult, red: AcquireResult) -> None:
    mem_source = None if mem.lease is None else mem.lease.source
    red_source = None if red.lease is None else red.lease.source
    assert mem_source == red_source, (mem, red)
    if mem.lease is not None and red.lease is not None:
        assert (mem.lease.probe, mem.lease.tokens) == (red.lease.probe, red.lease.tokens)
    assert [(r.source, r.reason) for r in mem.rejections] == [
        (r.source, r.reason) for r in red.rejections
    ], (mem, red)
    for m, r in zip(mem.rejections, red.rejections, strict=True):
        assert _close(m.reopen_in_s, r.reopen_in_s), (m, r)


def _assert_same_snapshot(mem: ScopeSnapshot, red: ScopeSnapshot) -> None:
    assert _close(mem.progress_age_s, red.progress_age_s), (mem, red)
    assert [s.name for s in mem.sources] == [s.name for s in red.sources]
    for m, r in zip(mem.sources, red.sources, strict=True):
        exact = (m.in_flight, m.breaker, m.consecutive_failures, m.trips)
        assert exact == (r.in_flight, r.breaker, r.consecutive_failures, r.trips), (m, r)
        for field in ("limit", "reopen_in_s", "paced_for_s", "rpm_tokens", "tpm_tokens"):
            assert _close(getattr(m, field), getattr(r, field)), (field, m, r)


async def _drive(data: st.DataObject, url: str) -> None:
    """Run one random sequence through both backends, comparing after every step."""
    specs = {name: data.draw(_spec(name), label=f"spec {name}") for name in NAMES}
    mem_clock, red_clock = FakeClock(), FakeClock()
    memory = MemoryBackend(now=mem_clock)
    redis = RedisBackend(url, now=red_clock)
    scope = f"diff-{uuid.uuid4().hex}"
    leases: list[tuple[Lease, Lease]] = []
    try:
        for _ in range(data.draw(st.integers(5, 40), label="steps")):
            op = data.draw(st.sampled_from(OPS))
            if op == "acquire":
                names = data.draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=8))
                candidates = [specs[n] for n in names]
                cost = data.draw(st.sampled_from((0, 1, 40, 120, 900)))
                ttl = data.draw(st.sampled_from(TTLS))
                mem = await memory.acquire(scope, candidates, cost_tokens=cost, ttl_s=ttl)
                red = await redis.acquire(scope, candidates, cost_tokens=cost, ttl_s=ttl)
                _assert_same_acquire(mem, red)
                if mem.lease is not None and red.lease is not None:
                    leases.append((mem.lease, red.lease))
                for rejection in mem.rejections:
                    event(f"rejected: {rejection.reason}")
            elif op == "burst":
                # Calls asking together: on Redis the first goes alone and the others, which
                # arrive while it is in flight, in one ACQUIRE run (backends/redis/runs.py);
                # the memory backend takes them one by one, in the same order.
                names = data.draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=8))
                candidates = [specs[n] for n in names]
                calls = data.draw(
                    st.lists(
                        st.tuples(st.sampled_from((0, 1, 40, 120, 900)), st.sampled_from(TTLS)),
                        min_size=2,
                        max_size=20,
                    ),
                    label="burst",
                )
                mems = [
                    await memory.acquire(scope, candidates, cost_tokens=cost, ttl_s=ttl)
                    for cost, ttl in calls
                ]
                reds = await asyncio.gather(
                    *(
                        redis.acquire(scope, candidates, cost_tokens=cost, ttl_s=ttl)
                        for cost, ttl in calls
                    )
                )
                for mem, red in zip(mems, reds, strict=True):
                    _assert_same_acquire(mem, red)
                    if mem.lease is not None and red.lease is not None:
                        leases.append((mem.lease, red.lease))
                event(f"burst of {len(calls)}")
            elif op == "release" and leases:
                index = data.draw(st.integers(0, len(leases) - 1))
                outcome = data.draw(_OUTCOME)
                mem_lease, red_lease = leases.pop(index)
                await memory.release(mem_lease, outcome)
                await redis.release(red_lease, outcome)
            elif op == "releases" and leases:
                # Several releases in a row: on Redis those behind one in flight at their
                # source go in one RELEASE run, written before the next step's commands.
                for _ in range(data.draw(st.integers(1, min(len(leases), 12)), label="releases")):
                    index = data.draw(st.integers(0, len(leases) - 1))
                    outcome = data.draw(_OUTCOME)
                    mem_lease, red_lease = leases.pop(index)
                    await memory.release(mem_lease, outcome)
                    await redis.release(red_lease, outcome)
            elif op == "renew" and leases:
                mem_lease, red_lease = leases[data.draw(st.integers(0, len(leases) - 1))]
                assert await memory.renew(mem_lease) == await redis.renew(red_lease)
            elif op == "respec":
                # The next acquires carry other limits for one source; its state stays.
                name = data.draw(st.sampled_from(NAMES))
                old_max = specs[name].max_concurrency
                specs[name] = data.draw(_spec(name), label=f"new spec {name}")
                event("limits changed")
                if specs[name].max_concurrency < old_max:
                    # Both twins must lower the AIMD limit to the new max at its next acquire.
                    event("max_concurrency lowered")
            elif op == "advance":
                step = data.draw(st.one_of(st.sampled_from(STEPS), st.floats(0.0, 3.0)))
                mem_clock.advance(step)
                red_clock.advance(step)
            assert _close(await memory.progress_age_s(scope), await redis.progress_age_s(scope))
            _assert_same_snapshot(await memory.snapshot(scope), await redis.snapshot(scope))
    finally:
        await redis.aclose()
        await memory.aclose()


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_redis_scripts_decide_exactly_as_the_python_policies(
    redis_url: str, data: st.DataObject
) -> None:
    """Every decision and every snapshot field agree between MemoryBackend and RedisBackend."""
    asyncio.run(_drive(data, redis_url))
