"""Every fault of a real upstream, end to end: simulator on 127.0.0.1, real client, both transports.

Each test plays one fault through the simulator (or a closed port) and pins
the whole chain: how the attempt was classified (its record), what the loop
did next (fail over, pace, trip, raise), what shared state recorded (breaker,
AIMD, pacer, permits) and what the caller finally got (type and ``reason``).
The faulty source is ``bad`` (priority 0, tried first); ``good`` (priority 1)
is healthy, so a failover is visible as ``bad`` then ``good`` in the attempts.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.cli.demo import tiny_png
from polygateway.config import GatewaySettings, ScopeConfig, SourceConfig
from polygateway.embedding import EmbeddingClient
from polygateway.errors import AllSourcesExhausted, StreamInterrupted
from polygateway.models import AttemptRecord, ChatChunk, EmbeddingProgress
from polygateway.ocr import OcrClient
from polygateway.simulator import FaultProfile, SimulatedUpstream
from polygateway.testing import Recorder

HI = [{"role": "user", "content": "hello"}]
HEALTHY = FaultProfile()
# Short enough to keep the suite quick, long enough that loopback never trips them by accident.
TIMEOUT_S = 0.4
TTFT_S = 0.4
STALL_S = 1.0
MAX_ATTEMPTS = 3
# Bounds the tests' own waits, never a timing under test.
BOUND_S = 20.0


@dataclass
class Rig:
    """A simulator, the settings pointing at it, one backend and a telemetry recorder."""

    sim: SimulatedUpstream
    transport: str
    backend: MemoryBackend
    recorder: Recorder

    def settings(
        self,
        *sources: Mapping[str, Any],
        kind: str = "chat",
        **gateway: Any,
    ) -> GatewaySettings:
        """One scope named after ``kind`` over the given sources (``name`` and overrides each)."""
        built = []
        for priority, spec in enumerate(sources):
            fields: dict[str, Any] = {
                "protocol": "monkey_ocr" if kind == "ocr" else "openai",
                "model": "sim",
                "timeout_s": TIMEOUT_S,
                "ttft_timeout_s": TTFT_S,
                "stream_idle_timeout_s": TIMEOUT_S,
                "connect_timeout_s": TIMEOUT_S,
                "priority": priority,
                **spec,
            }
            if "base_url" not in fields:
                protocol = "monkey_ocr" if kind == "ocr" else "openai"
                fields["base_url"] = self.sim.base_url(fields["name"], protocol)
            built.append(SourceConfig(**fields))
        knobs: dict[str, Any] = {
            "transport": self.transport,
            "max_attempts": MAX_ATTEMPTS,
            "stall_window_s": STALL_S,
            "poll_interval_s": 0.05,
            "backoff_base_s": 0.01,
            "backoff_cap_s": 0.05,
            "breaker_failures": 5,
            "breaker_cooldown_s": 30.0,
            **gateway,
        }
        return GatewaySettings(
            _env_file=None,
            scopes={kind: ScopeConfig(kind=kind, sources=tuple(built))},  # type: ignore[arg-type]
            **knobs,
        )

    def chat(self, settings: GatewaySettings) -> ChatClient:
        """A chat client on the rig's backend and recorder."""
        return ChatClient(settings, "chat", backend=self.backend, emitter=self.recorder)

    async def source(self, scope: str, name: str) -> Any:
        """The backend's snapshot of one source."""
        snapshot = (await self.backend.snapshot(scope)).source(name)
        assert snapshot is not None, f"the backend never saw {name}"
        return snapshot

    async def permits(self, scope: str) -> int:
        """Permits held in the scope."""
        return (await self.backend.snapshot(scope)).in_flight


@pytest.fixture
async def rig(transport: str) -> AsyncIterator[Rig]:
    """Sources ``bad`` and ``good`` (healthy until a test gives ``bad`` its fault)."""
    async with SimulatedUpstream({"bad": HEALTHY, "good": HEALTHY}, seed=3) as sim:
        yield Rig(sim, transport, MemoryBackend(), Recorder())


