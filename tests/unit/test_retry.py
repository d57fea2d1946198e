"""The governance loop (middleware/retry.py) as a caller sees it: failover, breaker, pacing,
deadlines, FIFO waiting, backend cost, cancellation at every await, and the pure pieces."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import random
from typing import Any

import pytest
from _closing import closing

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings, ScopeConfig
from polygateway.errors import AllSourcesExhausted, GovernanceBackendError, RequestRejected
from polygateway.middleware.attempt import AttemptContext
from polygateway.middleware.retry import (
    LoopPolicy,
    RetryMW,
    StallClock,
    backoff_delay,
    verdict_for,
)
from polygateway.middleware.waiting import MAX_ASKING, room_for
from polygateway.testing import (
    BoundedSleep,
    CountingBackend,
    Delay,
    FakeClock,
    FakeTimers,
    FakeTransport,
    Gate,
    Hang,
    Recorder,
    ScriptExhausted,
    StreamScript,
    TransientError,
    chat_completion,
    embedding_body,
    gateway_settings,
    settle,
)
from polygateway.transport.http import HttpRequest
from polygateway.transport.openai import parse_embedding_response

MESSAGES = [{"role": "user", "content": "hi"}]


def make_chat(
    clock: FakeClock,
    script: Any = (),
    *,
    sources: tuple[Any, ...] = ("primary",),
    backend: Any = None,
    sleep: Any = None,
    transport_sleep: Any = None,
    emitter: Any = None,
    default: Any = None,
    settings: GatewaySettings | None = None,
    **gateway: Any,
) -> tuple[ChatClient, FakeTransport, Any]:
    """A chat client on a fake clock, a scripted transport and a memory backend."""
    settings = settings if settings is not None else gateway_settings(*sources, **gateway)
    backend = backend if backend is not None else MemoryBackend(now=clock)
    transport = FakeTransport(script, clock=clock, sleep=transport_sleep, default=default)
    chat = closing(
        ChatClient(
            settings,
            backend=backend,
            transport=transport,
            now=clock,
            sleep=sleep if sleep is not None else BoundedSleep(clock, max_calls=2000),
            rng=random.Random(11),
            emitter=emitter,
        )
    )
    return chat, transport, backend


async def hold_permit(backend: Any, source: str = "primary") -> Lease:
    """Take the only permit of a max_concurrency=1 source, as another holder would."""
    result = await backend.acquire("chat", [SourceSpec(source, max_concurrency=1)], ttl_s=1e6)
    assert result.lease is not None
    return result.lease


async def in_flight(backend: Any) -> int:
    """Permits held in the chat scope right now."""
    return (await backend.snapshot("chat")).in_flight


# --- pure pieces ------------------------------------------------------------------------


class TestBackoffDelay:
    """Capped exponential back-off with equal jitter."""

    @pytest.mark.parametrize("attempt", [1, 2, 3, 4, 5, 10, 100])
    def test_delay_lies_between_half_and_whole_of_the_capped_exponential(
        self, attempt: int
    ) -> None:
        """Every delay is in [d/2, d] with d = min(cap, base * 2**(attempt-1))."""
        rng = random.Random(attempt)
        ceiling = min(8.0, 0.5 * 2 ** (attempt - 1))
        for _ in range(50):
            delay = backoff_delay(attempt, base_s=0.5, cap_s=8.0, rng=rng)
            assert ceiling / 2 <= delay <= ceiling

    def test_same_rng_state_gives_the_same_delays(self) -> None:
        """The function is pure: equal rng states give equal sequences."""
        a = [backoff_delay(n, base_s=0.5, cap_s=8.0, rng=random.Random(5)) for n in range(1, 6)]
        b = [backoff_delay(n, base_s=0.5, cap_s=8.0, rng=random.Random(5)) for n in range(1, 6)]
        assert a == b

    def test_attempt_below_one_counts_as_one(self) -> None:
        """A zero or negative count backs off like the first attempt."""
        delay = backoff_delay(0, base_s=1.0, cap_s=8.0, rng=random.Random(1))
        assert 0.5 <= delay <= 1.0


class TestStallClock:
    """The per-call stall account: elapsed minus time inside attempts."""

    async def test_attempt_time_is_subtracted(self) -> None:
        """Time inside attempting() does not count; time outside does."""
        clock = FakeClock()
        stall = StallClock(clock)
        clock.advance(10)
        async with stall.attempting():
            clock.advance(100)
        clock.advance(5)
        assert stall.stalled_s() == pytest.approx(15)

    async def test_failed_attempt_still_counts_as_productive(self) -> None:
        """An attempt that raises is still subtracted, and its exception passes through."""
        clock = FakeClock()
        stall = StallClock(clock)

        async def failing_attempt() -> None:
            async with stall.attempting():
                clock.advance(50)
                raise KeyError("boom")

        with pytest.raises(KeyError):
            await failing_attempt()
        assert stall.stalled_s() == pytest.approx(0)

    async def test_cancellation_passes_through_attempting(self) -> None:
        """CancelledError raised inside attempting() is not swallowed."""
        clock = FakeClock()
        stall = StallClock(clock)

        async def cancelled_attempt() -> None:
            async with stall.attempting():
                clock.advance(3)
                raise asyncio.CancelledError

        with pytest.raises(asyncio.CancelledError):
            await cancelled_attempt()
        assert stall.stalled_s() == pytest.approx(0)


# --- failover, breaker, pacing, rejection -------------------------------------------------


class TestFailover:
    """A failed attempt moves on to another source through the same loop."""

    async def test_timeout_at_one_source_fails_over_to_another(self) -> None:
        """Source a hangs until its timeout; b answers; the call succeeds from b."""
        clock = FakeClock()
        chat, transport, _ = make_chat(
            clock,
            {"a": [Hang()], "b": [chat_completion("from b")]},
            sources=({"name": "a", "timeout_s": 20}, {"name": "b", "priority": 1}),
        )
        started = clock()
        response = await chat.complete(MESSAGES)
        assert response.text == "from b"
        assert response.source == "b"
        assert transport.sources_called() == ["a", "b"]
        assert transport.requests[0].timeout_s == 20
        assert [a.outcome for a in response.attempts] == ["transient", "success"]
        assert clock() - started >= 20

    async def test_breaker_opens_after_threshold_and_later_admits_one_probe(self) -> None:
        """After breaker_failures failures a is skipped; after the cool-down one probe goes to a."""
        clock = FakeClock()
        chat, transport, backend = make_chat(
            clock,
            {
                "a": [TransientError(status_code=503)] * 2 + [chat_completion("probe")],
                "b": [chat_completion("b")] * 3,
            },
            sources=("a", {"name": "b", "priority": 1}),
            breaker_failures=2,
            breaker_cooldown_s=30,
        )
        for _ in range(2):
            assert (await chat.complete(MESSAGES)).source == "b"
        snap = (await backend.snapshot("chat")).source("a")
        assert snap is not None
        assert snap.breaker == "open"
        before = len(transport.requests)
        assert (await chat.complete(MESSAGES)).source == "b"
        assert transport.sources_called()[before:] == ["b"]  # a was not even tried
        clock.advance(31)
        probe = await chat.complete(MESSAGES)
        assert probe.source == "a"
        assert probe.text == "probe"
        snap = (await backend.snapshot("chat")).source("a")
        assert snap is not None
        assert snap.breaker == "closed"

    async def test_retry_after_paces_the_source_while_another_serves(self) -> None:
        """A 429 with Retry-After: 2 keeps a out for 2 s of the fake clock; b serves meanwhile."""
        clock = FakeClock()
        chat, transport, _ = make_chat(
            clock,
            {
                "a": [TransientError(status_code=429, retry_after_s=2.0), chat_completion("a")],
                "b": [chat_completion("b")] * 2,
            },
            sources=("a", {"name": "b", "priority": 1}),
        )
        first = await chat.complete(MESSAGES)
        assert first.source == "b"
        assert [a.outcome for a in first.attempts] == ["rate_limited", "success"]
        paced = await chat.complete(MESSAGES)
        assert paced.source == "b"
        clock.advance(2.0)
        assert (await chat.complete(MESSAGES)).source == "a"
        assert transport.sources_called() == ["a", "b", "b", "a"]

    async def test_bad_request_raises_request_rejected_after_one_attempt(self) -> None:
        """A 400 raises RequestRejected at once: no retry, no other source."""
        clock = FakeClock()
        chat, transport, backend = make_chat(
            clock,
            {"a": [TransientError(status_code=400)], "b": [chat_completion()]},
            sources=("a", {"name": "b", "priority": 1}),
        )
        with pytest.raises(RequestRejected) as caught:
            await chat.complete(MESSAGES)
        assert caught.value.status_code == 400
        assert caught.value.scope == "chat"
        assert caught.value.sources == ("a",)
        assert len(transport.requests) == 1
        assert await in_flight(backend) == 0

    async def test_misconfigured_source_trips_long_and_another_serves(self) -> None:
        """A 401 trips a's breaker for cooldown_max_s; b serves the call."""
        clock = FakeClock()
        chat, _, backend = make_chat(
            clock,
            {"a": [TransientError(status_code=401)], "b": [chat_completion("b")]},
            sources=("a", {"name": "b", "priority": 1}),
            breaker_cooldown_max_s=300,
        )
        assert (await chat.complete(MESSAGES)).source == "b"
        snap = (await backend.snapshot("chat")).source("a")
        assert snap is not None
        assert snap.breaker == "open"
        assert snap.reopen_in_s is not None
        assert snap.reopen_in_s > 290

    async def test_charged_failures_end_in_retry_exhausted(self) -> None:
        """max_attempts charged failures end the call with reason "retry_exhausted"."""
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, default=TransientError(status_code=503))
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES)
        assert caught.value.reason == "retry_exhausted"
        assert len(caught.value.attempts) == 3
        assert len(transport.requests) == 3
        # The message says what the last attempt ran into, not only that all failed.
        assert "last: primary: HTTP 503" in str(caught.value)

    async def test_429_is_charged_when_the_scope_is_not_exempt(self) -> None:
        """With exempt_429=False every 429 burns the retry budget (embedding, OCR)."""
        clock = FakeClock()
        base = gateway_settings("primary")
        settings = GatewaySettings(
            _env_file=None,
            scopes={
                "chat": ScopeConfig(
                    kind="chat", exempt_429=False, sources=base.scope("chat").sources
                )
            },
        )
        chat, transport, _ = make_chat(
            clock, settings=settings, default=TransientError(status_code=429)
        )
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES)
        assert caught.value.reason == "retry_exhausted"
        assert len(transport.requests) == 3

    async def test_back_off_grows_with_consecutive_unhinted_429s(self) -> None:
        """429s without a hint are free but not cheap: the gaps grow as charged back-offs do."""
        clock = FakeClock()
        sent: list[float] = []

        def limited(request: HttpRequest) -> TransientError:
            sent.append(clock())
            return TransientError(status_code=429)

        chat, transport, _ = make_chat(clock, [limited] * 4 + [chat_completion()])
        response = await chat.complete(MESSAGES)
        assert [a.outcome for a in response.attempts][-1] == "success"
        assert len(transport.requests) == 5  # four free 429s, then the answer
        gaps = [b - a for a, b in itertools.pairwise([*sent, clock()])]
        # Each gap is the longer of the default 1 s pause and the call's own back-off,
        # whose bands double: [0.25, 0.5], [0.5, 1], [1, 2], [2, 4].
        assert all(gap >= 1.0 for gap in gaps)
        assert 2.0 <= gaps[-1] <= 4.0 + 1e-2

    async def test_hinted_429_is_waited_out_exactly_without_own_back_off(self) -> None:
        """A 429 naming its back-off pauses its source that long; the call adds nothing to it."""
        clock = FakeClock()
        sent: list[float] = []

        def limited(request: HttpRequest) -> TransientError:
            sent.append(clock())
            return TransientError(status_code=429, retry_after_s=2.0)

        chat, _, _ = make_chat(clock, [limited] * 3 + [chat_completion()], poll_interval_s=30.0)
        response = await chat.complete(MESSAGES)
        assert response.attempts[-1].outcome == "success"
        gaps = [b - a for a, b in itertools.pairwise([*sent, clock()])]
        assert gaps == [pytest.approx(2.0, abs=0.005)] * 3

    async def test_untried_sources_come_first_on_retry(self) -> None:
        """A retry goes to a source this call has not tried, even a lower tier."""
        clock = FakeClock()
        chat, transport, _ = make_chat(
            clock,
            {
                "a": [TransientError(status_code=500)],
                "b": [TransientError(status_code=500)],
                "c": [chat_completion("c")],
            },
            sources=("a", {"name": "b", "priority": 1}, {"name": "c", "priority": 2}),
        )
        assert (await chat.complete(MESSAGES)).source == "c"
        assert transport.sources_called() == ["a", "b", "c"]

    async def test_busy_higher_tier_spills_over_without_waiting(self) -> None:
        """A full tier-0 source does not make a call wait while tier 1 is free."""
        clock = FakeClock()
        backend = MemoryBackend(now=clock)
        chat, transport, _ = make_chat(
            clock,
            {"b": [chat_completion("b")]},
            sources=({"name": "a", "max_concurrency": 1}, {"name": "b", "priority": 1}),
            backend=backend,
        )
        await hold_permit(backend, "a")
        started = clock()
        response = await chat.complete(MESSAGES)
        assert response.source == "b"
        assert clock() == started
        assert transport.sources_called() == ["b"]


