"""Admission edges that mutation testing found unpinned (research-wiki/MUTATION.md).

A ``Call`` (made with ``RetryMW.begin``) is driven step by step over a
``MemoryBackend`` on a ``FakeClock``: the limits its pick hands the backend,
the TTL of the leases it asks for, how long it waits in the queue, and the
``retry_after_s`` of the error that ends it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import pytest

from polygateway.backends.base import AttemptOutcome, Lease, ScopeSnapshot, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.config import SourceConfig
from polygateway.errors import AllSourcesExhausted, GovernanceBackendError, RequestRejected
from polygateway.middleware.attempt import AttemptContext
from polygateway.middleware.policy import LoopPolicy
from polygateway.middleware.retry import Call, RetryMW
from polygateway.models import AttemptRecord
from polygateway.testing import FakeClock, TransientError

SCOPE = "chat"


def _source(name: str = "a", **fields: Any) -> SourceConfig:
    return SourceConfig(name=name, protocol="openai", base_url="http://upstream.test/v1", **fields)


def _loop(
    *sources: SourceConfig,
    clock: FakeClock,
    backend: MemoryBackend | None = None,
    rng: random.Random | None = None,
    **policy: Any,
) -> RetryMW:
    return RetryMW(
        scope=SCOPE,
        sources=sources or (_source(),),
        policy=LoopPolicy(**({"lease_grace_s": 5.0} | policy)),
        backend=backend or MemoryBackend(now=clock),
        now=clock,
        sleep=clock.sleep,
        rng=rng if rng is not None else random.Random(7),
    )


def _call(mw: RetryMW, deadline_s: float | None = None, *, streaming: bool = False) -> Call:
    return mw.begin(op_name="complete", cost_tokens=10, deadline_s=deadline_s, streaming=streaming)


async def _pick(mw: RetryMW, **call: Any) -> Lease | None:
    return await _call(mw, **call).pick()


def _ctx(source: str, timeout_s: float, now: float) -> AttemptContext:
    """An attempt at ``source`` whose effective request timeout was ``timeout_s``."""
    lease = Lease(SCOPE, source, "1", 10.0, 0, False)
    return AttemptContext("c0ffee", 1, lease, timeout_s, timeout_s, timeout_s, now)


# --- the limits and TTLs handed to the backend --------------------------------------------


async def test_rpm_burst_of_a_source_reaches_the_backend() -> None:
    """rpm 600 with rpm_burst 2: the third call in the same instant is refused for rpm."""
    clock = FakeClock()
    mw = _loop(_source(rpm=600, rpm_burst=2, max_concurrency=8), clock=clock)
    assert await _pick(mw) is not None
    assert await _pick(mw) is not None
    refused = _call(mw)
    assert await refused.pick() is None
    assert refused._last is not None
    assert [r.reason for r in refused._last.rejections] == ["rpm"]


async def test_tpm_burst_of_a_source_reaches_the_backend() -> None:
    """tpm 6000 with tpm_burst 15: a second call costing 10 is refused, 5 tokens (50 ms) short."""
    clock = FakeClock()
    mw = _loop(_source(tpm=6000, tpm_burst=15, max_concurrency=8), clock=clock)
    assert await _pick(mw) is not None
    refused = _call(mw)
    assert await refused.pick() is None
    assert refused._last is not None
    assert [r.reason for r in refused._last.rejections] == ["tpm"]
    # Only the refusal knows the tpm wait (a snapshot shows no tpm reopen time).
    err = await refused.exhausted("no_runnable")
    assert err.retry_after_s == pytest.approx(0.05)


async def test_lease_ttl_is_the_attempt_timeout_plus_the_grace() -> None:
    """A request's lease lives timeout_s + lease_grace_s; a stream's TTFT + 2 idle + grace."""
    clock = FakeClock()
    mw = _loop(_source(timeout_s=0.5, ttft_timeout_s=0.25, stream_idle_timeout_s=3.0), clock=clock)
    request = await _pick(mw)
    stream = await _pick(mw, streaming=True)
    assert request is not None
    assert stream is not None
    assert request.ttl_s == pytest.approx(5.5)
    assert stream.ttl_s == pytest.approx(0.25 + 6.0 + 5.0)


async def test_a_deadline_clips_the_lease_ttl_of_requests_and_streams() -> None:
    """With 2 s left, the lease covers the clipped attempt: 2 s (request), 2 + 2 * 2 (stream)."""
    clock = FakeClock()
    mw = _loop(_source(timeout_s=60, ttft_timeout_s=10, stream_idle_timeout_s=30), clock=clock)
    request = await _pick(mw, deadline_s=2.0)
    stream = await _pick(mw, deadline_s=2.0, streaming=True)
    assert request is not None
    assert stream is not None
    assert request.ttl_s == pytest.approx(2.0 + 5.0)
    assert stream.ttl_s == pytest.approx(6.0 + 5.0)


async def _attempt_timeouts(mw: RetryMW, call: Call, clock: FakeClock, wait_s: float) -> Any:
    """The (timeout, TTFT, idle) an attempt gets ``wait_s`` after the call's pick."""
    lease = await call.pick()
    assert lease is not None
    clock.advance(wait_s)
    seen: list[tuple[float, float, float]] = []

    async def attempt(source: SourceConfig, ctx: AttemptContext) -> str:
        seen.append((ctx.timeout_s, ctx.ttft_timeout_s, ctx.idle_timeout_s))
        return "ok"

    served = await call.attempt(lease, attempt)
    served.complete()  # type: ignore[union-attr]
    await call.finish(served, None)  # type: ignore[arg-type]
    [timeouts] = seen
    return timeouts


