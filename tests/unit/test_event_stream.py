"""EventStream's one timer per stream: TTFT and idle deadlines, re-arming, cancellation, no leak.

The stream's read is scripted (a queue the test feeds) and its loop clock
is a manual one (``_ManualTimers``: the ``time`` and ``call_at`` the stream
uses), so every deadline here is decided by the test, never by real time.
The reading task itself runs on the real event loop, so cancellation is
asyncio's own. Two tests at the end use the real loop's clock and timers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
from collections.abc import Callable
from typing import Any, ClassVar, cast

import pytest

from polygateway.transport.exchange import (
    EventStream,
    RequestSecrets,
    open_timed_out,
    stream_deadlines,
)
from polygateway.transport.http import HttpRequest, TransientError
from polygateway.transport.openai import chunk_has_content

KEY = "sk-test-SECRET-123"


class _Handle:
    """A scheduled callback of ``_ManualTimers``."""

    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], object]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _ManualTimers:
    """The two loop methods EventStream uses (``time``, ``call_at``) on a clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.handles: list[_Handle] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], object]) -> _Handle:
        handle = _Handle(when, callback)
        self.handles.append(handle)
        return handle

    def pending(self) -> list[_Handle]:
        """Handles scheduled and neither fired nor cancelled."""
        return [h for h in self.handles if not h.cancelled]

    def advance(self, seconds: float) -> None:
        """Move the clock, firing every handle that falls due, in order, as a loop would."""
        target = self.now + seconds
        while True:
            due = [h for h in self.pending() if h.when <= target]
            if not due:
                break
            handle = min(due, key=lambda h: h.when)
            self.now = max(self.now, handle.when)
            handle.cancelled = True  # fired: no longer scheduled
            handle.callback()
        self.now = target


class _LibraryError(Exception):
    """A read failure of the pretend HTTP library."""


class _Scripted(EventStream):
    """An EventStream whose events are what the test puts in ``feed``."""

    __slots__ = ("feed",)

    _FAILURES: ClassVar[tuple[type[Exception], ...]] = (_LibraryError,)

    def __init__(
        self,
        request: HttpRequest,
        loop: asyncio.AbstractEventLoop,
        first_deadline: float,
        end: float = math.inf,
    ) -> None:
        super().__init__(request, RequestSecrets(request.headers), loop, first_deadline, end)
        self.feed: asyncio.Queue[str | Exception | None] = asyncio.Queue()

    async def _next_data(self) -> str | None:
        item = await self.feed.get()
        if isinstance(item, Exception):
            raise item
        return item

    def _translate(self, exc: Exception) -> TransientError:
        return TransientError(f"library failure at {self._request.source}", failure="transient")


def _request(
    timeout_s: float = 10.0,
    idle_timeout_s: float | None = 1.0,
    deadline_in_s: float | None = None,
) -> HttpRequest:
    return HttpRequest(
        source="primary",
        url="http://upstream.test/v1/chat/completions",
        timeout_s=timeout_s,
        idle_timeout_s=idle_timeout_s,
        headers={"Authorization": f"Bearer {KEY}"},
        deadline_in_s=deadline_in_s,
    )


def _stream(
    timers: _ManualTimers, timeout_s: float = 10.0, idle_timeout_s: float | None = 1.0
) -> _Scripted:
    loop = cast(asyncio.AbstractEventLoop, timers)
    return _Scripted(_request(timeout_s, idle_timeout_s), loop, timers.now + timeout_s)


async def _reading(events: EventStream) -> asyncio.Task[Any]:
    """A task blocked in the next read of ``events``."""

    async def read() -> Any:
        return await events.__anext__()

    task = asyncio.create_task(read())
    await asyncio.sleep(0)
    assert not task.done()
    return task


async def _event_after(events: _Scripted, timers: _ManualTimers, gap_s: float, n: int) -> Any:
    """Read one event that arrives ``gap_s`` after the read began."""
    task = await _reading(events)
    timers.advance(gap_s)
    events.feed.put_nowait(f'{{"n": {n}}}')
    return await task


