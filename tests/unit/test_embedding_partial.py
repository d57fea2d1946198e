"""EmbeddingClient on a long job: failed batches never lose the vectors computed by the others.

5,000 texts over two sources, 64 texts a batch (79 batches), one batch that
every source fails: ``partial=True`` returns every other vector at its input
position, the error without it carries the same result, retrying only the
failed span completes the set, ``on_progress`` reports each finished batch.
Cancellation and a failing backend still stop every batch at once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import FrozenInstanceError, dataclass
from typing import Any

import pytest

from polygateway import (
    AllSourcesExhausted,
    EmbeddingClient,
    EmbeddingProgress,
    EmbeddingResponse,
    GatewayError,
    GatewaySettings,
    GovernanceBackendError,
    MemoryBackend,
    PartialEmbeddingResponse,
    RequestRejected,
)
from polygateway.backends.base import SourceSpec
from polygateway.middleware.waiting import room_for
from polygateway.testing import (
    FakeClock,
    FakeTimers,
    FakeTransport,
    Gate,
    Outcome,
    Recorder,
    TransientError,
    embedding_body,
    settle,
)
from polygateway.transport.http import HttpRequest

SCOPE = "embed"
TOTAL = 5000
BATCH = 64
BATCHES = 79  # ceil(5000 / 64)
FAILING = (1024, 1088)  # the 17th batch: every source answers it 503


def texts(n: int) -> list[str]:
    """``t0`` .. ``t{n-1}``: each text names its own index, so positions can be checked."""
    return [f"t{i}" for i in range(n)]


def vector_of(text: str) -> list[float]:
    """The vector the upstream gives ``text``: its index, and a constant."""
    return [float(text[1:]), 1.0]


CLEAN = [vector_of(t) for t in texts(TOTAL)]
"""What a clean run of the 5,000 texts returns."""


class Upstream:
    """Both sources embed each text as ``vector_of`` it; a batch opening on a broken text: 503."""

    def __init__(self, broken: set[str] | None = None) -> None:
        self.broken = {f"t{FAILING[0]}"} if broken is None else broken

    def __call__(self, request: HttpRequest) -> Outcome:
        inputs = request.json["input"]
        if inputs[0] in self.broken:
            return TransientError(f"HTTP 503 from {request.source}", status_code=503)
        return embedding_body([vector_of(t) for t in inputs])


def settings_for(*names: str, batch: int = BATCH, concurrency: int = 8) -> GatewaySettings:
    """One embed scope over the named sources (priority tier 0, equal weight)."""
    sources = [
        {
            "name": name,
            "protocol": "openai",
            "base_url": f"http://127.0.0.1:9/{name}/v1",
            "model": "text-embedding-3-small",
            "max_batch_size": batch,
            "max_batch_tokens": 100_000,
            "max_concurrency": concurrency,
        }
        for name in names
    ]
    return GatewaySettings(
        _env_file=None, scopes={SCOPE: {"kind": "embed", "sources": sources}}, max_attempts=3
    )


@dataclass
class Rig:
    """A client on fakes, with the fakes at hand for assertions."""

    client: EmbeddingClient
    transport: FakeTransport
    backend: MemoryBackend
    clock: FakeClock
    recorder: Recorder

    async def permits(self) -> int:
        """Permits held in the scope."""
        return (await self.backend.snapshot(SCOPE)).in_flight


MakeRig = Callable[..., Rig]


@pytest.fixture
async def make_rig() -> AsyncIterator[MakeRig]:
    """Build rigs (two sources ``a`` and ``b`` by default); every client is closed at the end."""
    built: list[Rig] = []

    def make(
        default: Outcome | None = None,
        *,
        settings: GatewaySettings | None = None,
        backend: MemoryBackend | None = None,
        clock: FakeClock | None = None,
    ) -> Rig:
        clock = clock if clock is not None else FakeClock()
        transport = FakeTransport(
            clock=clock, default=default if default is not None else Upstream()
        )
        backend = backend if backend is not None else MemoryBackend(now=clock)
        recorder = Recorder()
        client = EmbeddingClient(
            settings if settings is not None else settings_for("a", "b"),
            SCOPE,
            backend=backend,
            transport=transport,
            now=clock,
            sleep=clock.sleep,
            rng=random.Random(7),
            emitter=recorder,
        )
        built.append(Rig(client, transport, backend, clock, recorder))
        return built[-1]

    yield make
    for rig in built:
        await rig.client.aclose()


def expected_partial() -> list[list[float] | None]:
    """The clean vectors with the failing batch's positions empty."""
    start, stop = FAILING
    return [None if start <= i < stop else v for i, v in enumerate(CLEAN)]


