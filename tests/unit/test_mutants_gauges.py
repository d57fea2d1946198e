"""Live gauges edges that mutation testing found unpinned (research-wiki/MUTATION.md).

Which backend and which waiting counts a scope shows when several clients
bind it, the loop a binding learns late, a scope that cannot be read among
others, where each kind of scrape reads (another loop, a loop gone, a loop
closing under the read) and the refresh that serves a scrape on the loop.
"""

# Survivors of the measured run these tests kill, all in polygateway.middleware.gauges:
#   xǁLiveGaugesǁ__init____mutmut_10
#   xǁLiveGaugesǁbind__mutmut_2, 3, 11, 16, 17, 19, 20, 21
#   xǁLiveGaugesǁadopt_loop__mutmut_6, 10, 11, 12
#   xǁLiveGaugesǁcollect__mutmut_6, 11, 28, 41
#   xǁLiveGaugesǁ_read__mutmut_24, 27, 63, 68
#   xǁLiveGaugesǁ_on_loop__mutmut_8, 11
#   xǁLiveGaugesǁ_refresh_later__mutmut_3, 6, 7, 8, 9, 10, 11, 12, 13, 14
#   xǁLiveGaugesǁ_families__mutmut_138, 141, 157, 158, 159, 160, 161
# and of the run of 2026-12-07 18:32 UTC, in polygateway.middleware.gauges:
#   xǁLiveReaderǁadopt_loop__mutmut_9, xǁLiveReaderǁ_refresh_later__mutmut_19

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import logging
import threading
from collections.abc import Callable
from typing import Any

import prometheus_client
import pytest
from _async_only import AsyncOnly
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from polygateway.backends.base import AttemptOutcome, ScopeSnapshot, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.errors import GovernanceBackendError
from polygateway.middleware.gauges import LiveGauges
from polygateway.middleware.telemetry import ClientInfo, PrometheusEmitter
from polygateway.models import CallRecord
from polygateway.testing import FakeClock, gateway_settings, settle

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
PRIMARY = SourceSpec("primary", 4)


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


def in_use(samples: Samples, scope: str = "chat") -> float | None:
    """``polygateway_source_permits_in_use`` of the scope's ``primary`` source."""
    return value(samples, "polygateway_source_permits_in_use", scope=scope, source="primary")


def waiting(samples: Samples, scope: str = "chat") -> float | None:
    """``polygateway_scope_calls_waiting`` of the scope."""
    return value(samples, "polygateway_scope_calls_waiting", scope=scope)


def up(samples: Samples, scope: str = "chat") -> float | None:
    """``polygateway_backend_up`` of the scope."""
    return value(samples, "polygateway_backend_up", scope=scope)


def age(samples: Samples, scope: str = "chat") -> float | None:
    """``polygateway_gauges_age_seconds`` of the scope."""
    return value(samples, "polygateway_gauges_age_seconds", scope=scope)


def collector(clock: FakeClock) -> tuple[CollectorRegistry, LiveGauges]:
    """A registry with its own live gauges on the fake clock."""
    registry = CollectorRegistry()
    gauges = LiveGauges(prometheus_client, now=clock)
    registry.register(gauges)
    return registry, gauges


def info(backend: Any, scope: str = "chat", waiting: Callable[[], int] = lambda: 0) -> ClientInfo:
    """What a chat client of ``scope`` on ``backend`` tells its emitters."""
    settings = gateway_settings({"name": "primary", "max_concurrency": 4}, scope=scope)
    return ClientInfo("chat", scope, settings.scope(scope).sources, backend, waiting)


def scrape_from_another_loop(registry: CollectorRegistry) -> Samples:
    """A scrape from a thread running its own event loop (an ASGI server's), made synchronously.

    The calling loop is blocked until the scrape returns, so a refresh the
    scrape starts on that loop runs only after it (at the caller's next await).
    """

    async def on_other_loop() -> Samples:
        return scrape(registry)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, on_other_loop()).result()


