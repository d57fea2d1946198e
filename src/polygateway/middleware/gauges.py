"""Live gauges of the governance state, read from the backend when a metric reader asks.

A ``LiveReader`` learns the clients an emitter is passed to (``ClientInfo``)
and, when asked, reads each scope's ``ScopeSnapshot`` from the backend; a
``LiveGauges`` collector (one per ``prometheus_client`` registry) turns the
readings into Prometheus families at every scrape, and ``OpenTelemetryEmitter``
into observable gauges at every collection. Nothing runs
between scrapes, and every value is the backend's, not a count this process
kept. A memory backend describes this process; a Redis backend, the fleet.
The exceptions are the scope's waiting room, which is per process: calls
waiting (in all, and per priority class) and permits in use per class
(``ClientInfo.by_class``) are this process's on every backend.
research-wiki/guides/observability.md lists the metrics and their units.

The text below says "a scrape" for any read: a Prometheus scrape or an
OpenTelemetry collection.

``collect()`` is synchronous and ``Backend.snapshot`` a coroutine, so a scrape
reads in one of these ways, by where it runs:

- On a thread without an event loop (``prometheus_client``'s HTTP server
  thread, a WSGI worker): the snapshot runs on the client's event loop
  (``run_coroutine_threadsafe``) and the scrape waits for it at most
  ``timeout_s``. A backend read there is consistent with the loop's own
  operations, which a read from this thread alone would not be.
- On the client's event loop thread, a backend that can read without
  suspending (``MemoryBackend.snapshot_now``) is read at once. Any other
  backend cannot be awaited from inside a synchronous callback of its own
  loop (blocking there would deadlock): the scrape serves the latest snapshot
  taken, its age in ``polygateway_gauges_age_seconds``, and starts one
  refresh for the next scrape (nothing at all before the first one ends).
- With the client's loop gone (``asyncio.run`` returned), a memory backend is
  read directly (nothing else can be changing it); any other is skipped, until
  a client of the backend built on a new loop (or outside one, then called on
  it) gives the reads that loop.

A read that fails or does not finish in time yields no sample of that scope
but ``polygateway_backend_up{scope} 0``; ``collect`` never raises.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from polygateway.errors import GatewayError

if TYPE_CHECKING:
    from polygateway.backends.base import Backend, ScopeSnapshot
    from polygateway.middleware.telemetry import ClientInfo

__all__ = [
    "BREAKER_STATES",
    "SCRAPE_TIMEOUT_S",
    "LiveGauges",
    "LiveReader",
    "ScopeReading",
    "SyncSnapshot",
]

_log = logging.getLogger("polygateway.telemetry")

SCRAPE_TIMEOUT_S = 2.0
"""How long a scrape from another thread waits for one scope's snapshot (Prometheus: 10 s)."""

BREAKER_STATES = ("closed", "open", "half_open")
"""The values of the ``state`` label of ``polygateway_source_breaker_state``."""


@runtime_checkable
class SyncSnapshot(Protocol):
    """A backend that can read a scope's state without suspending (``MemoryBackend``)."""

    def snapshot_now(self, scope: str) -> ScopeSnapshot:
        """The scope's live state, read synchronously."""
        ...


@dataclass(slots=True)
class _Binding:
    """One backend serving a scope here: its loop, its waiting counts, its latest snapshot."""

    loop: asyncio.AbstractEventLoop | None
    waiting: list[Callable[[], int]] = field(default_factory=list)
    by_class: list[Callable[[], Mapping[str, tuple[int, int]]]] = field(default_factory=list)
    latest: tuple[float, ScopeSnapshot] | None = None
    refreshing: concurrent.futures.Future[None] | None = None
    failed: bool = False
    """The latest refresh failed: the scope reads down until one succeeds."""


@dataclass(slots=True)
class _Scope:
    """A scope's configured limits and the backends that serve it in this process."""

    max_concurrency: dict[str, int]
    bindings: weakref.WeakKeyDictionary[Backend, _Binding] = field(
        default_factory=weakref.WeakKeyDictionary
    )


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _alive(loop: asyncio.AbstractEventLoop | None) -> bool:
    """Whether ``loop`` still runs, so a read can go through it."""
    return loop is not None and loop.is_running() and not loop.is_closed()


@dataclass(frozen=True, slots=True)
class ScopeReading:
    """What one read tells of a bound scope: its waiting calls, and its backend's state.

    ``waiting`` and ``by_class`` are this process's (every client of the
    scope); ``up`` is ``None`` when nothing could be said of the backend (its
    loop is gone, or no snapshot was taken yet), else whether the read
    succeeded; ``snapshot`` is the backend's state, ``age_s`` old.
    """

    scope: str
    waiting: int
    by_class: dict[str, tuple[int, int]]
    up: bool | None
    age_s: float
    snapshot: ScopeSnapshot | None
    max_concurrency: dict[str, int]


