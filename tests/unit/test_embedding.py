"""EmbeddingClient: input checks, batching, order, concurrency, failures, stall budget, cancel."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from _batch_clients import embed_settings as make_settings
from _batch_clients import embedding_source as source
from _closing import closing
from _permit_thief import PermitThief

from polygateway.backends.base import SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.config import GatewaySettings
from polygateway.embedding import EmbeddingClient, plan_batches
from polygateway.errors import AllSourcesExhausted, ConfigError, GatewayError, RequestRejected
from polygateway.middleware.waiting import room_for
from polygateway.models import EmbeddingResponse
from polygateway.testing import (
    FakeClock,
    FakeTimers,
    FakeTransport,
    Gate,
    Hang,
    Outcome,
    Recorder,
    TransientError,
    embedding_body,
    settle,
)
from polygateway.transport.http import HttpRequest
from polygateway.transport.openai import estimate_embedding_tokens

SCOPE = "embed"


def texts(n: int) -> list[str]:
    """``t0`` .. ``t{n-1}``: each text names its own index, so order can be checked."""
    return [f"t{i}" for i in range(n)]


def vector_of(text: str) -> list[float]:
    """The vector the echo upstream gives ``text``: its index, and a constant."""
    return [float(text[1:]), 1.0]


def echo(request: HttpRequest) -> dict[str, Any]:
    """An upstream that embeds each input as ``vector_of`` it, in order."""
    return embedding_body([vector_of(t) for t in request.json["input"]])


async def slow_echo(request: HttpRequest) -> dict[str, Any]:
    """``echo`` after a few loop turns, so concurrent requests overlap."""
    await settle(3)
    return echo(request)


def ones(request: HttpRequest) -> dict[str, Any]:
    """An upstream that answers the right number of identical vectors, whatever the texts."""
    return embedding_body([[1.0]] * len(request.json["input"]))


def short_by_one(request: HttpRequest) -> dict[str, Any]:
    """An upstream that drops the last vector of the batch."""
    return embedding_body([vector_of(t) for t in request.json["input"][:-1]])


@dataclass
class Rig:
    """A client on fakes, with the fakes at hand for assertions."""

    client: EmbeddingClient
    transport: FakeTransport
    backend: MemoryBackend
    clock: FakeClock
    recorder: Recorder


def rig(
    script: Sequence[Outcome] = (),
    *,
    settings: GatewaySettings | None = None,
    default: Outcome | None = None,
    clock: FakeClock | None = None,
    sleep: Any = None,
    backend: MemoryBackend | None = None,
) -> Rig:
    """An EmbeddingClient on a FakeTransport, a MemoryBackend and a FakeClock."""
    clock = clock if clock is not None else FakeClock()
    transport = FakeTransport(script, clock=clock, default=default)
    backend = backend if backend is not None else MemoryBackend(now=clock)
    recorder = Recorder()
    client = closing(
        EmbeddingClient(
            settings if settings is not None else make_settings(),
            SCOPE,
            backend=backend,
            transport=transport,
            now=clock,
            sleep=sleep if sleep is not None else clock.sleep,
            rng=random.Random(7),
            emitter=recorder,
        )
    )
    return Rig(client, transport, backend, clock, recorder)


# --- Input checked before any request -------------------------------------------


async def test_empty_input_returns_empty_result_without_request() -> None:
    """No texts: an empty result, no request, no permit."""
    r = rig()
    result = await r.client.embed([])
    assert result == EmbeddingResponse(vectors=[], usage=result.usage)
    assert result.usage.total_tokens == 0
    assert r.transport.requests == []


async def test_empty_string_is_rejected_before_any_request() -> None:
    """An empty string anywhere fails the call with RequestRejected naming its index."""
    r = rig(default=echo)
    with pytest.raises(RequestRejected, match=r"texts\[1\] is an empty string"):
        await r.client.embed(["a", "", "b"])
    assert r.transport.requests == []


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (["a", 3], r"texts\[1\] is int"),
        (["a", None], r"texts\[1\] is NoneType"),
        ("abc", "must be a list of strings, not str"),
        (b"abc", "must be a list of strings, not bytes"),
        ({"a"}, "must be a list of strings, not set"),
    ],
)
async def test_non_string_input_is_rejected_before_any_request(bad: Any, match: str) -> None:
    """A non-string item, or texts that are not a list, fail before any request."""
    r = rig(default=echo)
    with pytest.raises(RequestRejected, match=match):
        await r.client.embed(bad)
    assert r.transport.requests == []


async def test_non_float_encoding_format_is_rejected_before_any_request() -> None:
    """base64 vectors could not be read back as floats: refused up front."""
    r = rig(default=echo)
    with pytest.raises(RequestRejected, match="encoding_format='base64'"):
        await r.client.embed(["a"], encoding_format="base64")
    assert r.transport.requests == []


# --- Batching and order ------------------------------------------------------------


def test_plan_batches_respects_both_limits_and_covers_every_text_once() -> None:
    """Spans are contiguous, in order, within the size and token limits; a huge text goes alone."""
    items = ["abcd" * 2] * 7 + ["x" * 400] + ["ab"] * 3  # 2 tokens each, one of 100, 1 each
    spans = plan_batches(items, max_batch_size=3, max_batch_tokens=5)
    assert spans == [(0, 2), (2, 4), (4, 6), (6, 7), (7, 8), (8, 11)]
    spans = plan_batches(items, max_batch_size=2, max_batch_tokens=1000)
    assert spans == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 11)]


async def test_ten_thousand_inputs_come_back_in_order() -> None:
    """10,000 texts with max_batch_size=64: every vector in input order, 157 batches of <= 64."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    settings = make_settings(source(max_batch_size=64, max_batch_tokens=100_000, max_concurrency=8))
    r = rig(settings=settings, default=slow_echo, clock=clock, sleep=timers.sleep)
    items = texts(10_000)
    result = await r.client.embed(items)
    assert len(result.vectors) == 10_000
    assert result.vectors == [vector_of(t) for t in items]
    assert len(result.batches) == 157
    assert all(0 < stop - start <= 64 for start, stop in result.batches)
    assert result.batches[0] == (0, 64)
    assert result.batches[-1] == (9984, 10_000)
    assert len(r.transport.requests) == 157
    assert result.sources == ("emb",) * 157
    assert result.usage.total_tokens == 10_000  # embedding_body reports one token per text


