"""Admission edges that mutation testing found unpinned (research-wiki/MUTATION.md).

The ``Admitter`` is driven directly over a ``MemoryBackend`` on a
``FakeClock``: the limits it hands the backend, the TTL of the leases it
asks for, how long a waiter sleeps, and the ``retry_after_s`` of the error
that ends a call.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import pytest

from polygateway.backends.base import AttemptOutcome, Lease, ScopeSnapshot
from polygateway.backends.memory import MemoryBackend
from polygateway.backends.waiting import WaitingRoom
from polygateway.config import SourceConfig
from polygateway.errors import GovernanceBackendError, RequestRejected
from polygateway.middleware.admission import Admitter, CallState
from polygateway.middleware.policy import LoopPolicy
from polygateway.models import AttemptRecord
from polygateway.testing import FakeClock

SCOPE = "chat"


def _source(name: str = "a", **fields: Any) -> SourceConfig:
    return SourceConfig(name=name, protocol="openai", base_url="http://upstream.test/v1", **fields)


def _admitter(
    *sources: SourceConfig,
    clock: FakeClock,
    backend: MemoryBackend | None = None,
    **policy: Any,
) -> Admitter:
    return Admitter(
        scope=SCOPE,
        sources=sources or (_source(),),
        policy=LoopPolicy(**({"lease_grace_s": 5.0} | policy)),
        backend=backend or MemoryBackend(now=clock),
        now=clock,
        sleep=clock.sleep,
        rng=random.Random(7),
    )


def _call(admit: Admitter, deadline_s: float | None = None, *, streaming: bool = False) -> Any:
    return admit.begin("complete", 10, False, deadline_s, streaming=streaming)


async def _pick(admit: Admitter, call: CallState) -> Lease | None:
    return await admit.pick(call, WaitingRoom())


# --- the limits and TTLs handed to the backend --------------------------------------------


async def test_rpm_burst_of_a_source_reaches_the_backend() -> None:
    """rpm 600 with rpm_burst 2: the third call in the same instant is refused for rpm."""
    clock = FakeClock()
    admit = _admitter(_source(rpm=600, rpm_burst=2, max_concurrency=8), clock=clock)
    assert await _pick(admit, _call(admit)) is not None
    assert await _pick(admit, _call(admit)) is not None
    refused = _call(admit)
    assert await _pick(admit, refused) is None
    assert [r.reason for r in refused.last.rejections] == ["rpm"]


async def test_tpm_burst_of_a_source_reaches_the_backend() -> None:
    """tpm 6000 with tpm_burst 15: a second call costing 10 is refused, 5 tokens (50 ms) short."""
    clock = FakeClock()
    admit = _admitter(_source(tpm=6000, tpm_burst=15, max_concurrency=8), clock=clock)
    assert await _pick(admit, _call(admit)) is not None
    refused = _call(admit)
    assert await _pick(admit, refused) is None
    assert [r.reason for r in refused.last.rejections] == ["tpm"]
    # Only the refusal knows the tpm wait (a snapshot shows no tpm reopen time).
    err = await admit.exhausted(refused, "no_runnable")
    assert err.retry_after_s == pytest.approx(0.05)


async def test_lease_ttl_is_the_attempt_timeout_plus_the_grace() -> None:
    """A request's lease lives timeout_s + lease_grace_s; a stream's TTFT + 2 idle + grace."""
    clock = FakeClock()
    admit = _admitter(
        _source(timeout_s=0.5, ttft_timeout_s=0.25, stream_idle_timeout_s=3.0), clock=clock
    )
    request = await _pick(admit, _call(admit))
    stream = await _pick(admit, _call(admit, streaming=True))
    assert request is not None
    assert stream is not None
    assert request.ttl_s == pytest.approx(5.5)
    assert stream.ttl_s == pytest.approx(0.25 + 6.0 + 5.0)


async def test_a_deadline_clips_the_lease_ttl_of_requests_and_streams() -> None:
    """With 2 s left, the lease covers the clipped attempt: 2 s (request), 2 + 2 * 2 (stream)."""
    clock = FakeClock()
    admit = _admitter(
        _source(timeout_s=60, ttft_timeout_s=10, stream_idle_timeout_s=30), clock=clock
    )
    request = await _pick(admit, _call(admit, deadline_s=2.0))
    stream = await _pick(admit, _call(admit, deadline_s=2.0, streaming=True))
    assert request is not None
    assert stream is not None
    assert request.ttl_s == pytest.approx(2.0 + 5.0)
    assert stream.ttl_s == pytest.approx(6.0 + 5.0)


async def test_timeouts_are_clipped_to_the_time_left() -> None:
    """An attempt 1.5 s before the deadline gets 1.5 s for each of its timeouts."""
    clock = FakeClock()
    source = _source(timeout_s=60, ttft_timeout_s=10, stream_idle_timeout_s=30)
    admit = _admitter(source, clock=clock)
    call = _call(admit, deadline_s=2.0)
    clock.advance(0.5)
    assert admit.timeouts(source, call) == (1.5, 1.5, 1.5)


def test_a_zero_deadline_is_valid_and_a_bad_one_names_the_scope() -> None:
    """deadline_s=0 and 0.5 are accepted; a negative one is rejected with scope and sources."""
    clock = FakeClock()
    admit = _admitter(_source("a"), _source("b"), clock=clock)
    assert _call(admit, deadline_s=0.0).deadline_at == clock()
    assert _call(admit, deadline_s=0.5).deadline_at == clock() + 0.5
    with pytest.raises(RequestRejected) as caught:
        _call(admit, deadline_s=-1.0)
    assert caught.value.scope == SCOPE
    assert caught.value.sources == ("a", "b")


async def test_an_attempt_whose_timeout_equals_the_time_left_was_cut_by_the_source() -> None:
    """A timeout of exactly the source's own timeout_s is the source's, even at the deadline."""
    clock = FakeClock()
    admit = _admitter(_source(timeout_s=4), clock=clock)
    call = _call(admit, deadline_s=4.0)
    clock.advance(4.0)
    assert not admit.cut_by_deadline(call, 4.0, "a")
    assert admit.cut_by_deadline(call, 3.0, "a")


async def test_acquires_in_flight_are_counted_and_uncounted() -> None:
    """room.asking counts the acquires under way and is back to zero once they return."""
    clock = FakeClock()
    gate = asyncio.Event()

    class _Slow(MemoryBackend):
        __slots__ = ()

        async def acquire(self, *args: Any, **kwargs: Any) -> Any:
            await gate.wait()
            return await super().acquire(*args, **kwargs)

    admit = _admitter(_source(max_concurrency=4), clock=clock, backend=_Slow(now=clock))
    room = WaitingRoom()
    first = asyncio.create_task(admit.pick(_call(admit), room))
    await asyncio.sleep(0)
    second = asyncio.create_task(admit.pick(_call(admit), room))
    await asyncio.sleep(0)
    assert room.asking == 2
    gate.set()
    await asyncio.gather(first, second)
    assert room.asking == 0


# --- how long a waiter sleeps -----------------------------------------------------------


async def _wait_turn_behind_a_head(stalled_s: float, age: float | None) -> float:
    """The timer of a call queued behind another (stall 300 s, poll 0.5 s)."""
    clock = FakeClock()
    admit = _admitter(clock=clock, stall_window_s=300.0, poll_interval_s=0.5)
    room = WaitingRoom()
    room.enter()  # somebody else is head
    call = _call(admit)
    call.age = age
    await admit.wait_turn(call, room, stalled_s, ("a",))
    [slept] = clock.sleeps
    return slept


async def test_a_queued_call_sleeps_until_its_stall_deadline() -> None:
    """Behind the head, a call sleeps out what is left of its stall window (plus 1 ms)."""
    assert await _wait_turn_behind_a_head(100.0, None) == pytest.approx(200.001)
    assert await _wait_turn_behind_a_head(299.5, None) == pytest.approx(0.501)


async def test_a_queued_call_past_its_window_looks_again_when_progress_would_go_stale() -> None:
    """Past its window while the scope serves, it sleeps until the progress would be stale."""
    assert await _wait_turn_behind_a_head(400.0, 10.0) == pytest.approx(290.001)
    assert await _wait_turn_behind_a_head(400.0, 299.9) == pytest.approx(0.5)


async def test_a_backend_failure_ahead_fails_the_queued_call_with_context() -> None:
    """A call woken by a failure ahead raises GovernanceBackendError naming scope and sources."""
    clock = FakeClock()
    admit = _admitter(clock=clock)
    room = WaitingRoom()
    call = _call(admit)
    call.waiter = room.enter()
    failure = RuntimeError("connection refused")
    room.fail_all(failure)
    with pytest.raises(GovernanceBackendError) as caught:
        await admit.wait_turn(call, room, 0.0, ("a", "b"))
    err = caught.value
    assert err.operation == "acquire"
    assert (err.scope, err.sources) == (SCOPE, ("a", "b"))
    assert "a call ahead of this one" in str(err)
    assert "connection refused" in str(err)
    assert err.__cause__ is failure

    named = GovernanceBackendError("down", operation="release", scope=SCOPE)
    call.waiter.failure = None
    room.fail_all(named)
    with pytest.raises(GovernanceBackendError) as caught:
        await admit.wait_turn(call, room, 0.0, ("a",))
    assert caught.value.operation == "release"


# --- retry_after_s of the final error ---------------------------------------------------


async def test_retry_after_ages_the_last_refusal() -> None:
    """Refused with 10 s to go, 4 s ago: the error says 6 s."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    admit = _admitter(clock=clock, backend=backend)
    holder = await _pick(admit, _call(admit))
    assert holder is not None
    await backend.release(holder, AttemptOutcome("rate_limited", retry_after_s=10.0))
    call = _call(admit)
    assert await _pick(admit, call) is None
    clock.advance(4.0)
    err = await admit.exhausted(call, "deadline")
    assert err.retry_after_s == pytest.approx(6.0)


