"""Loop edges that mutation testing found unpinned (research-wiki/MUTATION.md).

``RetryMW`` is driven directly with attempt functions (no transport): its
defaults, the stall rule exactly at the window, back-off steps and their
clipping by a deadline, the record each attempt leaves, and how a session's
body ending is released.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import pytest
from _release_race import ReleasedDuringAcquire

from polygateway.backends.base import AttemptOutcome, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.config import SourceConfig
from polygateway.errors import AllSourcesExhausted, GovernanceBackendError, RequestRejected
from polygateway.middleware.attempt import AttemptContext
from polygateway.middleware.policy import LoopPolicy
from polygateway.middleware.retry import RetryMW, StallClock, backoff_delay
from polygateway.middleware.waiting import room_for
from polygateway.models import Usage
from polygateway.testing import FakeClock, Recorder, TransientError

SCOPE = "chat"


class _Flat(random.Random):
    """Every draw is 0: back-off is exactly half its ceiling, a poll exactly half its interval."""

    def random(self) -> float:
        return 0.0


def _source(name: str = "primary", **fields: Any) -> SourceConfig:
    return SourceConfig(name=name, protocol="openai", base_url="http://upstream.test/v1", **fields)


def _loop(
    clock: FakeClock,
    *sources: SourceConfig,
    backend: Any = None,
    emitter: Any = None,
    **policy: Any,
) -> RetryMW:
    return RetryMW(
        scope=SCOPE,
        sources=sources or (_source(),),
        policy=LoopPolicy(**policy),
        backend=backend if backend is not None else MemoryBackend(now=clock),
        now=clock,
        sleep=clock.sleep,
        rng=_Flat(),
        emitter=emitter,
    )


async def _ok(source: SourceConfig, ctx: AttemptContext) -> str:
    return source.name


def _script(*steps: BaseException | str) -> Any:
    """An attempt function that raises or returns each step in turn."""
    queue = list(steps)

    async def attempt(source: SourceConfig, ctx: AttemptContext) -> str:
        step = queue.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step

    return attempt


async def _hold(backend: MemoryBackend, name: str = "primary") -> None:
    result = await backend.acquire(SCOPE, [SourceSpec(name, max_concurrency=1)], ttl_s=1e6)
    assert result.lease is not None


# --- defaults of run and session --------------------------------------------------------


async def test_run_defaults_cost_nothing_and_name_the_call() -> None:
    """run() without arguments reserves no tpm and its errors start with "call:"."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(clock, _source(tpm=600, tpm_burst=50), backend=backend, max_attempts=1)
    await mw.run(_ok)
    assert (await backend.snapshot(SCOPE)).sources[0].tpm_tokens == pytest.approx(50.0)
    with pytest.raises(AllSourcesExhausted) as caught:
        await mw.run(_script(TransientError("boom", status_code=503)))
    assert str(caught.value).startswith("call: all sources exhausted")


async def test_run_and_session_wait_by_default_instead_of_failing_fast() -> None:
    """On a busy source the default call waits (here until its deadline), never no_runnable."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(clock, _source(max_concurrency=1), backend=backend)
    await _hold(backend)
    with pytest.raises(AllSourcesExhausted) as caught:
        await mw.run(_ok, deadline_s=1.0)
    assert caught.value.reason == "deadline"
    with pytest.raises(AllSourcesExhausted) as caught:
        async with mw.session(_ok, deadline_s=1.0):
            pass
    assert caught.value.reason == "deadline"
    with pytest.raises(AllSourcesExhausted) as caught:
        async with mw.session(_ok, fail_fast=True, op_name="stream"):
            pass
    assert caught.value.reason == "no_runnable"
    assert str(caught.value).startswith("stream: all sources exhausted")


async def test_session_defaults_to_a_request_lease_and_names_the_call() -> None:
    """session() leases for a request (timeout + grace), reserves no tpm, errors start "call:"."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    source = _source(timeout_s=6, ttft_timeout_s=1, stream_idle_timeout_s=2, tpm=600, tpm_burst=50)
    mw = _loop(clock, source, backend=backend, lease_grace_s=10.0, max_attempts=1)
    seen: list[float] = []

    async def attempt(source: SourceConfig, ctx: AttemptContext) -> str:
        seen.append(ctx.lease.ttl_s)
        return "ok"

    async with mw.session(attempt) as served:
        served.complete()
    await mw.run(attempt)
    async with mw.session(attempt, streaming=True) as served:
        served.complete()
    assert seen == [16.0, 16.0, 1.0 + 4.0 + 10.0]
    assert (await backend.snapshot(SCOPE)).sources[0].tpm_tokens == pytest.approx(50.0)
    with pytest.raises(AllSourcesExhausted) as caught:
        async with mw.session(_script(TransientError("x", status_code=503))):
            pass
    assert str(caught.value).startswith("call: all sources exhausted")