async def test_timeouts_are_clipped_to_the_time_left() -> None:
    """An attempt 1.5 s before the deadline gets 1.5 s for each of its timeouts."""
    clock = FakeClock()
    mw = _loop(_source(timeout_s=60, ttft_timeout_s=10, stream_idle_timeout_s=30), clock=clock)
    assert await _attempt_timeouts(mw, _call(mw, deadline_s=2.0), clock, 0.5) == (1.5, 1.5, 1.5)
    # 20 s left clips only the timeouts longer than that, each in its own place.
    assert await _attempt_timeouts(mw, _call(mw, deadline_s=20.5), clock, 0.5) == (20.0, 10.0, 20.0)
    assert await _attempt_timeouts(mw, _call(mw), clock, 0.5) == (60.0, 10.0, 30.0)


def test_a_zero_deadline_is_valid_and_a_bad_one_names_the_scope() -> None:
    """deadline_s=0 and 0.5 are accepted; a negative one is rejected with scope and sources."""
    clock = FakeClock()
    mw = _loop(_source("a"), _source("b"), clock=clock)
    assert _call(mw, deadline_s=0.0).deadline.at == clock()
    assert _call(mw, deadline_s=0.5).deadline.at == clock() + 0.5
    with pytest.raises(RequestRejected) as caught:
        _call(mw, deadline_s=-1.0)
    assert caught.value.scope == SCOPE
    assert caught.value.sources == ("a", "b")
    assert str(caught.value).startswith(
        "complete: deadline_s must be a finite, non-negative number of seconds, not -1.0"
    )


async def test_an_attempt_whose_timeout_equals_the_time_left_was_cut_by_the_source() -> None:
    """A timeout of exactly the source's own timeout_s is the source's, even at the deadline."""
    clock = FakeClock()
    mw = _loop(_source("a", timeout_s=4), _source("b", timeout_s=3), clock=clock)
    call = _call(mw, deadline_s=4.0)
    clock.advance(4.0)
    assert not call._cut(_ctx("a", 4.0, clock()))
    assert call._cut(_ctx("a", 3.0, clock()))
    # Each attempt is judged against its own source's timeout.
    assert not call._cut(_ctx("b", 3.0, clock()))


async def test_a_streams_timeout_at_the_deadline_is_always_the_deadlines() -> None:
    """A stream's end is the deadline itself: even its own full timeout counts as cut."""
    clock = FakeClock()
    mw = _loop(_source("a", timeout_s=4), clock=clock)
    call = _call(mw, deadline_s=4.0, streaming=True)
    clock.advance(4.0)
    assert call._cut(_ctx("a", 4.0, clock()))