async def test_gap_longer_than_idle_fails_as_stream_idle() -> None:
    """After a first event, a gap longer than the idle timeout is a transient 'stream idle'."""
    timers = _ManualTimers()
    events = _stream(timers, idle_timeout_s=1.0)
    assert await _event_after(events, timers, 0.1, 1) == {"n": 1}
    task = await _reading(events)
    timers.advance(1.01)
    with pytest.raises(TransientError) as info:
        await task
    assert info.value.timeout is True
    assert info.value.failure == "transient"
    assert str(info.value) == "stream idle at primary after 1 s"


async def test_gaps_each_under_idle_but_summing_over_it_do_not_fail() -> None:
    """Five gaps of 0.9 s under a 1 s idle timeout all pass: the timer follows the deadline."""
    timers = _ManualTimers()
    events = _stream(timers, idle_timeout_s=1.0)
    got = [await _event_after(events, timers, 0.9, n) for n in range(5)]
    assert got == [{"n": n} for n in range(5)]
    events.feed.put_nowait("[DONE]")
    with pytest.raises(StopAsyncIteration):
        await events.__anext__()


async def test_timer_that_fires_early_re_arms_at_the_moved_deadline() -> None:
    """A timer set for an old deadline re-arms and fires at the new one, not before, not never."""
    timers = _ManualTimers()
    events = _stream(timers, idle_timeout_s=1.0)
    await _event_after(events, timers, 0.5, 1)  # t = 0.5, the next read's deadline is 1.5
    await _event_after(events, timers, 0.9, 2)  # t = 1.4, the next read's deadline is 2.4
    task = await _reading(events)
    timers.advance(0.99)  # t = 2.39: the timer armed for 1.5 fired and re-armed at 2.4
    assert not task.done()
    timers.advance(0.02)
    with pytest.raises(TransientError, match="stream idle"):
        await task


async def test_one_timer_serves_many_quick_events() -> None:
    """Fifty events well inside the idle timeout schedule two timer handles, not fifty."""
    timers = _ManualTimers()
    events = _stream(timers, timeout_s=10.0, idle_timeout_s=1.0)
    for n in range(50):
        assert await _event_after(events, timers, 0.01, n) == {"n": n}
    # One for the TTFT, one moved earlier to the first (shorter) idle deadline.
    assert len(timers.handles) == 2


async def test_no_first_event_by_the_ttft_fails_as_no_first_event() -> None:
    """Silence from the start until the first deadline is a 'no first event' timeout."""
    timers = _ManualTimers()
    events = _stream(timers, timeout_s=2.0, idle_timeout_s=30.0)
    task = await _reading(events)
    timers.advance(1.99)
    assert not task.done()
    timers.advance(0.02)
    with pytest.raises(TransientError) as info:
        await task
    assert info.value.timeout is True
    assert str(info.value) == "no first event at primary after 2 s"


async def test_ttft_counts_from_the_request_not_from_the_first_read() -> None:
    """The first deadline is fixed when the request went out; a late first read keeps it."""
    timers = _ManualTimers()
    events = _stream(timers, timeout_s=2.0, idle_timeout_s=30.0)
    timers.advance(1.5)  # opening the stream took most of the TTFT
    task = await _reading(events)
    timers.advance(0.51)
    with pytest.raises(TransientError, match="no first event"):
        await task


async def test_idle_shorter_than_the_ttft_left_is_enforced_after_the_first_event() -> None:
    """A first event early in a long TTFT: the next gap is bounded by the shorter idle timeout."""
    timers = _ManualTimers()
    events = _stream(timers, timeout_s=10.0, idle_timeout_s=1.0)
    await _event_after(events, timers, 0.1, 1)
    task = await _reading(events)
    timers.advance(1.01)
    with pytest.raises(TransientError, match="stream idle"):
        await task


async def test_idle_defaults_to_timeout_s() -> None:
    """Without idle_timeout_s, each gap may last up to timeout_s."""
    timers = _ManualTimers()
    events = _stream(timers, timeout_s=3.0, idle_timeout_s=None)
    await _event_after(events, timers, 0.1, 1)
    task = await _reading(events)
    timers.advance(2.9)
    assert not task.done()
    timers.advance(0.2)
    with pytest.raises(TransientError, match="stream idle at primary after 3 s"):
        await task