class LiveReader:
    """Reads the live state of every bound scope from its backend, from any thread.

    Holds backends weakly: a client's backend that is gone is not read. A
    scope is read from one backend, the first bound that is still alive (two
    memory backends of one scope in one process need two readers); its
    waiting calls add up over every client of the scope. How a read is made
    depends on the thread it runs on (the module's docstring).
    """

    def __init__(
        self, *, timeout_s: float = SCRAPE_TIMEOUT_S, now: Callable[[], float] | None = None
    ) -> None:
        self._timeout_s = timeout_s
        self._now: Callable[[], float] = now if now is not None else time.monotonic  # edge
        self._scopes: dict[str, _Scope] = {}
        self._lock = threading.Lock()  # binds on a loop thread, reads on another
        self.loopless = False
        """Some binding was made outside any event loop: the next call record tells its loop."""

    def bind(self, client: ClientInfo) -> None:
        """Show ``client``'s scope from its backend; told once per client (``BindingEmitter``)."""
        loop = _running_loop()
        with self._lock:
            scope = self._scopes.get(client.scope)
            if scope is None:
                scope = self._scopes[client.scope] = _Scope({})
            for source in client.sources:
                scope.max_concurrency.setdefault(source.name, source.max_concurrency)
            binding = scope.bindings.get(client.backend)
            if binding is None:
                binding = scope.bindings[client.backend] = _Binding(loop)
            elif not _alive(binding.loop):
                # A backend outlives its clients: one bound on a loop that is gone (an
                # earlier ``asyncio.run``) is read through the loop of the client now.
                binding.loop = loop
            if all(w is not client.waiting and w != client.waiting for w in binding.waiting):
                binding.waiting.append(client.waiting)
            if all(c != client.by_class for c in binding.by_class):
                binding.by_class.append(client.by_class)
            self.loopless = self.loopless or loop is None

    def adopt_loop(self, scope: str) -> None:
        """Give the running loop to ``scope``'s bindings made outside one (from a call record).

        A binding whose loop is gone takes it too: its backend now serves this loop.
        """
        loop = _running_loop()
        if loop is None:
            return
        with self._lock:
            found = self._scopes.get(scope)
            for binding in found.bindings.values() if found is not None else ():
                if not _alive(binding.loop):
                    binding.loop = loop
            self.loopless = any(
                b.loop is None for s in self._scopes.values() for b in s.bindings.values()
            )

    def read(self) -> list[ScopeReading]:
        """Read every bound scope now (those with a live backend), in the order they were bound."""
        readings = []
        for name, max_concurrency, bindings in self._bound():
            backend, binding = bindings[0]
            waiting, by_class = _counts(b for _, b in bindings)
            read = self._read(name, backend, binding)
            up, age_s, snap = (None, 0.0, None) if read is None else read
            readings.append(ScopeReading(name, waiting, by_class, up, age_s, snap, max_concurrency))
        return readings

    def counts(self) -> list[tuple[str, int, dict[str, tuple[int, int]]]]:
        """(scope, calls waiting, per class (waiting, in use)) per bound scope, without a read."""
        return [(name, *_counts(b for _, b in bindings)) for name, _, bindings in self._bound()]

    def _bound(self) -> list[tuple[str, dict[str, int], list[tuple[Backend, _Binding]]]]:
        """Every scope with a live backend: its limits and bindings, copied under the lock."""
        with self._lock:
            scopes = [
                (name, dict(scope.max_concurrency), list(scope.bindings.items()))
                for name, scope in self._scopes.items()
            ]
        return [scope for scope in scopes if scope[2]]

    def _read(
        self, scope: str, backend: Backend, binding: _Binding
    ) -> tuple[bool, float, ScopeSnapshot | None] | None:
        """(up, age, snapshot) of one scope; ``None`` when there is nothing to say of it."""
        here = _running_loop()
        loop = binding.loop
        loop_alive = loop is not None and loop.is_running() and not loop.is_closed()
        try:
            if here is None and loop_alive:
                assert loop is not None
                return True, 0.0, self._on_loop(loop, backend, scope, binding)
            if isinstance(backend, SyncSnapshot) and (here is loop or not loop_alive):
                snap = backend.snapshot_now(scope)
                binding.latest = (self._now(), snap)
                return True, 0.0, snap
        except (GatewayError, TimeoutError, concurrent.futures.CancelledError) as exc:
            _log.debug("live gauges of scope %s: backend read failed: %r", scope, exc)
            return False, 0.0, None
        except Exception as exc:  # a scrape must never fail: one scope's bug blanks only it
            _log.warning("live gauges of scope %s: read failed: %r", scope, exc)
            return False, 0.0, None
        if not loop_alive:
            return None  # the client's loop is gone: no live client to describe
        assert loop is not None
        self._refresh_later(loop, backend, scope, binding)
        latest = binding.latest
        if latest is None:
            return (False, 0.0, None) if binding.failed else None
        taken_at, snap = latest
        return True, max(0.0, self._now() - taken_at), snap

    def _on_loop(
        self, loop: asyncio.AbstractEventLoop, backend: Backend, scope: str, binding: _Binding
    ) -> ScopeSnapshot:
        """The snapshot, taken on ``loop`` while this thread waits at most ``timeout_s``."""
        coro = backend.snapshot(scope)
        try:
            future = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the loop closed since it was checked
            coro.close()
            raise TimeoutError(f"the event loop of scope {scope} is closed") from None
        try:
            snap = future.result(self._timeout_s)
        except TimeoutError:
            future.cancel()
            raise
        binding.latest = (self._now(), snap)
        return snap

    def _refresh_later(
        self, loop: asyncio.AbstractEventLoop, backend: Backend, scope: str, binding: _Binding
    ) -> None:
        """Start one snapshot on ``loop`` for the next scrape (at most one at a time)."""
        if binding.refreshing is not None and not binding.refreshing.done():
            return

        async def refresh() -> None:
            try:
                binding.latest = (self._now(), await backend.snapshot(scope))
                binding.failed = False
            except GatewayError as exc:
                # Stale state would read as live: show the scope down, with no state.
                binding.latest, binding.failed = None, True
                _log.debug("live gauges of scope %s: refresh failed: %r", scope, exc)
            except Exception as exc:  # a bug: nobody awaits this refresh to hear of it
                binding.latest, binding.failed = None, True
                _log.warning("live gauges of scope %s: refresh failed: %r", scope, exc)

        coro = refresh()
        try:
            binding.refreshing = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the loop closed since it was checked
            coro.close()