async def test_batches_run_concurrently_up_to_the_permit_limit_and_never_beyond() -> None:
    """With 4 permits and 40 batches, exactly 4 requests are in flight at the peak."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    settings = make_settings(source(max_batch_size=2, max_concurrency=4))
    r = rig(settings=settings, default=slow_echo, clock=clock, sleep=timers.sleep)
    result = await r.client.embed(texts(80))
    assert r.transport.max_in_flight == 4
    assert len(r.transport.requests) == 40
    assert result.vectors == [vector_of(t) for t in texts(80)]
    assert (await r.backend.snapshot(SCOPE)).in_flight == 0


async def test_fail_fast_call_with_more_batches_than_permits_is_served() -> None:
    """fail_fast is about the scope, not the call's own batches: they queue behind each other."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    settings = make_settings(source(max_batch_size=2, max_concurrency=2))
    r = rig(settings=settings, default=slow_echo, clock=clock, sleep=timers.sleep)
    result = await r.client.embed(texts(20), fail_fast=True)
    assert result.vectors == [vector_of(t) for t in texts(20)]
    assert len(r.transport.requests) == 10
    assert r.transport.max_in_flight <= 2
    assert (await r.backend.snapshot(SCOPE)).in_flight == 0


async def test_fail_fast_call_on_a_full_scope_fails_with_no_runnable() -> None:
    """With every permit held by someone else, a fail_fast embed fails at once, sending nothing."""
    r = rig(default=echo, settings=make_settings(source(max_concurrency=1)))
    spec = SourceSpec(name="emb", max_concurrency=1)
    held = await r.backend.acquire(SCOPE, [spec], ttl_s=60.0)
    assert held.lease is not None
    with pytest.raises(AllSourcesExhausted) as caught:
        await r.client.embed(texts(5), fail_fast=True)
    assert caught.value.reason == "no_runnable"
    assert r.transport.requests == []


async def test_batch_tasks_are_capped_so_huge_inputs_stay_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With one permit, at most 2 batch tasks exist at once, however many batches there are."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    settings = make_settings(source(max_batch_size=1, max_concurrency=1))
    r = rig(settings=settings, default=slow_echo, clock=clock, sleep=timers.sleep)
    run_batch = r.client._embed_batch
    live = peak = 0

    async def counted(*args: Any) -> Any:
        nonlocal live, peak
        live += 1
        peak = max(peak, live)
        try:
            return await run_batch(*args)
        finally:
            live -= 1

    monkeypatch.setattr(r.client, "_embed_batch", counted)
    result = await r.client.embed(texts(50))
    assert result.vectors == [vector_of(t) for t in texts(50)]
    assert peak == 2
    assert r.transport.max_in_flight == 1


async def test_batch_limits_are_the_smallest_of_the_scope_sources() -> None:
    """Any batch may go to any source, so it fits the smallest size and token limits."""
    settings = make_settings(
        source("a", max_batch_size=5, max_batch_tokens=1000),
        source("b", max_batch_size=50, max_batch_tokens=6),
    )
    r = rig(settings=settings, default=ones)
    assert (r.client.max_batch_size, r.client.max_batch_tokens) == (5, 6)
    result = await r.client.embed(["abcdefgh"] * 7)  # 2 tokens each: 3 per batch
    assert [len(req.json["input"]) for req in r.transport.requests] == [3, 3, 1]
    assert result.batches == ((0, 3), (3, 6), (6, 7))