async def test_time_between_reads_does_not_count_as_idle() -> None:
    """The consumer's own work between events is not an upstream gap: idle starts at the read."""
    timers = _ManualTimers()
    events = _stream(timers, idle_timeout_s=1.0)
    await _event_after(events, timers, 0.1, 1)
    timers.advance(5.0)  # the consumer is busy; the timer fires with no read in progress
    assert await _event_after(events, timers, 0.9, 2) == {"n": 2}


async def test_outside_cancellation_while_waiting_is_cancelled_error() -> None:
    """Cancelling the reader from outside raises CancelledError, not a timeout; the stream ends."""
    timers = _ManualTimers()
    events = _stream(timers)
    await _event_after(events, timers, 0.1, 1)
    task = await _reading(events)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert timers.pending() == []
    with pytest.raises(StopAsyncIteration):
        await events.__anext__()


async def test_outside_cancellation_racing_the_expiry_still_passes_through() -> None:
    """When our expiry and an outside cancel hit the same read, the outside cancel wins."""
    timers = _ManualTimers()
    events = _stream(timers, idle_timeout_s=1.0)
    await _event_after(events, timers, 0.1, 1)
    task = await _reading(events)
    timers.advance(1.01)  # our timer cancels the read...
    task.cancel()  # ...and so does someone else before it runs
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_expiry_leaves_the_reader_with_no_pending_cancellation() -> None:
    """Our own cancel is withdrawn (uncancel): the reader sees a timeout and is not 'cancelling'."""
    timers = _ManualTimers()
    events = _stream(timers, idle_timeout_s=1.0)
    await _event_after(events, timers, 0.1, 1)

    async def read_and_report() -> tuple[str, int]:
        try:
            await events.__anext__()
        except TransientError as exc:
            current = asyncio.current_task()
            assert current is not None
            return str(exc), current.cancelling()
        raise AssertionError("the read must time out")

    task = asyncio.create_task(read_and_report())
    await asyncio.sleep(0)
    timers.advance(1.01)
    message, cancelling = await task
    assert "stream idle" in message
    assert cancelling == 0


async def test_expiry_inside_a_cancelled_caller_scope_is_still_a_timeout() -> None:
    """A read started by a task already being cancelled elsewhere counts only new requests."""
    timers = _ManualTimers()
    events = _stream(timers, idle_timeout_s=1.0)
    await _event_after(events, timers, 0.1, 1)
    outcome: list[str] = []

    async def read_while_cancelling() -> None:
        current = asyncio.current_task()
        assert current is not None
        current.cancel()
        # Swallowed on purpose: the task stays "cancelling" (count 1).
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0)
        try:
            await events.__anext__()
        except TransientError as exc:
            outcome.append(str(exc))

    task = asyncio.create_task(read_while_cancelling())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    timers.advance(1.01)
    await task
    assert len(outcome) == 1
    assert "stream idle" in outcome[0]


@pytest.mark.parametrize(
    ("last", "expected"),
    [
        ("[DONE]", StopAsyncIteration),
        (None, TransientError),
        (_LibraryError("reset"), TransientError),
        ("not json", TransientError),
    ],
)
async def test_no_timer_is_left_when_the_stream_ends(
    last: str | Exception | None, expected: type[BaseException]
) -> None:
    """The end marker, a truncation, a library failure or a malformed event cancel the timer."""
    timers = _ManualTimers()
    events = _stream(timers)
    await _event_after(events, timers, 0.1, 1)
    assert timers.pending() != []
    events.feed.put_nowait(last)
    with pytest.raises(expected):
        await events.__anext__()
    assert timers.pending() == []


async def test_close_between_events_cancels_the_timer_and_ends_iteration() -> None:
    """A consumer that leaves early: close() drops the timer and later reads stop."""
    timers = _ManualTimers()
    events = _stream(timers)
    await _event_after(events, timers, 0.1, 1)
    events.close()
    events.close()  # idempotent
    assert timers.pending() == []
    with pytest.raises(StopAsyncIteration):
        await events.__anext__()


