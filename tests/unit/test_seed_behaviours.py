"""The stall-budget behaviours, each pinned by name (research-wiki/ARCHITECTURE.md section 3).

Each test here turns red when one behaviour of the stall budget is broken on
its own, and none of them can hang: a call that should end but does not is
run by ``run_on_fake_clock``, which gives up once the fake clock has passed
a bound, cancels the call and fails the test.

- embedding and OCR have no main-loop stall check: the stall rule inside
  ``_on_no_runnable`` is their only backstop, and it ends a call on a scope
  that never serves within the stall window;
- the main-loop stall check is chat's alone (``exempt_429=True``);
- a ``fail_fast`` call never enters the stall rule;
- the head of the waiting room polls every ``[0.5p, 1.0p]`` of ``poll_interval_s``;
- a stream's attempt is productive from its request to its close (time to
  first token and reading included);
- a backend failure while reading the progress age fails the call closed;
- saturation still stalls: endless 429s end "stalled" about one window in,
  whatever their Retry-After;
- what the stall rule need not wait for: a call every source refused (401,
  403, 404) ends at once.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
from _closing import closing

from polygateway.backends.base import Lease, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings, ScopeKind
from polygateway.embedding import EmbeddingClient
from polygateway.errors import AllSourcesExhausted, GovernanceBackendError
from polygateway.middleware import retry
from polygateway.middleware.lifecycle import GovernedClient
from polygateway.ocr import OcrClient
from polygateway.testing import (
    Delay,
    FakeClock,
    FakeTransport,
    Outcome,
    StreamScript,
    TransientError,
    chat_chunk_events,
    chat_completion,
    embedding_body,
    gateway_settings,
)

T = TypeVar("T")

STALL = 300.0
POLL = 0.5
KINDS: tuple[ScopeKind, ...] = ("chat", "embed", "ocr")
UNEXEMPT: tuple[ScopeKind, ...] = ("embed", "ocr")  # exempt_429=False: no main-loop check
SOURCE = "primary"
MESSAGES = [{"role": "user", "content": "hi"}]
PNG = (Path(__file__).resolve().parents[1] / "data" / "page.png").read_bytes()
OCR_OK = {"success": True, "task_type": "text", "content": "page text", "message": "ok"}
ANSWER: dict[ScopeKind, dict[str, Any]] = {
    "chat": chat_completion("served"),
    "embed": embedding_body([[0.25, 0.5]]),
    "ocr": OCR_OK,
}
# A charged failure followed by a back-off longer than the stall window: equal jitter
# draws the delay from [350, 700] s, so the call's non-productive time passes the
# window without the call ever finding nothing runnable.
LONG_BACKOFF = {"backoff_base_s": 700.0, "backoff_cap_s": 700.0}
# Breakers that, once open, stay open far beyond any bound these tests run to.
STUCK_BREAKERS = {
    "breaker_failures": 1,
    "breaker_cooldown_s": 3000.0,
    "breaker_cooldown_max_s": 3000.0,
}


def settings_for(
    kind: ScopeKind,
    *sources: str | dict[str, Any],
    **gateway: Any,
) -> GatewaySettings:
    """One scope of ``kind`` (its scope named after the kind), stall window STALL, poll POLL."""
    gateway.setdefault("stall_window_s", STALL)
    gateway.setdefault("poll_interval_s", POLL)
    return gateway_settings(*(sources or (SOURCE,)), scope=kind, kind=kind, **gateway)


def make_client(
    kind: ScopeKind,
    clock: FakeClock,
    transport: FakeTransport,
    settings: GatewaySettings,
    *,
    backend: MemoryBackend | None = None,
    sleep: Callable[[float], Awaitable[None]] | None = None,
    rng: random.Random | None = None,
) -> GovernedClient:
    """The client of ``kind`` on the fake clock, a memory backend and a scripted transport."""
    client_type: type[GovernedClient] = {
        "chat": ChatClient,
        "embed": EmbeddingClient,
        "ocr": OcrClient,
    }[kind]
    return closing(
        client_type(
            settings,
            kind,
            backend=backend if backend is not None else MemoryBackend(now=clock),
            transport=transport,
            now=clock,
            sleep=sleep if sleep is not None else clock.sleep,
            rng=rng if rng is not None else random.Random(7),
        )
    )


def one_call(client: GovernedClient, **kwargs: Any) -> Coroutine[Any, Any, Any]:
    """The client's plain call: ``complete``, ``embed`` or ``recognize_text``."""
    if isinstance(client, ChatClient):
        return client.complete(MESSAGES, **kwargs)
    if isinstance(client, EmbeddingClient):
        return client.embed(["a"], **kwargs)
    assert isinstance(client, OcrClient)
    return client.recognize_text(PNG, **kwargs)


