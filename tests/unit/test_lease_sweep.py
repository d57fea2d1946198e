"""The lazy sweep of expired leases: it runs only once the earliest expiry has passed.

``SourceState.next_expiry`` is a lower bound of every held lease's expiry;
these tests pin that an expired lease is still reclaimed at exactly the right
moment by every operation, that a renewal past the old bound keeps its lease,
and that the bound never lets an expired lease be counted as live.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from polygateway.backends.base import AttemptOutcome, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.governance import source_state
from polygateway.governance.aimd import Aimd
from polygateway.governance.breaker import Breaker
from polygateway.governance.source_state import (
    Admission,
    LeaseEntry,
    Refusal,
    SourceState,
    drop_expired,
)
from polygateway.testing import FakeClock

ONE = SourceSpec(name="a", max_concurrency=1)
T0 = 1000.0


async def test_expired_lease_is_reclaimed_by_acquire_exactly_at_its_expiry() -> None:
    """The permit of a lease nobody released frees itself at ``now == expiry``, not a tick later."""
    clock = FakeClock(T0)
    backend = MemoryBackend(now=clock)
    assert (await backend.acquire("s", [ONE], ttl_s=10)).lease is not None
    clock.advance(9.5)
    refused = await backend.acquire("s", [ONE], ttl_s=10)
    assert refused.lease is None
    assert refused.rejections[0].reason == "concurrency"
    clock.advance(0.5)
    assert (await backend.acquire("s", [ONE], ttl_s=10)).lease is not None


async def test_snapshot_stops_counting_an_expired_lease_at_its_expiry() -> None:
    """A snapshot shows the permit free once the lease expired, with no other operation between."""
    clock = FakeClock(T0)
    backend = MemoryBackend(now=clock)
    assert (await backend.acquire("s", [ONE], ttl_s=10)).lease is not None
    clock.advance(9.5)
    assert (await backend.snapshot("s")).in_flight == 1
    clock.advance(0.5)
    assert (await backend.snapshot("s")).in_flight == 0


async def test_release_after_expiry_is_a_no_op_and_sweeps_the_dead() -> None:
    """Releasing a lease past its expiry records nothing; the sweep it runs drops every dead one."""
    clock = FakeClock(T0)
    backend = MemoryBackend(now=clock)
    two = SourceSpec(name="a", max_concurrency=2)
    short = (await backend.acquire("s", [two], ttl_s=5)).lease
    other = (await backend.acquire("s", [two], ttl_s=6)).lease
    assert short is not None
    assert other is not None
    clock.advance(6)
    await backend.release(short, AttemptOutcome("success"))
    assert await backend.progress_age_s("s") == math.inf
    # The sweep's effect is internal: read the state itself.
    state = backend._scopes["s"].sources["a"].state
    assert state.leases == {}
    assert state.next_expiry == math.inf


async def test_lease_renewed_past_the_old_earliest_expiry_is_not_reclaimed() -> None:
    """Passing the bound set by a lease's first expiry sweeps, but the renewed lease survives it."""
    clock = FakeClock(T0)
    backend = MemoryBackend(now=clock)
    lease = (await backend.acquire("s", [ONE], ttl_s=10)).lease
    assert lease is not None
    clock.advance(6)
    assert await backend.renew(lease) is True  # now expires at T0 + 16
    clock.advance(5)  # T0 + 11: past the first expiry, the earliest the state knew of
    refused = await backend.acquire("s", [ONE], ttl_s=10)
    assert refused.lease is None
    assert refused.rejections[0].reason == "concurrency"
    assert (await backend.snapshot("s")).in_flight == 1
    await backend.release(lease, AttemptOutcome("success"))
    assert await backend.progress_age_s("s") == 0.0


async def test_renewed_lease_is_reclaimed_at_its_new_expiry() -> None:
    """After the sweep that spared it, a renewed lease still expires at its renewed time."""
    clock = FakeClock(T0)
    backend = MemoryBackend(now=clock)
    lease = (await backend.acquire("s", [ONE], ttl_s=10)).lease
    assert lease is not None
    clock.advance(6)
    assert await backend.renew(lease) is True  # now expires at T0 + 16
    clock.advance(5)
    assert (await backend.acquire("s", [ONE], ttl_s=10)).lease is None
    clock.advance(4.5)
    assert (await backend.acquire("s", [ONE], ttl_s=10)).lease is None
    clock.advance(0.5)
    assert (await backend.acquire("s", [ONE], ttl_s=10)).lease is not None
    assert await backend.renew(lease) is False