async def test_an_error_before_any_acquire_has_no_retry_after() -> None:
    """A call that ends before it asked (deadline 0) reads the snapshot: nothing to wait for."""
    clock = FakeClock()
    admit = _admitter(clock=clock)
    err = await admit.exhausted(_call(admit, deadline_s=0.0), "deadline")
    assert err.retry_after_s is None


async def _after_failure(admit: Admitter, backend: MemoryBackend, outcome: AttemptOutcome) -> Any:
    """A call whose one attempt was granted and then failed with ``outcome``."""
    call = _call(admit)
    lease = await _pick(admit, call)
    assert lease is not None
    await backend.release(lease, outcome)
    return call


async def test_retry_after_a_failed_attempt_reads_the_open_breaker() -> None:
    """The attempt tripped the breaker: the error waits out its 30 s cool-down."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    admit = _admitter(clock=clock, backend=backend, breaker_failures=1)
    call = await _after_failure(admit, backend, AttemptOutcome("transient"))
    err = await admit.exhausted(call, "retry_exhausted")
    assert err.retry_after_s == pytest.approx(30.0)


async def test_retry_after_a_429_reads_the_pacing_deadline() -> None:
    """A 429 without a hint paces the source 1 s: the error says so."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    admit = _admitter(clock=clock, backend=backend)
    call = await _after_failure(admit, backend, AttemptOutcome("rate_limited"))
    assert (await admit.exhausted(call, "retry_exhausted")).retry_after_s == pytest.approx(1.0)