async def test_each_batch_reserves_its_tpm_estimate() -> None:
    """Each batch's acquire carries the estimate of its own texts as cost_tokens."""
    costs: list[int] = []

    class SpyBackend(MemoryBackend):
        async def acquire(self, *args: Any, **kwargs: Any) -> Any:
            costs.append(kwargs["cost_tokens"])
            return await super().acquire(*args, **kwargs)

    clock = FakeClock()
    items = ["a" * 40, "b" * 8, "c" * 4, "d" * 100]
    settings = make_settings(source(max_batch_size=2, max_concurrency=2, tpm=100_000))
    r = rig(settings=settings, default=ones, clock=clock, backend=SpyBackend(now=clock))
    await r.client.embed(items)
    assert sorted(costs) == sorted(
        [estimate_embedding_tokens(items[0:2]), estimate_embedding_tokens(items[2:4])]
    )
    assert sorted(costs) == [12, 26]


async def test_usage_is_summed_and_sources_listed_per_batch() -> None:
    """Usage adds up over batches; sources and batches line up, one entry per batch."""
    settings = make_settings(source(max_batch_size=2))
    r = rig(
        [embedding_body([[0.0]] * 2, prompt_tokens=7), embedding_body([[0.0]], prompt_tokens=4)],
        settings=settings,
    )
    result = await r.client.embed(["a", "b", "c"])
    assert result.usage.prompt_tokens == 11
    assert result.usage.total_tokens == 11
    assert result.batches == ((0, 2), (2, 3))
    assert result.sources == ("emb", "emb")
    assert [a.outcome for a in result.attempts] == ["success", "success"]


# --- Failures ------------------------------------------------------------------------


async def test_short_answer_is_malformed_and_retried_never_misaligned() -> None:
    """One vector too few is a transient failure: retried, and the vectors end up aligned."""
    r = rig([short_by_one, echo])
    result = await r.client.embed(texts(4))
    assert result.vectors == [vector_of(t) for t in texts(4)]
    assert r.recorder.outcomes() == ["transient", "success"]
    error = r.recorder.records[0].error or ""
    assert "expected 4 vectors, got 3" in error


async def test_short_answer_every_time_fails_naming_batch_and_cause() -> None:
    """A batch always answered one vector short ends retry_exhausted, its batch and cause named."""
    settings = make_settings(source(max_batch_size=3), max_attempts=3)
    r = rig(settings=settings, default=lambda req: short_by_one(req))
    with pytest.raises(AllSourcesExhausted) as info:
        await r.client.embed(texts(3))
    error = info.value
    assert error.reason == "retry_exhausted"
    assert error.batch == (0, 3)
    assert "batch=(0, 3)" in str(error)
    assert len(error.attempts) == 3
    assert all("expected 3 vectors, got 2" in (a.error or "") for a in error.attempts)


async def test_failing_batch_lets_siblings_finish_and_is_named() -> None:
    """A 400 on batch (2, 4): its siblings run to their end, then RequestRejected(batch=(2, 4)).

    The error's ``.partial`` keeps the siblings' vectors, so nothing computed is lost.
    """
    gate = Gate(echo)

    def upstream(request: HttpRequest) -> Outcome:
        if request.json["input"][0] == "t2":
            return TransientError("HTTP 400 from emb: input too long", status_code=400)
        return gate

    settings = make_settings(source(max_batch_size=2, max_concurrency=3))
    r = rig(settings=settings, default=upstream)
    task = asyncio.create_task(r.client.embed(texts(6)))
    await gate.wait_entered(2)
    await settle()
    assert not task.done()  # the rejection waits for the siblings still in flight
    gate.open()
    with pytest.raises(RequestRejected) as info:
        await task
    assert info.value.batch == (2, 4)
    assert info.value.status_code == 400
    assert info.value.partial is not None
    kept = [vector_of(t) for t in ("t0", "t1", "t4", "t5")]
    assert info.value.partial.vectors == [*kept[:2], None, None, *kept[2:]]
    assert info.value.partial.failed_spans == ((2, 4),)
    assert r.transport.in_flight == 0
    assert (await r.backend.snapshot(SCOPE)).in_flight == 0
    assert sorted(r.recorder.outcomes()) == ["request_rejected", "success", "success"]