async def run_on_fake_clock(
    call: Coroutine[Any, Any, T], clock: FakeClock, *, give_up_after_s: float
) -> T:
    """Run ``call`` to its end, or fail the test once the fake clock has moved past the bound.

    The fake sleeps move the clock, so a call that waits forever (the bug
    these tests look for) makes the clock run away instead of hanging the
    test; a busy loop that never sleeps is caught by the budget of turns.
    """
    bound = clock() + give_up_after_s
    task = asyncio.ensure_future(call)
    turns = 100_000
    for _ in range(turns):
        if task.done():
            return task.result()
        if clock() > bound:
            break
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    waited = clock() - bound + give_up_after_s
    if waited < give_up_after_s:
        pytest.fail(f"the call was still running after {turns} loop turns, {waited:g} s in")
    pytest.fail(f"the call was still waiting {waited:g} s in")


async def hold_only_permit(backend: MemoryBackend, scope: str) -> Lease:
    """Take the only permit of a ``max_concurrency=1`` source, as another holder would."""
    result = await backend.acquire(scope, [SourceSpec(SOURCE, max_concurrency=1)], ttl_s=1e6)
    assert result.lease is not None
    return result.lease


class FailingProgress(MemoryBackend):
    """A memory backend whose progress age cannot be read: the shared state is down."""

    __slots__ = ("reads",)

    def __init__(self, *, now: Callable[[], float]) -> None:
        super().__init__(now=now)
        self.reads = 0

    async def progress_age_s(self, scope: str) -> float:
        self.reads += 1
        raise GovernanceBackendError("progress key unreadable", operation="progress_age_s")


