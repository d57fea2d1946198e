"""Live gauges: read from the backend at scrape time, through a real Prometheus scrape.

Every check parses ``generate_latest`` back with ``prometheus_client``'s own
parser, so names, labels and values are what a Prometheus server would store.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

import pytest
from _async_only import AsyncOnly
from _closing import closing
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from polygateway.backends.base import (
    AttemptOutcome,
    ScopeSnapshot,
    SourceSpec,
)
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import AllSourcesExhausted, GovernanceBackendError
from polygateway.middleware.gauges import LiveGauges
from polygateway.middleware.telemetry import ClientInfo, PrometheusEmitter
from polygateway.testing import (
    BoundedSleep,
    FakeClock,
    FakeTimers,
    FakeTransport,
    Gate,
    TransientError,
    chat_completion,
    gateway_settings,
    settle,
)

MESSAGES = [{"role": "user", "content": "hi"}]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    """Every sample of the registry, by name and sorted labels, as a Prometheus server parses it."""
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample ``name{labels}``, or ``None`` when the scrape has none."""
    return samples.get((name, tuple(sorted(labels.items()))))


def names(samples: Samples) -> set[str]:
    """The sample names of a scrape."""
    return {name for name, _ in samples}


def make_chat(
    clock: FakeClock,
    script: Any,
    registry: CollectorRegistry,
    *,
    backend: Any = None,
    sources: Sequence[dict[str, Any]] = ({"name": "primary", "max_concurrency": 4},),
    sleep: Any = None,
) -> tuple[ChatClient, Any]:
    """A chat client on a fake clock with a Prometheus emitter (breaker opens after 1 failure)."""
    backend = backend if backend is not None else MemoryBackend(now=clock)
    client = closing(
        ChatClient(
            gateway_settings(*sources, breaker_failures=1, max_attempts=1),
            backend=backend,
            transport=FakeTransport(script, clock=clock),
            now=clock,
            sleep=sleep if sleep is not None else BoundedSleep(clock, max_calls=200),
            rng=random.Random(3),
            emitter=PrometheusEmitter(registry),
        )
    )
    return client, backend


async def test_the_breaker_scenario_shows_the_call_outcomes_and_the_open_breaker() -> None:
    """50 fail_fast calls behind a breaker: 1 retry_exhausted, 49 no_runnable, breaker open."""
    clock = FakeClock()
    registry = CollectorRegistry()
    chat, _ = make_chat(clock, [TransientError(status_code=500)], registry)
    for _ in range(50):
        with pytest.raises(AllSourcesExhausted):
            await chat.complete(MESSAGES, fail_fast=True)
    samples = scrape(registry)
    calls = {
        dict(labels)["outcome"]: v
        for (name, labels), v in samples.items()
        if name == "polygateway_calls_total"
    }
    assert calls == {"retry_exhausted": 1.0, "no_runnable": 49.0}
    at = {"scope": "chat", "source": "primary"}
    assert value(samples, "polygateway_source_breaker_state", **at, state="open") == 1.0
    assert value(samples, "polygateway_source_breaker_state", **at, state="closed") == 0.0
    assert value(samples, "polygateway_source_breaker_state", **at, state="half_open") == 0.0
    reopen = value(samples, "polygateway_source_breaker_reopen_seconds", **at)
    assert reopen is not None
    assert 0.0 < reopen <= 30.0  # the default cool-down, counted from the trip
    assert value(samples, "polygateway_source_consecutive_trips", **at) == 1.0
    assert value(samples, "polygateway_source_permits_in_use", **at) == 0.0
    assert value(samples, "polygateway_backend_up", scope="chat") == 1.0
    assert value(samples, "polygateway_scope_calls_waiting", scope="chat") == 0.0
    assert value(samples, "polygateway_gauges_age_seconds", scope="chat") == 0.0