async def test_a_key_containing_another_is_scrubbed_whole() -> None:
    """Longest secret first: a key that contains another key leaves no tail behind."""
    clock = FakeClock()
    recorder = Recorder()
    short, long = "sk-zzzzzzzz", "sk-aaaaaaaa-sk-zzzzzzzz"
    mw = _loop(
        clock,
        _source("a", api_key=short),
        _source("b", api_key=long),
        emitter=recorder,
        max_attempts=1,
    )
    with pytest.raises(AllSourcesExhausted) as caught:
        await mw.run(_script(TransientError(f"upstream echoed {long}", status_code=503)))
    assert recorder.records[0].error == "upstream echoed ***"
    assert "aaaa" not in str(caught.value)


def test_repr_names_the_scope_and_its_sources() -> None:
    """The loop's repr shows its scope and source names (and no secret)."""
    mw = _loop(FakeClock(), _source("a"), _source("b"))
    assert repr(mw) == "RetryMW(scope='chat', sources=['a', 'b'])"


# --- back-off -----------------------------------------------------------------------------


def test_backoff_jitter_spans_the_upper_half_of_the_ceiling() -> None:
    """A draw of 0.9 gives 0.5 + 0.45 of the ceiling: equal jitter over [c/2, c]."""

    class _Nine(random.Random):
        def random(self) -> float:
            return 0.9

    assert backoff_delay(3, base_s=1.0, cap_s=100.0, rng=_Nine()) == pytest.approx(3.8)


async def test_a_charged_failure_restarts_the_429_back_off() -> None:
    """A 503 then an unhinted 429 back off by step 1 each: the 429 count starts over."""
    clock = FakeClock()
    mw = _loop(clock, exempt_429=True, backoff_base_s=0.5)
    attempt = _script(
        TransientError("x", status_code=503), TransientError("x", status_code=429), "ok"
    )
    await mw.run(attempt)
    assert clock.sleeps[:2] == [0.25, 0.25]


async def test_a_hinted_429_moves_on_without_a_back_off() -> None:
    """A 429 naming 0.5 s: no back-off sleep, the call waits for the reopen and no more."""
    clock = FakeClock()
    mw = _loop(clock, exempt_429=True, poll_interval_s=10.0)
    await mw.run(_script(TransientError("x", status_code=429, retry_after_s=0.5), "ok"))
    assert clock.sleeps == [pytest.approx(0.501)]


async def test_back_off_is_clipped_to_the_time_left() -> None:
    """With 0.5 s left and a 2 s back-off due, the call sleeps 0.5 s and ends at its deadline."""
    clock = FakeClock()
    mw = _loop(clock, backoff_base_s=4.0)
    with pytest.raises(AllSourcesExhausted) as caught:
        await mw.run(_script(TransientError("x", status_code=503)), deadline_s=0.5)
    assert caught.value.reason == "deadline"
    assert clock.sleeps == [0.5]


async def test_a_deadline_of_exactly_the_epsilon_ends_before_any_attempt() -> None:
    """1 ms left is no time left: the call ends with "deadline" and sends nothing."""
    clock = FakeClock(start=0.0)
    sent: list[str] = []

    async def attempt(source: SourceConfig, ctx: AttemptContext) -> str:
        sent.append(source.name)
        return "ok"

    mw = _loop(clock)
    with pytest.raises(AllSourcesExhausted) as caught:
        await mw.run(attempt, deadline_s=0.001)
    assert caught.value.reason == "deadline"
    assert sent == []


# --- the stall rule at its boundary -----------------------------------------------------


async def test_a_call_exactly_at_the_stall_window_is_not_past_it() -> None:
    """stalled_s == stall_window_s does not stall, even in a scope that never served."""
    clock = FakeClock()
    mw = _loop(clock, stall_window_s=300.0)
    call = mw.begin()
    clock.advance(300.0)
    assert not await call.stalled()
    assert call._age is None  # within its window a call never asks the backend
    clock.advance(1.0)
    assert await call.stalled()


async def test_progress_exactly_a_window_old_is_not_stale() -> None:
    """The scope served exactly stall_window_s ago: a long waiter is not stalled yet."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(clock, backend=backend, stall_window_s=300.0)
    await mw.run(_ok)
    call = mw.begin()
    clock.advance(300.0)
    call.clock._entered_at -= 1.0  # this call has waited a little longer than the window
    assert not await call.stalled()
    assert call._age == 300.0


async def test_the_stall_clock_bills_only_time_outside_attempts() -> None:
    """attempting() and the begin/end pair both subtract the attempt's time; waiting counts."""
    clock = FakeClock()
    stall = StallClock(clock)
    clock.advance(2.0)
    async with stall.attempting():
        clock.advance(5.0)
    stall.begin_attempt()
    clock.advance(3.0)
    stall.end_attempt()
    clock.advance(1.0)
    assert stall.stalled_s() == pytest.approx(3.0)