class _Unreadable(MemoryBackend):
    """A memory backend whose every read fails as a backend fails."""

    __slots__ = ()

    def snapshot_now(self, scope: str) -> ScopeSnapshot:
        raise GovernanceBackendError("connection refused", operation="snapshot")


# --- which backend and which waiting counts a scope shows ---------------------------------------


async def test_a_scope_shows_its_first_bound_backend_and_the_waiting_calls_of_all() -> None:
    """Two backends of one scope: the first bound alive is shown; waiting adds over both."""
    clock = FakeClock()
    registry, gauges = collector(clock)
    first, second = MemoryBackend(now=clock), MemoryBackend(now=clock)
    await first.acquire("chat", [PRIMARY], ttl_s=60.0)
    for _ in range(2):
        await second.acquire("chat", [PRIMARY], ttl_s=60.0)
    gauges.bind(info(first, waiting=lambda: 2))
    gauges.bind(info(second, waiting=lambda: 3))
    samples = scrape(registry)
    assert in_use(samples) == 1.0
    assert waiting(samples) == 5.0
    del first
    gc.collect()
    samples = scrape(registry)
    assert in_use(samples) == 2.0
    assert waiting(samples) == 3.0


async def test_the_waiting_calls_of_every_client_of_a_backend_add_up() -> None:
    """Clients of one scope on one backend that count their waiting calls apart: the sum."""
    clock = FakeClock()
    registry, gauges = collector(clock)
    backend = MemoryBackend(now=clock)
    gauges.bind(info(backend, waiting=lambda: 2))
    gauges.bind(info(backend, waiting=lambda: 3))
    assert waiting(scrape(registry)) == 5.0


class _Room:
    """A waiting room two clients of a scope share: three calls wait in it."""

    def __len__(self) -> int:
        return 3


async def test_a_waiting_room_shared_by_two_clients_is_counted_once() -> None:
    """Two clients of a scope on one backend share its room (two equal bound methods): 3, not 6."""
    clock = FakeClock()
    registry, gauges = collector(clock)
    backend, room = MemoryBackend(now=clock), _Room()
    gauges.bind(info(backend, waiting=room.__len__))
    gauges.bind(info(backend, waiting=room.__len__))
    assert waiting(scrape(registry)) == 3.0


# --- the loop a binding reads through ------------------------------------------------------------


async def test_a_binding_made_outside_a_loop_learns_it_from_a_later_client_on_the_loop() -> None:
    """A client bound later on the loop gives the binding that loop; a loopless bind keeps it."""
    clock = FakeClock()
    registry, gauges = collector(clock)
    late = AsyncOnly(MemoryBackend(now=clock))
    await asyncio.to_thread(gauges.bind, info(late))
    assert up(await asyncio.to_thread(scrape, registry)) is None  # no loop to read through
    gauges.bind(info(late))
    assert up(await asyncio.to_thread(scrape, registry)) == 1.0

    registry, gauges = collector(clock)
    early = AsyncOnly(MemoryBackend(now=clock))
    gauges.bind(info(early))
    await asyncio.to_thread(gauges.bind, info(early))
    assert up(await asyncio.to_thread(scrape, registry)) == 1.0


async def test_loopless_is_true_exactly_while_some_binding_lacks_its_loop() -> None:
    """``loopless`` (call records then hand their loop over) clears once every binding has one."""
    clock = FakeClock()
    gauges = LiveGauges(prometheus_client, now=clock)
    on_loop = MemoryBackend(now=clock)
    gauges.bind(info(on_loop, scope="served"))
    assert not gauges.loopless
    a, b = AsyncOnly(MemoryBackend(now=clock)), AsyncOnly(MemoryBackend(now=clock))
    await asyncio.to_thread(gauges.bind, info(a, scope="a"))
    await asyncio.to_thread(gauges.bind, info(b, scope="b"))
    assert gauges.loopless
    gauges.adopt_loop("a")
    assert gauges.loopless  # scope b still has no loop
    gauges.adopt_loop("b")
    assert not gauges.loopless


def _record(scope: str) -> CallRecord:
    return CallRecord("c0ffee", scope, "chat.complete", "served", 1, "primary", 0.1, 0.0, 0.0)