def closed_port() -> int:
    """A loopback port nobody listens on: connecting to it is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def outcomes(attempts: tuple[AttemptRecord, ...]) -> list[tuple[str, str]]:
    """(source, outcome) of each attempt, in order."""
    return [(a.source, a.outcome) for a in attempts]


async def read_stream(chat: ChatClient) -> tuple[list[ChatChunk], BaseException | None]:
    """Consume one stream; the chunks that reached the caller and the error that ended it."""
    chunks: list[ChatChunk] = []
    try:
        async with asyncio.timeout(BOUND_S), chat.stream(HI, max_tokens=16) as stream:
            async for chunk in stream:
                chunks.append(chunk)
    except (StreamInterrupted, AllSourcesExhausted) as exc:
        return chunks, exc
    return chunks, None


async def fails_over(rig: Rig, settings: GatewaySettings) -> tuple[AttemptRecord, Any]:
    """A non-streamed call that ``bad`` fails and ``good`` serves; the failed attempt's record."""
    async with rig.chat(settings) as chat:
        async with asyncio.timeout(BOUND_S):
            answer = await chat.complete(HI, max_tokens=8)
    assert answer.source == "good"
    assert outcomes(answer.attempts)[-1] == ("good", "success")
    assert answer.attempts[0].source == "bad"
    assert await rig.permits("chat") == 0
    return answer.attempts[0], answer


async def exhausts(rig: Rig, settings: GatewaySettings, scope: str = "chat") -> AllSourcesExhausted:
    """A non-streamed call on a scope that cannot serve; the error that ended it."""
    async with rig.chat(settings) as chat:
        with pytest.raises(AllSourcesExhausted) as caught:
            async with asyncio.timeout(BOUND_S):
                await chat.complete(HI, max_tokens=8)
    assert await rig.permits(scope) == 0
    return caught.value


# -- connection refused -----------------------------------------------------------------


async def test_connection_refused_fails_over_then_exhausts_as_transient(rig: Rig) -> None:
    """A refused connect is transient: the call fails over; alone, it ends retry_exhausted."""
    refused = {"name": "bad", "base_url": f"http://127.0.0.1:{closed_port()}/v1"}
    failed, _ = await fails_over(rig, rig.settings(refused, {"name": "good"}))
    assert failed.outcome == "transient"
    assert failed.status_code is None
    assert "connect" in (failed.error or "")
    assert (await rig.source("chat", "bad")).consecutive_failures == 1

    error = await exhausts(rig, rig.settings(refused))
    assert error.reason == "retry_exhausted"
    assert [a.outcome for a in error.attempts] == ["transient"] * MAX_ATTEMPTS
    assert error.sources == ("bad",)


# -- resets -----------------------------------------------------------------------------


async def test_reset_mid_body_is_transient_and_fails_over(rig: Rig) -> None:
    """A connection dropped halfway through a 200 body is transient; the next source serves."""
    rig.sim.set_profile("bad", FaultProfile(rate_reset=1.0))
    failed, _ = await fails_over(rig, rig.settings({"name": "bad"}, {"name": "good"}))
    assert failed.outcome == "transient"
    assert failed.status_code is None
    assert rig.sim.stats("bad").outcome("reset") == 1
    assert (await rig.source("chat", "bad")).breaker == "closed"
    assert (await rig.source("chat", "bad")).consecutive_failures == 1


async def test_reset_mid_stream_raises_stream_interrupted_and_tries_no_other_source(
    rig: Rig,
) -> None:
    """A reset after chunks reached the caller is StreamInterrupted: never silently retried."""
    rig.sim.set_profile("bad", FaultProfile(rate_reset=1.0, stream_chunks=8))
    async with rig.chat(rig.settings({"name": "bad"}, {"name": "good"})) as chat:
        chunks, error = await read_stream(chat)
    assert isinstance(error, StreamInterrupted)
    assert error.chunks_delivered == len(chunks) >= 1
    assert error.sources == ("bad",)
    assert rig.sim.stats("good").requests == 0
    assert [r.outcome for r in rig.recorder.records] == ["transient"]
    assert (await rig.source("chat", "bad")).consecutive_failures == 1
    assert await rig.permits("chat") == 0


# -- timeouts ---------------------------------------------------------------------------