async def test_429_is_charged_to_max_attempts() -> None:
    """exempt_429 is False for embed scopes: three 429s end the call retry_exhausted."""
    too_many = TransientError("HTTP 429 from emb", status_code=429, retry_after_s=0.0)
    r = rig([too_many, too_many, too_many], settings=make_settings(max_attempts=3))
    with pytest.raises(AllSourcesExhausted) as info:
        await r.client.embed(["a"])
    assert info.value.reason == "retry_exhausted"
    assert info.value.batch == (0, 1)
    assert r.recorder.outcomes() == ["rate_limited"] * 3


async def test_deadline_bounds_the_batches() -> None:
    """deadline_s clips the attempt's timeout; when it runs out the batch fails with 'deadline'."""
    settings = make_settings(source(timeout_s=60))
    r = rig([Hang()], settings=settings)
    with pytest.raises(AllSourcesExhausted) as info:
        await r.client.embed(["a"], deadline_s=5.0)
    assert info.value.reason == "deadline"
    assert info.value.batch == (0, 1)
    assert r.transport.requests[0].timeout_s == 5.0


# --- The stall budget bills non-productive time only ---------------------------------


async def test_single_timeout_does_not_exhaust_stall_budget() -> None:
    """A 350 s timeout, then one no-runnable round (the test holds the only permit), then success.

    Under a wall-clock stall meter the call would end 'stalled': more than
    stall_window_s (300) has passed and the scope has never served (age inf).
    """
    clock = FakeClock()
    start = clock()
    backend = MemoryBackend(now=clock)
    sleep = PermitThief(backend, clock, SCOPE, "emb")

    settings = make_settings(source(max_concurrency=1, timeout_s=350), stall_window_s=300)
    r = rig([Hang(), echo], settings=settings, clock=clock, sleep=sleep, backend=backend)
    result = await r.client.embed(["t0", "t1"])
    assert result.vectors == [vector_of("t0"), vector_of("t1")]
    assert sleep.no_runnable_rounds == 1
    assert clock() - start > 300.0  # the wall clock alone is past the stall window
    assert r.recorder.outcomes() == ["transient", "success"]
    assert len(r.transport.requests) == 2


# --- Cancellation --------------------------------------------------------------------


async def test_cancel_releases_permit() -> None:
    """Cancelling embed() with batches in flight frees every permit; CancelledError passes."""
    gate = Gate()
    settings = make_settings(source(max_batch_size=1, max_concurrency=2))
    r = rig(settings=settings, default=gate)
    task = asyncio.create_task(r.client.embed(texts(3)))
    await gate.wait_entered(2)
    assert (await r.backend.snapshot(SCOPE)).in_flight == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (await r.backend.snapshot(SCOPE)).in_flight == 0
    assert r.transport.in_flight == 0
    assert room_for(r.backend, SCOPE).empty
    assert r.recorder.outcomes() == ["cancelled", "cancelled"]


async def test_close_cancels_batches_in_flight_after_the_grace() -> None:
    """aclose() past close_grace_s cancels the batches, frees their permits, fails the call."""
    gate = Gate()
    clock = FakeClock()
    timers = FakeTimers(clock)
    settings = make_settings(source(max_batch_size=1, max_concurrency=2), close_grace_s=1.0)
    r = rig(settings=settings, default=gate, clock=clock, sleep=timers.sleep)
    task = asyncio.create_task(r.client.embed(texts(4)))
    await gate.wait_entered(2)
    closing = asyncio.create_task(r.client.aclose())
    await settle()
    assert not task.done()  # still within the grace
    await timers.advance(1.0)
    await closing
    with pytest.raises(GatewayError, match="client closed"):
        await task
    assert (await r.backend.snapshot(SCOPE)).in_flight == 0
    assert r.transport.in_flight == 0


# --- Construction and life -----------------------------------------------------------


async def test_from_settings_as_context_manager_then_closed() -> None:
    """from_settings binds the 'embed' scope; after the block the client refuses new calls."""
    clock = FakeClock()
    transport = FakeTransport(default=echo, clock=clock)
    settings = make_settings()
    async with EmbeddingClient.from_settings(
        settings, transport=transport, now=clock, sleep=clock.sleep
    ) as emb:
        assert emb.scope == SCOPE
        result = await emb.embed(["t5"])
        assert result.vectors == [vector_of("t5")]
    assert emb.closed
    assert transport.closed
    with pytest.raises(GatewayError, match="client closed"):
        await emb.embed(["t1"])


def test_scope_of_another_kind_is_a_config_error() -> None:
    """An EmbeddingClient on a chat scope fails at construction with ConfigError."""
    settings = GatewaySettings(
        _env_file=None,
        scopes={"chat": {"kind": "chat", "sources": [source()]}},
    )
    with pytest.raises(ConfigError, match="kind 'chat'"):
        EmbeddingClient(settings, "chat", transport=FakeTransport())