async def test_a_binding_on_a_running_loop_keeps_it_when_another_loop_adopts_the_scope() -> None:
    """A call record on another loop hands its loop to bindings without a live one only."""
    clock = FakeClock()
    registry, gauges = collector(clock)
    backend = AsyncOnly(MemoryBackend(now=clock))  # held: a binding lives with its backend
    gauges.bind(info(backend))  # on this loop, which runs on

    async def adopt() -> None:
        gauges.adopt_loop("chat")

    await asyncio.to_thread(asyncio.run, adopt())  # a loop that is gone once this returns
    assert up(await asyncio.to_thread(scrape, registry)) == 1.0  # read through this loop


async def test_clients_of_two_scopes_built_outside_a_loop_learn_it_from_their_first_calls() -> None:
    """Each scope's first call record gives it the loop; a record of an unbound scope is inert."""
    clock = FakeClock()
    registry = CollectorRegistry()
    emitter = PrometheusEmitter(registry)
    a, b = AsyncOnly(MemoryBackend(now=clock)), AsyncOnly(MemoryBackend(now=clock))
    await asyncio.to_thread(emitter.bind, info(a, scope="a"))
    await asyncio.to_thread(emitter.bind, info(b, scope="b"))
    emitter.emit_call(_record("unbound"))
    emitter.emit_call(_record("a"))
    emitter.emit_call(_record("b"))
    samples = await asyncio.to_thread(scrape, registry)
    assert up(samples, "a") == 1.0
    assert up(samples, "b") == 1.0
    assert value(samples, "polygateway_calls_total", scope="unbound", operation="chat.complete",
                 outcome="served") == 1.0  # fmt: skip


# --- a scope that cannot be read among others ----------------------------------------------------


async def test_a_scope_with_nothing_to_show_does_not_hide_the_scopes_bound_after_it() -> None:
    """A backend gone, a loop unknown, a failed read: each blanks its own scope, not the next."""
    clock = FakeClock()
    registry, gauges = collector(clock)
    gone = MemoryBackend(now=clock)
    gauges.bind(info(gone, scope="gone"))
    del gone
    gc.collect()
    loopless = AsyncOnly(MemoryBackend(now=clock))
    await asyncio.to_thread(gauges.bind, info(loopless, scope="loopless"))
    down = _Unreadable(now=clock)
    gauges.bind(info(down, scope="down"))
    served = MemoryBackend(now=clock)
    await served.acquire("chat", [PRIMARY], ttl_s=60.0)
    gauges.bind(info(served))
    samples = scrape(registry)
    assert up(samples, "gone") is None
    assert up(samples, "loopless") is None
    assert up(samples, "down") == 0.0
    assert up(samples) == 1.0
    assert in_use(samples) == 1.0


# --- where each kind of scrape reads -------------------------------------------------------------


async def test_a_scrape_from_another_loop_serves_the_latest_snapshot_with_its_age() -> None:
    """From another loop's thread the backend is not read: the latest snapshot, aged, then fresh."""
    clock = FakeClock()
    registry, gauges = collector(clock)
    backend = MemoryBackend(now=clock)
    held = await backend.acquire("chat", [PRIMARY], ttl_s=60.0)
    assert held.lease is not None
    gauges.bind(info(backend))
    assert in_use(scrape(registry)) == 1.0  # on the loop: read at once, kept as the latest
    await backend.release(held.lease, AttemptOutcome("success"))
    stale = scrape_from_another_loop(registry)
    assert in_use(stale) == 1.0
    assert up(stale) == 1.0
    assert age(stale) == 0.0
    await settle()  # the refresh that scrape started runs on the client's loop
    clock.advance(2.0)
    later = scrape_from_another_loop(registry)
    assert in_use(later) == 0.0
    assert age(later) == 2.0
    await settle()


def test_a_memory_backend_is_read_directly_once_its_loop_is_gone() -> None:
    """After ``asyncio.run`` returned, a scrape reads the memory backend itself."""
    clock = FakeClock()
    registry, gauges = collector(clock)
    backend = MemoryBackend(now=clock)

    async def serve() -> None:
        gauges.bind(info(backend))
        await backend.acquire("chat", [PRIMARY], ttl_s=60.0)

    asyncio.run(serve())
    samples = scrape(registry)
    assert up(samples) == 1.0
    assert in_use(samples) == 1.0
    assert age(samples) == 0.0