async def test_a_failed_attempt_is_productive_and_its_back_off_is_not() -> None:
    """A 10 s attempt that fails, then a 0.25 s back-off: the next attempt has stalled 0.25 s."""
    clock = FakeClock()
    mw = _loop(clock, backoff_base_s=0.5)
    stalled: list[float] = []

    async def slow_then_ok(source: SourceConfig, ctx: AttemptContext) -> str:
        stalled.append(ctx.stalled_s)
        if len(stalled) == 1:
            clock.advance(10.0)
            raise TransientError("x", status_code=503)
        return "ok"

    await mw.run(slow_then_ok)
    assert stalled == [0.0, pytest.approx(0.25)]


async def test_a_served_attempt_stays_productive_until_its_finish() -> None:
    """A body that runs 50 s after serve(): finish() ends the attempt, nothing is billed."""
    clock = FakeClock()
    mw = _loop(clock)
    call = mw.begin()
    served = await call.serve(_ok)
    clock.advance(50.0)
    served.complete()
    await call.finish(served, None)
    assert call.clock.stalled_s() == pytest.approx(0.0)
    assert [r.outcome for r in call.records] == ["success"]


# --- records ------------------------------------------------------------------------------


async def test_records_carry_the_scope_and_one_call_id_per_call() -> None:
    """Every attempt of a call shares its call id; another call has another; scope is set."""
    clock = FakeClock()
    recorder = Recorder()
    mw = _loop(clock, emitter=recorder)
    await mw.run(_script(TransientError("x", status_code=503), "ok"))
    await mw.run(_ok)
    first, second, third = recorder.records
    assert isinstance(first.call_id, str)
    assert first.call_id == second.call_id != third.call_id
    assert {r.scope for r in recorder.records} == {SCOPE}


async def test_a_cancelled_attempt_is_recorded_as_cancelled() -> None:
    """Cancelling a call mid-attempt leaves one record: outcome and error "cancelled"."""
    clock = FakeClock()
    recorder = Recorder()
    mw = _loop(clock, emitter=recorder)
    started = asyncio.Event()

    async def hang(source: SourceConfig, ctx: AttemptContext) -> str:
        started.set()
        await asyncio.Event().wait()
        return "never"

    task = asyncio.create_task(mw.run(hang))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    [record] = recorder.records
    assert (record.outcome, record.error) == ("cancelled", "cancelled")


