"""The one governance loop every client runs its calls through (research-wiki/ARCHITECTURE.md §2).

``RetryMW`` holds what is fixed for a scope: its sources in selection order,
their timeouts and lease TTLs, the backend, the process's waiting room of the
scope, the telemetry emitter. Each call gets a ``Call`` of its own, which
owns everything that changes while the call runs (its ``StallClock``, its
deadline, its attempts, its place in the queue) and reads as the loop reads::

    call = Call(...)                                  one per call, with its StallClock
    serve:
        loop:
            chat only: call.stalled()            -> AllSourcesExhausted("stalled")
            call.deadline.over()                 -> AllSourcesExhausted("deadline")
            lease = call.pick()                     selection order + one backend.acquire;
                                                    no time left once granted -> release, "deadline"
            nothing runnable -> call.wait():     fail_fast -> "no_runnable";
                                                 call.stalled() -> "stalled";
                                                 else wait our turn in the scope's queue
            call.attempt(lease)                     productive time on the StallClock:
                                                    request, and on failure release + record
            success -> served, permit held;  else call.after_failure():
                request_rejected -> RequestRejected at once
                timeout cut by the deadline -> "deadline" at once
                exempt 429 -> not charged; else fails += 1 -> "retry_exhausted" at max_attempts
                back-off, then back into the queue in arrival order
    finish(served, how the body ended):          release + record, end the attempt

``run`` (request/response) and ``session`` (a stream: the body runs with the
permit held and the attempt still open) are two thin wrappers over one call.

The stall budget (research-wiki/designs/stall-budget.md) bills only
non-productive time: a real attempt is governed by ``max_attempts``, so it is
subtracted from the call's elapsed time. Embedding and OCR run the same loop
with ``exempt_429=False``: every failure is charged and the top-of-loop stall
check is off. ``deadline_s`` is a hard bound (``middleware/deadline.py``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import random
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Generic, TypedDict, TypeVar, Unpack

from polygateway.backends.base import AcquireResult, AttemptOutcome, Backend, Lease, SourceSpec
from polygateway.errors import (
    AllSourcesExhausted,
    ExhaustedReason,
    GovernanceBackendError,
    RequestRejected,
)
from polygateway.governance.selection import SelectionOrder, untried_first
from polygateway.middleware.attempt import AttemptContext, AttemptFn, Served, release_quietly
from polygateway.middleware.classify import (
    DEADLINE_CUT,
    FAILURE_TABLE,
    FailureRule,
    Verdict,
    clamped_hint,
    verdict_for,
)
from polygateway.middleware.deadline import Deadline, Timeouts, check_deadline_s
from polygateway.middleware.policy import LoopPolicy
from polygateway.middleware.telemetry import (
    AttemptEmitter,
    Emitters,
    attempt_record,
    emitters_of,
)
from polygateway.middleware.waiting import ClassState, Sleep, Waiter, room_for
from polygateway.models import CallRecord
from polygateway.transport.http import TransientError, request_secrets, scrub
from polygateway.transport.wire import endpoint, source_headers

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from polygateway.config import SourceConfig
    from polygateway.models import AttemptRecord, CallOutcome

__all__ = [
    "FAILURE_TABLE",
    "AttemptContext",
    "AttemptFn",
    "Call",
    "CallOptions",
    "FailureRule",
    "LoopPolicy",
    "RetryMW",
    "Served",
    "StallClock",
    "Verdict",
    "backoff_delay",
    "verdict_for",
]

T = TypeVar("T")

_log = logging.getLogger("polygateway.retry")

_CANCELLED: Final = AttemptOutcome("cancelled")

_STALL_TIMER_SLACK_S: Final = 1e-3
"""A waiter's stall timer fires just past the window, so the strict ``>`` of the rule holds."""

_REOPEN_SLACK_S: Final = 1e-3
"""The head wakes just after a source reopens, so the backend's ``now < not_before`` is over."""

_Candidate = tuple["SourceConfig", SourceSpec]


class StallClock:
    """Per-call stall timer: counts only non-productive waiting.

    See research-wiki/designs/stall-budget.md §1.

    The stall budget governs waiting nobody else governs (429 back-off, polling
    for a permit, breaker cool-down); real attempts are already governed by
    ``max_attempts``, so their time is subtracted. Billing both budgets for
    the same seconds let one slow attempt end a call as stalled.

    One instance per call, owned by the call's ``Call``. Never make it an
    attribute of anything shared: concurrent calls sharing one would pollute
    each other's accounts.
    """

    __slots__ = ("_attempt_began", "_entered_at", "_now", "_productive_s")

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self._entered_at = now()
        self._productive_s = 0.0
        self._attempt_began = 0.0

    def stalled_s(self) -> float:
        """Seconds of non-productive waiting so far: elapsed minus time spent in attempts."""
        return self._now() - self._entered_at - self._productive_s

    def attempting(self) -> _Attempting:
        """Wrap one real attempt: an async context manager whose duration counts as productive.

        Arithmetic only, in ``finally``: nothing is swallowed, ``CancelledError``
        passes through untouched.
        """
        return _Attempting(self)

    def begin_attempt(self) -> None:
        """An attempt begins now (``attempting()`` without the context manager).

        The loop uses the pair because a stream's attempt ends when the stream
        closes, after the loop's own frame has returned the open stream.
        """
        self._attempt_began = self._now()

    def end_attempt(self) -> None:
        """The attempt begun last has ended: add its duration to the productive time."""
        self._productive_s += self._now() - self._attempt_began