class _ClosingLoop(asyncio.SelectorEventLoop):
    """A running loop that refuses callbacks once ``refusing``, as one closing under a scrape."""

    refusing = False

    def call_soon_threadsafe(self, callback: Any, *args: Any, context: Any = None) -> Any:
        if self.refusing:
            raise RuntimeError("Event loop is closed")
        return super().call_soon_threadsafe(callback, *args, context=context)


def test_a_loop_closing_under_a_scrape_reports_the_scope_down_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The scrape cannot reach the client's loop: ``backend_up 0``, and the log names the scope."""
    clock = FakeClock()
    registry, gauges = collector(clock)
    backend = MemoryBackend(now=clock)
    loop = _ClosingLoop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:

        async def bind() -> None:
            gauges.bind(info(backend))

        asyncio.run_coroutine_threadsafe(bind(), loop).result(timeout=10.0)
        loop.refusing = True
        with caplog.at_level(logging.DEBUG, logger="polygateway"):
            samples = scrape(registry)
    finally:
        loop.refusing = False
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
    assert up(samples) == 0.0
    assert in_use(samples) is None
    assert (
        "live gauges of scope chat: backend read failed: "
        "TimeoutError('the event loop of scope chat is closed')"
    ) in caplog.messages


# --- the refresh that serves a scrape on the loop ------------------------------------------------


async def test_a_snapshot_read_from_a_thread_is_served_on_the_loop_with_its_age() -> None:
    """A scrape from a thread keeps what it read: the next scrape on the loop shows it, aged."""
    clock = FakeClock()
    registry, gauges = collector(clock)
    backend = AsyncOnly(MemoryBackend(now=clock))
    held = await backend.inner.acquire("chat", [PRIMARY], ttl_s=60.0)
    assert held.lease is not None
    gauges.bind(info(backend))
    assert in_use(await asyncio.to_thread(scrape, registry)) == 1.0
    await backend.inner.release(held.lease, AttemptOutcome("success"))
    clock.advance(4.0)
    on_loop = scrape(registry)
    assert in_use(on_loop) == 1.0
    assert age(on_loop) == 4.0
    await settle()


async def test_a_refresh_just_taken_on_the_loop_shows_age_0_and_the_backend_up() -> None:
    """Served on the loop right after its refresh ended: age 0, ``backend_up 1``."""
    clock = FakeClock()
    registry, gauges = collector(clock)
    backend = AsyncOnly(MemoryBackend(now=clock))
    await backend.inner.acquire("chat", [PRIMARY], ttl_s=60.0)
    gauges.bind(info(backend))
    assert up(scrape(registry)) is None  # nothing taken yet; starts the refresh
    await settle()
    samples = scrape(registry)
    assert up(samples) == 1.0
    assert age(samples) == 0.0
    assert in_use(samples) == 1.0
    await settle()


async def test_scrapes_on_the_loop_run_one_refresh_at_a_time_and_start_the_next() -> None:
    """While a refresh runs, scrapes start none; once it has ended, the next scrape starts one."""
    clock = FakeClock()
    registry, gauges = collector(clock)
    backend = AsyncOnly(MemoryBackend(now=clock))
    backend.gate = asyncio.Event()
    gauges.bind(info(backend))
    scrape(registry)
    await settle()
    scrape(registry)
    await settle()
    assert backend.reads == 1
    backend.gate.set()
    await settle()
    held = await backend.inner.acquire("chat", [PRIMARY], ttl_s=60.0)
    assert held.lease is not None
    assert in_use(scrape(registry)) is None  # taken before the source was first seen
    await settle()
    assert backend.reads == 2
    assert in_use(scrape(registry)) == 1.0
    await settle()