async def test_hang_past_timeout_fails_over_and_shrinks_aimd(rig: Rig) -> None:
    """A hang is cut at timeout_s: transient, AIMD decreases, the next source serves."""
    rig.sim.set_profile("bad", FaultProfile(rate_hang=1.0))
    settings = rig.settings({"name": "bad", "max_concurrency": 4}, {"name": "good"})
    failed, _ = await fails_over(rig, settings)
    assert failed.outcome == "transient"
    assert TIMEOUT_S * 0.9 <= failed.latency_s < TIMEOUT_S + 1.0
    bad = await rig.source("chat", "bad")
    assert bad.limit < 4
    assert bad.consecutive_failures == 1


async def test_hang_on_every_attempt_is_bounded_by_max_attempts_times_timeout(rig: Rig) -> None:
    """Alone, a hanging source ends retry_exhausted within max_attempts x timeout_s (+ back-off)."""
    rig.sim.set_profile("bad", FaultProfile(rate_hang=1.0))
    started = time.monotonic()
    error = await exhausts(rig, rig.settings({"name": "bad"}))
    elapsed = time.monotonic() - started
    assert error.reason == "retry_exhausted"
    assert [a.outcome for a in error.attempts] == ["transient"] * MAX_ATTEMPTS
    assert MAX_ATTEMPTS * TIMEOUT_S * 0.9 <= elapsed < MAX_ATTEMPTS * TIMEOUT_S + 2.0


async def test_slow_first_token_fails_over_before_any_chunk_reaches_the_caller(rig: Rig) -> None:
    """A first token later than ttft_timeout_s is a transient failure; the caller sees good only."""
    rig.sim.set_profile("bad", FaultProfile(ttft_s=5.0))
    async with rig.chat(rig.settings({"name": "bad"}, {"name": "good"})) as chat:
        started = time.monotonic()
        chunks, error = await read_stream(chat)
        elapsed = time.monotonic() - started
    assert error is None
    assert chunks
    assert {c.source for c in chunks} == {"good"}
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["stop"]
    first = rig.recorder.records[0]
    assert (first.source, first.outcome) == ("bad", "transient")
    assert TTFT_S * 0.9 <= first.latency_s < TTFT_S + 1.0
    assert elapsed < TTFT_S + 2.0
    assert await rig.permits("chat") == 0


# -- bodies that are not what they claim -------------------------------------------------


async def test_malformed_json_is_transient_and_fails_over(rig: Rig) -> None:
    """A 200 whose body is not JSON is a malformed answer: transient, next source."""
    rig.sim.set_profile("bad", FaultProfile(rate_malformed=1.0))
    failed, _ = await fails_over(rig, rig.settings({"name": "bad"}, {"name": "good"}))
    assert failed.outcome == "transient"
    assert "malformed" in (failed.error or "")
    assert rig.sim.stats("bad").outcome("malformed") == 1


async def test_malformed_stream_event_fails_over_before_the_first_chunk(rig: Rig) -> None:
    """A stream whose first event is not JSON fails over like any failure before a chunk."""
    rig.sim.set_profile("bad", FaultProfile(rate_malformed=1.0))
    async with rig.chat(rig.settings({"name": "bad"}, {"name": "good"})) as chat:
        chunks, error = await read_stream(chat)
    assert error is None
    assert {c.source for c in chunks} == {"good"}
    assert outcomes(tuple(rig.recorder.records)) == [("bad", "transient"), ("good", "success")]


async def test_a_200_whose_body_is_an_error_is_transient_and_fails_over(rig: Rig) -> None:
    """A 200 carrying {"error": ...} is a failure, plain or streamed, never an empty answer."""
    rig.sim.set_profile("bad", FaultProfile(rate_error_body=1.0))
    settings = rig.settings({"name": "bad"}, {"name": "good"})
    failed, answer = await fails_over(rig, settings)
    assert failed.outcome == "transient"
    assert "error" in (failed.error or "")
    assert answer.text

    rig.recorder.records.clear()
    async with rig.chat(settings) as chat:
        chunks, error = await read_stream(chat)
    assert error is None
    assert {c.source for c in chunks} == {"good"}
    assert [r.outcome for r in rig.recorder.records] == ["transient", "success"]