# --- partial=True, and the error without it ------------------------------------------


async def test_partial_result_keeps_every_other_vector_and_names_the_failed_span(
    make_rig: MakeRig,
) -> None:
    """One batch fails after its retries: every other vector is at its input position."""
    r = make_rig()
    result = await r.client.embed(texts(TOTAL), partial=True)
    assert isinstance(result, PartialEmbeddingResponse)
    assert result.vectors == expected_partial()
    assert result.failed_spans == (FAILING,)
    assert len(result.batches) == BATCHES
    failed_index = result.batches.index(FAILING)
    assert result.sources[failed_index] == ""
    assert {s for i, s in enumerate(result.sources) if i != failed_index} == {"a", "b"}
    assert result.usage.total_tokens == TOTAL - BATCH  # one token per served text
    outcomes = [a.outcome for a in result.attempts]
    assert outcomes.count("success") == BATCHES - 1
    assert outcomes.count("transient") == 3  # the failed batch's attempts are kept too
    assert len(r.transport.requests) == BATCHES - 1 + 3  # every other batch ran to its end
    assert await r.permits() == 0


async def test_without_partial_the_error_carries_the_same_result(make_rig: MakeRig) -> None:
    """Without partial=True the failing batch raises, naming it, with the same vectors kept."""
    r = make_rig()
    with pytest.raises(AllSourcesExhausted) as caught:
        await r.client.embed(texts(TOTAL))
    error = caught.value
    assert error.reason == "retry_exhausted"
    assert error.batch == FAILING
    assert f"batch={FAILING!r}" in str(error)
    assert f"partial={TOTAL - BATCH}/{TOTAL} vectors" in str(error)
    assert error.partial is not None
    assert error.partial.vectors == expected_partial()
    assert error.partial.failed_spans == (FAILING,)
    assert len(r.transport.requests) == BATCHES - 1 + 3

    again = make_rig()
    returned = await again.client.embed(texts(TOTAL), partial=True)
    assert (returned.vectors, returned.failed_spans, returned.batches, returned.usage) == (
        error.partial.vectors,
        error.partial.failed_spans,
        error.partial.batches,
        error.partial.usage,
    )


async def test_first_failure_in_input_order_is_raised(make_rig: MakeRig) -> None:
    """Two batches fail: the one earlier in the input is raised, both spans are in .partial."""
    r = make_rig(Upstream({"t128", "t4096"}))
    with pytest.raises(AllSourcesExhausted) as caught:
        await r.client.embed(texts(TOTAL))
    assert caught.value.batch == (128, 192)
    assert caught.value.partial is not None
    assert caught.value.partial.failed_spans == ((128, 192), (4096, 4160))


async def test_retrying_only_the_failed_spans_completes_the_set(make_rig: MakeRig) -> None:
    """The resumable job: keep the partial vectors, embed only the failed spans, get a clean run."""
    upstream = Upstream()
    r = make_rig(upstream)
    items = texts(TOTAL)
    first = await r.client.embed(items, partial=True)
    sent = len(r.transport.requests)
    upstream.broken.clear()  # the flaky source recovers
    vectors = list(first.vectors)
    for start, stop in first.failed_spans:
        retry = await r.client.embed(items[start:stop])
        vectors[start:stop] = retry.vectors
    assert vectors == CLEAN
    assert len(r.transport.requests) == sent + 1  # one batch sent again, nothing else


async def test_complete_call_with_partial_true_has_no_failed_span(make_rig: MakeRig) -> None:
    """Nothing fails: partial=True still returns the partial type, complete and in order."""
    r = make_rig(Upstream(set()))
    result = await r.client.embed(texts(300), partial=True)
    assert isinstance(result, PartialEmbeddingResponse)
    assert result.vectors == CLEAN[:300]
    assert result.failed_spans == ()
    plain = await r.client.embed(texts(300))
    assert isinstance(plain, EmbeddingResponse)
    assert plain.failed_spans == ()


async def test_empty_input_with_partial_true_is_an_empty_partial_result(make_rig: MakeRig) -> None:
    """No texts: an empty result of the asked type, no request, no progress report."""
    r = make_rig()
    reports: list[EmbeddingProgress] = []
    result = await r.client.embed([], partial=True, on_progress=reports.append)
    assert isinstance(result, PartialEmbeddingResponse)
    assert (result.vectors, result.failed_spans) == ([], ())
    assert isinstance(await r.client.embed([]), EmbeddingResponse)
    assert reports == []
    assert r.transport.requests == []