async def test_acquires_in_flight_are_counted_and_uncounted() -> None:
    """room.asking counts the acquires under way and is back to zero once they return."""
    clock = FakeClock()
    gate = asyncio.Event()

    class _Slow(MemoryBackend):
        __slots__ = ()

        async def acquire(self, *args: Any, **kwargs: Any) -> Any:
            await gate.wait()
            return await super().acquire(*args, **kwargs)

    mw = _loop(_source(max_concurrency=4), clock=clock, backend=_Slow(now=clock))
    room = mw._room
    first = asyncio.create_task(_pick(mw))
    await asyncio.sleep(0)
    second = asyncio.create_task(_pick(mw))
    await asyncio.sleep(0)
    assert room.asking == 2
    assert room.empty  # both asked at once: nobody queued
    gate.set()
    leases = await asyncio.gather(first, second)
    assert None not in leases
    assert room.asking == 0


async def test_a_failing_acquire_is_uncounted_and_fails_the_queue_behind() -> None:
    """A backend error: asking is back to 0, every queued call is told, the error passes on."""
    clock = FakeClock()

    class _Down(MemoryBackend):
        __slots__ = ()

        async def acquire(self, *args: Any, **kwargs: Any) -> Any:
            raise GovernanceBackendError("redis gone", operation="acquire", scope=SCOPE)

    mw = _loop(clock=clock, backend=_Down(now=clock))
    room = mw._room
    call = _call(mw)
    behind = room.enter()
    with pytest.raises(GovernanceBackendError):
        await call.pick()  # queued at its arrival, ahead of ``behind``: the head asks
    assert room.asking == 0
    assert isinstance(behind.failure, GovernanceBackendError)
    assert call._waiter is not None
    assert call._waiter.failure is None


# --- how long a waiter sleeps -----------------------------------------------------------


async def _queued_wait(stalled_s: float, served_ago: float | None = None) -> float:
    """What a call queued behind another sleeps (stall 300 s, poll 0.5 s).

    The call has waited ``stalled_s``; the scope last served ``served_ago`` s ago
    (``None``: never).
    """
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(clock=clock, backend=backend, stall_window_s=300.0, poll_interval_s=0.5)
    mw._room.enter()  # somebody else arrived first and is head
    call = _call(mw)
    if served_ago is None:
        clock.advance(stalled_s)
    else:
        clock.advance(stalled_s - served_ago)
        result = await backend.acquire(SCOPE, [SourceSpec("other", max_concurrency=1)], ttl_s=10.0)
        assert result.lease is not None
        await backend.release(result.lease, AttemptOutcome("success"))
        clock.advance(served_ago)
    await call.wait()
    [slept] = clock.sleeps
    assert not mw._room.is_head(call._waiter)  # type: ignore[arg-type]
    return slept


async def test_a_queued_call_sleeps_until_its_stall_deadline() -> None:
    """Behind the head, a call sleeps out what is left of its stall window (plus 1 ms)."""
    assert await _queued_wait(100.0) == pytest.approx(200.001)
    assert await _queued_wait(299.5) == pytest.approx(0.501)


async def test_a_queued_call_past_its_window_looks_again_when_progress_would_go_stale() -> None:
    """Past its window while the scope serves, it sleeps until the progress would be stale."""
    assert await _queued_wait(400.0, served_ago=10.0) == pytest.approx(290.001)
    assert await _queued_wait(400.0, served_ago=299.9) == pytest.approx(0.5)


async def test_a_queued_call_exactly_at_its_window_sleeps_only_the_slack() -> None:
    """stalled_s == stall_window_s: the call behind the head looks again 1 ms later."""
    assert await _queued_wait(300.0) == pytest.approx(0.001)


async def test_a_call_past_its_window_with_no_age_read_waits_a_whole_window() -> None:
    """No progress age read this iteration: the queued call counts it as 0 and waits a window."""
    clock = FakeClock()
    mw = _loop(clock=clock, stall_window_s=300.0, poll_interval_s=0.5)
    call = _call(mw)
    clock.advance(400.0)
    assert call._age is None
    assert call._stall_timer_s() == pytest.approx(300.001)
    call._age = 10.0
    assert call._stall_timer_s() == pytest.approx(290.001)


