"""Telemetry per call: one ``CallRecord`` for every call through the loop, however it ends,
several emitters at once, and an emitter that raises never failing a call."""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import pytest
from _closing import closing
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from polygateway.backends.base import AttemptOutcome
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import AllSourcesExhausted, RequestRejected
from polygateway.middleware.telemetry import Emitters, PrometheusEmitter
from polygateway.models import AttemptRecord, CallRecord
from polygateway.testing import (
    BoundedSleep,
    Delay,
    FakeClock,
    FakeTransport,
    Gate,
    Recorder,
    StreamScript,
    TransientError,
    chat_chunk_events,
    chat_completion,
    gateway_settings,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def make_chat(
    clock: FakeClock,
    script: Any,
    *,
    backend: MemoryBackend | None = None,
    max_concurrency: int = 4,
    **parts: Any,
) -> tuple[ChatClient, MemoryBackend]:
    """A one-source chat client on a fake clock (breaker opens after 1 failure)."""
    backend = backend if backend is not None else MemoryBackend(now=clock)
    client = closing(
        ChatClient(
            gateway_settings(
                {"name": "primary", "max_concurrency": max_concurrency},
                breaker_failures=1,
                max_attempts=1,
            ),
            backend=backend,
            transport=FakeTransport(script, clock=clock),
            now=clock,
            sleep=BoundedSleep(clock, max_calls=200),
            rng=random.Random(3),
            **parts,
        )
    )
    return client, backend


async def test_a_served_call_yields_one_record_with_its_tokens_and_source() -> None:
    """A call served at once: outcome served, one attempt, its source, its usage, no waiting."""
    clock = FakeClock()
    recorder = Recorder()
    chat, _ = make_chat(
        clock,
        [Delay(2.0, chat_completion("hi", prompt_tokens=7, completion_tokens=3))],
        emitter=recorder,
    )
    await chat.complete(MESSAGES)
    [call] = recorder.calls
    assert call.outcome == "served"
    assert call.operation == "chat.complete"
    assert (call.scope, call.source, call.attempts) == ("chat", "primary", 1)
    assert (call.prompt_tokens, call.completion_tokens) == (7, 3)
    assert call.duration_s == pytest.approx(2.0)
    assert call.waited_s == 0.0
    assert call.stalled_s == pytest.approx(0.0)
    assert recorder.records[0].call_id == call.call_id


async def test_an_open_breaker_leaves_one_retry_exhausted_and_the_rest_no_runnable() -> None:
    """50 fail_fast calls on a broken source: the first fails, 49 never reach it, all recorded."""
    clock = FakeClock()
    recorder = Recorder()
    chat, _ = make_chat(clock, [TransientError(status_code=500)], emitter=recorder)
    outcomes = []
    for _ in range(50):
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES, fail_fast=True)
        outcomes.append(caught.value.reason)
    assert recorder.call_outcomes() == outcomes
    assert outcomes.count("retry_exhausted") == 1
    assert outcomes.count("no_runnable") == 49
    assert [c.attempts for c in recorder.calls] == [1] + [0] * 49
    assert all(c.source is None for c in recorder.calls)
    assert len(recorder.records) == 1  # one attempt record: the only call that reached it


async def test_the_breaker_scenario_through_a_prometheus_scrape() -> None:
    """Scraped and parsed back: calls_total counts 1 retry_exhausted and 49 no_runnable."""
    clock = FakeClock()
    registry = CollectorRegistry()
    chat, _ = make_chat(
        clock, [TransientError(status_code=500)], emitter=PrometheusEmitter(registry)
    )
    for _ in range(50):
        with pytest.raises(AllSourcesExhausted):
            await chat.complete(MESSAGES, fail_fast=True)
    calls: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        if family.name == "polygateway_calls":
            for sample in family.samples:
                if sample.name == "polygateway_calls_total":
                    calls[sample.labels["outcome"]] = sample.value
    assert calls == {"retry_exhausted": 1.0, "no_runnable": 49.0}


async def test_a_rejected_request_is_recorded_as_rejected() -> None:
    """A 400 ends the call at once: outcome rejected, its attempt counted."""
    clock = FakeClock()
    recorder = Recorder()
    chat, _ = make_chat(clock, [TransientError(status_code=400)], emitter=recorder)
    with pytest.raises(RequestRejected):
        await chat.complete(MESSAGES)
    assert recorder.call_outcomes() == ["rejected"]
    assert recorder.calls[0].attempts == 1


async def test_a_cancelled_call_is_recorded_as_cancelled() -> None:
    """The caller's cancellation mid-attempt ends the call with a cancelled record."""
    clock = FakeClock()
    recorder = Recorder()
    gate = Gate()
    chat, _ = make_chat(clock, [gate], emitter=recorder)
    task = asyncio.create_task(chat.complete(MESSAGES))
    await gate.wait_entered()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert recorder.call_outcomes() == ["cancelled"]