class LiveGauges:
    """A ``prometheus_client`` collector of the live governance state of every bound scope.

    The reading is a ``LiveReader``'s (backends held weakly; one backend per
    scope, the first bound that is still alive; waiting calls added up over
    every client of the scope); this class turns readings into families.
    """

    def __init__(
        self,
        prometheus: Any,
        *,
        timeout_s: float = SCRAPE_TIMEOUT_S,
        now: Callable[[], float] | None = None,
    ) -> None:
        self._gauge = prometheus.metrics_core.GaugeMetricFamily
        self.reader = LiveReader(timeout_s=timeout_s, now=now)

    @property
    def loopless(self) -> bool:
        """Some binding was made outside any event loop (``LiveReader.loopless``)."""
        return self.reader.loopless

    def bind(self, client: ClientInfo) -> None:
        """Show ``client``'s scope from its backend; told once per client (``BindingEmitter``)."""
        self.reader.bind(client)

    def adopt_loop(self, scope: str) -> None:
        """Give the running loop to ``scope``'s bindings made outside one (from a call record).

        A binding whose loop is gone takes it too: its backend now serves this loop.
        """
        self.reader.adopt_loop(scope)

    def describe(self) -> list[Any]:
        """The families ``collect`` yields, without reading anything (the registry's name check)."""
        return list(self._families().values())

    def collect(self) -> list[Any]:
        """Read every bound scope's snapshot now and return the gauge families."""
        families = self._families()
        for r in self.reader.read():
            families["waiting"].add_metric([r.scope], r.waiting)
            for klass, (queued, in_use) in r.by_class.items():
                families["class_waiting"].add_metric([r.scope, klass], queued)
                families["class_in_use"].add_metric([r.scope, klass], in_use)
            if r.up is None:
                continue
            families["up"].add_metric([r.scope], 1.0 if r.up else 0.0)
            if r.snapshot is None:
                continue
            families["age"].add_metric([r.scope], r.age_s)
            _add_scope(families, r.snapshot, r.max_concurrency)
        # Families without a sample are left out: an unbound registry exposes nothing new.
        return [family for family in families.values() if family.samples]

    def _families(self) -> dict[str, Any]:
        g = self._gauge
        src = ("scope", "source")
        return {
            "up": g(
                "polygateway_backend_up",
                "Whether the last read of the scope's governance state succeeded (1) or not (0).",
                labels=("scope",),
            ),
            "age": g(
                "polygateway_gauges_age_seconds",
                "Age of the snapshot the live gauges show: 0 when read at this scrape.",
                labels=("scope",),
            ),
            "waiting": g(
                "polygateway_scope_calls_waiting",
                "Calls of the scope waiting for a permit in this process.",
                labels=("scope",),
            ),
            "class_waiting": g(
                "polygateway_scope_calls_waiting_by_class",
                "Calls of the scope waiting for a permit in this process, per priority class "
                "(empty: a scope without classes).",
                labels=("scope", "priority_class"),
            ),
            "class_in_use": g(
                "polygateway_scope_permits_in_use",
                "Permits the scope's calls hold in this process, per priority class "
                "(empty: a scope without classes).",
                labels=("scope", "priority_class"),
            ),
            "progress": g(
                "polygateway_scope_progress_age_seconds",
                "Seconds since the scope last served (fleet-wide on Redis); absent if never.",
                labels=("scope",),
            ),
            "in_use": g(
                "polygateway_source_permits_in_use",
                "Permits held at the source (fleet-wide on Redis).",
                labels=src,
            ),
            "limit": g(
                "polygateway_source_limit",
                "The source's current AIMD concurrency limit (permits).",
                labels=src,
            ),
            "max": g(
                "polygateway_source_max_concurrency",
                "The source's configured max_concurrency: the ceiling of its AIMD limit.",
                labels=src,
            ),
            "breaker": g(
                "polygateway_source_breaker_state",
                "The source's circuit breaker: 1 for its current state, 0 for the others.",
                labels=(*src, "state"),
            ),
            "reopen": g(
                "polygateway_source_breaker_reopen_seconds",
                "Seconds until an open breaker admits its probe; 0 when not open.",
                labels=src,
            ),
            "failures": g(
                "polygateway_source_consecutive_failures",
                "Failures in a row the breaker has counted at the source.",
                labels=src,
            ),
            "trips": g(
                "polygateway_source_consecutive_trips",
                "Times in a row the breaker opened since the source last served (its cool-down "
                "doubles with each); 0 after a success.",
                labels=src,
            ),
            "paused": g(
                "polygateway_source_paused_seconds",
                "Seconds the source stays paused (Retry-After, overload); 0 when not paused.",
                labels=src,
            ),
            "rpm": g(
                "polygateway_source_rpm_tokens",
                "Requests left in the source's rpm bucket; absent without an rpm limit.",
                labels=src,
            ),
            "tpm": g(
                "polygateway_source_tpm_tokens",
                "Tokens left in the source's tpm bucket; absent without a tpm limit.",
                labels=src,
            ),
        }