async def test_a_queued_call_past_its_window_in_a_stale_scope_ends_stalled() -> None:
    """Past its window and the scope never served: the wait ends the call as stalled."""
    clock = FakeClock()
    mw = _loop(clock=clock, stall_window_s=300.0)
    mw._room.enter()
    call = _call(mw)
    clock.advance(300.5)
    with pytest.raises(AllSourcesExhausted) as caught:
        await call.wait()
    assert caught.value.reason == "stalled"
    assert clock.sleeps == []


async def test_a_fail_fast_call_never_waits_nor_reads_the_stall_rule() -> None:
    """fail_fast: "no_runnable" at once, even past the stall window, and no queue place."""
    clock = FakeClock()
    mw = _loop(clock=clock, stall_window_s=300.0)
    call = mw.begin(fail_fast=True)
    clock.advance(400.0)
    with pytest.raises(AllSourcesExhausted) as caught:
        await call.wait()
    assert caught.value.reason == "no_runnable"
    assert call._age is None  # the progress age was never asked for
    assert mw._room.empty


async def test_a_backend_failure_ahead_fails_the_queued_call_with_context() -> None:
    """A call woken by a failure ahead raises GovernanceBackendError naming scope and sources."""
    clock = FakeClock()
    mw = _loop(_source("a"), _source("b"), clock=clock)
    room = mw._room
    head = room.enter()
    call = _call(mw)
    assert await call.pick() is None  # queued behind the head, without asking
    assert call._waiter is not None
    failure = RuntimeError("connection refused")
    room.fail_all(failure, but=head)
    with pytest.raises(GovernanceBackendError) as caught:
        await call.wait()
    err = caught.value
    assert err.operation == "acquire"
    assert (err.scope, err.sources) == (SCOPE, ("a", "b"))
    assert "a call ahead of this one" in str(err)
    assert "connection refused" in str(err)
    assert err.__cause__ is failure

    named = GovernanceBackendError("down", operation="release", scope=SCOPE)
    call._waiter.failure = None
    room.fail_all(named)
    with pytest.raises(GovernanceBackendError) as caught:
        await call.wait()
    assert caught.value.operation == "release"


async def test_the_head_wakes_just_after_a_source_reopens() -> None:
    """A reopen exactly at the poll draw: the head sleeps the draw, not the draw plus slack."""

    class _Draw(random.Random):
        def uniform(self, a: float, b: float) -> float:
            return 0.25

    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(clock=clock, backend=backend, rng=_Draw(7), poll_interval_s=1.0)
    holder = await _pick(mw)
    assert holder is not None
    await backend.release(holder, AttemptOutcome("rate_limited", retry_after_s=0.25))
    call = _call(mw)
    assert await call.pick() is None
    await call.wait()
    assert clock.sleeps == [0.25]


async def test_the_head_wakes_at_a_reopen_sooner_than_its_poll() -> None:
    """A source reopening in 0.1 s, 0.05 s after the refusal: the head sleeps 0.051 s."""

    class _Draw(random.Random):
        def uniform(self, a: float, b: float) -> float:
            return 0.25

    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(clock=clock, backend=backend, rng=_Draw(7), poll_interval_s=1.0)
    holder = await _pick(mw)
    assert holder is not None
    await backend.release(holder, AttemptOutcome("rate_limited", retry_after_s=0.1))
    call = _call(mw)
    assert await call.pick() is None
    clock.advance(0.05)
    await call.wait()
    assert clock.sleeps == [pytest.approx(0.051)]


async def test_a_head_that_has_not_asked_yet_waits_one_poll() -> None:
    """A call that became head before its first acquire has no reopen time: one poll draw."""
    clock = FakeClock()
    mw = _loop(clock=clock, poll_interval_s=1.0)
    await _call(mw).wait()
    [slept] = clock.sleeps
    assert 0.5 <= slept <= 1.0