async def test_the_breaker_gauge_follows_the_clock_to_half_open() -> None:
    """Read at scrape time, not when the breaker tripped: past the cool-down it is half-open."""
    clock = FakeClock()
    registry = CollectorRegistry()
    chat, _ = make_chat(clock, [TransientError(status_code=500)], registry)
    with pytest.raises(AllSourcesExhausted):
        await chat.complete(MESSAGES, fail_fast=True)
    at = {"scope": "chat", "source": "primary"}
    before = value(scrape(registry), "polygateway_source_breaker_reopen_seconds", **at)
    assert before is not None
    clock.advance(before + 0.5)
    samples = scrape(registry)
    assert value(samples, "polygateway_source_breaker_state", **at, state="half_open") == 1.0
    assert value(samples, "polygateway_source_breaker_state", **at, state="open") == 0.0
    assert value(samples, "polygateway_source_breaker_reopen_seconds", **at) == 0.0


async def test_permits_in_use_limit_and_waiting_calls_while_calls_run() -> None:
    """One call holds the only permit, two wait: in use 1 of limit 1, waiting 2; then all 0."""
    clock = FakeClock()
    timers = FakeTimers(clock)
    registry = CollectorRegistry()
    gate = Gate(chat_completion("ok"))
    chat, _ = make_chat(
        clock,
        [gate, gate, gate],
        registry,
        sources=({"name": "primary", "max_concurrency": 1},),
        sleep=timers.sleep,
    )
    calls = [asyncio.ensure_future(chat.complete(MESSAGES)) for _ in range(3)]
    await gate.wait_entered(1)
    await settle()
    at = {"scope": "chat", "source": "primary"}
    busy = scrape(registry)
    assert value(busy, "polygateway_source_permits_in_use", **at) == 1.0
    assert value(busy, "polygateway_source_limit", **at) == 1.0
    assert value(busy, "polygateway_source_max_concurrency", **at) == 1.0
    assert value(busy, "polygateway_scope_calls_waiting", scope="chat") == 2.0
    gate.open()
    served = await asyncio.gather(*calls)
    assert [r.text for r in served] == ["ok"] * 3
    idle = scrape(registry)
    assert value(idle, "polygateway_source_permits_in_use", **at) == 0.0
    assert value(idle, "polygateway_scope_calls_waiting", scope="chat") == 0.0
    assert value(idle, "polygateway_scope_progress_age_seconds", scope="chat") == 0.0


async def test_aimd_limit_pause_and_rate_buckets_of_an_overloaded_source() -> None:
    """A 429 with Retry-After 20 s: the limit drops below the max, paused 20 s, rpm tokens shown."""
    clock = FakeClock()
    registry = CollectorRegistry()
    chat, _ = make_chat(
        clock,
        [TransientError(status_code=429, retry_after_s=20.0)],
        registry,
        sources=({"name": "primary", "max_concurrency": 8, "rpm": 600},),
    )
    with pytest.raises(AllSourcesExhausted):
        await chat.complete(MESSAGES, fail_fast=True)
    samples = scrape(registry)
    at = {"scope": "chat", "source": "primary"}
    limit = value(samples, "polygateway_source_limit", **at)
    assert limit is not None
    assert 1.0 <= limit < 8.0
    assert value(samples, "polygateway_source_max_concurrency", **at) == 8.0
    assert value(samples, "polygateway_source_paused_seconds", **at) == pytest.approx(20.0)
    rpm = value(samples, "polygateway_source_rpm_tokens", **at)
    assert rpm is not None
    assert 0.0 <= rpm < 10.0  # a 10-request bucket (one second of 600 rpm) less the attempt
    assert "polygateway_source_tpm_tokens" not in names(samples)  # no tpm limit, no gauge
    clock.advance(20.0)
    later = scrape(registry)
    assert value(later, "polygateway_source_paused_seconds", **at) == 0.0
    assert value(later, "polygateway_source_rpm_tokens", **at) == 10.0