def _counts(bindings: Iterable[_Binding]) -> tuple[int, dict[str, tuple[int, int]]]:
    """Calls waiting, and per class (waiting, in use), added up over a scope's clients."""
    waiting = 0
    by_class: dict[str, tuple[int, int]] = {}
    for binding in bindings:
        waiting += sum(count() for count in binding.waiting)
        for read_classes in binding.by_class:
            for klass, (queued, in_use) in read_classes().items():
                before = by_class.get(klass, (0, 0))
                by_class[klass] = (before[0] + queued, before[1] + in_use)
    return waiting, by_class


def _add_scope(
    families: dict[str, Any], snap: ScopeSnapshot, max_concurrency: dict[str, int]
) -> None:
    """One scope's samples: a row per source the backend has seen, and the scope's own."""
    scope = snap.scope
    if snap.progress_age_s != float("inf"):
        families["progress"].add_metric([scope], snap.progress_age_s)
    for s in snap.sources:
        labels = [scope, s.name]
        families["in_use"].add_metric(labels, s.in_flight)
        families["limit"].add_metric(labels, s.limit)
        cap = max_concurrency.get(s.name)
        if cap is not None:
            families["max"].add_metric(labels, cap)
        for state in BREAKER_STATES:
            families["breaker"].add_metric([*labels, state], 1.0 if s.breaker == state else 0.0)
        families["reopen"].add_metric(labels, max(0.0, s.reopen_in_s or 0.0))
        families["failures"].add_metric(labels, s.consecutive_failures)
        families["trips"].add_metric(labels, s.trips)
        families["paused"].add_metric(labels, max(0.0, s.paced_for_s or 0.0))
        if s.rpm_tokens is not None:
            families["rpm"].add_metric(labels, s.rpm_tokens)
        if s.tpm_tokens is not None:
            families["tpm"].add_metric(labels, s.tpm_tokens)