class _Attempting:
    """``StallClock.attempting()``: ``begin_attempt`` on entry, ``end_attempt`` on exit."""

    __slots__ = ("_clock",)

    def __init__(self, clock: StallClock) -> None:
        self._clock = clock

    async def __aenter__(self) -> None:
        self._clock.begin_attempt()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._clock.end_attempt()


def backoff_delay(attempt: int, *, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Capped exponential back-off with equal jitter: a delay in ``[d/2, d]``.

    ``d = min(cap_s, base_s * 2 ** (attempt - 1))``, ``attempt`` counted from 1.

    Equal jitter rather than full jitter: the delay never collapses towards 0,
    so a saturated scope still accumulates non-productive time and the stall
    rule stays a real bound (research-wiki/designs/stall-budget.md, "Saturation
    still stalls"). Pure: one ``rng.random()``.
    """
    exponent = min(max(attempt, 1) - 1, 62)  # beyond 2**62 the cap has long won
    ceiling = min(cap_s, base_s * float(2**exponent))
    return ceiling / 2.0 + rng.random() * ceiling / 2.0


@dataclass(frozen=True, slots=True)
class _Failed:
    """A failed attempt, already released and recorded: what the loop does next depends on it."""

    source: str
    verdict: Verdict
    error: TransientError


class CallOptions(TypedDict, total=False):
    """What a call may ask of the loop, typed once for ``begin``, ``run`` and ``session``.

    ``op_name`` names the client operation (errors, telemetry); ``cost_tokens``
    is the tpm estimate; ``streaming`` marks a call whose attempt lasts while
    its stream is read. Defaults: those of ``Call``.
    """

    op_name: str
    cost_tokens: int
    fail_fast: bool
    deadline_s: float | None
    streaming: bool
    priority_class: str | None
    tenant: str | None


class RetryMW:
    """The governance loop for one scope; shared by the chat, embedding and OCR clients.

    Holds only what is fixed for the scope; each call's state is its ``Call``
    (``begin``). ``run`` serves a request/response call; ``session`` serves a
    call whose attempt outlives the loop (a stream).
    """

    __slots__ = (
        "_backend",
        "_by_name",
        "_classes",
        "_default_class",
        "_emitter",
        "_free_ttl",
        "_names",
        "_now",
        "_order",
        "_policy",
        "_rng",
        "_room",
        "_scope",
        "_secrets",
        "_sleep",
        "_slots",
        "_timeouts",
    )

    def __init__(
        self,
        *,
        scope: str,
        sources: Sequence[SourceConfig],
        policy: LoopPolicy,
        backend: Backend,
        now: Callable[[], float],
        sleep: Sleep,
        rng: random.Random,
        emitter: AttemptEmitter | None = None,
        priority_classes: Mapping[str, float] | None = None,
        default_priority_class: str | None = None,
        reserved_permits: Mapping[str, int] | None = None,
    ) -> None:
        sources = tuple(sources)
        self._scope = scope
        self._policy = policy
        self._backend = backend
        self._now = now
        self._sleep = sleep
        self._rng = rng
        # Records are built for the call's attempts anyway; emitters are called only if any.
        self._emitter: Emitters | None = (
            emitter if isinstance(emitter, Emitters) else emitters_of(emitter, None)
        )
        self._names = tuple(s.name for s in sources)
        self._by_name = {s.name: s for s in sources}
        # Defence in depth: transports scrub their messages already, but nothing
        # that reaches a record, a log or an error may carry a source's credentials,
        # in its headers or its URL (a query key, a password in base_url).
        found = {v for s in sources for v in request_secrets(source_headers(s), endpoint(s, ""))}
        self._secrets = tuple(sorted(found, key=len, reverse=True))
        # The process's queue of the scope's waiting calls, shared by every client of it.
        self._room = room_for(backend, scope)
        # Priority classes and their shares (none: one class, "", arrival order).
        self._classes: Mapping[str, float] = dict(priority_classes or {})
        self._default_class = default_priority_class or ""
        self._room.declare(self._classes, reserved_permits or {})
        # Each class's record in the room, where a call counts the permit it holds.
        self._slots = {
            name: self._room.slot(name) for name in (*self._classes, self._default_class)
        }
        specs = [
            SourceSpec(
                name=s.name,
                max_concurrency=s.max_concurrency,
                rpm=s.rpm,
                rpm_burst=s.rpm_burst,
                tpm=s.tpm,
                tpm_burst=s.tpm_burst,
                breaker_failures=policy.breaker_failures,
                cooldown_s=policy.breaker_cooldown_s,
                cooldown_max_s=policy.breaker_cooldown_max_s,
            )
            for s in sources
        ]
        self._order: SelectionOrder[_Candidate] = SelectionOrder(
            tuple(zip(sources, specs, strict=True)),
            priority=lambda c: c[0].priority,
            weight=lambda c: c[0].weight,
        )
        self._timeouts: Mapping[str, Timeouts] = {
            s.name: (float(s.timeout_s), float(s.ttft_timeout_s), float(s.stream_idle_timeout_s))
            for s in sources
        }
        # Without a deadline nothing clips the timeouts, and every call's candidates are
        # all the scope's sources: the TTL is one figure per kind of call.
        every = list(self._timeouts.values())
        self._free_ttl = (
            self._longest(every, streaming=False),
            self._longest(every, streaming=True),
        )

    def __repr__(self) -> str:
        return f"RetryMW(scope={self._scope!r}, sources={list(self._names)!r})"

    @property
    def scope(self) -> str:
        """The scope this loop governs."""
        return self._scope

    @property
    def sources(self) -> tuple[str, ...]:
        """Names of the scope's sources, in configuration order."""
        return self._names

    @property
    def backend(self) -> Backend:
        """The shared governance state this loop acquires from."""
        return self._backend

    @property
    def policy(self) -> LoopPolicy:
        """The numbers this loop runs by."""
        return self._policy

    # --- the two ways to run a call ----------------------------------------------

    def begin(self, **options: Unpack[CallOptions]) -> Call:
        """A new call on this scope.

        Raises ``RequestRejected`` for a deadline that is not a number, a
        priority class the scope does not declare, or a tenant that is not a string.
        """
        return Call(self, **options)

    async def run(self, attempt_fn: AttemptFn[T], **options: Unpack[CallOptions]) -> Served[T]:
        """Serve one request/response call; the permit is released before this returns."""
        call = self.begin(**options)
        served = await call.serve(attempt_fn)
        served.complete()
        await call.finish(served, None)
        return served

    def session(
        self, attempt_fn: AttemptFn[T], **options: Unpack[CallOptions]
    ) -> AbstractAsyncContextManager[Served[T]]:
        """Run the loop until an attempt succeeds, then hand it to the body with the permit held.

        The attempt (productive on the stall clock) lasts until the body ends,
        so a stream's attempt spans request to close. A body that raises
        releases with the matching outcome and re-raises; one that ends without
        ``complete()`` releases as cancelled. A body cut by the call's deadline
        (a timeout once no time is left) releases as cancelled and ends the
        call with ``AllSourcesExhausted(reason="deadline")`` instead.
        """
        return _Session(functools.partial(self.begin, **options), attempt_fn)

    # --- what is fixed for the scope ---------------------------------------------

    def check_flow(self, priority_class: object, tenant: object, op_name: str) -> tuple[str, str]:
        """A call's (priority class, tenant), checked: ``RequestRejected`` naming what is wrong.

        No class named: the scope's ``default_priority_class`` (``""`` for a
        scope without classes). No tenant: ``""``, one flow for all.
        """
        if tenant is not None and not isinstance(tenant, str):
            raise RequestRejected(
                f"{op_name}: tenant must be a string naming the call's flow, not {tenant!r}",
                scope=self._scope,
                sources=self._names,
            )
        if priority_class is None or priority_class == self._default_class:
            return self._default_class, tenant or ""
        if isinstance(priority_class, str) and priority_class in self._classes:
            return priority_class, tenant or ""
        known = ", ".join(sorted(self._classes))
        detail = f"its classes are {known}" if known else "it declares no priority classes"
        raise RequestRejected(
            f"{op_name}: priority_class {priority_class!r} is not a class of scope "
            f"{self._scope!r}: {detail}",
            scope=self._scope,
            sources=self._names,
        )

    def _candidates(self, tried: set[str]) -> Sequence[_Candidate]:
        """The sources in selection order, those a call has not tried yet first."""
        candidates = self._order.order(self._rng)
        if tried:
            candidates = untried_first(candidates, tried, name=_candidate_name)
        return candidates

    def _lease_ttl(
        self, deadline: Deadline, candidates: Sequence[_Candidate], *, streaming: bool
    ) -> float:
        """The TTL of the lease a call asks for now: fixed without a deadline, else clipped."""
        if not deadline.bounded:
            return self._free_ttl[streaming]
        every = [deadline.clip(self._timeouts[source.name]) for source, _ in candidates]
        return self._longest(every, streaming=streaming)

    def _longest(self, timeouts: Sequence[Timeouts], *, streaming: bool) -> float:
        """Lease TTL: the longest effective attempt among the candidates, plus the grace.

        A stream holds its lease until it closes and renews it every TTL/3
        when a chunk arrives; TTFT plus twice the idle timeout outlasts the
        longest gap between two renewals the transport allows.
        """
        longest = 0.0
        for timeout_s, ttft_s, idle_s in timeouts:
            longest = max(longest, ttft_s + 2.0 * idle_s if streaming else timeout_s)
        return longest + self._policy.lease_grace_s

    async def _snapshot_reopen(self) -> float | None:
        """Seconds until the earliest source reopens by time, from a snapshot of the backend."""
        try:
            snap = await self._backend.snapshot(self._scope)
        except GovernanceBackendError as exc:
            _log.warning("snapshot for retry_after_s failed: %s", exc)
            return None
        times: list[float] = []
        for _, spec in self._order.sources:
            s = snap.source(spec.name)
            if s is None:
                continue
            if s.breaker == "open" and s.reopen_in_s is not None:
                times.append(s.reopen_in_s)
            if s.paced_for_s:
                times.append(s.paced_for_s)
            rpm = spec.rpm
            if rpm and s.rpm_tokens is not None and s.rpm_tokens < 1:
                times.append((1.0 - s.rpm_tokens) * 60.0 / rpm)
        return min(times) if times else None

    def _text(self, error: BaseException) -> str:
        """An error's message with every credential of the scope's sources scrubbed."""
        return scrub(str(error), self._secrets)


def _candidate_name(candidate: _Candidate) -> str:
    """The source name of a candidate, for ``untried_first``."""
    return candidate[0].name


class Call:
    """One call's run of its scope's loop: the state that changes while it runs.

    Made per call (``RetryMW.begin``) and never shared: it owns the call's
    ``StallClock``, its ``Deadline``, its count of charged failures and
    consecutive 429s, the sources it tried, its attempt records and its
    place in the scope's queue. Its methods are the steps of the loop, in the
    words of research-wiki/ARCHITECTURE.md §2: ``pick``, ``wait``,
    ``attempt``, ``after_failure``, ``stalled``, ``exhausted``; ``serve``
    runs them until an attempt succeeds and ``finish`` ends that attempt.
    """

    __slots__ = (
        "_age",
        "_held",
        "_hint_at",
        "_hint_s",
        "_last",
        "_last_at",
        "_mw",
        "_pick_started_at",
        "_refused",
        "_releases",
        "_started_at",
        "_ticket",
        "_tried",
        "_waited_s",
        "_waiter",
        "call_id",
        "clock",
        "consecutive_429",
        "cost_tokens",
        "deadline",
        "fail_fast",
        "fails",
        "op_name",
        "priority_class",
        "records",
        "streaming",
        "tenant",
    )

    def __init__(
        self,
        mw: RetryMW,
        *,
        op_name: str = "call",
        cost_tokens: int = 0,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        streaming: bool = False,
        priority_class: str | None = None,
        tenant: str | None = None,
    ) -> None:
        if deadline_s is not None and not check_deadline_s(deadline_s):
            raise RequestRejected(
                f"{op_name}: deadline_s must be a finite, non-negative number of seconds, "
                f"not {deadline_s!r}",
                scope=mw._scope,
                sources=mw._names,
            )
        self.priority_class, self.tenant = mw.check_flow(priority_class, tenant, op_name)
        self._mw = mw
        self.op_name = op_name
        self.cost_tokens = cost_tokens
        self.fail_fast = fail_fast
        self.streaming = streaming
        self.call_id = os.urandom(8).hex()
        self.clock = StallClock(mw._now)  # the call's own: never shared
        self.deadline = Deadline.after(deadline_s, mw._now)
        self.fails = 0
        self.consecutive_429 = 0
        self.records: list[AttemptRecord] = []
        self._tried: set[str] = set()
        self._refused: set[str] = set()  # sources that refused: 401/402/403/404, no credit
        self._started_at = self._pick_started_at = mw._now()  # the search for a permit began
        self._waited_s = 0.0  # in the queue and in back-offs
        self._ticket = mw._room.ticket()  # the call's place in the arrival order
        self._waiter: Waiter | None = None
        # The room's count of releases as the call last asked from outside the queue.
        self._releases: int | None = None
        self._held: ClassState | None = None  # the class the held permit is counted in, if any
        self._last: AcquireResult | None = None  # the latest acquire, for retry_after_s
        self._last_at = 0.0
        self._age: float | None = None  # the progress age read in this iteration, if any
        self._hint_s: float | None = None  # the upstream's latest back-off (clamped), if any
        self._hint_at = 0.0

    def __repr__(self) -> str:
        return (
            f"Call({self.op_name!r}, scope={self._mw._scope!r}, attempts={len(self.records)}, "
            f"fails={self.fails})"
        )

    # --- the loop ----------------------------------------------------------------

    async def serve(self, attempt_fn: AttemptFn[T]) -> Served[T]:
        """Run the loop until an attempt succeeds; it returns with its permit still held.

        The attempt stays open on the stall clock until ``finish``. Whatever
        ends the call here (its final error, a cancellation) gives up its
        place in the queue.
        """
        # Chat only: 429s are not charged, so the stall rule is what bounds a saturated scope.
        stall_first = self._mw._policy.exempt_429
        try:
            while True:
                self._age = None
                if stall_first and await self.stalled():
                    raise await self.exhausted("stalled")
                if self.deadline.over():
                    raise await self.exhausted("deadline")
                lease = await self.pick()
                if lease is None:
                    await self.wait()
                    continue
                if self.deadline.over():
                    # The acquire outlasted the time left (a slow shared backend): the
                    # attempt could only time out, so the permit goes back unused.
                    await self._release(lease, _CANCELLED)
                    raise await self.exhausted("deadline")
                result = await self.attempt(lease, attempt_fn)
                if isinstance(result, Served):
                    return result
                await self.after_failure(result)
        except BaseException as exc:
            self.leave()
            self._ended(_outcome_of(exc), None)
            raise

    async def finish(self, served: Served[Any], exc: BaseException | None) -> None:
        """The served attempt's body has ended (``exc``: how): release, record, end the attempt.

        Raises ``AllSourcesExhausted(reason="deadline")`` from ``exc`` when the
        body was cut by the call's deadline; any other ``exc`` is the caller's
        to re-raise.
        """
        cut = False
        try:
            try:
                cut = await self._release_served(served, exc)
            finally:
                self.clock.end_attempt()
            if cut:
                # Cut at the call's deadline: the call ends as the loop ends any call
                # whose time is up, with the stream's attempt among its records.
                raise await self.exhausted("deadline") from exc
        finally:
            self.leave()
            if cut:
                outcome: CallOutcome = "deadline"
            elif exc is None:
                outcome = "served" if served.completed else "cancelled"
            elif isinstance(exc, TransientError):
                outcome = "interrupted"
            else:
                outcome = _outcome_of(exc)
            self._ended(outcome, served.source)

    def leave(self, *, granted: bool = False) -> None:
        """Give up the call's place in the queue, if it holds one (``granted``: with a permit)."""
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            self._mw._room.leave(waiter, granted=granted)

    # --- the steps ---------------------------------------------------------------

    async def pick(self) -> Lease | None:
        """A lease on the best runnable source, or ``None`` (not our turn, or nothing runnable).

        One ``acquire`` over every source in selection order, this call's
        untried ones first: a busy or closed tier spills over to the next at
        no extra cost. With nobody waiting (and room for another acquire) a
        call asks at once; otherwise it takes its place in the queue and only
        the head asks. ``fail_fast`` calls never queue: they ask once.
        """
        mw = self._mw
        room = mw._room
        waiter = self._waiter
        if waiter is None and not self.fail_fast and not room.may_ask_at_once:
            waiter = self._waiter = room.enter(
                self._ticket, priority_class=self.priority_class, tenant=self.tenant
            )
        if waiter is not None and not room.is_head(waiter):
            return None
        candidates = mw._candidates(self._tried)
        ttl_s = mw._lease_ttl(self.deadline, candidates, streaming=self.streaming)
        slot = mw._slots[self.priority_class]
        # A call outside the queue counts as asking in its class: a fleet's backend
        # registers the process under the classes with calls waiting or asking.
        outside = int(waiter is None)
        # Outside the queue no release can wake this call: ``wait`` looks for one it missed.
        self._releases = room.releases if outside else None
        room.asking += 1
        slot.asking += outside
        specs = [spec for _, spec in candidates]
        try:
            if self.priority_class:
                # A call of a scope with classes names its class: a fleet's backend counts
                # the permits of a class with a floor, and keeps the process registered
                # where calls are left once this one is granted. A scope without classes
                # keeps the protocol's older form, so backends without the keyword serve it.
                result = await mw._backend.acquire(
                    mw._scope,
                    specs,
                    cost_tokens=self.cost_tokens,
                    ttl_s=ttl_s,
                    priority_class=self.priority_class,
                )
            else:
                result = await mw._backend.acquire(
                    mw._scope, specs, cost_tokens=self.cost_tokens, ttl_s=ttl_s
                )
        except GovernanceBackendError as exc:
            # Fail closed together: the calls queued behind this one would each
            # wait out the backend's timeout in turn otherwise.
            room.fail_all(exc, but=waiter)
            raise
        finally:
            room.asking -= 1
            slot.asking -= outside
        self._last = result
        lease = result.lease
        if lease is None:
            self._last_at = mw._now()  # retry_after_s is aged from here
            return None
        self.leave(granted=True)  # first: a grant below the class's floor is not charged
        self._held = slot
        room.hold(slot)
        return lease

    async def wait(self) -> None:
        """Nothing runnable: fail fast, apply the stall rule, or wait our turn in the queue.

        The head polls every ``[0.5p, 1.0p]`` of ``poll_interval_s`` (jitter
        against herds), is woken early by a release, and wakes when the
        earliest source that refused it reopens by time (a pause's end, a
        breaker's cool-down, a rate window) if that comes sooner. A call behind
        the head sleeps until promoted or until the stall rule could next hold
        for it (one timer, no polling). A call that asked from outside the
        queue and was refused while a release was announced asks again at
        once if it queues as head: that wake-up could not reach it.
        """
        if self.fail_fast:
            # Never the stall rule: the caller asked not to wait at all.
            raise await self.exhausted("no_runnable")
        if await self.stalled():
            raise await self.exhausted("stalled")
        mw = self._mw
        room = mw._room
        waiter = self._waiter
        if waiter is None:
            waiter = self._waiter = room.enter(
                self._ticket, priority_class=self.priority_class, tenant=self.tenant
            )
        releases, self._releases = self._releases, None
        if room.is_head(waiter):
            if releases is not None and releases != room.releases:
                # A permit was freed while this call asked from outside the queue: its
                # wake-up went to nobody, or to a call this one now queues ahead of by
                # arrival. Ask again now rather than a poll later.
                return
            poll = mw._policy.poll_interval_s
            timeout = mw._rng.uniform(0.5 * poll, poll)
            reopen = self._reopen_in()
            if reopen is not None and reopen + _REOPEN_SLACK_S < timeout:
                timeout = reopen + _REOPEN_SLACK_S
        else:
            timeout = self._stall_timer_s()
        began = mw._now()
        try:
            await room.wait(waiter, self.deadline.bound(timeout), mw._sleep)
        finally:
            self._waited_s += mw._now() - began
        failure = waiter.failure
        if failure is not None:
            raise GovernanceBackendError(
                f"the backend failed for a call ahead of this one in the queue: {failure}",
                operation=getattr(failure, "operation", "acquire"),
                scope=mw._scope,
                sources=mw._names,
            ) from failure

    async def attempt(self, lease: Lease, attempt_fn: AttemptFn[T]) -> Served[T] | _Failed:
        """One real request on a held permit, productive time on the stall clock.

        Success comes back as ``Served``, the permit held and the attempt
        open (``finish`` ends both). A failure is released and recorded here,
        inside the attempt, so telemetry counts as productive.
        """
        mw = self._mw
        source = mw._by_name[lease.source]
        self._tried.add(source.name)
        deadline = self.deadline
        timeout_s, ttft_s, idle_s = deadline.clip(mw._timeouts[source.name])
        clock = self.clock
        clock.begin_attempt()
        started = mw._now()
        ctx = AttemptContext(
            call_id=self.call_id,
            attempt=len(self.records) + 1,
            lease=lease,
            timeout_s=timeout_s,
            ttft_timeout_s=ttft_s,
            idle_timeout_s=idle_s,
            started_at=started,
            permit_wait_s=max(0.0, started - self._pick_started_at),
            stalled_s=clock.stalled_s(),
            deadline_in_s=deadline.left_or_none(),
        )
        emitter = mw._emitter
        try:
            # Telemetry's headers for the request (trace context), asked as the attempt begins.
            if emitter is not None and emitter.wants_headers:
                ctx.headers = emitter.headers_for(
                    ctx, mw._scope, self.op_name, started - self._started_at
                )
            value = await attempt_fn(source, ctx)
        except TransientError as error:
            try:
                if error.timeout and self._cut(ctx):
                    verdict = DEADLINE_CUT
                else:
                    verdict = self._verdict(error, source.name)
                try:
                    await self._release(lease, verdict.outcome)
                finally:
                    # Recorded even if the caller is cancelled during the release: one
                    # record per attempt, whatever instant the cancellation lands at.
                    self._record(ctx, verdict.outcome.kind, error.status_code, mw._text(error))
            finally:
                clock.end_attempt()
            return _Failed(source.name, verdict, error)
        except BaseException:
            # Cancellation, the caller's timeout, or a bug in the attempt function:
            # the permit goes back at once, then the exception passes on untouched.
            try:
                try:
                    await self._release(lease, _CANCELLED)
                finally:
                    self._record(ctx, "cancelled", None, "cancelled")
            finally:
                clock.end_attempt()
            raise
        return Served(value, ctx, self.records, mw._backend, mw._now)

    async def after_failure(self, failed: _Failed) -> None:
        """Apply the table's verdict to the loop: raise, charge, then back off."""
        mw = self._mw
        policy = mw._policy
        verdict, error = failed.verdict, failed.error
        if verdict is DEADLINE_CUT:
            # No time is left: another attempt could only time out at once.
            raise await self.exhausted("deadline")
        if verdict.raises:
            raise RequestRejected(
                f"{self.op_name}: {failed.source} rejected the request: {mw._text(error)}",
                scope=mw._scope,
                sources=(failed.source,),
                status_code=error.status_code,
            )
        if verdict.outcome.kind == "source_misconfigured":
            self._refused.add(failed.source)
        if verdict.charged:
            self.fails += 1
            self.consecutive_429 = 0
            # Every source refused this call's credentials, account or model and
            # is tripped long: waiting out its cool-down cannot serve the call.
            if self.fails >= policy.max_attempts or self._refused.issuperset(mw._names):
                raise await self.exhausted("retry_exhausted")
            step = self.fails
        else:
            self.consecutive_429 += 1
            hinted = error.retry_after_s
            if hinted is not None and hinted > 0.0:
                # An exempt 429 that named its back-off: the source is paused for exactly
                # that long, fleet-wide, and reopens through one probe. The call moves on
                # at once: to another source, or into the queue until the reopen, where
                # its wait is non-productive and bills the stall clock. (A hint of 0 asks
                # for nothing: the call's own back-off keeps it from spinning.)
                self._look_again()
                return
            # An exempt 429 without a hint: free of charge, but a saturated scope still
            # backs off exponentially, which is what lets the stall rule bound it.
            step = self.consecutive_429
        delay = backoff_delay(
            step, base_s=policy.backoff_base_s, cap_s=policy.backoff_cap_s, rng=mw._rng
        )
        # Outside any attempt: back-off is non-productive and bills the stall clock.
        began = mw._now()
        try:
            await mw._sleep(self.deadline.bound(delay))
        finally:
            self._waited_s += mw._now() - began
        self._look_again()

    # --- the stall rule (research-wiki/designs/stall-budget.md) --------------------

    async def stalled(self) -> bool:
        """The stall rule: this call's non-productive time AND the scope's progress age exceed it.

        The local measure comes first, so a call that has not waited long
        never asks the backend; the age is asked at most once per iteration
        of the loop, of the scope's waiting room, which shares one backend
        read among the calls that ask (``WaitingRoom.progress_age``). ``inf``
        (never served) counts as exceeded (research-wiki/designs/stall-budget.md,
        "Never served counts as stale"). A backend failure reading the age
        fails the call closed.
        """
        mw = self._mw
        window = mw._policy.stall_window_s
        if self.clock.stalled_s() <= window:
            return False
        if self._age is None:
            self._age = await mw._room.progress_age(
                mw._backend, mw._scope, mw._now, known_below=window
            )
        return self._age > window

    def _stall_timer_s(self) -> float:
        """How long a call behind the head sleeps before the stall rule could first hold for it.

        Until its own window is spent; once it is, until the scope's progress
        would go stale if nobody served meanwhile (at least one poll interval).
        """
        policy = self._mw._policy
        window = policy.stall_window_s
        local_left = window - self.clock.stalled_s()
        if local_left >= 0.0:
            return local_left + _STALL_TIMER_SLACK_S
        age = self._age if self._age is not None else 0.0
        return max(window - age + _STALL_TIMER_SLACK_S, policy.poll_interval_s)

    # --- the end of a call ---------------------------------------------------------

    async def exhausted(self, reason: ExhaustedReason) -> AllSourcesExhausted:
        """The error that ends a call, with the time until the earliest source reopens."""
        mw = self._mw
        message = f"{self.op_name}: all sources exhausted: {_EXPLAINED[reason]}"
        last = self.records[-1] if self.records else None
        if last is not None and last.error:
            # Already scrubbed of credentials when the record was made.
            message += f"; last: {last.source}: {last.error}"
        return AllSourcesExhausted(
            message,
            reason=reason,
            scope=mw._scope,
            sources=mw._names,
            retry_after_s=await self._retry_after(),
            attempts=tuple(self.records),
        )

    async def _retry_after(self) -> float | None:
        """Seconds until a source may serve again, or ``None`` when nothing says.

        From this call's last refused acquire when it was refused by time
        (aged by the time since), else from a snapshot of the backend. When
        neither names a time still to come and an upstream named a back-off
        during the call: what is left of it, or the whole hint once it has run
        out (a source that keeps refusing asks again for as long).
        """
        last = self._last
        if last is None or last.lease is not None:
            reopen = await self._mw._snapshot_reopen()
        else:
            reopen = self._reopen_in()
        hint_s = self._hint_s
        if (reopen is None or reopen <= 0.0) and hint_s is not None:
            left = hint_s - (self._mw._now() - self._hint_at)
            reopen = left if left > 0.0 else hint_s
        return reopen

    # --- helpers -----------------------------------------------------------------

    def _look_again(self) -> None:
        """After a failure: the search for a permit starts again, at the tail of the arrivals."""
        self._pick_started_at = self._mw._now()
        self._ticket = self._mw._room.ticket()

    def _reopen_in(self) -> float | None:
        """Seconds until a source that refused the call's last acquire reopens, or ``None``."""
        last = self._last
        if last is None or last.lease is not None:
            return None
        reopen = last.retry_after_s
        return None if reopen is None else max(0.0, reopen - (self._mw._now() - self._last_at))

    def _cut(self, ctx: AttemptContext) -> bool:
        """Whether an attempt's timeout was the call's deadline rather than its source's."""
        own_timeout_s = self._mw._timeouts[ctx.source][0]
        return self.deadline.cut(ctx.timeout_s, own_timeout_s, streaming=self.streaming)

    def _verdict(self, error: TransientError, source: str) -> Verdict:
        """The table's verdict on a failure, its back-off clamped to the stall window and kept."""
        mw = self._mw
        window = mw._policy.stall_window_s
        hint = error.retry_after_s
        if hint is not None and hint > window:
            _log.warning(
                "%s asked to be left alone for %.0f s; paused for the stall window "
                "(%.0f s) instead",
                source,
                hint,
                window,
            )
        verdict = verdict_for(error, exempt_429=mw._policy.exempt_429, max_pause_s=window)
        kept = verdict.outcome.retry_after_s
        if kept is not None:
            # For the call's final error (retry_after_s).
            self._hint_s = kept
            self._hint_at = mw._now()
        return verdict

    async def _release_served(self, served: Served[Any], exc: BaseException | None) -> bool:
        """Release the serving attempt's permit according to how its body ended; record it.

        Returns whether the body was cut by the call's deadline.
        """
        mw = self._mw
        ctx = served.ctx
        status: int | None = None
        error: str | None = None
        cut = False
        if isinstance(exc, TransientError):
            cut = exc.timeout and self._cut(ctx)
            verdict = DEADLINE_CUT if cut else self._verdict(exc, ctx.source)
            outcome = verdict.outcome
            status, error = exc.status_code, mw._text(exc)
        elif exc is None and served.completed:
            used = ctx.usage.total_tokens if ctx.usage is not None else 0
            hint = ctx.hint
            # A success that announced its source's window spent pauses the source.
            pause = (
                None
                if hint is None
                else clamped_hint(hint.exhausted_for_s(self.cost_tokens), mw._policy.stall_window_s)
            )
            outcome = AttemptOutcome("success", retry_after_s=pause, tokens_used=used or None)
        else:
            outcome = _CANCELLED
            error = "cancelled"
        try:
            await self._release(ctx.lease, outcome)
        finally:
            # A cancellation during the release must not lose the served attempt's record.
            self._record(ctx, outcome.kind, status, error)
        return cut

    def _release(self, lease: Lease, outcome: AttemptOutcome) -> Coroutine[Any, Any, None]:
        """Free the held permit (await the result): the one place a call gives its lease back.

        The room's count of the class goes down first, so the room's choice of
        head, made as the backend announces the freed permit, already sees it.
        Not a coroutine itself: the release is the backend's coroutine, with no
        frame of ours around it on a path every call takes.
        """
        mw = self._mw
        held = self._held
        if held is not None:
            self._held = None
            mw._room.unhold(held)
        return release_quietly(mw._backend, lease, outcome, mw._text)

    def _record(
        self,
        ctx: AttemptContext,
        outcome: str,
        status_code: int | None,
        error: str | None,
    ) -> None:
        """Keep one attempt's record on the call and hand it to telemetry, inside the attempt."""
        mw = self._mw
        record = attempt_record(
            ctx,
            scope=mw._scope,
            outcome=outcome,
            status_code=status_code,
            error=error,
            ended_at=mw._now(),
        )
        self.records.append(record)
        emitter = mw._emitter
        if emitter is not None and emitter.recording():
            emitter.emit_attempt(record)

    def _ended(self, outcome: CallOutcome, source: str | None) -> None:
        """The call is over: hand its record to telemetry (every call, however it ended)."""
        mw = self._mw
        emitter = mw._emitter
        if emitter is None or not emitter.recording():
            return
        records = self.records
        emitter.emit_call(
            CallRecord(
                call_id=self.call_id,
                scope=mw._scope,
                operation=self.op_name,
                outcome=outcome,
                attempts=len(records),
                source=source,
                duration_s=mw._now() - self._started_at,
                waited_s=self._waited_s,
                stalled_s=self.clock.stalled_s(),
                prompt_tokens=sum(r.prompt_tokens for r in records),
                completion_tokens=sum(r.completion_tokens for r in records),
            )
        )


class _Session(Generic[T]):
    """What ``RetryMW.session`` returns: the call's loop on entry, its ``finish`` on exit."""

    __slots__ = ("_attempt_fn", "_begin", "_call", "_served")

    def __init__(self, begin: Callable[[], Call], attempt_fn: AttemptFn[T]) -> None:
        self._begin = begin
        self._attempt_fn = attempt_fn
        self._call: Call | None = None
        self._served: Served[T] | None = None

    async def __aenter__(self) -> Served[T]:
        call = self._call = self._begin()
        served = self._served = await call.serve(self._attempt_fn)
        return served

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        call, served = self._call, self._served
        self._call = self._served = None
        if call is not None and served is not None:
            # The body's exception (stream cut, consumer gone, cancellation) passes
            # on after the release, which records how the body ended.
            await call.finish(served, exc)


def _outcome_of(exc: BaseException) -> CallOutcome:
    """How a call that ended with ``exc`` ended, for its record."""
    if isinstance(exc, AllSourcesExhausted):
        return exc.reason
    if isinstance(exc, RequestRejected):
        return "rejected"
    if isinstance(exc, GovernanceBackendError):
        return "backend_error"
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return "cancelled"
    return "error"


_EXPLAINED: Final[Mapping[ExhaustedReason, str]] = {
    "retry_exhausted": "every charged attempt failed",
    "stalled": "this call waited past the stall window and the scope made no progress",
    "no_runnable": "no source could take the call at once (fail_fast)",
    "deadline": "the call's deadline passed",
}