# --- errors: retry_after_s, fail_fast, deadlines --------------------------------------------


class TestExhaustion:
    """The error that ends a call says why and when to come back."""

    async def test_every_source_refusing_the_call_ends_it_at_once(self) -> None:
        """A scope whose only source answers 401 ends retry_exhausted now, not after the window.

        The 401 trips the breaker long; waiting out its cool-down (the stall
        window, 300 s by default) could not serve the call.
        """
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, default=TransientError(status_code=401))
        started = clock()
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES)
        assert caught.value.reason == "retry_exhausted"
        assert len(transport.requests) == 1
        assert clock() - started < 1.0
        assert "HTTP 401" in str(caught.value)

    async def test_one_refusing_source_fails_over_to_the_other(self) -> None:
        """A 401 on one source moves the call to the next, which serves it."""
        clock = FakeClock()
        transport_script = {"a": [TransientError(status_code=401)], "b": [chat_completion("b")]}
        chat, _, _ = make_chat(clock, transport_script, sources=("a", "b"))
        response = await chat.complete(MESSAGES)
        assert response.source == "b"

    @pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, "10", True])
    async def test_invalid_deadline_is_rejected_before_any_request(self, bad: Any) -> None:
        """deadline_s must be a finite, non-negative number; anything else is RequestRejected."""
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, [chat_completion()])
        with pytest.raises(RequestRejected, match="deadline_s"):
            await chat.complete(MESSAGES, deadline_s=bad)
        assert transport.requests == []

    async def test_retry_after_is_the_earliest_reopening_across_sources(self) -> None:
        """retry_after_s equals the earliest breaker reopening among the sources."""
        clock = FakeClock()
        chat, _, backend = make_chat(
            clock,
            {
                "a": [TransientError(status_code=503)],
                "b": [Delay(10.0, TransientError(status_code=503))],
            },
            sources=("a", {"name": "b", "priority": 1}),
            breaker_failures=1,
            breaker_cooldown_s=30,
        )
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES, fail_fast=True)
        snap = await backend.snapshot("chat")
        reopen = {s.name: s.reopen_in_s for s in snap.sources}
        assert caught.value.reason == "no_runnable"
        assert reopen["a"] is not None
        assert reopen["b"] is not None
        assert reopen["a"] < reopen["b"]
        assert caught.value.retry_after_s == pytest.approx(reopen["a"])

    async def test_fail_fast_raises_no_runnable_without_waiting(self) -> None:
        """fail_fast=True with every permit taken raises "no_runnable" at once."""
        clock = FakeClock()
        backend = MemoryBackend(now=clock)
        chat, transport, _ = make_chat(
            clock, sources=({"name": "primary", "max_concurrency": 1},), backend=backend
        )
        await hold_permit(backend)
        started = clock()
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES, fail_fast=True)
        assert caught.value.reason == "no_runnable"
        assert caught.value.retry_after_s is None  # only a release frees a permit
        assert clock() == started
        assert transport.requests == []

    async def test_deadline_ends_a_hanging_call_at_the_deadline(self) -> None:
        """deadline_s=10 with a hanging source ends at 10 s with "deadline", not 3 x timeout_s."""
        clock = FakeClock()
        chat, transport, _ = make_chat(
            clock, default=Hang(), sources=({"name": "primary", "timeout_s": 60},)
        )
        started = clock()
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES, deadline_s=10)
        assert caught.value.reason == "deadline"
        assert clock() - started == pytest.approx(10)
        assert transport.requests[0].timeout_s == pytest.approx(10)

    async def test_deadline_clips_waiting_for_a_permit(self) -> None:
        """A call waiting for a permit ends at its deadline."""
        clock = FakeClock()
        backend = MemoryBackend(now=clock)
        chat, transport, _ = make_chat(
            clock, sources=({"name": "primary", "max_concurrency": 1},), backend=backend
        )
        await hold_permit(backend)
        started = clock()
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES, deadline_s=5)
        assert caught.value.reason == "deadline"
        assert clock() - started == pytest.approx(5, abs=0.01)
        assert transport.requests == []

    async def test_attempt_timeout_is_clipped_to_the_time_left(self) -> None:
        """The second attempt gets only what the deadline leaves of timeout_s."""
        clock = FakeClock()
        chat, transport, _ = make_chat(
            clock,
            [Delay(7.0, TransientError(status_code=503)), chat_completion()],
            sources=({"name": "primary", "timeout_s": 60},),
        )
        await chat.complete(MESSAGES, deadline_s=10)
        first, second = transport.requests
        assert first.timeout_s == pytest.approx(10)
        assert second.timeout_s < 3.0

    async def test_caller_timeout_cancels_the_attempt_and_frees_the_permit(self) -> None:
        """asyncio.timeout() around a call cancels the attempt in flight and frees its permit."""
        clock = FakeClock()
        chat, _, backend = make_chat(clock, [Gate()])
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await chat.complete(MESSAGES)
        assert await in_flight(backend) == 0