async def test_library_timeout_keeps_the_phase_classification() -> None:
    """A TimeoutError raised by the library's read is classified like our own expiry."""
    timers = _ManualTimers()
    events = _stream(timers, idle_timeout_s=1.0)
    await _event_after(events, timers, 0.1, 1)
    events.feed.put_nowait(TimeoutError("socket read"))
    with pytest.raises(TransientError, match="stream idle") as info:
        await events.__anext__()
    assert info.value.timeout is True


def test_request_secrets_scan_lazily_and_never_show() -> None:
    """RequestSecrets finds a request's header and URL secrets on first use; its repr hides them."""
    request = HttpRequest(
        source="a",
        url="http://127.0.0.1:9/v1?key=query-key-0123456789",
        timeout_s=1.0,
        headers={"Authorization": f"Bearer {KEY}", "X-Org": "acme"},
    )
    secrets = RequestSecrets(request)
    assert "unscanned" in repr(secrets)
    assert set(secrets) == {f"Bearer {KEY}", KEY, "query-key-0123456789"}
    assert len(secrets) == 3
    assert list(secrets) == sorted(secrets, key=len, reverse=True)
    assert KEY not in repr(secrets)


# --- The real loop: its own clock and timer heap ---


def _our_handles(loop: asyncio.AbstractEventLoop, events: EventStream) -> list[asyncio.TimerHandle]:
    """Live timer handles on ``loop`` whose callback belongs to ``events``."""
    scheduled: list[asyncio.TimerHandle] = loop._scheduled  # type: ignore[attr-defined]  # the heap
    return [
        h
        for h in scheduled
        if not h.cancelled() and getattr(h._callback, "__self__", None) is events  # type: ignore[attr-defined]
    ]


async def test_real_loop_stream_leaves_no_scheduled_handle() -> None:
    """On the real loop, a stream read to [DONE] leaves no handle of its own in the timer heap."""
    loop = asyncio.get_running_loop()
    events = _Scripted(_request(timeout_s=30.0, idle_timeout_s=30.0), loop, loop.time() + 30.0)
    for n in range(3):
        events.feed.put_nowait(f'{{"n": {n}}}')
    events.feed.put_nowait("[DONE]")
    got = [item async for item in events]
    assert got == [{"n": 0}, {"n": 1}, {"n": 2}]
    assert _our_handles(loop, events) == []


async def test_real_loop_idle_expiry_is_a_stream_idle_timeout() -> None:
    """On the real loop, silence after the first event ends in 'stream idle' (timing not pinned)."""
    loop = asyncio.get_running_loop()
    events = _Scripted(_request(timeout_s=30.0, idle_timeout_s=0.05), loop, loop.time() + 30.0)
    events.feed.put_nowait('{"n": 1}')
    assert await events.__anext__() == {"n": 1}
    assert _our_handles(loop, events) != []
    with pytest.raises(TransientError, match="stream idle") as info:
        await events.__anext__()
    assert info.value.timeout is True
    assert _our_handles(loop, events) == []


# --- The call's end (HttpRequest.deadline_in_s) ---


def _ending_stream(
    timers: _ManualTimers, deadline_in_s: float | None, timeout_s: float = 10.0, idle_s: float = 1.0
) -> _Scripted:
    """A stream opened now whose deadlines come from ``stream_deadlines``, as a transport's do."""
    loop = cast(asyncio.AbstractEventLoop, timers)
    request = _request(timeout_s, idle_s, deadline_in_s)
    first, end = stream_deadlines(request, loop)
    return _Scripted(request, loop, first, end)


def test_stream_deadlines_count_from_the_request_start() -> None:
    """The first deadline is the TTFT from now, never past the end; no deadline_in_s: no end."""
    timers = _ManualTimers()
    loop = cast(asyncio.AbstractEventLoop, timers)
    assert stream_deadlines(_request(10.0, 1.0, 3.0), loop) == (1003.0, 1003.0)
    assert stream_deadlines(_request(2.0, 1.0, 3.0), loop) == (1002.0, 1003.0)
    assert stream_deadlines(_request(2.0, 1.0, None), loop) == (1002.0, math.inf)