async def test_monkey_ocr_success_false_is_charged_until_retry_exhausted(rig: Rig) -> None:
    """MonkeyOCR's {"success": false} in a 200 is transient; OCR charges it to max_attempts."""
    rig.sim.set_profile("bad", FaultProfile(rate_error_body=1.0))
    settings = rig.settings({"name": "bad"}, kind="ocr")
    async with OcrClient(settings, "ocr", backend=rig.backend) as ocr:
        with pytest.raises(AllSourcesExhausted) as caught:
            async with asyncio.timeout(BOUND_S):
                await ocr.recognize_text(tiny_png())
    assert caught.value.reason == "retry_exhausted"
    assert [a.outcome for a in caught.value.attempts] == ["transient"] * MAX_ATTEMPTS
    assert rig.sim.stats("bad").outcome("error_body") == MAX_ATTEMPTS
    assert await rig.permits("ocr") == 0


async def test_truncated_stream_after_chunks_is_stream_interrupted(rig: Rig) -> None:
    """An event stream that stops without finish_reason or [DONE] is interrupted, not finished."""
    rig.sim.set_profile("bad", FaultProfile(rate_truncate=1.0, stream_chunks=8))
    async with rig.chat(rig.settings({"name": "bad"}, {"name": "good"})) as chat:
        chunks, error = await read_stream(chat)
    assert isinstance(error, StreamInterrupted)
    assert error.chunks_delivered == len(chunks) >= 1
    assert all(c.finish_reason is None for c in chunks)
    assert rig.sim.stats("good").requests == 0
    assert [r.outcome for r in rig.recorder.records] == ["transient"]
    assert await rig.permits("chat") == 0


# -- storms -----------------------------------------------------------------------------


async def test_503_storm_opens_every_breaker_then_nothing_reaches_the_upstream(rig: Rig) -> None:
    """503s trip every breaker; then calls fail without a request: no_runnable, then stalled."""
    storm = FaultProfile(rate_5xx=1.0, statuses_5xx=(503,))
    rig.sim.set_profile("bad", storm)
    rig.sim.set_profile("good", storm)
    settings = rig.settings(
        {"name": "bad", "max_concurrency": 4},
        {"name": "good", "max_concurrency": 4},
        breaker_failures=2,
    )
    async with rig.chat(settings) as chat:
        for _ in range(4):
            with pytest.raises(AllSourcesExhausted) as caught:
                async with asyncio.timeout(BOUND_S):
                    await chat.complete(HI, fail_fast=True)
            if caught.value.reason == "no_runnable":
                break
            assert caught.value.reason == "retry_exhausted"
            assert {a.status_code for a in caught.value.attempts} == {503}
        assert caught.value.reason == "no_runnable"
        for name in ("bad", "good"):
            state = await rig.source("chat", name)
            assert state.breaker == "open"
            assert state.limit < 4  # 503 is overload: AIMD shrank too
        retry_after = caught.value.retry_after_s
        assert retry_after is not None
        assert 25.0 < retry_after <= 30.0

        seen = rig.sim.stats("bad").requests + rig.sim.stats("good").requests
        started = time.monotonic()
        with pytest.raises(AllSourcesExhausted) as waited:
            async with asyncio.timeout(BOUND_S):
                await chat.complete(HI)
        assert waited.value.reason == "stalled"
        assert time.monotonic() - started >= STALL_S
        assert waited.value.attempts == ()
        assert rig.sim.stats("bad").requests + rig.sim.stats("good").requests == seen
    assert await rig.permits("chat") == 0


@pytest.mark.parametrize(
    ("retry_after_s", "pace_s"),
    [pytest.param(0.5, 0.5, id="retry-after"), pytest.param(None, 1.0, id="no-retry-after")],
)
async def test_429_storm_paces_the_source_and_chat_ends_stalled_uncharged(
    rig: Rig, retry_after_s: float | None, pace_s: float
) -> None:
    """Chat: 429s are paced (Retry-After, else 1 s), never charged, never trip; the call stalls."""
    rig.sim.set_profile("bad", FaultProfile(rate_429=1.0, retry_after_s=retry_after_s))
    settings = rig.settings({"name": "bad", "max_concurrency": 4}, stall_window_s=1.5)
    error = await exhausts(rig, settings)
    assert error.reason == "stalled"
    assert all(a.outcome == "rate_limited" and a.status_code == 429 for a in error.attempts)
    assert len(error.attempts) >= 2
    state = await rig.source("chat", "bad")
    assert state.breaker == "closed"
    assert state.consecutive_failures == 0
    assert state.limit < 4
    assert error.retry_after_s is not None
    assert 0.0 <= error.retry_after_s <= pace_s
    arrivals = rig.sim.stats("bad").arrivals
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    assert min(gaps) >= pace_s * 0.9, gaps