async def test_a_scrape_from_another_thread_reads_through_the_clients_loop() -> None:
    """From a thread without a loop (the HTTP server's), the snapshot runs on the client's loop."""
    clock = FakeClock()
    registry = CollectorRegistry()
    chat, _ = make_chat(clock, [TransientError(status_code=500)], registry)
    with pytest.raises(AllSourcesExhausted):
        await chat.complete(MESSAGES, fail_fast=True)
    on_loop = scrape(registry)
    from_thread = await asyncio.to_thread(scrape, registry)
    at = {"scope": "chat", "source": "primary"}
    assert value(from_thread, "polygateway_source_breaker_state", **at, state="open") == 1.0
    assert {k: v for k, v in from_thread.items() if k[0].startswith("polygateway_source")} == {
        k: v for k, v in on_loop.items() if k[0].startswith("polygateway_source")
    }


async def test_a_registry_without_clients_exposes_no_gauge() -> None:
    """An emitter not yet passed to a client adds no family to the exposition."""
    registry = CollectorRegistry()
    PrometheusEmitter(registry)
    PrometheusEmitter(registry)  # a second emitter on the registry shares the collector
    text = generate_latest(registry).decode()
    assert "polygateway_source" not in text
    assert "polygateway_backend_up" not in text


async def test_two_clients_of_one_scope_share_one_set_of_gauges() -> None:
    """Two clients of a scope on one backend and registry: one row per source, not two."""
    clock = FakeClock()
    registry = CollectorRegistry()
    backend = MemoryBackend(now=clock)
    first, _ = make_chat(clock, [chat_completion("a")], registry, backend=backend)
    second, _ = make_chat(clock, [chat_completion("b")], registry, backend=backend)
    await first.complete(MESSAGES)
    await second.complete(MESSAGES)
    samples = scrape(registry)
    rows = [k for k in samples if k[0] == "polygateway_source_limit"]
    assert rows == [("polygateway_source_limit", (("scope", "chat"), ("source", "primary")))]
    assert value(samples, "polygateway_scope_calls_waiting", scope="chat") == 0.0


class _Unreadable(MemoryBackend):
    """A memory backend whose snapshots fail (``error``) or never finish (``hang``)."""

    __slots__ = ("error", "hang")

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(now=clock)
        self.error: Exception | None = GovernanceBackendError(
            "connection refused", operation="snapshot"
        )
        self.hang: asyncio.Event | None = None

    def snapshot_now(self, scope: str) -> ScopeSnapshot:
        if self.error is not None:
            raise self.error
        return super().snapshot_now(scope)

    async def snapshot(self, scope: str) -> ScopeSnapshot:
        if self.hang is not None:
            await self.hang.wait()
        return self.snapshot_now(scope)


async def test_a_failing_backend_read_gives_backend_up_0_and_no_source_sample() -> None:
    """The read raises, on the loop or from a thread: ``backend_up 0``, no gauge, no exception."""
    clock = FakeClock()
    registry = CollectorRegistry()
    backend = _Unreadable(clock)
    backend.error = None
    chat, _ = make_chat(clock, [chat_completion("ok")], registry, backend=backend)
    await chat.complete(MESSAGES)
    backend.error = GovernanceBackendError("connection refused", operation="snapshot")
    for samples in (scrape(registry), await asyncio.to_thread(scrape, registry)):
        assert value(samples, "polygateway_backend_up", scope="chat") == 0.0
        assert not any(name.startswith("polygateway_source") for name in names(samples))
        assert value(samples, "polygateway_calls_total", scope="chat", operation="chat.complete",
                     outcome="served") == 1.0  # fmt: skip
    backend.error = RuntimeError("a bug in a backend")
    samples = await asyncio.to_thread(scrape, registry)
    assert value(samples, "polygateway_backend_up", scope="chat") == 0.0
    backend.error = None
    samples = scrape(registry)
    assert value(samples, "polygateway_backend_up", scope="chat") == 1.0
    assert value(samples, "polygateway_source_limit", scope="chat", source="primary") == 4.0


def _info(backend: Any, scope: str = "chat", waiting: int = 0) -> ClientInfo:
    """What a chat client of ``scope`` on ``backend`` tells its emitters."""
    settings = gateway_settings({"name": "primary", "max_concurrency": 4}, scope=scope)
    return ClientInfo("chat", scope, settings.scope(scope).sources, backend, lambda: waiting)