async def test_retry_after_skips_sources_the_backend_never_saw() -> None:
    """A source never asked about (not in the snapshot) does not hide the next one's reopen."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    spare, first = _source("spare", priority=1), _source("first", priority=0)
    admit = _admitter(spare, first, clock=clock, backend=backend, breaker_failures=1)
    call = await _after_failure(admit, backend, AttemptOutcome("transient"))
    assert (await backend.snapshot(SCOPE)).source("spare") is None
    assert (await admit.exhausted(call, "retry_exhausted")).retry_after_s == pytest.approx(30.0)


async def test_retry_after_an_open_breaker_ignores_a_full_rpm_bucket() -> None:
    """rpm tokens to spare add no time: the open breaker's 30 s is the answer."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    admit = _admitter(
        _source(rpm=60, rpm_burst=5), clock=clock, backend=backend, breaker_failures=1
    )
    call = await _after_failure(admit, backend, AttemptOutcome("transient"))
    assert (await admit.exhausted(call, "retry_exhausted")).retry_after_s == pytest.approx(30.0)


async def test_retry_after_waits_for_the_next_rpm_token() -> None:
    """rpm 30 (one token per 2 s), half a token left: the next token is 1 s away."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    admit = _admitter(_source(rpm=30, rpm_burst=1), clock=clock, backend=backend)
    call = await _after_failure(admit, backend, AttemptOutcome("request_rejected"))
    clock.advance(1.0)
    assert (await admit.exhausted(call, "retry_exhausted")).retry_after_s == pytest.approx(1.0)


async def test_retry_after_with_exactly_one_rpm_token_left_is_none() -> None:
    """One whole token left: nothing to wait for, so no retry_after_s."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    admit = _admitter(_source(rpm=60, rpm_burst=2), clock=clock, backend=backend)
    call = await _after_failure(admit, backend, AttemptOutcome("request_rejected"))
    assert (await admit.exhausted(call, "retry_exhausted")).retry_after_s is None