async def test_fail_fast_on_a_full_scope_fails_every_batch_without_sending(
    make_rig: MakeRig,
) -> None:
    """fail_fast, no permit free: the first batch's no_runnable ends the call, nothing is sent."""
    settings = settings_for("a", batch=2, concurrency=1)
    r = make_rig(settings=settings)
    # The one source's only permit, held by someone else.
    held = await r.backend.acquire(SCOPE, [SourceSpec(name="a", max_concurrency=1)], ttl_s=60.0)
    assert held.lease is not None
    reports: list[EmbeddingProgress] = []
    result = await r.client.embed(
        texts(6), partial=True, fail_fast=True, on_progress=reports.append
    )
    assert result.vectors == [None] * 6
    assert result.failed_spans == ((0, 2), (2, 4), (4, 6))
    assert reports[-1].batches_failed == 3
    assert reports[-1].texts_done == 6
    with pytest.raises(AllSourcesExhausted) as caught:
        await r.client.embed(texts(6), fail_fast=True)
    assert caught.value.reason == "no_runnable"
    assert caught.value.batch == (0, 2)
    assert caught.value.partial is not None
    assert caught.value.partial.failed_spans == ((0, 2), (2, 4), (4, 6))
    assert r.transport.requests == []


# --- on_progress -----------------------------------------------------------------------


async def test_on_progress_is_called_once_per_batch_with_monotonic_counts(
    make_rig: MakeRig,
) -> None:
    """One report per finished batch, served or failed; every count grows and ends at the totals."""
    r = make_rig()
    reports: list[EmbeddingProgress] = []
    await r.client.embed(texts(TOTAL), partial=True, on_progress=reports.append)
    assert len(reports) == BATCHES
    assert [p.batches_done for p in reports] == list(range(1, BATCHES + 1))
    assert all(a.texts_done < b.texts_done for a, b in itertools.pairwise(reports))
    assert all(
        a.batches_failed <= b.batches_failed and a.texts_failed <= b.texts_failed
        for a, b in itertools.pairwise(reports)
    )
    assert {(p.texts_total, p.batches_total) for p in reports} == {(TOTAL, BATCHES)}
    last = reports[-1]
    assert (last.texts_done, last.texts_failed, last.batches_failed) == (TOTAL, BATCH, 1)
    with pytest.raises(FrozenInstanceError):
        last.texts_done = 0  # type: ignore[misc]


async def test_on_progress_is_never_called_concurrently_with_itself(make_rig: MakeRig) -> None:
    """Reports come one at a time from the event loop, even with 8 batches in flight."""
    upstream = Upstream()

    async def overlapping(request: HttpRequest) -> Outcome:
        await settle(3)
        return upstream(request)

    r = make_rig(overlapping)
    inside = 0
    most = 0

    def report(progress: EmbeddingProgress) -> None:
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        inside -= 1

    await r.client.embed(texts(TOTAL), partial=True, on_progress=report)
    assert most == 1
    assert r.transport.max_in_flight > 1


async def test_raising_callback_does_not_lose_the_job(
    make_rig: MakeRig, caplog: pytest.LogCaptureFixture
) -> None:
    """A progress callback that always raises: every vector still comes back, once logged loudly."""
    r = make_rig(Upstream(set()))
    calls = 0

    def broken(progress: EmbeddingProgress) -> None:
        nonlocal calls
        calls += 1
        raise ZeroDivisionError("progress bar bug")

    with caplog.at_level(logging.DEBUG, logger="polygateway"):
        result = await r.client.embed(texts(TOTAL), on_progress=broken)
    assert result.vectors == CLEAN
    assert calls == BATCHES
    mine = [rec for rec in caplog.records if "on_progress raised" in rec.getMessage()]
    assert len(mine) == BATCHES
    assert [rec.levelno for rec in mine].count(logging.WARNING) == 1  # then quietly, at debug
    assert mine[0].exc_info is not None
    assert "progress bar bug" in caplog.text
    assert "scope 'embed'" in mine[0].getMessage()


async def test_async_on_progress_is_rejected_before_any_request(make_rig: MakeRig) -> None:
    """An async callback would never run (nothing awaits it): refused up front."""
    r = make_rig()

    async def report(progress: EmbeddingProgress) -> None:
        return None

    with pytest.raises(RequestRejected, match="on_progress must be a plain"):
        await r.client.embed(["t0"], on_progress=report)  # type: ignore[arg-type]
    with pytest.raises(RequestRejected, match="on_progress must be a plain"):
        await r.client.embed(["t0"], on_progress="bar")  # type: ignore[arg-type]
    with pytest.raises(RequestRejected, match="partial must be True or False"):
        await r.client.embed(["t0"], partial="yes")  # type: ignore[call-overload]
    assert r.transport.requests == []