async def test_a_stream_read_to_its_end_is_served_and_one_closed_early_is_cancelled() -> None:
    """A stream's record comes at its end: served after a clean end, cancelled when left."""
    clock = FakeClock()
    recorder = Recorder()
    script = [StreamScript(chat_chunk_events(["a", "b"])) for _ in range(2)]
    chat, _ = make_chat(clock, script, emitter=recorder)
    async with chat.stream(MESSAGES) as stream:
        assert [c.text async for c in stream]
    async with chat.stream(MESSAGES) as stream:
        async for _ in stream:
            break
    assert recorder.call_outcomes() == ["served", "cancelled"]
    assert [c.operation for c in recorder.calls] == ["chat.stream", "chat.stream"]


async def test_waiting_in_the_queue_is_recorded_as_waited() -> None:
    """A call that waits for the only permit records the wait, as waited and stalled time."""
    clock = FakeClock()
    recorder = Recorder()
    backend = MemoryBackend(now=clock)
    chat, _ = make_chat(
        clock, [chat_completion()], backend=backend, max_concurrency=1, emitter=recorder
    )
    held = await backend.acquire(
        "chat",
        [chat._mw._order.sources[0][1]],  # the scope's own spec: one permit
        ttl_s=60.0,
    )
    assert held.lease is not None
    task = asyncio.create_task(chat.complete(MESSAGES))
    for _ in range(5):
        await asyncio.sleep(0)
    clock.advance(3.0)
    await backend.release(held.lease, AttemptOutcome("success"))
    await task
    [call] = recorder.calls
    assert call.outcome == "served"
    assert call.waited_s >= 3.0
    assert call.stalled_s >= 3.0


class _Broken:
    """An emitter that raises on everything."""

    def emit_attempt(self, record: AttemptRecord) -> None:
        raise RuntimeError("attempt sink down")

    def emit_call(self, record: CallRecord) -> None:
        raise RuntimeError("call sink down")


