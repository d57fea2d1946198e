"""``deadline_s`` as a hard bound: streams are cut at the call's deadline, and a cut the caller's
deadline caused is not charged to the source (research-wiki/ARCHITECTURE.md §4)."""

from __future__ import annotations

from typing import Any

import pytest
from _chat_clients import chat_on_clock

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import AllSourcesExhausted, StreamInterrupted
from polygateway.models import ChatChunk
from polygateway.testing import (
    Delay,
    FakeClock,
    FakeTransport,
    Hang,
    Recorder,
    StreamScript,
    chat_chunk_events,
    chat_completion,
    gateway_settings,
)

MESSAGES = [{"role": "user", "content": "hi"}]

SLOW = {
    "name": "slow",
    "max_concurrency": 4,
    "timeout_s": 60,
    "ttft_timeout_s": 30,
    "stream_idle_timeout_s": 20,
}
"""A healthy source with generous timeouts of its own; breaker_failures=1 makes any charge show."""


def make_chat(
    clock: FakeClock, script: Any, *, source: dict[str, Any] | None = None, **gateway: Any
) -> tuple[ChatClient, FakeTransport, MemoryBackend, Recorder]:
    """A chat client on a fake clock whose one source trips at its first charged failure."""
    settings = gateway_settings(source or SLOW, breaker_failures=1, **gateway)
    backend = MemoryBackend(now=clock)
    transport = FakeTransport(script, clock=clock)
    recorder = Recorder()
    chat = chat_on_clock(
        settings,
        backend,
        transport,
        clock,
        max_sleeps=2000,
        seed=3,
        emitter=recorder,
    )
    return chat, transport, backend, recorder


async def assert_source_untouched(backend: MemoryBackend, name: str = "slow") -> None:
    """The breaker is closed with no failure counted, the AIMD limit at its max, no permit held."""
    snap = (await backend.snapshot("chat")).source(name)
    assert snap is not None
    assert (snap.breaker, snap.consecutive_failures, snap.trips) == ("closed", 0, 0)
    assert snap.limit == pytest.approx(4.0)
    assert snap.in_flight == 0


# --- request/response calls -----------------------------------------------------------------


class TestCutNotCharged:
    """An attempt cut by the caller's deadline is released as cancelled, not as a failure."""

    @pytest.mark.parametrize(
        "slow",
        [Hang(), Delay(30.0, chat_completion("late"), cut_at_timeout=True)],
        ids=["hang", "answer-after-30s"],
    )
    async def test_slow_source_cut_by_a_short_deadline_keeps_its_breaker_and_limit(
        self, slow: Any
    ) -> None:
        """deadline_s=5 against a 60 s timeout: 'deadline' at 5 s, the source is not charged."""
        clock = FakeClock()
        chat, transport, backend, recorder = make_chat(clock, [slow])
        started = clock()
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES, deadline_s=5)
        assert caught.value.reason == "deadline"
        assert clock() - started == pytest.approx(5)
        assert len(transport.requests) == 1
        assert [r.outcome for r in caught.value.attempts] == ["cancelled"]
        assert recorder.outcomes() == ["cancelled"]
        await assert_source_untouched(backend)

    async def test_deadline_cut_ends_the_call_at_once_even_with_attempts_left(self) -> None:
        """A cut at the deadline is not a retry: no second request, whatever max_attempts allows."""
        clock = FakeClock()
        chat, transport, _, _ = make_chat(clock, [Hang(), chat_completion()], max_attempts=5)
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES, deadline_s=2)
        assert caught.value.reason == "deadline"
        assert len(transport.requests) == 1

    async def test_one_attempt_allowed_still_says_deadline(self) -> None:
        """With max_attempts=1 a deadline cut ends with 'deadline', not 'retry_exhausted'."""
        clock = FakeClock()
        chat, _, _, _ = make_chat(clock, [Hang()], max_attempts=1)
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES, deadline_s=2)
        assert caught.value.reason == "deadline"

    async def test_timeout_at_the_sources_own_limit_is_still_charged(self) -> None:
        """A hang ending at the source's own timeout_s, before the deadline, is transient."""
        clock = FakeClock()
        source = {**SLOW, "timeout_s": 3}
        chat, _, backend, recorder = make_chat(
            clock, [Hang(), chat_completion()], source=source, breaker_cooldown_s=1
        )
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES, deadline_s=5, fail_fast=True)
        # The 3 s hang was the source's fault: charged, breaker open, then nothing runnable.
        assert recorder.outcomes()[0] == "transient"
        assert caught.value.reason in {"no_runnable", "deadline"}
        snap = (await backend.snapshot("chat")).source("slow")
        assert snap is not None
        assert snap.trips == 1
        assert snap.limit < 4.0

    async def test_timeout_without_any_deadline_is_charged_as_before(self) -> None:
        """No deadline_s: a hang is a transient timeout, an AIMD decrease and a breaker failure."""
        clock = FakeClock()
        chat, _, backend, recorder = make_chat(
            clock, [Hang(), chat_completion()], breaker_cooldown_s=1
        )
        await chat.complete(MESSAGES)
        assert recorder.outcomes() == ["transient", "success"]
        snap = (await backend.snapshot("chat")).source("slow")
        assert snap is not None
        assert snap.limit < 4.0  # decreased by the timeout; one success cannot undo it

    async def test_answer_within_the_clipped_timeout_is_served(self) -> None:
        """A delay shorter than the time left is served as usual."""
        clock = FakeClock()
        chat, _, backend, _ = make_chat(clock, [Delay(4.0, chat_completion("in time"))])
        response = await chat.complete(MESSAGES, deadline_s=5)
        assert response.text == "in time"
        await assert_source_untouched(backend)