# --- What still stops every batch at once ------------------------------------------------


async def test_cancelling_the_call_cancels_every_batch_and_leaks_no_permit(
    make_rig: MakeRig,
) -> None:
    """A batch has failed, two wait in flight: cancelling the call cancels them, frees permits."""
    gate = Gate()

    def upstream(request: HttpRequest) -> Outcome:
        if request.json["input"][0] == "t0":
            return TransientError("HTTP 400 from a: bad input", status_code=400)
        return gate

    r = make_rig(upstream, settings=settings_for("a", batch=1, concurrency=2))
    reports: list[EmbeddingProgress] = []
    task = asyncio.create_task(r.client.embed(texts(4), partial=True, on_progress=reports.append))
    await gate.wait_entered(2)
    assert [p.batches_failed for p in reports] == [1]
    assert await r.permits() == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await r.permits() == 0
    assert r.transport.in_flight == 0
    assert room_for(r.backend, SCOPE).empty
    assert sorted(r.recorder.outcomes()) == ["cancelled", "cancelled", "request_rejected"]
    assert len(reports) == 1  # a cancelled batch is not reported as finished


async def test_governance_backend_error_still_fails_the_call_at_once(make_rig: MakeRig) -> None:
    """The backend fails under one batch: every batch stops at once, even with partial=True.

    Batch t2 meets a 503 and, on its retry, a backend that has gone down; t1 and
    t3 are still in flight at the upstream and are cancelled, never awaited.
    """
    clock = FakeClock()

    class GoesDown(MemoryBackend):
        __slots__ = ("down",)

        def __init__(self, *, now: Any) -> None:
            super().__init__(now=now)
            self.down = False

        async def acquire(self, *args: Any, **kwargs: Any) -> Any:
            if self.down:
                raise GovernanceBackendError("redis went away", operation="acquire", scope=SCOPE)
            return await super().acquire(*args, **kwargs)

    backend = GoesDown(now=clock)
    gate = Gate()

    async def upstream(request: HttpRequest) -> Outcome:
        first = request.json["input"][0]
        if first == "t0":
            return embedding_body([vector_of("t0")])
        if first == "t2":
            await gate.wait_entered(2)  # its siblings t1 and t3 are at the upstream
            backend.down = True
            return TransientError("HTTP 503 from a", status_code=503)
        return gate

    r = make_rig(
        upstream, settings=settings_for("a", batch=1, concurrency=4), backend=backend, clock=clock
    )
    with pytest.raises(GovernanceBackendError) as caught:
        await r.client.embed(texts(4), partial=True)
    error = caught.value
    assert error.batch == (2, 3)
    assert gate.entered == 2  # t1 and t3 were in flight, and were never let through
    assert error.partial is not None
    assert error.partial.vectors == [vector_of("t0"), None, None, None]
    assert error.partial.failed_spans == ((1, 2), (2, 3), (3, 4))
    assert r.transport.in_flight == 0
    backend.down = False
    assert await r.permits() == 0
    assert sorted(r.recorder.outcomes()) == ["cancelled", "cancelled", "success", "transient"]


async def test_close_during_the_call_keeps_the_vectors_computed(make_rig: MakeRig) -> None:
    """aclose() past its grace cancels the call: its 'client closed' error carries .partial."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    gate = Gate()

    def upstream(request: HttpRequest) -> Outcome:
        if request.json["input"][0] == "t0":
            return embedding_body([vector_of("t0")])
        return gate

    settings = settings_for("a", batch=1, concurrency=2)
    transport = FakeTransport(clock=clock, default=upstream)
    backend = MemoryBackend(now=clock)
    client = EmbeddingClient(
        settings, SCOPE, backend=backend, transport=transport, now=clock, sleep=timers.sleep
    )
    task = asyncio.create_task(client.embed(texts(3), partial=True))
    await gate.wait_entered(2)
    closing = asyncio.create_task(client.aclose())
    await settle()
    await timers.advance(settings.close_grace_s)
    await closing
    with pytest.raises(GatewayError, match="client closed") as caught:
        await task
    assert caught.value.partial is not None
    assert caught.value.partial.vectors == [vector_of("t0"), None, None]
    assert caught.value.partial.failed_spans == ((1, 2), (2, 3))
    assert (await backend.snapshot(SCOPE)).in_flight == 0