# --- waiting: FIFO and cost ------------------------------------------------------------------


class TestWaiting:
    """Waiting calls form one FIFO; only its head polls the backend."""

    async def test_calls_reach_the_upstream_in_submission_order(self) -> None:
        """With max_concurrency=1, calls submitted while the permit is held are served FIFO."""
        clock = FakeClock()
        timers = FakeTimers(clock)
        seen: list[str] = []

        def answer(request: Any) -> dict[str, Any]:
            seen.append(request.json["messages"][0]["content"])
            return chat_completion()

        gate = Gate(answer)
        chat, _, _ = make_chat(
            clock,
            [gate],
            default=answer,
            sources=({"name": "primary", "max_concurrency": 1},),
            sleep=timers.sleep,
        )
        tasks = [asyncio.create_task(chat.complete([{"role": "user", "content": "call-0"}]))]
        await gate.wait_entered()
        for i in range(1, 6):
            tasks.append(
                asyncio.create_task(chat.complete([{"role": "user", "content": f"call-{i}"}]))
            )
            await settle()
        gate.open()
        for _ in range(50):
            if all(t.done() for t in tasks):
                break
            await timers.advance(0.5)
        await asyncio.gather(*tasks)
        assert seen == [f"call-{i}" for i in range(6)]

    @staticmethod
    async def _acquires_while_waiting(waiters: int, window_s: float) -> int:
        """Backend acquires made during ``window_s`` by ``waiters`` calls blocked on one permit."""
        clock = FakeClock()
        timers = FakeTimers(clock)
        backend = CountingBackend(MemoryBackend(now=clock))
        chat, _, _ = make_chat(
            clock,
            sources=({"name": "primary", "max_concurrency": 1},),
            backend=backend,
            sleep=timers.sleep,
        )
        await hold_permit(backend)
        tasks = [asyncio.create_task(chat.complete(MESSAGES)) for _ in range(waiters)]
        await settle()
        assert len(room_for(backend, "chat")) == waiters
        before = backend.calls.get("acquire", 0)
        for _ in range(int(window_s / 0.25)):
            await timers.advance(0.25, turns=3)
        polls = backend.calls.get("acquire", 0) - before
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return polls

    async def test_a_thousand_waiters_poll_no_more_than_one(self) -> None:
        """1,000 waiting calls cost the backend no more polls per interval than a single one."""
        single = await self._acquires_while_waiting(1, window_s=10.0)
        crowd = await self._acquires_while_waiting(1000, window_s=10.0)
        assert 0 < single <= 10.0 / (0.5 * 0.5) + 1  # jittered polls, 0.25-0.5 s apart
        assert crowd <= single

    async def test_concurrency_never_exceeds_max_concurrency(self) -> None:
        """Ten concurrent calls on a source with max_concurrency=2: at most two in flight."""
        clock = FakeClock()
        timers = FakeTimers(clock)
        chat, transport, backend = make_chat(
            clock,
            default=Delay(1.0, chat_completion()),
            sources=({"name": "primary", "max_concurrency": 2},),
            sleep=timers.sleep,
            transport_sleep=timers.sleep,
        )
        tasks = [asyncio.create_task(chat.complete(MESSAGES)) for _ in range(10)]
        for _ in range(100):
            if all(t.done() for t in tasks):
                break
            await timers.advance(0.25)
        assert [r.text for r in await asyncio.gather(*tasks)] == ["ok"] * 10
        assert transport.max_in_flight == 2
        assert len(transport.requests) == 10
        assert await in_flight(backend) == 0

    async def test_a_call_that_never_waits_costs_two_backend_operations(self) -> None:
        """acquire + release, nothing else, for a call served at once."""
        clock = FakeClock()
        backend = CountingBackend(MemoryBackend(now=clock))
        chat, _, _ = make_chat(clock, [chat_completion()], backend=backend)
        await chat.complete(MESSAGES)
        assert backend.calls == {"acquire": 1, "release": 1}