async def test_a_failing_emitter_is_logged_once_and_never_fails_a_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A broken emitter beside a good one: both calls served and recorded, one warning."""
    clock = FakeClock()
    recorder = Recorder()
    chat, _ = make_chat(
        clock, [chat_completion("a"), chat_completion("b")], emitters=[_Broken(), recorder]
    )
    with caplog.at_level(logging.DEBUG, logger="polygateway.telemetry"):
        assert (await chat.complete(MESSAGES)).text == "a"
        assert (await chat.complete(MESSAGES)).text == "b"
    assert recorder.call_outcomes() == ["served", "served"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "_Broken" in warnings[0].getMessage()


async def test_emitter_and_emitters_all_receive_every_record() -> None:
    """``emitter=`` and ``emitters=[...]`` together: each gets every attempt and call record."""
    clock = FakeClock()
    first, second, third = Recorder(), Recorder(), Recorder()
    chat, _ = make_chat(clock, [chat_completion()], emitter=first, emitters=[second, third])
    await chat.complete(MESSAGES)
    for recorder in (first, second, third):
        assert recorder.call_outcomes() == ["served"]
        assert recorder.outcomes() == ["success"]


def test_an_attempt_only_emitter_gets_attempt_records() -> None:
    """An emitter without ``emit_call`` (written before call records) still gets attempts."""

    class AttemptsOnly:
        def __init__(self) -> None:
            self.seen: list[AttemptRecord] = []

        def emit_attempt(self, record: AttemptRecord) -> None:
            self.seen.append(record)

    sink = AttemptsOnly()
    group = Emitters([sink])
    record = AttemptRecord("c", "chat", "primary", 1, "success", None, 0.1)
    group.emit_attempt(record)
    group.emit_call(CallRecord("c", "chat", "chat.complete", "served", 1, "primary", 0.1, 0, 0))
    assert sink.seen == [record]


async def test_a_binding_emitter_learns_each_client_it_is_passed_to() -> None:
    """``bind`` is called once per client with its kind, scope, sources, backend and queue."""
    from polygateway.middleware.telemetry import ClientInfo

    class Binding(Recorder):
        __slots__ = ("bound",)

        def __init__(self) -> None:
            super().__init__()
            self.bound: list[ClientInfo] = []

        def bind(self, client: ClientInfo) -> None:
            self.bound.append(client)

    clock = FakeClock()
    sink = Binding()
    _chat, backend = make_chat(clock, [], emitters=[sink])
    [info] = sink.bound
    assert (info.kind, info.scope) == ("chat", "chat")
    assert [s.name for s in info.sources] == ["primary"]
    assert info.backend is backend
    assert info.waiting() == 0


# --- every way a call can end has its outcome --------------------------------------------------


async def _read_all(chat: ChatClient, **options: Any) -> None:
    async with chat.stream(MESSAGES, **options) as stream:
        async for _ in stream:
            pass


async def test_a_cut_stream_is_interrupted_and_one_past_its_deadline_is_deadline() -> None:
    """A stream failing mid-way ends ``interrupted``; one flowing at its deadline, ``deadline``."""
    from polygateway.errors import StreamInterrupted

    clock = FakeClock()
    recorder = Recorder()
    events = chat_chunk_events(["a", "b", "c"])
    script = [
        StreamScript(events, fail_after=2),
        StreamScript(events, gap_s=10.0),
    ]
    chat, _ = make_chat(clock, script, emitter=recorder)
    with pytest.raises(StreamInterrupted):
        await _read_all(chat)
    with pytest.raises(AllSourcesExhausted) as caught:
        await _read_all(chat, deadline_s=15.0)
    assert caught.value.reason == "deadline"
    assert recorder.call_outcomes() == ["interrupted", "deadline"]


async def test_a_backend_failure_is_backend_error_and_a_bug_is_error() -> None:
    """The backend failing ends ``backend_error``; an unexpected exception ends ``error``."""
    from polygateway.errors import GovernanceBackendError
    from polygateway.middleware.retry import LoopPolicy, RetryMW

    clock = FakeClock()
    recorder = Recorder()

    class Broken(MemoryBackend):
        __slots__ = ()

        async def acquire(self, *args: Any, **kwargs: Any) -> Any:
            raise GovernanceBackendError("redis went away", operation="acquire")

    chat, _ = make_chat(clock, [], backend=Broken(now=clock), emitter=recorder)
    with pytest.raises(GovernanceBackendError):
        await chat.complete(MESSAGES)
    settings = gateway_settings("primary")
    mw = RetryMW(
        scope="chat",
        sources=settings.scope("chat").sources,
        policy=LoopPolicy(),
        backend=MemoryBackend(now=clock),
        now=clock,
        sleep=BoundedSleep(clock, max_calls=10),
        rng=random.Random(1),
        emitter=recorder,
    )

    async def buggy(source: Any, ctx: Any) -> Any:
        raise KeyError("a bug in the attempt function")

    with pytest.raises(KeyError):
        await mw.run(buggy)
    assert recorder.call_outcomes() == ["backend_error", "error"]


async def test_waits_add_up_over_the_queue_and_the_back_offs() -> None:
    """Two failures with their back-offs, each counted into ``waited_s``, none lost."""
    clock = FakeClock()
    recorder = Recorder()
    backend = MemoryBackend(now=clock)
    chat = closing(
        ChatClient(
            gateway_settings(
                {"name": "primary"}, max_attempts=3, backoff_base_s=2.0, backoff_cap_s=2.0
            ),
            backend=backend,
            transport=FakeTransport(
                [
                    TransientError(status_code=500),
                    TransientError(status_code=500),
                    chat_completion(),
                ],
                clock=clock,
            ),
            now=clock,
            sleep=BoundedSleep(clock, max_calls=50),
            rng=random.Random(3),
            emitter=recorder,
        )
    )
    await chat.complete(MESSAGES)
    [call] = recorder.calls
    # Two back-offs, each in [1, 2] s (equal jitter of a 2 s cap): their sum, not the last.
    assert 2.0 <= call.waited_s <= 4.0
    assert call.waited_s == pytest.approx(call.duration_s)


class _RaisingAttempts:
    """An emitter handed straight to a loop (no fan-out around it) that raises."""

    def emit_attempt(self, record: AttemptRecord) -> None:
        raise RuntimeError("down")

    def emit_call(self, record: CallRecord) -> None:
        raise RuntimeError("down")


async def test_an_emitter_given_straight_to_the_loop_is_isolated_too() -> None:
    """``RetryMW(emitter=...)`` wraps a bare emitter in the safe fan-out: the call is served."""
    from polygateway.middleware.retry import LoopPolicy, RetryMW

    clock = FakeClock()
    settings = gateway_settings("primary")
    mw = RetryMW(
        scope="chat",
        sources=settings.scope("chat").sources,
        policy=LoopPolicy(),
        backend=MemoryBackend(now=clock),
        now=clock,
        sleep=BoundedSleep(clock, max_calls=10),
        rng=random.Random(1),
        emitter=_RaisingAttempts(),
    )

    async def ok(source: Any, ctx: Any) -> str:
        return "served"

    assert (await mw.run(ok)).value == "served"


async def test_a_cancelled_attempt_whose_release_fails_is_logged_scrubbed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Cancelled mid-attempt and the release fails: CancelledError passes, the log has no key."""
    from polygateway.errors import GovernanceBackendError

    clock = FakeClock()
    gate = Gate()

    class BrokenRelease(MemoryBackend):
        __slots__ = ()

        async def release(self, *args: Any, **kwargs: Any) -> None:
            raise GovernanceBackendError(
                "release failed near sk-test-primary-secret", operation="release"
            )

    chat, _ = make_chat(clock, [gate], backend=BrokenRelease(now=clock))
    task = asyncio.create_task(chat.complete(MESSAGES))
    await gate.wait_entered()
    with caplog.at_level(logging.WARNING, logger="polygateway.retry"):
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    [line] = [r.getMessage() for r in caplog.records if "release of a cancelled" in r.getMessage()]
    assert "sk-test-primary-secret" not in line