class ScriptedRandom(random.Random):
    """A ``random.Random`` whose ``random()`` always draws ``value`` (``uniform`` builds on it)."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


# --- Embedding and OCR: the stall rule in _on_no_runnable is their only backstop ---------


class TestEmbeddingAndOcrBackstop:
    """A call on a scope that never serves ends "stalled" within the window, for every kind."""

    @pytest.mark.parametrize("kind", KINDS)
    async def test_call_on_a_scope_whose_only_permit_is_held_ends_stalled_in_the_window(
        self, kind: ScopeKind
    ) -> None:
        """Nothing runnable (the only permit held elsewhere), never served: "stalled" at STALL."""
        clock = FakeClock()
        backend = MemoryBackend(now=clock)
        await hold_only_permit(backend, kind)
        transport = FakeTransport(clock=clock)
        client = make_client(
            kind,
            clock,
            transport,
            settings_for(kind, {"name": SOURCE, "max_concurrency": 1}),
            backend=backend,
        )
        started = clock()
        with pytest.raises(AllSourcesExhausted) as caught:
            await run_on_fake_clock(one_call(client), clock, give_up_after_s=2 * STALL)
        assert caught.value.reason == "stalled"
        assert caught.value.attempts == ()
        assert transport.requests == []
        # The head polls every POLL at most, so it sees the window pass within one poll.
        assert STALL < clock() - started <= STALL + POLL

    @pytest.mark.parametrize("kind", UNEXEMPT)
    async def test_call_on_a_scope_whose_breakers_are_all_open_ends_stalled_in_the_window(
        self, kind: ScopeKind
    ) -> None:
        """Each source fails once and its breaker stays open: "stalled" one window later."""
        clock = FakeClock()
        transport = FakeTransport(
            [TransientError(status_code=503), TransientError(status_code=503)], clock=clock
        )
        settings = settings_for(kind, "one", "two", **STUCK_BREAKERS)
        client = make_client(kind, clock, transport, settings)
        started = clock()
        with pytest.raises(AllSourcesExhausted) as caught:
            await run_on_fake_clock(one_call(client), clock, give_up_after_s=2 * STALL)
        error = caught.value
        assert error.reason == "stalled"
        assert sorted(a.source for a in error.attempts) == ["one", "two"]
        assert error.retry_after_s is not None  # the breakers reopen, some day
        # Both attempts took no time: the whole call was non-productive waiting.
        assert STALL < clock() - started <= STALL + POLL


# --- The main-loop stall check is chat's alone ---------------------------------------------


class TestMainLoopStallCheckIsChatOnly:
    """Only chat (429s free of charge) checks the stall rule at the top of every iteration."""

    @pytest.mark.parametrize("kind", UNEXEMPT)
    async def test_embedding_and_ocr_retry_after_a_backoff_longer_than_the_window(
        self, kind: ScopeKind
    ) -> None:
        """Past the window by back-off alone, in a scope never served: the retry still runs."""
        clock = FakeClock()
        backend = MemoryBackend(now=clock)
        transport = FakeTransport([TransientError(status_code=503), ANSWER[kind]], clock=clock)
        client = make_client(
            kind, clock, transport, settings_for(kind, **LONG_BACKOFF), backend=backend
        )
        started = clock()
        assert await backend.progress_age_s(kind) == math.inf
        await run_on_fake_clock(one_call(client), clock, give_up_after_s=3 * STALL)
        assert len(transport.requests) == 2
        assert clock() - started > STALL  # all of it back-off: non-productive

    async def test_chat_ends_stalled_at_the_top_of_the_loop_after_such_a_backoff(self) -> None:
        """The same back-off in a chat scope ends "stalled" before the retry is sent."""
        clock = FakeClock()
        transport = FakeTransport([TransientError(status_code=503), ANSWER["chat"]], clock=clock)
        client = make_client("chat", clock, transport, settings_for("chat", **LONG_BACKOFF))
        with pytest.raises(AllSourcesExhausted) as caught:
            await run_on_fake_clock(one_call(client), clock, give_up_after_s=3 * STALL)
        assert caught.value.reason == "stalled"
        assert len(transport.requests) == 1
        assert [a.outcome for a in caught.value.attempts] == ["transient"]


# --- Saturation still stalls ------------------------------------------------------------------


@pytest.mark.parametrize(
    "retry_after_s", [None, 0.0, 1.0], ids=["no-retry-after", "retry-after-0", "retry-after-1"]
)
async def test_endless_429s_end_stalled_about_one_window_in(retry_after_s: float | None) -> None:
    """A chat scope answering only 429s (free of charge) ends "stalled", whatever its Retry-After.

    Each 429 round trip is productive and fast; what fills the window is the
    waiting between them (the call's growing back-off, the source's pacing), so
    the call ends within one back-off of the window, never in a busy loop.
    """
    clock = FakeClock()

    async def throttled(request: object) -> TransientError:
        await asyncio.sleep(0)  # answered on a later turn of the loop, as a real upstream is
        return TransientError("HTTP 429", status_code=429, retry_after_s=retry_after_s)

    transport = FakeTransport(clock=clock, default=throttled)
    settings = settings_for("chat")
    client = make_client("chat", clock, transport, settings)
    started = clock()
    with pytest.raises(AllSourcesExhausted) as caught:
        await run_on_fake_clock(one_call(client), clock, give_up_after_s=2 * STALL)
    assert caught.value.reason == "stalled"
    assert {a.outcome for a in caught.value.attempts} == {"rate_limited"}
    assert STALL < clock() - started <= STALL + settings.backoff_cap_s + POLL


# --- What the stall rule need not wait for -------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_a_call_every_source_refused_ends_at_once_not_after_the_window(
    kind: ScopeKind,
) -> None:
    """401, 403 and 404 from every source: retry_exhausted at once, though attempts are left.

    Each refusal trips its source for the long cool-down, so nothing could
    serve the call before the stall window ends: the loop does not wait it out.
    """
    clock = FakeClock()
    refusals = {"one": 401, "two": 403, "three": 404}
    transport = FakeTransport(
        {name: [TransientError(status_code=status)] for name, status in refusals.items()},
        clock=clock,
    )
    settings = settings_for(kind, *refusals, max_attempts=5)
    client = make_client(kind, clock, transport, settings)
    started = clock()
    with pytest.raises(AllSourcesExhausted) as caught:
        await run_on_fake_clock(one_call(client), clock, give_up_after_s=2 * STALL)
    assert caught.value.reason == "retry_exhausted"
    assert {(a.source, a.status_code) for a in caught.value.attempts} == set(refusals.items())
    # The back-offs after the first two refusals (at most 0.5 s and 1 s), and no waiting.
    assert clock() - started <= 3 * settings.backoff_base_s


# --- fail_fast never enters the stall rule ---------------------------------------------------


@pytest.mark.parametrize("kind", UNEXEMPT)
async def test_fail_fast_call_past_the_window_raises_no_runnable_not_stalled(
    kind: ScopeKind,
) -> None:
    """A fail_fast call that has waited past the window and finds nothing runnable: no_runnable.

    Both halves of the stall rule hold when it finds nothing runnable (back-off
    longer than the window, a scope never served), so only the order
    fail_fast-before-stall-rule tells the two reasons apart.
    """
    clock = FakeClock()
    transport = FakeTransport([TransientError(status_code=503)], clock=clock)
    settings = settings_for(kind, **LONG_BACKOFF, **STUCK_BREAKERS)
    client = make_client(kind, clock, transport, settings)
    started = clock()
    with pytest.raises(AllSourcesExhausted) as caught:
        await run_on_fake_clock(one_call(client, fail_fast=True), clock, give_up_after_s=3 * STALL)
    assert caught.value.reason == "no_runnable"
    assert len(transport.requests) == 1
    assert clock() - started > STALL


# --- Poll jitter: [0.5p, 1.0p] of poll_interval_s ---------------------------------------------


class TestPollJitter:
    """The head of the waiting room waits a jittered ``[0.5p, 1.0p]`` between two polls."""

    POLL_S = 10.0  # a longer poll: fewer rounds to the end of the window

    async def head_waits(self, kind: ScopeKind, rng: random.Random) -> list[float]:
        """Every wait of a lone call (the head) on a scope whose only permit is held."""
        clock = FakeClock()
        backend = MemoryBackend(now=clock)
        await hold_only_permit(backend, kind)
        transport = FakeTransport(clock=clock)
        settings = settings_for(
            kind, {"name": SOURCE, "max_concurrency": 1}, poll_interval_s=self.POLL_S
        )
        client = make_client(kind, clock, transport, settings, backend=backend, rng=rng)
        with pytest.raises(AllSourcesExhausted) as caught:
            await run_on_fake_clock(one_call(client), clock, give_up_after_s=2 * STALL)
        assert caught.value.reason == "stalled"
        assert transport.requests == []
        assert len(clock.sleeps) >= STALL / self.POLL_S  # no sleep but the head's polls
        return clock.sleeps

    @pytest.mark.parametrize("kind", KINDS)
    async def test_lowest_draw_waits_half_the_poll_interval(self, kind: ScopeKind) -> None:
        """An rng drawing 0 makes every wait exactly 0.5 x poll_interval_s (never less)."""
        waits = await self.head_waits(kind, ScriptedRandom(0.0))
        assert set(waits) == {0.5 * self.POLL_S}

    @pytest.mark.parametrize("kind", KINDS)
    async def test_highest_draw_waits_the_whole_poll_interval(self, kind: ScopeKind) -> None:
        """An rng drawing just under 1 makes every wait just under poll_interval_s (never more)."""
        waits = await self.head_waits(kind, ScriptedRandom(1.0 - 1e-12))
        assert all(0.999 * self.POLL_S < w <= self.POLL_S for w in waits), waits

    async def test_seeded_draws_spread_over_the_whole_band(self) -> None:
        """With a seeded rng the waits fill [0.5p, 1.0p]: jittered, and never outside it."""
        waits = await self.head_waits("embed", random.Random(2024))
        assert all(0.5 * self.POLL_S <= w <= self.POLL_S for w in waits), waits
        assert min(waits) < 0.6 * self.POLL_S
        assert max(waits) > 0.9 * self.POLL_S


# --- A stream's attempt is productive from request to close -----------------------------------


@pytest.fixture
def spied_clocks(monkeypatch: pytest.MonkeyPatch) -> list[retry.StallClock]:
    """Every StallClock the loop makes during the test, in order, kept for the test to read."""
    made: list[retry.StallClock] = []

    class SpiedStallClock(retry.StallClock):
        __slots__ = ()

        def __init__(self, now: Callable[[], float]) -> None:
            super().__init__(now)
            made.append(self)

    monkeypatch.setattr(retry, "StallClock", SpiedStallClock)
    return made


def stream_client(clock: FakeClock, script: list[Outcome]) -> tuple[ChatClient, FakeTransport]:
    """A chat client whose sources allow slow first tokens and slow chunks."""
    settings = settings_for(
        "chat", {"name": SOURCE, "ttft_timeout_s": STALL, "stream_idle_timeout_s": 200.0}
    )
    transport = FakeTransport(script, clock=clock)
    client = make_client("chat", clock, transport, settings)
    assert isinstance(client, ChatClient)
    return client, transport


class TestStreamAttemptIsProductive:
    """StallClock counts a stream's attempt, from request to close, as productive time."""

    async def test_slow_first_token_then_a_failure_retries_instead_of_stalling(self) -> None:
        """A first token 350 s late, then a failure before it: the call retries, not stalls."""
        clock = FakeClock()
        slow_then_reset = Delay(
            STALL + 50.0, StreamScript(chat_chunk_events(["never"]), fail_after=0)
        )
        client, transport = stream_client(
            clock, [slow_then_reset, StreamScript(chat_chunk_events(["hello"]))]
        )

        async def consume() -> list[str]:
            async with client.stream(MESSAGES) as stream:
                return [chunk.text async for chunk in stream]

        texts = await run_on_fake_clock(consume(), clock, give_up_after_s=3 * STALL)
        assert "".join(texts) == "hello"
        assert len(transport.requests) == 2

    @pytest.mark.parametrize("bare", [False, True], ids=["async-with", "bare-async-for"])
    async def test_stream_from_request_to_close_is_all_productive(
        self, spied_clocks: list[retry.StallClock], bare: bool
    ) -> None:
        """A stream with a 200 s first token and 100 s gaps leaves the call's stall account at 0."""
        clock = FakeClock()
        events = chat_chunk_events(["a", "b", "c", "d"])
        slow = Delay(200.0, StreamScript(events, gap_s=100.0))
        client, _ = stream_client(clock, [slow])
        started = clock()

        async def consume() -> list[str]:
            if bare:
                return [chunk.text async for chunk in client.stream(MESSAGES)]
            async with client.stream(MESSAGES) as stream:
                return [chunk.text async for chunk in stream]

        texts = await run_on_fake_clock(consume(), clock, give_up_after_s=10 * STALL)
        assert "".join(texts) == "abcd"
        elapsed = clock() - started
        assert elapsed >= 200.0 + 100.0 * (len(events) - 1)  # TTFT, then every gap
        assert len(spied_clocks) == 1
        assert spied_clocks[0].stalled_s() == pytest.approx(0.0, abs=1e-6)

    async def test_a_request_attempt_is_productive_too(
        self, spied_clocks: list[retry.StallClock]
    ) -> None:
        """The same holds for a plain request: 350 s of answering leaves the account at 0."""
        clock = FakeClock()
        transport = FakeTransport([Delay(STALL + 50.0, chat_completion("late"))], clock=clock)
        settings = settings_for("chat", {"name": SOURCE, "timeout_s": 2 * STALL})
        client = make_client("chat", clock, transport, settings)
        await run_on_fake_clock(one_call(client), clock, give_up_after_s=3 * STALL)
        assert len(spied_clocks) == 1
        assert spied_clocks[0].stalled_s() == pytest.approx(0.0, abs=1e-6)