def test_sweep_does_not_walk_the_leases_before_the_earliest_expiry() -> None:
    """While ``now`` is below the bound the sweep is one comparison: it does not look at leases."""
    state = source_state.new_source_state(ONE, T0)
    source_state.commit(state, ONE, "x", T0, ttl_s=10, cost_tokens=0, probe=False)
    assert state.next_expiry == T0 + 10
    # Forged behind the bound's back: only a sweep that walks the leases would see it.
    state.leases["x"].expiry = T0 + 1
    drop_expired(state, T0 + 5)
    assert "x" in state.leases
    drop_expired(state, T0 + 10)
    assert state.leases == {}
    assert state.next_expiry == math.inf


def test_sweep_records_the_exact_earliest_expiry_of_the_survivors() -> None:
    """After a sweep the bound is the minimum expiry of the leases left, so the next sweep waits."""
    state = source_state.new_source_state(SourceSpec(name="a", max_concurrency=5), T0)
    for lease_id, ttl in (("a", 1.0), ("b", 7.0), ("c", 3.0)):
        source_state.commit(state, ONE, lease_id, T0, ttl_s=ttl, cost_tokens=0, probe=False)
    assert state.next_expiry == T0 + 1
    drop_expired(state, T0 + 2)
    assert sorted(state.leases) == ["b", "c"]
    assert state.next_expiry == T0 + 3


def test_state_built_with_leases_sweeps_on_its_first_operation() -> None:
    """A state handed leases directly has an unknown bound (``-inf``): the first admit sweeps."""
    state = SourceState(
        breaker=Breaker(),
        aimd=Aimd(limit=1.0),
        leases={"dead": LeaseEntry(expiry=T0 - 1, tokens=0, ttl_s=10)},
    )
    assert state.next_expiry == -math.inf
    assert isinstance(source_state.admit(state, ONE, T0, 0), Admission)
    assert state.leases == {}


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), st.floats(0.5, 20.0)),
        st.tuples(st.just("release"), st.integers(0, 30)),
        st.tuples(st.just("renew"), st.integers(0, 30)),
        st.tuples(st.just("advance"), st.floats(0.0, 8.0)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=_OPS)
def test_lazy_sweep_decides_exactly_as_an_eager_one(ops: list[tuple[str, float]]) -> None:
    """Against a model that forgets expired leases at once, every verdict and live count agree."""
    spec = SourceSpec(name="a", max_concurrency=4)
    now = T0
    state = source_state.new_source_state(spec, now)
    model: dict[str, tuple[float, float]] = {}  # lease id -> (expiry, ttl), live or not
    issued: list[str] = []
    for op, arg in ops:
        if op == "advance":
            now += arg
            continue
        live = {i for i, (expiry, _) in model.items() if expiry > now}
        if op == "acquire":
            verdict = source_state.admit(state, spec, now, 0)
            assert isinstance(verdict, Admission) == (len(live) < 4)
            if isinstance(verdict, Refusal):
                assert verdict.reason == "concurrency"
                continue
            lease_id = str(len(issued))
            issued.append(lease_id)
            source_state.commit(state, spec, lease_id, now, ttl_s=arg, cost_tokens=0, probe=False)
            model[lease_id] = (now + arg, arg)
        elif issued:
            lease_id = issued[int(arg) % len(issued)]
            if op == "release":
                freed = source_state.apply_outcome(state, spec, lease_id, now, "success")
                assert freed == (lease_id in live)
                model.pop(lease_id, None)
            else:
                renewed = source_state.renew(state, lease_id, now)
                assert renewed == (lease_id in live)
                if renewed:
                    model[lease_id] = (now + model[lease_id][1], model[lease_id][1])
        # The bound never passes a held lease's expiry, and the view counts only the live.
        held = [entry.expiry for entry in state.leases.values()]
        assert state.next_expiry <= min(held, default=math.inf)
        live = {i for i, (expiry, _) in model.items() if expiry > now}
        assert source_state.view(state, spec, now, name="a").in_flight == len(live)