def test_opening_cut_says_which_bound_cut_it() -> None:
    """An opening cut at the end is the call's deadline; before it, a 'no first event'."""
    request = _request(2.0, 1.0, 3.0)
    assert "call deadline reached" in str(open_timed_out(request, 1003.0, 1003.0))
    assert str(open_timed_out(request, 1002.0, 1003.0)) == "no first event at primary after 2 s"


async def test_end_earlier_than_the_idle_deadline_cuts_with_the_deadline_message() -> None:
    """Events 0.9 s apart (idle 1 s) flow until the end at 2.5 s, which cuts the read then."""
    timers = _ManualTimers()
    events = _ending_stream(timers, deadline_in_s=2.5)
    got = [await _event_after(events, timers, 0.9, n) for n in range(2)]  # at 0.9 and 1.8 s
    assert got == [{"n": 0}, {"n": 1}]
    task = await _reading(events)
    timers.advance(0.69)  # t = 2.49: the idle deadline (2.8) is later than the end
    assert not task.done()
    timers.advance(0.02)
    with pytest.raises(TransientError) as info:
        await task
    assert info.value.timeout is True
    assert info.value.failure == "transient"
    assert str(info.value) == "call deadline reached at primary after 2.5 s"
    assert KEY not in str(info.value)
    assert KEY not in repr(info.value)
    assert timers.pending() == []
    with pytest.raises(StopAsyncIteration):
        await events.__anext__()


async def test_idle_earlier_than_the_end_still_fails_as_stream_idle() -> None:
    """With an end far away, a gap past the idle timeout is 'stream idle', not the deadline."""
    timers = _ManualTimers()
    events = _ending_stream(timers, deadline_in_s=100.0)
    await _event_after(events, timers, 0.1, 1)
    task = await _reading(events)
    timers.advance(1.01)
    with pytest.raises(TransientError, match="stream idle at primary after 1 s"):
        await task


async def test_no_end_lets_a_flowing_stream_run_on() -> None:
    """Without deadline_in_s, events 0.9 s apart keep coming for 90 s and more."""
    timers = _ManualTimers()
    events = _ending_stream(timers, deadline_in_s=None)
    got = [await _event_after(events, timers, 0.9, n) for n in range(100)]
    assert got[-1] == {"n": 99}
    assert timers.now > 1089.0


async def test_end_keeps_one_timer_for_many_events() -> None:
    """Fifty quick events with an end still schedule two timer handles, not fifty."""
    timers = _ManualTimers()
    events = _ending_stream(timers, deadline_in_s=30.0)
    for n in range(50):
        assert await _event_after(events, timers, 0.01, n) == {"n": n}
    assert len(timers.handles) == 2


async def test_no_first_event_before_an_earlier_end_is_the_deadline() -> None:
    """A TTFT (10 s) longer than the time left (2 s): silence is cut at 2 s as the deadline."""
    timers = _ManualTimers()
    events = _ending_stream(timers, deadline_in_s=2.0, timeout_s=10.0)
    task = await _reading(events)
    timers.advance(1.99)
    assert not task.done()
    timers.advance(0.02)
    with pytest.raises(TransientError, match="call deadline reached"):
        await task


async def test_end_passed_while_the_consumer_held_an_event_reads_nothing_more() -> None:
    """A consumer busy past the end: its next read fails at once, without waiting or a timer."""
    timers = _ManualTimers()
    events = _ending_stream(timers, deadline_in_s=2.0)
    await _event_after(events, timers, 0.1, 1)
    timers.advance(5.0)  # the consumer's own work runs past the end
    events.feed.put_nowait('{"n": 2}')  # already there, yet past the end
    with pytest.raises(TransientError, match="call deadline reached"):
        await events.__anext__()
    assert timers.pending() == []
    assert events.feed.qsize() == 1  # not read


async def test_real_loop_end_cuts_a_flowing_stream() -> None:
    """On the real loop, events every 10 ms with a 0.1 s end are cut as the deadline."""
    loop = asyncio.get_running_loop()
    request = _request(timeout_s=30.0, idle_timeout_s=30.0, deadline_in_s=0.1)
    first, end = stream_deadlines(request, loop)
    events = _Scripted(request, loop, first, end)

    async def feed() -> None:
        for n in range(1000):
            events.feed.put_nowait(f'{{"n": {n}}}')
            await asyncio.sleep(0.01)

    async def read_all(got: list[Any]) -> None:
        async with asyncio.timeout(5.0):
            async for item in events:
                got.append(item)

    feeder = asyncio.create_task(feed())
    got: list[Any] = []
    try:
        with pytest.raises(TransientError, match="call deadline reached") as info:
            await read_all(got)
    finally:
        feeder.cancel()
    assert info.value.timeout is True
    assert 0 < len(got) < 1000
    assert _our_handles(loop, events) == []


