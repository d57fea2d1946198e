"""MemoryBackend specifics the contract suite cannot see: atomicity, default clock, housekeeping."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from polygateway.backends.base import AttemptOutcome, Backend, OutcomeKind, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.middleware.waiting import room_for
from polygateway.testing import FakeClock

R = TypeVar("R")
SPEC = SourceSpec(name="a", max_concurrency=5)


def _run_without_suspending(coro: Coroutine[Any, Any, R]) -> R:
    """Drive a coroutine one step; fail if it ever yields to the event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        result: R = done.value
        return result
    coro.close()
    raise AssertionError("the operation suspended: it is not atomic")


def test_every_operation_completes_without_yielding() -> None:
    """No await inside any operation, so no other task can interleave with one (atomicity)."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    result = _run_without_suspending(backend.acquire("s", [SPEC], ttl_s=10))
    assert result.lease is not None
    assert _run_without_suspending(backend.renew(result.lease)) is True
    _run_without_suspending(backend.release(result.lease, AttemptOutcome("success")))
    assert _run_without_suspending(backend.progress_age_s("s")) == 0.0
    assert _run_without_suspending(backend.snapshot("s")).in_flight == 0
    _run_without_suspending(backend.aclose())


async def test_concurrent_acquires_never_overshoot() -> None:
    """100 tasks racing for 5 permits get exactly 5."""
    backend = MemoryBackend(now=FakeClock())
    results = await asyncio.gather(*(backend.acquire("s", [SPEC], ttl_s=10) for _ in range(100)))
    assert sum(r.lease is not None for r in results) == 5


async def test_default_clock_is_monotonic_time() -> None:
    """Without ``now`` the backend runs on the real monotonic clock."""
    backend = MemoryBackend()
    lease = (await backend.acquire("s", [SPEC], ttl_s=60)).lease
    assert lease is not None
    await backend.release(lease, AttemptOutcome("success"))
    age = await backend.progress_age_s("s")
    assert 0.0 <= age < 5.0


def test_is_a_backend() -> None:
    """MemoryBackend satisfies the runtime-checkable protocol."""
    backend: Backend = MemoryBackend()
    assert isinstance(backend, Backend)


async def test_waiting_room_is_lazy_and_one_per_scope() -> None:
    """Rooms exist only once asked for; a release in a scope without a room is fine."""
    backend = MemoryBackend(now=FakeClock())
    lease = (await backend.acquire("s", [SPEC], ttl_s=10)).lease
    assert lease is not None
    await backend.release(lease, AttemptOutcome("success"))
    room = room_for(backend, "s")
    assert room_for(backend, "s") is room
    assert len(room) == 0


async def test_release_notifies_only_when_a_permit_is_freed() -> None:
    """A release of an expired lease frees nothing, so it wakes nobody."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    room = room_for(backend, "s")
    waiter = room.enter()
    lease = (await backend.acquire("s", [SPEC], ttl_s=1)).lease
    assert lease is not None
    clock.advance(2)
    await backend.release(lease, AttemptOutcome("success"))
    assert room.wakeups == 0
    live = (await backend.acquire("s", [SPEC], ttl_s=1)).lease
    assert live is not None
    await backend.release(live, AttemptOutcome("cancelled"))
    assert room.wakeups == 1
    room.leave(waiter)


async def test_a_changed_spec_takes_effect_on_the_next_acquire() -> None:
    """Limits come with every acquire; a lowered ``max_concurrency`` caps at once."""
    backend = MemoryBackend(now=FakeClock())
    wide = SourceSpec(name="a", max_concurrency=3)
    assert (await backend.acquire("s", [wide], ttl_s=10)).lease is not None
    narrow = SourceSpec(name="a", max_concurrency=1)
    assert (await backend.acquire("s", [narrow], ttl_s=10)).lease is None
    # The lowered max brought the AIMD limit down to 1: raised again, it is grown into.
    assert (await backend.acquire("s", [wide], ttl_s=10)).lease is None


async def test_a_rate_limit_added_later_starts_with_a_full_bucket() -> None:
    """A source first seen without rpm, then given one, gets a full bucket at that moment."""
    backend = MemoryBackend(now=FakeClock())
    assert (await backend.acquire("s", [SPEC], ttl_s=10)).lease is not None
    limited = SourceSpec(name="a", max_concurrency=5, rpm=60, rpm_burst=2)
    grants = [(await backend.acquire("s", [limited], ttl_s=10)).lease for _ in range(3)]
    assert [g is not None for g in grants] == [True, True, False]


async def test_snapshot_lists_sources_in_order_of_first_sight() -> None:
    """Sources appear in the order acquire first met them."""
    backend = MemoryBackend(now=FakeClock())
    names = ["z", "a", "m"]
    for name in names:
        await backend.acquire("s", [SourceSpec(name=name, max_concurrency=1)], ttl_s=10)
    snap = await backend.snapshot("s")
    assert [s.name for s in snap.sources] == names
    assert snap.progress_age_s == math.inf


def test_repr_names_scopes_only() -> None:
    """The repr is short and holds no state dump."""
    assert repr(MemoryBackend()) == "MemoryBackend(scopes=[])"


@pytest.mark.parametrize("kind", ["success", "transient", "cancelled"])
async def test_released_lease_cannot_be_released_twice(kind: OutcomeKind) -> None:
    """A second release of the same lease frees nothing more, whatever the outcome."""
    backend = MemoryBackend(now=FakeClock())
    lease = (await backend.acquire("s", [SPEC], ttl_s=10)).lease
    other = (await backend.acquire("s", [SPEC], ttl_s=10)).lease
    assert lease is not None
    assert other is not None
    outcome = AttemptOutcome(kind)
    await backend.release(lease, outcome)
    await backend.release(lease, outcome)
    assert (await backend.snapshot("s")).in_flight == 1


async def test_a_changed_burst_sets_the_bucket_capacity_from_the_next_acquire() -> None:
    """Capacities are derived once per spec seen: a new spec's burst caps refills and snapshots."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    small = SourceSpec(name="a", max_concurrency=5, rpm=60, rpm_burst=2)
    assert (await backend.acquire("s", [small], ttl_s=1)).lease is not None
    clock.advance(100)
    snap = (await backend.snapshot("s")).source("a")
    assert snap is not None
    assert snap.rpm_tokens == 2
    large = SourceSpec(name="a", max_concurrency=5, rpm=60, rpm_burst=10)
    grants = [(await backend.acquire("s", [large], ttl_s=1)).lease for _ in range(3)]
    assert all(g is not None for g in grants)
    clock.advance(100)
    snap = (await backend.snapshot("s")).source("a")
    assert snap is not None
    assert snap.rpm_tokens == 10