async def test_a_read_that_does_not_finish_in_time_is_cancelled_and_reported_down() -> None:
    """A scrape from a thread waits at most its timeout; the snapshot left behind is cancelled."""
    clock = FakeClock()
    backend = _Unreadable(clock)
    backend.error = None
    backend.hang = asyncio.Event()
    await backend.acquire("chat", [SourceSpec("primary", 4)], ttl_s=60.0)
    registry = CollectorRegistry()
    gauges = LiveGauges(__import__("prometheus_client"), timeout_s=0.0)
    registry.register(gauges)
    gauges.bind(_info(backend, waiting=3))
    tasks_before = len(asyncio.all_tasks())
    samples = await asyncio.to_thread(scrape, registry)
    assert value(samples, "polygateway_backend_up", scope="chat") == 0.0
    assert value(samples, "polygateway_scope_calls_waiting", scope="chat") == 3.0
    assert not any(name.startswith("polygateway_source") for name in names(samples))
    await settle()
    assert len(asyncio.all_tasks()) == tasks_before  # the abandoned snapshot was cancelled


async def test_scraped_on_the_loop_an_async_backend_serves_its_latest_snapshot_with_its_age() -> (
    None
):
    """On the loop thread nothing can be awaited: the latest snapshot, aged, and one refresh."""
    clock = FakeClock()
    backend = AsyncOnly(MemoryBackend(now=clock))
    spec = SourceSpec("primary", 4)
    held = await backend.acquire("chat", [spec], ttl_s=600.0)
    assert held.lease is not None
    registry = CollectorRegistry()
    gauges = LiveGauges(__import__("prometheus_client"), now=clock)
    registry.register(gauges)
    gauges.bind(_info(backend))
    first = scrape(registry)  # nothing taken yet: no gauge and no verdict on the backend
    assert "polygateway_source_permits_in_use" not in names(first)
    assert "polygateway_backend_up" not in names(first)
    for _ in range(20):  # the refresh the scrape started runs on this loop
        await asyncio.sleep(0)
        if "polygateway_source_permits_in_use" in names(scrape(registry)):
            break
    at = {"scope": "chat", "source": "primary"}
    await backend.release(held.lease, AttemptOutcome("success"))
    clock.advance(3.0)
    stale = scrape(registry)  # the snapshot taken while the permit was held, 3 s old
    assert value(stale, "polygateway_source_permits_in_use", **at) == 1.0
    assert value(stale, "polygateway_gauges_age_seconds", scope="chat") == 3.0
    fresh = await asyncio.to_thread(scrape, registry)  # from a thread: read now, on the loop
    assert value(fresh, "polygateway_source_permits_in_use", **at) == 0.0
    assert value(fresh, "polygateway_gauges_age_seconds", scope="chat") == 0.0


async def test_a_client_built_outside_any_loop_is_read_once_its_first_call_ran() -> None:
    """Built in a thread without a loop, the client's loop is learnt from its first call."""
    clock = FakeClock()
    registry = CollectorRegistry()
    backend = AsyncOnly(MemoryBackend(now=clock))
    chat, _ = await asyncio.to_thread(
        make_chat, clock, [chat_completion("ok")], registry, backend=backend
    )
    before = await asyncio.to_thread(scrape, registry)  # loop unknown: nothing to read through
    assert "polygateway_source_limit" not in names(before)
    await chat.complete(MESSAGES)
    after = await asyncio.to_thread(scrape, registry)
    assert value(after, "polygateway_source_limit", scope="chat", source="primary") == 4.0
    assert value(after, "polygateway_backend_up", scope="chat") == 1.0


async def test_a_backend_that_is_gone_leaves_the_scrape() -> None:
    """The collector holds backends weakly: a dropped backend's scope is no longer shown."""
    clock = FakeClock()
    registry = CollectorRegistry()
    gauges = LiveGauges(__import__("prometheus_client"))
    registry.register(gauges)
    backend = MemoryBackend(now=clock)
    await backend.acquire("chat", [SourceSpec("primary", 4)], ttl_s=60.0)
    gauges.bind(_info(backend))
    assert "polygateway_source_limit" in names(scrape(registry))
    del backend
    assert names(scrape(registry)) == set()