# --- TTFT to the first content (HttpRequest.is_content) ---

ROLE_CHUNK = '{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}'
USAGE_CHUNK = '{"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 0}}'
TEXT_CHUNK = '{"choices": [{"index": 0, "delta": {"content": "Hi"}}]}'


def _content_stream(
    timers: _ManualTimers,
    timeout_s: float = 10.0,
    idle_timeout_s: float = 1.0,
    deadline_in_s: float | None = None,
    is_content: Callable[[Any], bool] = chunk_has_content,
) -> _Scripted:
    """A stream opened now whose request tells content apart, as a chat stream's does."""
    loop = cast(asyncio.AbstractEventLoop, timers)
    request = dataclasses.replace(
        _request(timeout_s, idle_timeout_s, deadline_in_s), is_content=is_content
    )
    first, end = stream_deadlines(request, loop)
    return _Scripted(request, loop, first, end)


async def _data_after(events: _Scripted, timers: _ManualTimers, gap_s: float, data: str) -> Any:
    """Read one event whose data is ``data``, arriving ``gap_s`` after the read began."""
    task = await _reading(events)
    timers.advance(gap_s)
    events.feed.put_nowait(data)
    return await task


async def test_role_chunk_then_silence_fails_at_the_ttft_not_the_idle_timeout() -> None:
    """A role-only chunk does not end the TTFT: silence after it is cut at the TTFT deadline."""
    timers = _ManualTimers()
    events = _content_stream(timers, timeout_s=10.0, idle_timeout_s=1.0)
    assert await _data_after(events, timers, 0.1, ROLE_CHUNK) == json.loads(ROLE_CHUNK)
    task = await _reading(events)
    timers.advance(1.5)  # past the idle timeout: still within the TTFT
    assert not task.done()
    timers.advance(8.39)  # t = 9.99 s from the request
    assert not task.done()
    timers.advance(0.02)
    with pytest.raises(TransientError) as info:
        await task
    assert info.value.timeout is True
    assert info.value.failure == "transient"
    assert str(info.value) == "no first content at primary after 10 s"
    assert KEY not in str(info.value)
    assert timers.pending() == []


async def test_usage_and_role_chunks_keep_the_first_deadline_until_content() -> None:
    """Preamble chunks 4 s apart (idle 1 s) all pass; the first text switches to idle timing."""
    timers = _ManualTimers()
    events = _content_stream(timers, timeout_s=10.0, idle_timeout_s=1.0)
    await _data_after(events, timers, 4.0, ROLE_CHUNK)
    await _data_after(events, timers, 4.0, USAGE_CHUNK)
    assert await _data_after(events, timers, 1.5, TEXT_CHUNK) == json.loads(TEXT_CHUNK)
    task = await _reading(events)
    timers.advance(1.01)
    with pytest.raises(TransientError, match="stream idle at primary after 1 s"):
        await task


async def test_silence_with_no_event_at_all_is_still_no_first_event() -> None:
    """Nothing at all by the TTFT, with is_content set: the message stays 'no first event'."""
    timers = _ManualTimers()
    events = _content_stream(timers, timeout_s=2.0, idle_timeout_s=30.0)
    task = await _reading(events)
    timers.advance(2.01)
    with pytest.raises(TransientError) as info:
        await task
    assert str(info.value) == "no first event at primary after 2 s"


async def test_tool_call_delta_ends_the_ttft() -> None:
    """A tool-call delta with no text is content: the next gap is bounded by the idle timeout."""
    timers = _ManualTimers()
    events = _content_stream(timers, timeout_s=10.0, idle_timeout_s=1.0)
    tool_chunk = (
        '{"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c1",'
        ' "function": {"name": "f", "arguments": ""}}]}}]}'
    )
    await _data_after(events, timers, 0.1, ROLE_CHUNK)
    await _data_after(events, timers, 0.1, tool_chunk)
    task = await _reading(events)
    timers.advance(1.01)
    with pytest.raises(TransientError, match="stream idle"):
        await task