async def test_a_failing_snapshot_gives_no_retry_after_and_logs_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A backend that cannot snapshot: retry_after_s is None and a warning names the error."""
    clock = FakeClock()

    class _NoSnapshot(MemoryBackend):
        __slots__ = ()

        async def snapshot(self, scope: str) -> ScopeSnapshot:
            raise GovernanceBackendError("redis gone", operation="snapshot", scope=scope)

    admit = _admitter(clock=clock, backend=_NoSnapshot(now=clock))
    with caplog.at_level(logging.WARNING, logger="polygateway.retry"):
        err = await admit.exhausted(_call(admit), "deadline")
    assert err.retry_after_s is None
    [record] = caplog.records
    assert record.getMessage() == (
        "snapshot for retry_after_s failed: redis gone (operation=snapshot) (scope='chat')"
    )


async def test_retry_after_falls_back_to_what_is_left_of_the_upstream_hint() -> None:
    """Nothing closed, a 5 s hint: 3 s left after 2 s, 0.5 s after 4.5 s, all 5 once spent."""
    clock = FakeClock()
    admit = _admitter(clock=clock)
    call = _call(admit)
    admit.remember_hint(call, 5.0)
    clock.advance(2.0)
    assert await admit.retry_after(call) == pytest.approx(3.0)
    clock.advance(2.5)
    assert await admit.retry_after(call) == pytest.approx(0.5)
    clock.advance(0.5)
    assert await admit.retry_after(call) == 5.0


async def test_a_short_reopen_wins_over_a_longer_hint() -> None:
    """A source reopening in 0.5 s is the answer even when an upstream hinted 5 s."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    admit = _admitter(clock=clock, backend=backend)
    call = await _after_failure(admit, backend, AttemptOutcome("rate_limited", retry_after_s=0.5))
    admit.remember_hint(call, 5.0)
    assert await admit.retry_after(call) == pytest.approx(0.5)


async def test_the_final_error_names_the_call_the_scope_and_the_last_failure() -> None:
    """The message starts with the operation and reason and ends with the last attempt's error."""
    clock = FakeClock()
    admit = _admitter(_source("a"), _source("b"), clock=clock)
    call = _call(admit)
    call.records.append(_record(source="b", error="HTTP 503"))
    err = await admit.exhausted(call, "retry_exhausted")
    assert str(err).startswith("complete: all sources exhausted: every charged attempt failed")
    assert "; last: b: HTTP 503" in str(err)
    assert (err.scope, err.sources) == (SCOPE, ("a", "b"))


def _record(*, source: str, error: str) -> AttemptRecord:
    fields = dict.fromkeys(AttemptRecord.__dataclass_fields__)
    fields.update(source=source, error=error)
    return AttemptRecord(**fields)  # type: ignore[arg-type]


async def test_a_timeout_with_exactly_the_epsilon_left_may_be_the_deadlines() -> None:
    """1 ms left is no time left: a clipped timeout then counts as cut by the deadline."""
    clock = FakeClock(start=0.0)
    admit = _admitter(_source(timeout_s=60), clock=clock)
    call = _call(admit, deadline_s=0.001)
    assert admit.cut_by_deadline(call, 0.0005, "a")


async def test_a_queued_call_exactly_at_its_window_sleeps_only_the_slack() -> None:
    """stalled_s == stall_window_s: the call behind the head looks again 1 ms later."""
    assert await _wait_turn_behind_a_head(300.0, None) == pytest.approx(0.001)


async def test_the_head_wakes_just_after_a_source_reopens() -> None:
    """A reopen exactly at the poll draw: the head sleeps the draw, not the draw plus slack."""

    class _Draw(random.Random):
        def uniform(self, a: float, b: float) -> float:
            return 0.25

    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    admit = Admitter(
        scope=SCOPE,
        sources=(_source(),),
        policy=LoopPolicy(poll_interval_s=1.0),
        backend=backend,
        now=clock,
        sleep=clock.sleep,
        rng=_Draw(7),
    )
    holder = await _pick(admit, _call(admit))
    assert holder is not None
    await backend.release(holder, AttemptOutcome("rate_limited", retry_after_s=0.25))
    call = _call(admit)
    room = WaitingRoom()
    assert await admit.pick(call, room) is None
    await admit.wait_turn(call, room, 0.0, ("a",))
    assert clock.sleeps == [0.25]


async def test_a_call_past_its_window_with_no_age_read_waits_a_whole_window() -> None:
    """No progress age read this iteration: the queued call counts it as 0 and waits a window."""
    assert await _wait_turn_behind_a_head(400.0, None) == pytest.approx(300.001)


async def test_a_head_that_has_not_asked_yet_waits_one_poll() -> None:
    """A call that became head before its first acquire has no reopen time: one poll draw."""
    clock = FakeClock()
    admit = _admitter(clock=clock, poll_interval_s=1.0)
    await admit.wait_turn(_call(admit), WaitingRoom(), 0.0, ("a",))
    [slept] = clock.sleeps
    assert 0.5 <= slept <= 1.0