class BackendWithoutClasses(MemoryBackend):
    """A backend written before ``acquire`` took ``priority_class``: no such keyword."""

    async def acquire(  # type: ignore[override]
        self, scope: str, candidates: Any, *, cost_tokens: int = 0, ttl_s: float
    ) -> Any:
        return await super().acquire(scope, candidates, cost_tokens=cost_tokens, ttl_s=ttl_s)


async def test_a_backend_without_the_class_keyword_serves_a_scope_without_floors() -> None:
    """Only a call of a class with reserved permits names its class to the backend."""
    clock = FakeClock()
    chat, _, _ = make_chat(clock, [chat_completion()], backend=BackendWithoutClasses(now=clock))
    assert (await chat.complete(MESSAGES)).text


class GatedBackend(MemoryBackend):
    """A memory backend that holds every acquire at a gate and counts those in flight."""

    def __init__(self, *, now: FakeClock) -> None:
        super().__init__(now=now)
        self.gate = asyncio.Event()
        self.asking = 0
        self.most_asking = 0
        self.acquires = 0

    async def acquire(
        self,
        scope: str,
        candidates: Any,
        *,
        cost_tokens: int = 0,
        ttl_s: float,
        priority_class: str = "",
    ) -> Any:
        """Count the acquires in flight, wait at the gate, then acquire."""
        self.asking += 1
        self.most_asking = max(self.most_asking, self.asking)
        try:
            await self.gate.wait()
        finally:
            self.asking -= 1
        self.acquires += 1
        return await super().acquire(
            scope, candidates, cost_tokens=cost_tokens, ttl_s=ttl_s, priority_class=priority_class
        )


