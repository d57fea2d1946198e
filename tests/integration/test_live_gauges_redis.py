"""Live gauges on a real Redis: what one backend does shows in another's scrape (the fleet).

Two ``RedisBackend`` objects on one server stand for two processes of a
fleet, each with its own client and its own Prometheus registry served by
``prometheus_client``'s HTTP server on 127.0.0.1, scraped over HTTP as a
Prometheus server would: from the server's thread, so each read runs on the
test's event loop with a bounded wait.
"""

from __future__ import annotations

import asyncio
import random
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from polygateway.backends.base import AttemptOutcome, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.chat import ChatClient
from polygateway.middleware.telemetry import PrometheusEmitter
from polygateway.testing import FakeTransport, Gate, chat_completion, gateway_settings

MESSAGES = [{"role": "user", "content": "hi"}]
SOURCES = ({"name": "primary", "max_concurrency": 4}, {"name": "flaky", "max_concurrency": 2})
TRIPPING = SourceSpec("flaky", 2, breaker_failures=1, cooldown_s=600.0, cooldown_max_s=600.0)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, by name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample ``name{labels}``, or ``None`` when the scrape has none."""
    return samples.get((name, tuple(sorted(labels.items()))))


@contextmanager
def metrics_server(registry: CollectorRegistry) -> Iterator[Callable[[], Samples]]:
    """``registry`` served by prometheus_client on a free loopback port; a scrape function."""
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"

    def scrape() -> Samples:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return parse(answer.read().decode())

    try:
        yield scrape
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@asynccontextmanager
async def member(
    url: str, script: Any, sources: tuple[dict[str, Any], ...] = SOURCES
) -> AsyncIterator[tuple[ChatClient, CollectorRegistry]]:
    """One fleet member: its own Redis backend, chat client (of ``sources``) and registry."""
    registry = CollectorRegistry()
    backend = RedisBackend(url)
    client = ChatClient(
        gateway_settings(*sources),
        backend=backend,
        transport=FakeTransport(script),
        rng=random.Random(1),
        emitter=PrometheusEmitter(registry),
    )
    try:
        async with client:
            yield client, registry
    finally:
        await backend.aclose()


async def test_permits_and_a_breaker_of_one_member_show_in_the_other_members_scrape(
    redis_url: str,
) -> None:
    """Member A holds 3 permits, member B trips a breaker: each scrape over HTTP shows both.

    A's client knows only ``primary``; the fleet's state names ``flaky`` too.
    """
    gate = Gate(chat_completion("ok"))
    async with (
        member(redis_url, [gate] * 3, SOURCES[:1]) as (chat_a, registry_a),
        member(redis_url, []) as (chat_b, registry_b),
    ):
        held = [asyncio.ensure_future(chat_a.complete(MESSAGES)) for _ in range(3)]
        await gate.wait_entered(3)
        probe = await chat_b.backend.acquire("chat", [TRIPPING], ttl_s=60.0)
        assert probe.lease is not None
        await chat_b.backend.release(probe.lease, AttemptOutcome("transient"))
        with metrics_server(registry_a) as scrape_a, metrics_server(registry_b) as scrape_b:
            seen_by_a = await asyncio.to_thread(scrape_a)
            seen_by_b = await asyncio.to_thread(scrape_b)
            for seen in (seen_by_a, seen_by_b):
                primary = {"scope": "chat", "source": "primary"}
                flaky = {"scope": "chat", "source": "flaky"}
                assert value(seen, "polygateway_backend_up", scope="chat") == 1.0
                assert value(seen, "polygateway_source_permits_in_use", **primary) == 3.0
                assert value(seen, "polygateway_source_limit", **primary) == 4.0
                assert value(seen, "polygateway_source_max_concurrency", **primary) == 4.0
                assert (
                    value(seen, "polygateway_source_breaker_state", **primary, state="closed") == 1
                )
                assert value(seen, "polygateway_source_breaker_state", **flaky, state="open") == 1
                assert value(seen, "polygateway_source_consecutive_trips", **flaky) == 1.0
                reopen = value(seen, "polygateway_source_breaker_reopen_seconds", **flaky)
                assert reopen is not None
                assert 500.0 < reopen <= 600.0
                assert value(seen, "polygateway_source_permits_in_use", **flaky) == 0.0
            # Waiting calls are each process's own: none waits in either member.
            assert value(seen_by_b, "polygateway_scope_calls_waiting", scope="chat") == 0.0
            gate.open()
            assert [r.text for r in await asyncio.gather(*held)] == ["ok"] * 3
            freed = await asyncio.to_thread(scrape_b)
            primary = {"scope": "chat", "source": "primary"}
            assert value(freed, "polygateway_source_permits_in_use", **primary) == 0.0
            age = value(freed, "polygateway_scope_progress_age_seconds", scope="chat")
            assert age is not None
            assert 0.0 <= age < 30.0  # A served; B's scrape sees the fleet's progress


async def test_scraped_on_the_loop_thread_redis_gauges_serve_the_latest_snapshot(
    redis_url: str,
) -> None:
    """On the loop's own thread a Redis read cannot be awaited: the latest snapshot, aged."""
    async with member(redis_url, []) as (chat, registry):
        lease = (await chat.backend.acquire("chat", [SourceSpec("primary", 4)], ttl_s=60.0)).lease
        assert lease is not None
        first = parse(generate_latest(registry).decode())
        assert value(
            first, "polygateway_source_permits_in_use", scope="chat", source="primary"
        ) is (None)  # nothing taken yet; the scrape started a refresh
        fresh = parse((await asyncio.to_thread(generate_latest, registry)).decode())
        assert (
            value(fresh, "polygateway_source_permits_in_use", scope="chat", source="primary") == 1
        )
        await chat.backend.release(lease, AttemptOutcome("cancelled"))
        stale = parse(generate_latest(registry).decode())
        # The snapshot taken while the permit was held (or by the refresh this scrape left).
        assert (
            value(stale, "polygateway_source_permits_in_use", scope="chat", source="primary") == 1
        )
        age = value(stale, "polygateway_gauges_age_seconds", scope="chat")
        assert age is not None
        assert age >= 0.0