# --- A backend failure reading the progress age fails closed -----------------------------------


class TestProgressAgeFailureFailsClosed:
    """GovernanceBackendError from ``progress_age_s`` escapes the loop: nothing waits ungoverned."""

    @pytest.mark.parametrize("kind", KINDS)
    async def test_failure_while_waiting_for_a_permit_escapes(self, kind: ScopeKind) -> None:
        """Waiting past the window, the stall rule reads the age; its failure ends the call."""
        clock = FakeClock()
        backend = FailingProgress(now=clock)
        await hold_only_permit(backend, kind)
        transport = FakeTransport(clock=clock)
        client = make_client(
            kind,
            clock,
            transport,
            settings_for(kind, {"name": SOURCE, "max_concurrency": 1}),
            backend=backend,
        )
        started = clock()
        with pytest.raises(GovernanceBackendError) as caught:
            await run_on_fake_clock(one_call(client), clock, give_up_after_s=2 * STALL)
        assert caught.value.operation == "progress_age_s"
        assert backend.reads == 1
        assert transport.requests == []
        # The age is read only once the call's own window has passed.
        assert STALL < clock() - started <= STALL + POLL

    async def test_failure_at_the_top_of_the_chat_loop_escapes(self) -> None:
        """Chat's main-loop check, after a back-off past the window: the failure ends the call."""
        clock = FakeClock()
        backend = FailingProgress(now=clock)
        transport = FakeTransport([TransientError(status_code=503), ANSWER["chat"]], clock=clock)
        client = make_client(
            "chat", clock, transport, settings_for("chat", **LONG_BACKOFF), backend=backend
        )
        with pytest.raises(GovernanceBackendError) as caught:
            await run_on_fake_clock(one_call(client), clock, give_up_after_s=3 * STALL)
        assert caught.value.operation == "progress_age_s"
        assert len(transport.requests) == 1