async def test_429_storm_on_embeddings_is_charged_until_retry_exhausted(rig: Rig) -> None:
    """Embedding charges 429s (exempt_429 false): paced, then retry_exhausted at max_attempts."""
    rig.sim.set_profile("bad", FaultProfile(rate_429=1.0, retry_after_s=0.2))
    settings = rig.settings({"name": "bad"}, kind="embed")
    async with EmbeddingClient(settings, "embed", backend=rig.backend) as emb:
        with pytest.raises(AllSourcesExhausted) as caught:
            async with asyncio.timeout(BOUND_S):
                await emb.embed(["a", "b"])
    assert caught.value.reason == "retry_exhausted"
    assert [a.outcome for a in caught.value.attempts] == ["rate_limited"] * MAX_ATTEMPTS
    assert caught.value.batch == (0, 2)
    arrivals = rig.sim.stats("bad").arrivals
    assert all(b - a >= 0.18 for a, b in itertools.pairwise(arrivals)), arrivals
    assert await rig.permits("embed") == 0


async def test_flaky_embedding_source_loses_no_computed_vector(rig: Rig) -> None:
    """A source failing some batches: every other vector kept, only the failed spans re-sent.

    One attempt per batch, so the simulator's seeded dice decide how many of
    the 20 batches fail (their order only decides which). ``partial=True``
    returns the rest in place; without it the error carries the same kind of
    result; once the source heals, embedding only the failed spans gives
    exactly the vectors of a clean run.
    """
    rig.sim.set_profile("bad", FaultProfile(rate_5xx=0.3, statuses_5xx=(500,)))
    settings = rig.settings(
        {"name": "bad", "max_batch_size": 2, "max_concurrency": 4},
        kind="embed",
        max_attempts=1,
        breaker_failures=1000,  # the point is failed batches, not a tripped source
    )
    texts = [f"text {i}" for i in range(40)]
    reports: list[EmbeddingProgress] = []
    async with EmbeddingClient(settings, "embed", backend=rig.backend) as emb:
        async with asyncio.timeout(BOUND_S):
            first = await emb.embed(texts, partial=True, on_progress=reports.append)
        assert rig.sim.stats("bad").requests == 20
        assert 0 < len(first.failed_spans) < 20
        assert [a.outcome for a in first.attempts].count("transient") == len(first.failed_spans)
        assert [p.batches_done for p in reports] == list(range(1, 21))
        assert (reports[-1].texts_done, reports[-1].batches_failed) == (
            40,
            len(first.failed_spans),
        )
        with pytest.raises(AllSourcesExhausted) as caught:
            async with asyncio.timeout(BOUND_S):
                await emb.embed(texts)
        kept = caught.value.partial
        assert kept is not None
        assert kept.failed_spans
        assert caught.value.batch == kept.failed_spans[0]
        rig.sim.set_profile("bad", HEALTHY)
        async with asyncio.timeout(BOUND_S):
            merged = list(first.vectors)
            for start, stop in first.failed_spans:
                merged[start:stop] = (await emb.embed(texts[start:stop])).vectors
            clean = await emb.embed(texts)
    assert merged == clean.vectors
    for start, stop in first.failed_spans:
        assert first.vectors[start:stop] == [None] * (stop - start)
    served = [i for i, v in enumerate(first.vectors) if v is not None]
    assert [first.vectors[i] for i in served] == [clean.vectors[i] for i in served]
    assert await rig.permits("embed") == 0


async def test_unknown_model_path_trips_long_and_fails_over(rig: Rig) -> None:
    """A 404 (misconfigured source) trips its breaker for the long cool-down; good serves."""
    wrong = {"name": "bad", "base_url": f"{rig.sim.url}/nosuchsource/v1"}
    failed, _ = await fails_over(rig, rig.settings(wrong, {"name": "good"}))
    assert (failed.outcome, failed.status_code) == ("source_misconfigured", 404)
    state = await rig.source("chat", "bad")
    assert state.breaker == "open"
    assert state.reopen_in_s is not None
    assert state.reopen_in_s > 30.0  # the long cool-down (breaker_cooldown_max_s), not the first