async def test_a_redis_that_went_away_reads_as_backend_down_without_failing_the_scrape(
    make_redis_server: Callable[..., Any],
) -> None:
    """Redis stopped: the scrape answers, ``backend_up 0``, no source gauge, counters kept."""
    server = make_redis_server()
    async with member(server.url, [chat_completion("ok")]) as (chat, registry):
        await chat.complete(MESSAGES)
        with metrics_server(registry) as scrape:
            up = await asyncio.to_thread(scrape)
            assert value(up, "polygateway_backend_up", scope="chat") == 1.0
            server.stop()
            down = await asyncio.to_thread(scrape)
    assert value(down, "polygateway_backend_up", scope="chat") == 0.0
    assert not any(name.startswith("polygateway_source") for name, _ in down)
    served = {"scope": "chat", "operation": "chat.complete", "outcome": "served"}
    assert value(down, "polygateway_calls_total", **served) == 1.0


async def test_opentelemetry_gauges_read_a_redis_fleet_from_the_sdks_reader_thread(
    redis_url: str,
) -> None:
    """The OTel observable gauges show a Redis scope's sources, read on the client's loop.

    A metric reader collects on its own thread (the SDK's periodic reader
    does): each read is taken on the test's event loop with a bounded wait,
    as Prometheus scrapes are, so a fleet's state reaches OpenTelemetry too.
    """
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from polygateway import OpenTelemetryEmitter

    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    backend = RedisBackend(redis_url)
    held = await backend.acquire("chat", [SourceSpec("primary", 4)], ttl_s=60.0)
    assert held.lease is not None
    client = ChatClient(
        gateway_settings(*SOURCES),
        backend=backend,
        transport=FakeTransport([]),
        rng=random.Random(1),
        emitter=OpenTelemetryEmitter(meter_provider=meter_provider),
    )
    try:
        data = await asyncio.to_thread(reader.get_metrics_data)
        assert data is not None
        points = {
            metric.name: {
                tuple(sorted(p.attributes.items())): p.value for p in metric.data.data_points
            }
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
        }
        in_use = points["polygateway.source.permits.in_use"]
        assert in_use[(("polygateway.scope", "chat"), ("polygateway.source", "primary"))] == 1
    finally:
        await backend.release(held.lease, AttemptOutcome("success"))
        await client.aclose()
        await backend.aclose()
        meter_provider.shutdown()