async def test_a_wait_is_clipped_to_the_time_left() -> None:
    """0.2 s before the deadline, a queued call sleeps 0.2 s, not its stall timer."""
    clock = FakeClock()
    mw = _loop(clock=clock, stall_window_s=300.0)
    mw._room.enter()
    call = _call(mw, deadline_s=1.0)
    clock.advance(0.8)
    await call.wait()
    assert clock.sleeps == [pytest.approx(0.2)]


# --- retry_after_s of the final error ---------------------------------------------------


async def test_retry_after_ages_the_last_refusal() -> None:
    """Refused with 10 s to go, 4 s ago: the error says 6 s."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(clock=clock, backend=backend)
    holder = await _pick(mw)
    assert holder is not None
    await backend.release(holder, AttemptOutcome("rate_limited", retry_after_s=10.0))
    call = _call(mw)
    assert await call.pick() is None
    clock.advance(4.0)
    err = await call.exhausted("deadline")
    assert err.retry_after_s == pytest.approx(6.0)


async def test_an_error_before_any_acquire_has_no_retry_after() -> None:
    """A call that ends before it asked (deadline 0) reads the snapshot: nothing to wait for."""
    clock = FakeClock()
    mw = _loop(clock=clock)
    err = await _call(mw, deadline_s=0.0).exhausted("deadline")
    assert err.retry_after_s is None


async def _after_failure(mw: RetryMW, backend: MemoryBackend, outcome: AttemptOutcome) -> Call:
    """A call whose one attempt was granted and then failed with ``outcome``."""
    call = _call(mw)
    lease = await call.pick()
    assert lease is not None
    await backend.release(lease, outcome)
    return call


async def test_retry_after_a_failed_attempt_reads_the_open_breaker() -> None:
    """The attempt tripped the breaker: the error waits out its 30 s cool-down."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(clock=clock, backend=backend, breaker_failures=1)
    call = await _after_failure(mw, backend, AttemptOutcome("transient"))
    err = await call.exhausted("retry_exhausted")
    assert err.retry_after_s == pytest.approx(30.0)


async def test_retry_after_a_429_reads_the_pacing_deadline() -> None:
    """A 429 without a hint paces the source 1 s: the error says so."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(clock=clock, backend=backend)
    call = await _after_failure(mw, backend, AttemptOutcome("rate_limited"))
    assert (await call.exhausted("retry_exhausted")).retry_after_s == pytest.approx(1.0)


async def test_retry_after_skips_sources_the_backend_never_saw() -> None:
    """A source never asked about (not in the snapshot) does not hide the next one's reopen."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    spare, first = _source("spare", priority=1), _source("first", priority=0)
    mw = _loop(spare, first, clock=clock, backend=backend, breaker_failures=1)
    call = await _after_failure(mw, backend, AttemptOutcome("transient"))
    assert (await backend.snapshot(SCOPE)).source("spare") is None
    assert (await call.exhausted("retry_exhausted")).retry_after_s == pytest.approx(30.0)


async def test_retry_after_an_open_breaker_ignores_a_full_rpm_bucket() -> None:
    """rpm tokens to spare add no time: the open breaker's 30 s is the answer."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(_source(rpm=60, rpm_burst=5), clock=clock, backend=backend, breaker_failures=1)
    call = await _after_failure(mw, backend, AttemptOutcome("transient"))
    assert (await call.exhausted("retry_exhausted")).retry_after_s == pytest.approx(30.0)


async def test_retry_after_waits_for_the_next_rpm_token() -> None:
    """rpm 30 (one token per 2 s), half a token left: the next token is 1 s away."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(_source(rpm=30, rpm_burst=1), clock=clock, backend=backend)
    call = await _after_failure(mw, backend, AttemptOutcome("request_rejected"))
    clock.advance(1.0)
    assert (await call.exhausted("retry_exhausted")).retry_after_s == pytest.approx(1.0)