# --- streams ----------------------------------------------------------------------------------


def flowing(count: int, gap_s: float) -> StreamScript:
    """A stream of ``count`` text chunks, one every ``gap_s`` of fake time, then a clean end."""
    return StreamScript(
        chat_chunk_events([f"w{i}" for i in range(count)], role_first=False), gap_s=gap_s
    )


async def read_until_error(stream: Any, got: list[ChatChunk]) -> None:
    """Iterate a stream, keeping each chunk, until it raises."""
    async for chunk in stream:
        got.append(chunk)


class TestStreamCutAtTheDeadline:
    """A stream that keeps flowing is cut at the call's deadline, not when the flow stops."""

    async def test_flowing_stream_is_cut_at_the_deadline_after_its_chunks(self) -> None:
        """Chunks every 1 s, deadline_s=5.5: five chunks arrive, then 'deadline' at 5.5 s."""
        clock = FakeClock()
        chat, transport, backend, recorder = make_chat(clock, [flowing(100, 1.0)])
        started = clock()
        got: list[ChatChunk] = []
        with pytest.raises(AllSourcesExhausted) as caught:
            await read_until_error(chat.stream(MESSAGES, deadline_s=5.5), got)
        assert caught.value.reason == "deadline"
        assert [c.text for c in got] == [f"w{i}" for i in range(6)]  # at 0, 1, ..., 5 s
        assert clock() - started == pytest.approx(5.5)
        assert len(transport.requests) == 1  # no retry on another source
        assert transport.open_streams == 0
        assert [r.outcome for r in caught.value.attempts] == ["cancelled"]
        assert recorder.outcomes() == ["cancelled"]
        await assert_source_untouched(backend)

    async def test_gaps_within_idle_but_summing_past_the_deadline_are_cut(self) -> None:
        """Gaps of 15 s under a 20 s idle timeout, deadline_s=40: cut at 40 s, not by idle."""
        clock = FakeClock()
        chat, _, backend, _ = make_chat(clock, [flowing(10, 15.0)])
        started = clock()
        got: list[ChatChunk] = []
        with pytest.raises(AllSourcesExhausted) as caught:
            await read_until_error(chat.stream(MESSAGES, deadline_s=40), got)
        assert caught.value.reason == "deadline"
        assert len(got) == 3  # at 0, 15 and 30 s
        assert clock() - started == pytest.approx(40)
        assert "deadline" in (caught.value.attempts[-1].error or "")
        await assert_source_untouched(backend)

    async def test_context_manager_form_is_cut_alike(self) -> None:
        """async with chat.stream(...) as s: the cut surfaces inside the block as 'deadline'."""
        clock = FakeClock()
        chat, transport, backend, _ = make_chat(clock, [flowing(100, 1.0)])
        got: list[ChatChunk] = []
        with pytest.raises(AllSourcesExhausted) as caught:
            async with chat.stream(MESSAGES, deadline_s=2.5) as stream:
                await read_until_error(stream, got)
        assert caught.value.reason == "deadline"
        assert len(got) == 3
        assert transport.open_streams == 0
        await assert_source_untouched(backend)

    async def test_stream_without_deadline_is_never_cut(self) -> None:
        """No deadline_s: 30 chunks 15 s apart (450 s in all) arrive in full and succeed."""
        clock = FakeClock()
        chat, _, backend, recorder = make_chat(clock, [flowing(30, 15.0)])
        got = [c async for c in chat.stream(MESSAGES)]
        assert [c.text for c in got if c.text] == [f"w{i}" for i in range(30)]
        assert recorder.outcomes() == ["success"]
        await assert_source_untouched(backend)

    async def test_stream_ending_before_the_deadline_succeeds(self) -> None:
        """A stream that ends cleanly inside its deadline is an ordinary success."""
        clock = FakeClock()
        chat, _, _, recorder = make_chat(clock, [flowing(3, 1.0)])
        got = [c async for c in chat.stream(MESSAGES, deadline_s=10)]
        assert [c.text for c in got if c.text] == ["w0", "w1", "w2"]
        assert recorder.outcomes() == ["success"]

    async def test_request_carries_the_time_left_as_its_end(self) -> None:
        """The stream's request carries deadline_in_s, the time left when the attempt began."""
        clock = FakeClock()
        chat, transport, _, _ = make_chat(clock, [flowing(1, 0.0)])
        _ = [c async for c in chat.stream(MESSAGES, deadline_s=7)]
        assert transport.requests[0].deadline_in_s == pytest.approx(7)

    async def test_stream_without_deadline_sends_no_end(self) -> None:
        """Without deadline_s the request's deadline_in_s is None."""
        clock = FakeClock()
        chat, transport, _, _ = make_chat(clock, [flowing(1, 0.0)])
        _ = [c async for c in chat.stream(MESSAGES)]
        assert transport.requests[0].deadline_in_s is None

    async def test_ttft_clipped_by_the_deadline_is_not_charged(self) -> None:
        """No first event before deadline_s=4 (TTFT 30 s): 'deadline' at 4 s, source untouched."""
        clock = FakeClock()
        script = StreamScript(chat_chunk_events(["x"]), hang_before_first=True)
        chat, transport, backend, _ = make_chat(clock, [script])
        started = clock()
        with pytest.raises(AllSourcesExhausted) as caught:
            await read_until_error(chat.stream(MESSAGES, deadline_s=4), [])
        assert caught.value.reason == "deadline"
        assert clock() - started == pytest.approx(4)
        assert len(transport.requests) == 1
        await assert_source_untouched(backend)

    async def test_idle_timeout_of_the_source_still_interrupts(self) -> None:
        """A gap past the source's own idle timeout, before the deadline, is StreamInterrupted."""

        clock = FakeClock()
        script = StreamScript(chat_chunk_events(["a", "b"], role_first=False), hang_after=1)
        chat, _, backend, recorder = make_chat(clock, [script])
        with pytest.raises(StreamInterrupted):
            await read_until_error(chat.stream(MESSAGES, deadline_s=1000), [])
        assert recorder.outcomes() == ["transient"]
        snap = (await backend.snapshot("chat")).source("slow")
        assert snap is not None
        assert snap.trips == 1