class TestAskingBound:
    """A scope runs at most ``MAX_ASKING`` acquires at once per process; later calls queue."""

    @staticmethod
    async def _burst(
        calls: int, *, max_concurrency: int = 100
    ) -> tuple[GatedBackend, int, list[str], FakeTransport]:
        """``calls`` at once on a held gate: the backend, how many queued, the texts served."""
        clock = FakeClock()
        timers = FakeTimers(clock)
        backend = GatedBackend(now=clock)
        chat, transport, _ = make_chat(
            clock,
            # Each answer takes a second: the permits stay held while the others queue.
            default=Delay(1.0, chat_completion()),
            sources=({"name": "primary", "max_concurrency": max_concurrency},),
            backend=backend,
            sleep=timers.sleep,
            transport_sleep=timers.sleep,
        )
        tasks = [
            asyncio.create_task(chat.complete([{"role": "user", "content": str(i)}]))
            for i in range(calls)
        ]
        await settle()
        queued = len(room_for(backend, "chat"))
        backend.gate.set()
        for _ in range(10 * calls):  # bounded: each second of fake time serves two or more
            await timers.advance(0.5)
            if all(t.done() for t in tasks):
                break
        texts = [r.text for r in await asyncio.gather(*tasks)]
        return backend, queued, texts, transport

    async def test_a_burst_past_the_bound_queues_behind_the_head(self) -> None:
        """MAX_ASKING - 1 calls ask at once, the next asks as the head, the rest wait behind it."""
        extra = 6
        backend, queued, texts, _ = await self._burst(MAX_ASKING + extra)
        assert backend.most_asking == MAX_ASKING
        assert queued == extra + 1  # the head asks from the queue; the others wait behind it
        assert texts == ["ok"] * (MAX_ASKING + extra)
        assert backend.acquires == MAX_ASKING + extra

    async def test_a_burst_within_the_bound_asks_at_once(self) -> None:
        """Fewer calls than the bound: every one asks at once, nobody queues."""
        backend, queued, texts, _ = await self._burst(MAX_ASKING - 1)
        assert backend.most_asking == MAX_ASKING - 1
        assert queued == 0
        assert texts == ["ok"] * (MAX_ASKING - 1)

    async def test_waiters_are_served_in_arrival_order_past_the_bound(self) -> None:
        """100 calls on 2 permits reach the upstream in the order they were made.

        Calls refused after asking at once take their place by arrival, ahead
        of the later calls that queued while their acquires were in flight.
        """
        calls = 100
        _, _, texts, transport = await self._burst(calls, max_concurrency=2)
        assert texts == ["ok"] * calls
        order = [int(_sent_text(r)) for r in transport.requests]
        assert order == list(range(calls))