# --- what a scrape says of each gauge, the tpm bucket, and a failed read in the log -------------

HELP = {
    "polygateway_backend_up": (
        "Whether the last read of the scope's governance state succeeded (1) or not (0)."
    ),
    "polygateway_gauges_age_seconds": (
        "Age of the snapshot the live gauges show: 0 when read at this scrape."
    ),
    "polygateway_scope_calls_waiting": "Calls of the scope waiting for a permit in this process.",
    "polygateway_scope_progress_age_seconds": (
        "Seconds since the scope last served (fleet-wide on Redis); absent if never."
    ),
    "polygateway_source_permits_in_use": "Permits held at the source (fleet-wide on Redis).",
    "polygateway_source_limit": "The source's current AIMD concurrency limit (permits).",
    "polygateway_source_max_concurrency": (
        "The source's configured max_concurrency: the ceiling of its AIMD limit."
    ),
    "polygateway_source_breaker_state": (
        "The source's circuit breaker: 1 for its current state, 0 for the others."
    ),
    "polygateway_source_breaker_reopen_seconds": (
        "Seconds until an open breaker admits its probe; 0 when not open."
    ),
    "polygateway_source_consecutive_failures": (
        "Failures in a row the breaker has counted at the source."
    ),
    "polygateway_source_paused_seconds": (
        "Seconds the source stays paused (Retry-After, overload); 0 when not paused."
    ),
    "polygateway_source_rpm_tokens": (
        "Requests left in the source's rpm bucket; absent without an rpm limit."
    ),
    "polygateway_source_tpm_tokens": (
        "Tokens left in the source's tpm bucket; absent without a tpm limit."
    ),
}


async def test_every_gauge_says_what_it_measures_in_its_help_line() -> None:
    """The ``# HELP`` a scrape carries for each gauge: what the metric browser shows users."""
    clock = FakeClock()
    registry = CollectorRegistry()
    chat, _ = make_chat(
        clock,
        [chat_completion("ok")],
        registry,
        sources=({"name": "primary", "max_concurrency": 4, "rpm": 600, "tpm": 6000},),
    )
    await chat.complete(MESSAGES)
    documented = {
        family.name: family.documentation
        for family in text_string_to_metric_families(generate_latest(registry).decode())
    }
    for name, help_text in HELP.items():
        assert documented.get(name) == help_text, name


async def test_a_tpm_limit_shows_the_tokens_left_in_its_bucket() -> None:
    """With tpm = 6000 (a 100-token burst) and a call that used 10: about 90 tokens left."""
    clock = FakeClock()
    registry = CollectorRegistry()
    chat, _ = make_chat(
        clock,
        [chat_completion("ok", prompt_tokens=6, completion_tokens=4)],
        registry,
        sources=({"name": "primary", "max_concurrency": 4, "tpm": 6000},),
    )
    await chat.complete(MESSAGES)
    left = value(scrape(registry), "polygateway_source_tpm_tokens", scope="chat", source="primary")
    assert left == pytest.approx(90.0)


async def test_a_read_failing_from_a_bug_is_logged_with_its_scope_and_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A backend's own failure is a debug line; anything else a warning naming scope and error."""
    import logging

    clock = FakeClock()
    registry = CollectorRegistry()
    backend = _Unreadable(clock)
    backend.error = None
    chat, _ = make_chat(clock, [chat_completion("ok")], registry, backend=backend)
    await chat.complete(MESSAGES)
    with caplog.at_level(logging.DEBUG, logger="polygateway"):
        backend.error = GovernanceBackendError("connection refused", operation="snapshot")
        scrape(registry)
        backend.error = RuntimeError("a bug in a backend")
        scrape(registry)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "live gauges" in r.getMessage()]
    debug = [message for level, message in lines if level == logging.DEBUG]
    assert any(
        m.startswith("live gauges of scope chat: backend read failed: ") and "refused" in m
        for m in debug
    ), lines
    assert (
        logging.WARNING,
        "live gauges of scope chat: read failed: RuntimeError('a bug in a backend')",
    ) in lines