@pytest.mark.parametrize(
    "error",
    [
        GovernanceBackendError("connection refused", operation="snapshot"),
        RuntimeError("connection refused"),  # a bug: logged as a warning, down alike
    ],
    ids=["backend", "bug"],
)
async def test_a_failed_refresh_withdraws_the_snapshot_served_and_logs_why(
    caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    """Stale state would read as live: after a failed refresh the scope shows it down, no state."""
    clock = FakeClock()
    registry, gauges = collector(clock)
    backend = AsyncOnly(MemoryBackend(now=clock))
    gauges.bind(info(backend))
    scrape(registry)
    await settle()
    assert up(scrape(registry)) == 1.0
    await settle()
    backend.error = error
    with caplog.at_level(logging.DEBUG, logger="polygateway"):
        assert up(scrape(registry)) == 1.0  # the latest snapshot; its refresh fails
        await settle()
        samples = scrape(registry)
        await settle()
    assert up(samples) == 0.0  # down, as the guide's alert on backend_up == 0 expects
    assert in_use(samples) is None
    backend.error = None
    scrape(registry)  # down still; its refresh succeeds
    await settle()
    assert up(scrape(registry)) == 1.0
    failed = [m for m in caplog.messages if "refresh failed" in m]
    assert failed
    assert all(
        m.startswith(f"live gauges of scope chat: refresh failed: {type(error).__name__}(")
        and "connection refused" in m
        for m in failed
    ), failed


# --- the failures and trips gauges ---------------------------------------------------------------


async def test_consecutive_failures_and_trips_show_per_source_with_their_help_lines() -> None:
    """Two failures short of a trip: failures 2 and trips 0 for the source, each documented."""
    clock = FakeClock()
    registry, gauges = collector(clock)
    backend = MemoryBackend(now=clock)
    spec = SourceSpec("primary", 4, breaker_failures=5)
    for _ in range(2):
        held = await backend.acquire("chat", [spec], ttl_s=60.0)
        assert held.lease is not None
        await backend.release(held.lease, AttemptOutcome("transient"))
    gauges.bind(info(backend))
    text = generate_latest(registry).decode()
    samples = scrape(registry)
    at = {"scope": "chat", "source": "primary"}
    assert value(samples, "polygateway_source_consecutive_failures", **at) == 2.0
    assert value(samples, "polygateway_source_consecutive_trips", **at) == 0.0
    documented = {f.name: f.documentation for f in text_string_to_metric_families(text)}
    assert documented["polygateway_source_consecutive_trips"] == (
        "Times in a row the breaker opened since the source last served (its cool-down "
        "doubles with each); 0 after a success."
    )


def test_per_class_counts_add_up_over_every_backend_of_a_scope_with_their_help() -> None:
    """Two backends serving one scope here: per class, their waiting and in-use counts add up.

    The two per-class families say what they count in their ``# HELP``, with
    the ``scope`` and ``priority_class`` labels.
    """
    clock = FakeClock()
    registry, gauges = collector(clock)
    first, second = MemoryBackend(now=clock), MemoryBackend(now=clock)
    for backend, counts in ((first, {"": (1, 2)}), (second, {"": (3, 4)})):
        gauges.bind(dataclasses.replace(info(backend), by_class=lambda c=counts: c))
    samples = scrape(registry)
    by_class = {"priority_class": "", "scope": "chat"}
    assert value(samples, "polygateway_scope_calls_waiting_by_class", **by_class) == 4
    assert value(samples, "polygateway_scope_permits_in_use", **by_class) == 6
    text = generate_latest(registry).decode()
    assert (
        "# HELP polygateway_scope_calls_waiting_by_class Calls of the scope waiting for a permit"
        " in this process, per priority class (empty: a scope without classes)."
    ) in text
    assert (
        "# HELP polygateway_scope_permits_in_use Permits the scope's calls hold in this process,"
        " per priority class (empty: a scope without classes)."
    ) in text


def test_the_scrape_timeout_reaches_the_reader() -> None:
    """``LiveGauges(timeout_s=...)`` bounds each read from another thread by that time."""
    assert LiveGauges(prometheus_client, timeout_s=0.25).reader._timeout_s == 0.25