def _sent_text(request: Any) -> str:
    """The user message a chat request carried."""
    return str(request.json["messages"][0]["content"])


# --- the backend failing ---------------------------------------------------------------------


class TestBackendFailures:
    """Fail closed before an attempt; never lose an answer after one."""

    async def test_answer_survives_a_failing_release(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A release failing after the upstream answered: the answer still returns."""
        clock = FakeClock()

        class BrokenRelease(MemoryBackend):
            __slots__ = ()

            async def release(self, lease: Lease, outcome: AttemptOutcome) -> None:
                raise GovernanceBackendError("redis went away", operation="release")

        chat, _, _ = make_chat(clock, [chat_completion("kept")], backend=BrokenRelease(now=clock))
        with caplog.at_level(logging.WARNING, logger="polygateway"):
            response = await chat.complete(MESSAGES)
        assert response.text == "kept"
        assert "release" in caplog.text
        assert "redis went away" in caplog.text
        assert "sk-test-" not in caplog.text

    async def test_failing_acquire_fails_closed(self) -> None:
        """acquire raising GovernanceBackendError ends the call with it; nothing runs ungoverned."""
        clock = FakeClock()

        class BrokenAcquire(MemoryBackend):
            __slots__ = ()

            async def acquire(self, *args: Any, **kwargs: Any) -> Any:
                raise GovernanceBackendError("redis went away", operation="acquire")

        chat, transport, _ = make_chat(clock, [chat_completion()], backend=BrokenAcquire(now=clock))
        with pytest.raises(GovernanceBackendError):
            await chat.complete(MESSAGES)
        assert transport.requests == []

    async def test_backend_failure_fails_every_queued_call_at_once(self) -> None:
        """When the head's acquire fails, the calls queued behind it fail closed too, at once.

        Otherwise each would become head in turn and wait out the backend's
        timeout on its own: the last of N would fail N timeouts late.
        """
        clock = FakeClock()
        timers = FakeTimers(clock)

        class GoesDown(MemoryBackend):
            __slots__ = ("acquires", "down")

            def __init__(self, *, now: Any) -> None:
                super().__init__(now=now)
                self.down = False
                self.acquires = 0

            async def acquire(self, *args: Any, **kwargs: Any) -> Any:
                self.acquires += 1
                if self.down:
                    raise GovernanceBackendError("redis went away", operation="acquire")
                return await super().acquire(*args, **kwargs)

        backend = GoesDown(now=clock)
        chat, transport, _ = make_chat(
            clock,
            [],
            sources=({"name": "primary", "max_concurrency": 1},),
            backend=backend,
            sleep=timers.sleep,
        )
        await hold_permit(backend)
        tasks = [asyncio.create_task(chat.complete(MESSAGES)) for _ in range(4)]
        await settle()
        assert len(room_for(backend, "chat")) == 4
        backend.down = True
        asked = backend.acquires
        started = clock()
        await timers.advance(1.0)  # the head's next poll meets the failure
        await settle()
        assert all(t.done() for t in tasks)
        for task in tasks:
            assert isinstance(task.exception(), GovernanceBackendError)
        assert backend.acquires == asked + 1  # only the head asked; the others failed with it
        assert clock() - started <= 1.0
        assert room_for(backend, "chat").empty
        assert transport.requests == []

    async def test_the_backend_runs_in_the_callers_task(self) -> None:
        """Backends are cancellation-safe: the loop awaits them directly, no task per operation."""
        clock = FakeClock()
        seen: list[asyncio.Task[Any] | None] = []

        class Spy(MemoryBackend):
            __slots__ = ()

            async def acquire(self, *args: Any, **kwargs: Any) -> Any:
                seen.append(asyncio.current_task())
                return await super().acquire(*args, **kwargs)

            async def release(self, *args: Any, **kwargs: Any) -> None:
                seen.append(asyncio.current_task())
                await super().release(*args, **kwargs)

        chat, _, _ = make_chat(clock, [chat_completion()], backend=Spy(now=clock))
        caller = asyncio.create_task(chat.complete(MESSAGES))
        await caller
        assert seen == [caller, caller]


# --- cancellation at every await ----------------------------------------------------------


class TestCancellation:
    """A cancellation anywhere releases the permit at once and passes through."""

    async def test_cancel_during_acquire_leaks_no_permit(self) -> None:
        """Cancelled while acquire runs: no permit stays held, even if the backend grants late."""
        clock = FakeClock()
        backend = CountingBackend(MemoryBackend(now=clock))
        backend.hold_acquire = asyncio.Event()
        chat, transport, _ = make_chat(clock, [chat_completion()], backend=backend)
        task = asyncio.create_task(chat.complete(MESSAGES))
        await settle()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await in_flight(backend) == 0
        backend.hold_acquire.set()  # the backend grants the lease after the caller left
        await settle()
        assert backend.calls.get("acquire") == 1
        assert await in_flight(backend) == 0
        assert transport.requests == []

    async def test_cancel_during_attempt_frees_the_permit(self) -> None:
        """Cancelled while the request is in flight: the permit is free right after."""
        clock = FakeClock()
        gate = Gate()
        chat, _, backend = make_chat(clock, [gate])
        task = asyncio.create_task(chat.complete(MESSAGES))
        await gate.wait_entered()
        assert await in_flight(backend) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await in_flight(backend) == 0

    async def test_cancel_during_backoff_sleep_leaves_nothing_behind(self) -> None:
        """Cancelled in the back-off after a failure: no permit held, no waiter left."""
        clock = FakeClock()
        timers = FakeTimers(clock)
        recorder = Recorder()
        chat, _, backend = make_chat(
            clock, [TransientError(status_code=503)], sleep=timers.sleep, emitter=recorder
        )
        task = asyncio.create_task(chat.complete(MESSAGES))
        await settle()
        assert recorder.outcomes() == ["transient"]
        assert timers.pending == 1  # the back-off sleep
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await in_flight(backend) == 0
        assert room_for(backend, "chat").empty

    async def test_cancel_during_waiting_frees_the_queue_place(self) -> None:
        """Cancelled while queued behind another waiter: it leaves the FIFO, the head stays."""
        clock = FakeClock()
        timers = FakeTimers(clock)
        backend = MemoryBackend(now=clock)
        chat, _, _ = make_chat(
            clock,
            [chat_completion()],
            sources=({"name": "primary", "max_concurrency": 1},),
            backend=backend,
            sleep=timers.sleep,
        )
        lease = await hold_permit(backend)
        head = asyncio.create_task(chat.complete(MESSAGES))
        await settle()
        behind = asyncio.create_task(chat.complete(MESSAGES))
        await settle()
        room = room_for(backend, "chat")
        assert len(room) == 2
        behind.cancel()
        with pytest.raises(asyncio.CancelledError):
            await behind
        assert len(room) == 1
        await backend.release(lease, AttemptOutcome("cancelled"))
        await settle()
        assert (await head).text == "ok"
        assert await in_flight(backend) == 0

    async def test_cancel_during_release_still_frees_the_permit(self) -> None:
        """Cancelled while the release is in progress: the release completes regardless."""
        clock = FakeClock()
        backend = CountingBackend(MemoryBackend(now=clock))
        backend.hold_release = asyncio.Event()
        chat, _, _ = make_chat(clock, [chat_completion()], backend=backend)
        task = asyncio.create_task(chat.complete(MESSAGES))
        await settle()
        assert await in_flight(backend) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        backend.hold_release.set()
        await settle()
        assert backend.calls.get("release") == 1
        assert await in_flight(backend) == 0


# --- the generic loop, as embedding and OCR clients use it ---------------------------------


class TestRetryMWDirectly:
    """RetryMW.run with an attempt function of the caller's own."""

    async def test_run_returns_the_value_its_source_and_attempts(self) -> None:
        """run() hands back Served with the value, the source and the attempt records."""
        clock = FakeClock()
        settings = gateway_settings("a", "b", scope="embed", kind="embed")
        scope = settings.scope("embed")
        backend = MemoryBackend(now=clock)
        recorder = Recorder()
        mw = RetryMW(
            scope="embed",
            sources=scope.sources,
            policy=LoopPolicy.from_settings(settings, scope),
            backend=backend,
            now=clock,
            sleep=BoundedSleep(clock),
            rng=random.Random(1),
            emitter=recorder,
        )
        assert mw.policy.exempt_429 is False
        seen: list[AttemptContext] = []

        async def attempt(source: Any, ctx: AttemptContext) -> str:
            seen.append(ctx)
            if ctx.attempt == 1:
                raise TransientError(status_code=502)
            return f"vectors from {source.name}"

        served = await mw.run(attempt, cost_tokens=3, op_name="embed")
        assert served.value == f"vectors from {served.source}"
        assert [a.outcome for a in served.attempts] == ["transient", "success"]
        assert recorder.records == list(served.attempts)
        assert {r.call_id for r in served.attempts} == {seen[0].call_id}
        assert seen[0].source != seen[1].source  # the retry went to the untried source
        assert (await backend.snapshot("embed")).in_flight == 0


# --- the test kit itself ------------------------------------------------------------------


async def drain_stream(transport: FakeTransport, request: HttpRequest, got: list[Any]) -> None:
    """Read a scripted stream into ``got`` until it ends or fails."""
    async with transport.stream(request) as events:
        async for item in events:
            got.append(item)


class TestFakeTransport:
    """The scripted upstream behaves as documented."""

    async def test_hang_moves_the_clock_by_exactly_the_timeout(self) -> None:
        """Hang() sleeps the request's effective timeout, then raises a timeout failure."""
        clock = FakeClock()
        transport = FakeTransport([Hang()], clock=clock)
        request = HttpRequest(source="s", url="http://127.0.0.1:9/x", timeout_s=7.5)
        started = clock()
        with pytest.raises(TransientError) as caught:
            await transport.send(request)
        assert caught.value.timeout
        assert verdict_for(caught.value, exempt_429=True).outcome.aimd_decrease
        assert clock() - started == 7.5

    async def test_delay_cut_at_timeout_times_out_at_the_requests_timeout(self) -> None:
        """Delay(30, body, cut_at_timeout=True) under a 5 s timeout fails as a timeout at 5 s."""
        clock = FakeClock()
        late = Delay(30.0, chat_completion("late"), cut_at_timeout=True)
        transport = FakeTransport([late, late], clock=clock)
        started = clock()
        with pytest.raises(TransientError) as caught:
            await transport.send(HttpRequest("s", "http://127.0.0.1:9/x", 5.0))
        assert caught.value.timeout
        assert clock() - started == 5.0
        body = await transport.send(HttpRequest("s", "http://127.0.0.1:9/x", 60.0))
        assert body["choices"][0]["message"]["content"] == "late"
        assert clock() - started == 35.0

    async def test_plain_delay_plays_past_the_timeout(self) -> None:
        """Without cut_at_timeout a Delay longer than timeout_s still plays its outcome."""
        clock = FakeClock()
        transport = FakeTransport([Delay(30.0, {"n": 1})], clock=clock)
        assert await transport.send(HttpRequest("s", "http://127.0.0.1:9/x", 5.0)) == {"n": 1}

    async def test_stream_is_cut_at_its_end_with_the_deadline_message(self) -> None:
        """A stream with deadline_in_s=2.5 and 1 s gaps yields 3 events, then fails at 2.5 s."""
        clock = FakeClock()
        transport = FakeTransport(
            [StreamScript([{"n": i} for i in range(10)], gap_s=1.0)], clock=clock
        )
        request = HttpRequest(
            "s", "http://127.0.0.1:9/x", 5.0, idle_timeout_s=5.0, deadline_in_s=2.5
        )
        started = clock()
        got: list[Any] = []
        with pytest.raises(TransientError, match="call deadline reached") as caught:
            await drain_stream(transport, request, got)
        assert caught.value.timeout
        assert got == [{"n": 0}, {"n": 1}, {"n": 2}]
        assert clock() - started == pytest.approx(2.5)

    async def test_stream_gap_longer_than_idle_fails_as_stream_idle(self) -> None:
        """A scripted gap of 3 s under a 2 s idle timeout fails as 'stream idle' at 2 s."""
        clock = FakeClock()
        transport = FakeTransport([StreamScript([{"n": 0}, {"n": 1}], gap_s=3.0)], clock=clock)
        request = HttpRequest("s", "http://127.0.0.1:9/x", 5.0, idle_timeout_s=2.0)
        started = clock()
        got: list[Any] = []
        with pytest.raises(TransientError, match="stream idle") as caught:
            await drain_stream(transport, request, got)
        assert caught.value.timeout
        assert got == [{"n": 0}]
        assert clock() - started == 2.0

    async def test_per_source_scripts_fall_back_to_the_shared_one(self) -> None:
        """A source's own script is used first, then the shared script, then the default."""
        transport = FakeTransport({"a": [{"n": 1}]}, default={"n": 0})
        transport.add({"n": 2})
        ask = HttpRequest(source="a", url="http://127.0.0.1:9/a", timeout_s=1)
        assert [await transport.send(ask) for _ in range(3)] == [{"n": 1}, {"n": 2}, {"n": 0}]

    async def test_running_out_of_script_fails_loudly(self) -> None:
        """With no default, one request too many raises ScriptExhausted."""
        transport = FakeTransport([])
        with pytest.raises(ScriptExhausted):
            await transport.send(HttpRequest(source="s", url="http://127.0.0.1:9/", timeout_s=1))

    async def test_callables_and_awaitables_are_played(self) -> None:
        """A callable outcome gets the request; its (awaited) result is played in turn."""

        async def answer(request: HttpRequest) -> Any:
            return TransientError(f"no {request.source}", status_code=503)

        transport = FakeTransport([answer])
        with pytest.raises(TransientError, match="no s"):
            await transport.send(HttpRequest(source="s", url="http://127.0.0.1:9/", timeout_s=1))

    def test_recorded_requests_never_show_headers(self) -> None:
        """The repr of a recorded request leaves headers (credentials) and body out."""
        request = HttpRequest(
            source="s",
            url="http://127.0.0.1:9/",
            timeout_s=1,
            headers={"Authorization": "Bearer sk-test-hidden"},
            json={"messages": ["private"]},
        )
        assert "sk-test-hidden" not in repr(request)
        assert "private" not in repr(request)

    def test_embedding_body_parses_as_an_openai_answer(self) -> None:
        """embedding_body builds what the OpenAI embeddings reader accepts."""
        vectors, usage = parse_embedding_response(embedding_body([[0.1, 0.2], [0.3, 0.4]]), 2)
        assert vectors == [[0.1, 0.2], [0.3, 0.4]]
        assert usage.prompt_tokens == 2