async def test_a_hint_past_the_stall_window_is_logged_with_its_source(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 400 s back-off with a 300 s window is clamped, and the warning names the source."""
    clock = FakeClock()
    mw = _loop(clock, stall_window_s=300.0, max_attempts=1)
    with (
        caplog.at_level(logging.WARNING, logger="polygateway.retry"),
        pytest.raises(AllSourcesExhausted),
    ):
        await mw.run(_script(TransientError("x", status_code=503, retry_after_s=400.0)))
    assert [r.getMessage() for r in caplog.records] == [
        "primary asked to be left alone for 400 s; paused for the stall window (300 s) instead"
    ]


async def test_a_hint_of_exactly_the_stall_window_is_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A back-off equal to the window needs no clamping: nothing is logged."""
    clock = FakeClock()
    mw = _loop(clock, stall_window_s=300.0, max_attempts=1)
    with (
        caplog.at_level(logging.WARNING, logger="polygateway.retry"),
        pytest.raises(AllSourcesExhausted),
    ):
        await mw.run(_script(TransientError("x", status_code=503, retry_after_s=300.0)))
    assert caplog.records == []


# --- how a session's body ends ----------------------------------------------------------


async def test_a_body_timing_out_at_the_deadline_ends_the_call_as_deadline() -> None:
    """A request body whose timeout lands on the deadline ends the call with "deadline"."""
    clock = FakeClock()
    recorder = Recorder()
    mw = _loop(clock, _source(timeout_s=60), emitter=recorder)

    async def body_times_out() -> None:
        async with mw.session(_ok, deadline_s=1.0):
            clock.advance(1.0)
            raise TransientError("timed out", timeout=True)

    with pytest.raises(AllSourcesExhausted) as caught:
        await body_times_out()
    assert caught.value.reason == "deadline"
    assert recorder.outcomes() == ["cancelled"]


async def test_a_body_failing_with_a_hint_keeps_the_hint_and_logs_its_source(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A stream body cut by a 503 naming 400 s: clamped, logged with the source, recorded."""
    clock = FakeClock()
    recorder = Recorder()
    mw = _loop(clock, stall_window_s=300.0, emitter=recorder)
    with (
        caplog.at_level(logging.WARNING, logger="polygateway.retry"),
        pytest.raises(TransientError),
    ):
        async with mw.session(_ok):
            raise TransientError("cut", status_code=503, retry_after_s=400.0)
    assert caplog.records[0].getMessage().startswith("primary asked to be left alone")
    [record] = recorder.records
    assert (record.outcome, record.status_code) == ("transient", 503)


async def test_a_completed_body_that_then_raises_is_released_as_cancelled() -> None:
    """complete() then an error: the permit goes back as cancelled, not as a success."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    recorder = Recorder()
    mw = _loop(clock, backend=backend, emitter=recorder)

    async def complete_then_fail() -> None:
        async with mw.session(_ok) as served:
            served.complete()
            raise RuntimeError("consumer bug")

    with pytest.raises(RuntimeError):
        await complete_then_fail()
    assert recorder.outcomes() == ["cancelled"]
    assert recorder.records[0].error == "cancelled"
    assert await backend.progress_age_s(SCOPE) == float("inf")


async def test_a_success_without_usage_keeps_the_tpm_reservation() -> None:
    """No usage reported: the reserved tokens stay spent (no reconciliation to 0 or 1)."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(clock, _source(tpm=600, tpm_burst=50), backend=backend)
    await mw.run(_ok, cost_tokens=10)
    assert (await backend.snapshot(SCOPE)).sources[0].tpm_tokens == pytest.approx(40.0)

    async def with_usage(source: SourceConfig, ctx: AttemptContext) -> str:
        ctx.usage = Usage(prompt_tokens=2, completion_tokens=1, total_tokens=3)
        return "ok"

    await mw.run(with_usage, cost_tokens=10)
    assert (await backend.snapshot(SCOPE)).sources[0].tpm_tokens == pytest.approx(37.0)


async def test_a_failing_release_keeps_the_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A backend that fails to release: logged, the answer returned, failures still retried."""
    clock = FakeClock()

    class _BadRelease(MemoryBackend):
        __slots__ = ()

        async def release(self, lease: Any, outcome: AttemptOutcome) -> None:
            raise GovernanceBackendError("release lost", operation="release", scope=SCOPE)

    mw = _loop(clock, backend=_BadRelease(now=clock))
    with caplog.at_level(logging.WARNING, logger="polygateway"):
        served = await mw.run(_ok)
        with pytest.raises(AllSourcesExhausted):
            await mw.run(_script(*[TransientError("x", status_code=503)] * 3))
    assert served.value == "primary"
    assert any("release lost" in r.getMessage() for r in caplog.records)


async def test_a_queued_session_that_fails_gives_up_its_place() -> None:
    """A session queued behind a busy source ends at its deadline and leaves the queue empty."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    mw = _loop(clock, _source(max_concurrency=1), backend=backend)
    await _hold(backend)
    room = room_for(backend, SCOPE)
    room.enter()  # another call is queued first, so this one queues too
    with pytest.raises(AllSourcesExhausted) as caught:
        async with mw.session(_ok, deadline_s=1.0):
            pass
    assert caught.value.reason == "deadline"
    assert len(room) == 1


async def test_a_rejected_request_names_the_call_the_source_and_the_reason() -> None:
    """A 400 raises RequestRejected with the operation, the source and the upstream's words."""
    clock = FakeClock()
    mw = _loop(clock)
    with pytest.raises(RequestRejected) as caught:
        await mw.run(_script(TransientError("context too long", status_code=400)), op_name="chat")
    assert str(caught.value).startswith("chat: primary rejected the request: context too long")


# --- wake-ups of the queue ----------------------------------------------------------------


async def test_a_release_heard_while_queued_wakes_the_head_for_one_ask_only() -> None:
    """A queued head refused while a release was announced asks once more at once; refused
    again, it waits its poll (the wake-up is spent), not a second ask at once."""
    clock = FakeClock()
    backend = ReleasedDuringAcquire(clock, retake=True)
    mw = _loop(clock, _source(max_concurrency=1), backend=backend, poll_interval_s=10.0)
    held = await backend.acquire(SCOPE, [SourceSpec("primary", max_concurrency=1)], ttl_s=1e6)
    call = mw.begin()
    assert await call.pick() is None  # asked at once, refused: it queues as head
    await call.wait()
    assert clock() == 1005.0  # half the poll interval (every draw is 0)
    backend.lease = held.lease
    assert await call.pick() is None  # asked as the queue's head; the release came meanwhile
    await call.wait()
    assert clock() == 1005.0  # woken by that release: it asks again at once
    assert await call.pick() is None  # the permit was taken back
    await call.wait()
    assert clock() == 1010.0  # no wake-up left: it waits its poll
    call.leave()