async def test_content_predicate_runs_only_until_the_first_content() -> None:
    """The predicate sees the preamble and the first content, never the chunks after it."""
    timers = _ManualTimers()
    seen: list[Any] = []

    def counting(event: Any) -> bool:
        seen.append(event)
        return chunk_has_content(event)

    events = _content_stream(timers, is_content=counting)
    await _data_after(events, timers, 0.01, ROLE_CHUNK)
    for _ in range(50):
        await _data_after(events, timers, 0.01, TEXT_CHUNK)
    assert len(seen) == 2
    # Still one timer for the TTFT and one moved earlier to the first idle deadline.
    assert len(timers.handles) == 2


async def test_end_before_the_ttft_cuts_a_stalled_preamble_as_the_deadline() -> None:
    """A role chunk, then silence, with the call's end (3 s) before the TTFT (10 s): deadline."""
    timers = _ManualTimers()
    events = _content_stream(timers, timeout_s=10.0, idle_timeout_s=1.0, deadline_in_s=3.0)
    await _data_after(events, timers, 0.1, ROLE_CHUNK)
    task = await _reading(events)
    timers.advance(2.89)
    assert not task.done()
    timers.advance(0.02)
    with pytest.raises(TransientError, match="call deadline reached"):
        await task


async def test_a_predicate_that_raises_closes_the_stream() -> None:
    """A failing predicate ends the stream like any failed read: no timer outlives it."""
    timers = _ManualTimers()

    def broken(event: Any) -> bool:
        raise ValueError("bug")

    events = _content_stream(timers, is_content=broken)
    events.feed.put_nowait(ROLE_CHUNK)
    with pytest.raises(ValueError, match="bug"):
        await events.__anext__()
    assert timers.pending() == []
    with pytest.raises(StopAsyncIteration):
        await events.__anext__()


async def test_real_loop_role_chunk_then_silence_is_cut_at_the_ttft() -> None:
    """On the real loop, a role chunk then silence ends at a 50 ms TTFT, not a 30 s idle timeout."""
    loop = asyncio.get_running_loop()
    request = dataclasses.replace(
        _request(timeout_s=0.05, idle_timeout_s=30.0), is_content=chunk_has_content
    )
    first, end = stream_deadlines(request, loop)
    events = _Scripted(request, loop, first, end)
    events.feed.put_nowait(ROLE_CHUNK)
    async with asyncio.timeout(5.0):
        assert await events.__anext__() == json.loads(ROLE_CHUNK)
        with pytest.raises(TransientError, match="no first content") as info:
            await events.__anext__()
    assert info.value.timeout is True
    assert _our_handles(loop, events) == []


@pytest.mark.parametrize(
    ("chunk", "expected"),
    [
        ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, False),
        (
            {"choices": [{"delta": {"role": "assistant", "content": None, "refusal": None}}]},
            False,
        ),
        ({"choices": [{"index": 0, "delta": {}, "finish_reason": None}]}, False),
        ({"choices": [{"index": 0}]}, False),
        ({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 0}}, False),
        ({"choices": [{"delta": {"content": "x"}}]}, True),
        ({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c"}]}}]}, True),
        ({"choices": [{"delta": {"refusal": "no"}}]}, True),
        ({"choices": [{"delta": {"function_call": {"name": "f"}}}]}, True),
        ({"choices": [{"delta": {"reasoning_content": "hmm"}}]}, True),
        ({"choices": [{"delta": {}, "finish_reason": "stop"}]}, True),
        ({"error": {"message": "boom"}}, True),
        ("not an object", True),
        ({"choices": "not a list"}, True),
    ],
)
def test_chunk_has_content_tells_content_from_the_preamble(chunk: Any, expected: bool) -> None:
    """Text, tool calls, refusals, reasoning, a finish or an error are content; the rest is not."""
    assert chunk_has_content(chunk) is expected