async def test_retry_after_with_exactly_one_rpm_token_left_is_none() -> None:
    """One whole token left: nothing to wait for, so no retry_after_s."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(_source(rpm=60, rpm_burst=2), clock=clock, backend=backend)
    call = await _after_failure(mw, backend, AttemptOutcome("request_rejected"))
    assert (await call.exhausted("retry_exhausted")).retry_after_s is None


async def test_a_failing_snapshot_gives_no_retry_after_and_logs_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A backend that cannot snapshot: retry_after_s is None and a warning names the error."""
    clock = FakeClock()

    class _NoSnapshot(MemoryBackend):
        __slots__ = ()

        async def snapshot(self, scope: str) -> ScopeSnapshot:
            raise GovernanceBackendError("redis gone", operation="snapshot", scope=scope)

    mw = _loop(clock=clock, backend=_NoSnapshot(now=clock))
    with caplog.at_level(logging.WARNING, logger="polygateway.retry"):
        err = await _call(mw).exhausted("deadline")
    assert err.retry_after_s is None
    [record] = caplog.records
    assert record.getMessage() == (
        "snapshot for retry_after_s failed: redis gone (operation=snapshot) (scope='chat')"
    )


def _hint(call: Call, retry_after_s: float) -> None:
    """An upstream failure of the call named ``retry_after_s`` (kept for its final error)."""
    call._verdict(TransientError("x", status_code=503, retry_after_s=retry_after_s), "a")


async def test_retry_after_falls_back_to_what_is_left_of_the_upstream_hint() -> None:
    """Nothing closed, a 5 s hint: 3 s left after 2 s, 0.5 s after 4.5 s, all 5 once spent."""
    clock = FakeClock()
    mw = _loop(clock=clock)
    call = _call(mw)
    _hint(call, 5.0)
    clock.advance(2.0)
    assert await call._retry_after() == pytest.approx(3.0)
    clock.advance(2.5)
    assert await call._retry_after() == pytest.approx(0.5)
    clock.advance(0.5)
    assert await call._retry_after() == 5.0


async def test_a_hint_is_kept_clamped_to_the_stall_window() -> None:
    """A 400 s hint with a 300 s window is kept as 300 s; a failure naming nothing keeps none."""
    clock = FakeClock()
    mw = _loop(clock=clock, stall_window_s=300.0)
    call = _call(mw)
    call._verdict(TransientError("x", status_code=503), "a")
    assert call._hint_s is None
    _hint(call, 400.0)
    assert call._hint_s == 300.0
    assert call._hint_at == clock()


async def test_a_short_reopen_wins_over_a_longer_hint() -> None:
    """A source reopening in 0.5 s is the answer even when an upstream hinted 5 s."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(clock=clock, backend=backend)
    call = await _after_failure(mw, backend, AttemptOutcome("rate_limited", retry_after_s=0.5))
    _hint(call, 5.0)
    assert await call._retry_after() == pytest.approx(0.5)


async def test_the_final_error_names_the_call_the_scope_and_the_last_failure() -> None:
    """The message starts with the operation and reason and ends with the last attempt's error."""
    clock = FakeClock()
    mw = _loop(_source("a"), _source("b"), clock=clock)
    call = _call(mw)
    call.records.append(_record(source="b", error="HTTP 503"))
    err = await call.exhausted("retry_exhausted")
    assert str(err).startswith("complete: all sources exhausted: every charged attempt failed")
    assert "; last: b: HTTP 503" in str(err)
    assert (err.scope, err.sources) == (SCOPE, ("a", "b"))
    assert err.reason == "retry_exhausted"
    assert err.attempts == tuple(call.records)


def _record(*, source: str, error: str) -> AttemptRecord:
    fields = dict.fromkeys(AttemptRecord.__dataclass_fields__)
    fields.update(source=source, error=error)
    return AttemptRecord(**fields)  # type: ignore[arg-type]


async def test_a_timeout_with_exactly_the_epsilon_left_may_be_the_deadlines() -> None:
    """1 ms left is no time left: a clipped timeout then counts as cut by the deadline."""
    clock = FakeClock(start=0.0)
    mw = _loop(_source(timeout_s=60), clock=clock)
    call = _call(mw, deadline_s=0.001)
    assert call._cut(_ctx("a", 0.0005, clock()))
