"""The one governance loop every client runs its calls through (DESIGN.md section 5).

One call, whatever the client::

    clock = StallClock(now)                          one per call, never an attribute
    loop:
        exempt_429 and stall rule            -> AllSourcesExhausted("stalled")
        no time left before the deadline     -> AllSourcesExhausted("deadline")
        _pick_runnable: selection order + one backend.acquire (or wait our turn)
        nothing runnable -> _on_no_runnable: fail_fast -> "no_runnable";
                            stall rule -> "stalled"; else wait in the scope's FIFO
        async with clock.attempting():       productive time: request, release, telemetry
            _attempt(...)
        success -> return; request_rejected -> RequestRejected at once
        exempt 429 -> not charged; else fails += 1 -> "retry_exhausted" at max_attempts
        back-off sleep, then back to the tail of the waiting room

The stall budget (seed design "stall budget", DESIGN.md section 5) bills only
non-productive time: a real attempt is governed by ``max_attempts``, so it is
subtracted from the call's elapsed time. Embedding and OCR run the same loop
with ``exempt_429=False``: every failure is charged and the main-loop stall
check is off, exactly as the seed design section 5.4 says.

A stream is one attempt that outlives the loop: ``session()`` hands the open
attempt to its body with the permit still held and ``attempting()`` still
open, and releases when the body ends (see ``Served``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypeVar

from polygateway.backends.base import AcquireResult, AttemptOutcome, Backend, Lease, SourceSpec
from polygateway.errors import (
    AllSourcesExhausted,
    ExhaustedReason,
    GovernanceBackendError,
    RequestRejected,
)
from polygateway.governance.selection import order_candidates, untried_first
from polygateway.middleware.attempt import (
    AttemptContext,
    AttemptFn,
    Served,
    keep_until_done,
    shielded,
)
from polygateway.middleware.classify import FAILURE_TABLE, FailureRule, Verdict, verdict_for
from polygateway.middleware.policy import LoopPolicy
from polygateway.middleware.telemetry import Emitter, NullEmitter
from polygateway.models import AttemptRecord
from polygateway.transport.http import TransientError, scrub, secrets_in
from polygateway.transport.wire import source_headers

if TYPE_CHECKING:
    from polygateway.backends.waiting import Waiter, WaitingRoom
    from polygateway.config import SourceConfig

__all__ = [
    "FAILURE_TABLE",
    "AttemptContext",
    "AttemptFn",
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

Sleep = Callable[[float], Awaitable[None]]

_log = logging.getLogger("polygateway.retry")

_DEADLINE_EPSILON_S: Final = 1e-3
"""No attempt starts with less time left than this: it could only time out."""

_MAX_ASKING: Final = 16
"""Acquires one scope runs at once in one process before new calls queue instead of asking.

A burst of calls all find the waiting room empty; without a bound each would
ask the backend at once, and a shared backend fails closed under thousands
of concurrent acquires (Redis: its connection pool is exhausted, replies time
out). Past the bound, calls queue and the room's head asks for them in turn.
"""

_STALL_TIMER_SLACK_S: Final = 1e-3
"""A waiter's stall timer fires just past the window, so the strict ``>`` of the rule holds."""


class StallClock:
    """Per-call stall timer: counts only non-productive waiting (seed design section 3.1).

    The stall budget governs waiting nobody else governs (429 back-off, polling
    for a permit, breaker cool-down); real attempts are already governed by
    ``max_attempts``, so their time is subtracted. Billing both budgets for
    the same seconds was the root cause the seed design fixes.

    One instance per call. Never make it an attribute: concurrent calls
    sharing one would pollute each other's accounts.
    """

    __slots__ = ("_entered_at", "_now", "_productive_s")

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self._entered_at = now()
        self._productive_s = 0.0

    def stalled_s(self) -> float:
        """Seconds of non-productive waiting so far: elapsed minus time spent in attempts."""
        return self._now() - self._entered_at - self._productive_s

    @contextlib.asynccontextmanager
    async def attempting(self) -> AsyncIterator[None]:
        """Wrap one real attempt; its duration counts as productive (the ``_attempt`` boundary)."""
        started = self._now()
        try:
            yield
        finally:
            # Arithmetic only: nothing is swallowed, CancelledError passes through untouched.
            self._productive_s += self._now() - started


def _valid_deadline(deadline_s: object) -> bool:
    """A per-call deadline is a real number of seconds, finite and not negative (NaN is not)."""
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float):
        return False
    return math.isfinite(deadline_s) and deadline_s >= 0.0


def backoff_delay(attempt: int, *, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Capped exponential back-off with equal jitter: a delay in ``[d/2, d]``.

    ``d = min(cap_s, base_s * 2 ** (attempt - 1))``, ``attempt`` counted from 1.

    Equal jitter rather than full jitter: the delay never collapses towards 0,
    so a saturated scope still accumulates non-productive time and the stall
    rule stays a real bound (seed design section 3.5). Pure: one ``rng.random()``.
    """
    exponent = min(max(attempt, 1) - 1, 62)  # beyond 2**62 the cap has long won
    ceiling = min(cap_s, base_s * float(2**exponent))
    return ceiling / 2.0 + rng.random() * ceiling / 2.0


# --- One call's state ------------------------------------------------------------


@dataclass(slots=True, eq=False)
class _Call:
    """One call's private loop state (never shared between calls).

    The call's ``StallClock`` is not kept here: it is a local of the loop,
    handed to each step that reads it, as the seed design prescribes.
    """

    op_name: str
    cost_tokens: int
    fail_fast: bool
    streaming: bool
    deadline_at: float | None
    pick_started_at: float  # when the search for this attempt's permit began
    call_id: str = field(default_factory=lambda: os.urandom(8).hex())
    fails: int = 0
    consecutive_429: int = 0
    tried: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)  # sources that answered 401/403/404
    records: list[AttemptRecord] = field(default_factory=list)
    waiter: Waiter | None = None
    last: AcquireResult | None = None  # this call's latest acquire, for retry_after_s
    last_at: float = 0.0
    age: float | None = None  # progress age read in this iteration, if any


@dataclass(frozen=True, slots=True)
class _Failed:
    """A failed attempt, already released and emitted: what the loop does next depends on it."""

    source: str
    verdict: Verdict
    error: TransientError


class RetryMW:
    """The governance loop for one scope; shared by the chat, embedding and OCR clients.

    ``run`` serves a request/response call; ``session`` serves a call whose
    attempt outlives the loop (a stream). Both are the same loop.
    """

    __slots__ = (
        "_backend",
        "_by_name",
        "_emitter",
        "_names",
        "_now",
        "_policy",
        "_rng",
        "_scope",
        "_secrets",
        "_sleep",
        "_sources",
        "_specs",
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
        emitter: Emitter | None = None,
    ) -> None:
        self._scope = scope
        self._sources = tuple(sources)
        self._policy = policy
        self._backend = backend
        self._now = now
        self._sleep = sleep
        self._rng = rng
        self._emitter: Emitter = emitter if emitter is not None else NullEmitter()
        self._names = tuple(s.name for s in self._sources)
        self._by_name = {s.name: s for s in self._sources}
        # Defence in depth: transports scrub their messages already, but nothing
        # that reaches a record, a log or an error may carry a source's credentials.
        self._secrets = tuple(
            sorted({v for s in self._sources for v in secrets_in(source_headers(s))}, key=len)[::-1]
        )
        self._specs = {
            s.name: SourceSpec(
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
            for s in self._sources
        }

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

    async def run(
        self,
        attempt_fn: AttemptFn[T],
        *,
        cost_tokens: int = 0,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        op_name: str = "call",
    ) -> Served[T]:
        """Serve one request/response call; the permit is released before this returns."""
        async with self.session(
            attempt_fn,
            cost_tokens=cost_tokens,
            fail_fast=fail_fast,
            deadline_s=deadline_s,
            op_name=op_name,
        ) as served:
            served.complete()
        return served

    @contextlib.asynccontextmanager
    async def session(
        self,
        attempt_fn: AttemptFn[T],
        *,
        cost_tokens: int = 0,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        op_name: str = "call",
        streaming: bool = False,
    ) -> AsyncIterator[Served[T]]:
        """Run the loop until an attempt succeeds, then hand it to the body with the permit held.

        The attempt (and ``attempting()``) lasts until the body ends, so a
        stream's attempt spans request to close. A body that raises releases
        with the matching outcome and re-raises; one that ends without
        ``complete()`` releases as cancelled.
        """
        if deadline_s is not None and not _valid_deadline(deadline_s):
            raise RequestRejected(
                f"{op_name}: deadline_s must be a finite, non-negative number of seconds, "
                f"not {deadline_s!r}",
                scope=self._scope,
                sources=self._names,
            )
        clock = StallClock(self._now)  # one per call, never an attribute
        started = self._now()
        call = _Call(
            op_name=op_name,
            cost_tokens=cost_tokens,
            fail_fast=fail_fast,
            streaming=streaming,
            deadline_at=None if deadline_s is None else started + deadline_s,
            pick_started_at=started,
        )
        room = self._backend.waiting_room(self._scope)
        try:
            while True:
                call.age = None
                # Chat only: 429s are not charged, so this is what bounds a saturated scope.
                if self._policy.exempt_429 and await self._stalled(call, clock):
                    raise await self._exhausted(call, "stalled")
                left = self._time_left(call)
                if left is not None and left <= _DEADLINE_EPSILON_S:
                    raise await self._exhausted(call, "deadline")
                lease = await self._pick_runnable(call, room)
                if lease is None:
                    await self._on_no_runnable(call, room, clock)
                    continue
                async with clock.attempting():
                    result = await self._attempt(call, clock, lease, attempt_fn)
                    if isinstance(result, Served):
                        try:
                            yield result
                        except BaseException as exc:
                            # Clean-up only: the body's exception (stream cut, consumer
                            # gone, cancellation) passes on after the release.
                            await self._finish(call, result, exc)
                            raise
                        await self._finish(call, result, None)
                        return
                await self._after_failure(call, result)
        finally:
            if call.waiter is not None:
                room.leave(call.waiter)
                call.waiter = None

    # --- the steps of the loop -------------------------------------------------

    def _time_left(self, call: _Call) -> float | None:
        """Seconds before the call's deadline, or ``None`` without one."""
        return None if call.deadline_at is None else call.deadline_at - self._now()

    async def _stalled(self, call: _Call, clock: StallClock) -> bool:
        """The stall rule: this call's non-productive time AND the scope's progress age exceed it.

        The local measure comes first, so a call that has not waited long
        never asks the backend; the age is read at most once per iteration.
        ``inf`` (never served) counts as exceeded (seed design section 3.4).
        """
        stall = self._policy.stall_window_s
        if clock.stalled_s() <= stall:
            return False
        if call.age is None:
            call.age = await self._backend.progress_age_s(self._scope)
        return call.age > stall

    def _timeouts(self, source: SourceConfig, call: _Call) -> tuple[float, float, float]:
        """(timeout, TTFT, idle) of one attempt at ``source``, each clipped to the time left."""
        timeout_s = float(source.timeout_s)
        ttft_s = float(source.ttft_timeout_s)
        idle_s = float(source.stream_idle_timeout_s)
        left = self._time_left(call)
        if left is not None:
            timeout_s, ttft_s, idle_s = min(timeout_s, left), min(ttft_s, left), min(idle_s, left)
        return timeout_s, ttft_s, idle_s

    def _ttl(self, call: _Call, candidates: Sequence[SourceConfig]) -> float:
        """Lease TTL: the longest effective attempt among the candidates, plus the grace.

        A stream holds its lease until it closes and renews it every TTL/3
        when a chunk arrives; TTFT plus twice the idle timeout outlasts the
        longest gap between two renewals the transport allows.
        """
        longest = 0.0
        for source in candidates:
            timeout_s, ttft_s, idle_s = self._timeouts(source, call)
            longest = max(longest, ttft_s + 2.0 * idle_s if call.streaming else timeout_s)
        return longest + self._policy.lease_grace_s

    async def _pick_runnable(self, call: _Call, room: WaitingRoom) -> Lease | None:
        """A lease on the best runnable source, or ``None`` (not our turn, or nothing runnable).

        One ``acquire`` over every source in selection order, this call's
        untried ones first: a busy or closed tier spills over to the next at
        no extra cost. Fast path: with nobody waiting (and fewer than
        ``_MAX_ASKING`` acquires in flight) a call asks at once; otherwise it
        joins the tail of the FIFO and only the head asks. ``fail_fast`` calls
        never queue: they ask once.
        """
        busy = not room.empty or room.asking >= _MAX_ASKING
        if call.waiter is None and not call.fail_fast and busy:
            call.waiter = room.enter()
        if call.waiter is not None and not room.is_head(call.waiter):
            return None
        ordered = order_candidates(
            self._sources,
            priority=lambda s: s.priority,
            weight=lambda s: s.weight,
            rng=self._rng,
        )
        candidates = untried_first(ordered, call.tried)
        acquire = self._backend.acquire(
            self._scope,
            [self._specs[s.name] for s in candidates],
            cost_tokens=call.cost_tokens,
            ttl_s=self._ttl(call, candidates),
        )
        room.asking += 1
        try:
            if self._backend.cancel_safe:
                result = await acquire
            else:
                acquiring = asyncio.ensure_future(acquire)
                try:
                    result = await asyncio.shield(acquiring)
                except asyncio.CancelledError:
                    # The backend may grant the lease after we have gone: give it back.
                    keep_until_done(asyncio.ensure_future(self._release_late(acquiring)))
                    raise
        except GovernanceBackendError as exc:
            # Fail closed together: the calls queued behind this one would each
            # wait out the backend's timeout in turn otherwise.
            room.fail_all(exc, but=call.waiter)
            raise
        finally:
            room.asking -= 1
        call.last = result
        call.last_at = self._now()
        if result.lease is None:
            return None
        if call.waiter is not None:
            room.leave(call.waiter)
            call.waiter = None
        return result.lease

    async def _release_late(self, acquiring: asyncio.Future[AcquireResult]) -> None:
        """Release the lease of an acquire whose caller was cancelled while it ran."""
        result = await acquiring
        if result.lease is not None:
            await self._backend.release(result.lease, AttemptOutcome("cancelled"))

    async def _on_no_runnable(self, call: _Call, room: WaitingRoom, clock: StallClock) -> None:
        """Nothing runnable: fail fast, apply the stall rule, or wait our turn in the FIFO.

        The head polls every ``[0.5p, 1.0p]`` of ``poll_interval_s`` (jitter
        against herds) and is woken early by a local release. A call behind
        the head sleeps until promoted or until its own stall deadline (one
        timer, no polling), then checks the stall rule again.
        """
        if call.fail_fast:
            # Never the stall rule: the caller asked not to wait at all.
            raise await self._exhausted(call, "no_runnable")
        if await self._stalled(call, clock):
            raise await self._exhausted(call, "stalled")
        if call.waiter is None:
            call.waiter = room.enter()
        stall = self._policy.stall_window_s
        poll = self._policy.poll_interval_s
        if room.is_head(call.waiter):
            timeout = self._rng.uniform(0.5 * poll, poll)
        else:
            local_left = stall - clock.stalled_s()
            if local_left >= 0.0:
                timeout = local_left + _STALL_TIMER_SLACK_S
            else:
                # Our window is spent but the scope serves others: look again when
                # its progress would go stale if nobody served meanwhile.
                age = call.age if call.age is not None else 0.0
                timeout = max(stall - age + _STALL_TIMER_SLACK_S, poll)
        left = self._time_left(call)
        if left is not None:
            timeout = min(timeout, max(left, 0.0))
        await room.wait(call.waiter, timeout, self._sleep)
        failure = call.waiter.failure
        if failure is not None:
            raise GovernanceBackendError(
                f"the backend failed for a call ahead of this one in the queue: {failure}",
                operation=getattr(failure, "operation", "acquire"),
                scope=self._scope,
                sources=self._names,
            ) from failure

    async def _attempt(
        self, call: _Call, clock: StallClock, lease: Lease, attempt_fn: AttemptFn[T]
    ) -> Served[T] | _Failed:
        """One real request on a held permit; a failure is released and emitted here.

        Success comes back as ``Served`` with the permit still held: ``_finish``
        releases it when the session's body ends.
        """
        source = self._by_name[lease.source]
        call.tried.add(source.name)
        timeout_s, ttft_s, idle_s = self._timeouts(source, call)
        started = self._now()
        ctx = AttemptContext(
            call_id=call.call_id,
            attempt=len(call.records) + 1,
            lease=lease,
            timeout_s=timeout_s,
            ttft_timeout_s=ttft_s,
            idle_timeout_s=idle_s,
            started_at=started,
            permit_wait_s=max(0.0, started - call.pick_started_at),
            stalled_s=clock.stalled_s(),
        )
        try:
            value = await attempt_fn(source, ctx)
        except TransientError as error:
            verdict = verdict_for(error, exempt_429=self._policy.exempt_429)
            try:
                await self._release(lease, verdict.outcome)
            finally:
                # Emitted even if the caller is cancelled during the release: one record
                # per attempt, whatever instant the cancellation lands at.
                self._emit(call, ctx, verdict.outcome.kind, error.status_code, self._text(error))
            return _Failed(source.name, verdict, error)
        except BaseException:
            # Cancellation, the caller's timeout, or a bug in the attempt function:
            # the permit goes back at once, then the exception passes on untouched.
            try:
                await self._release(lease, AttemptOutcome("cancelled"))
            finally:
                self._emit(call, ctx, "cancelled", None, "cancelled")
            raise
        return Served(value, ctx, call.records, self._backend, self._now)

    async def _finish(self, call: _Call, served: Served[Any], exc: BaseException | None) -> None:
        """Release the serving attempt's permit according to how its body ended; emit its record."""
        ctx = served.ctx
        status: int | None = None
        error: str | None = None
        if isinstance(exc, TransientError):
            outcome = verdict_for(exc, exempt_429=self._policy.exempt_429).outcome
            status, error = exc.status_code, self._text(exc)
        elif exc is None and served.completed:
            used = ctx.usage.total_tokens if ctx.usage is not None else 0
            outcome = AttemptOutcome("success", tokens_used=used or None)
        else:
            outcome = AttemptOutcome("cancelled")
            error = "cancelled"
        try:
            await self._release(ctx.lease, outcome)
        finally:
            # A cancellation during the release must not lose the served attempt's record.
            self._emit(call, ctx, outcome.kind, status, error)

    async def _after_failure(self, call: _Call, failed: _Failed) -> None:
        """Apply the table's verdict to the loop: raise, charge, then back off."""
        verdict, error = failed.verdict, failed.error
        if verdict.raises:
            raise RequestRejected(
                f"{call.op_name}: {failed.source} rejected the request: {self._text(error)}",
                scope=self._scope,
                sources=(failed.source,),
                status_code=error.status_code,
            )
        if verdict.outcome.kind == "source_misconfigured":
            call.refused.add(failed.source)
        if verdict.charged:
            call.fails += 1
            call.consecutive_429 = 0
            # Every source refused this call's credentials or model (401/403/404) and
            # is tripped long: waiting out its cool-down cannot serve the call.
            if call.fails >= self._policy.max_attempts or call.refused.issuperset(self._names):
                raise await self._exhausted(call, "retry_exhausted")
            step = call.fails
        else:
            # An exempt 429: free of charge, but a saturated scope still backs off
            # exponentially, which is what lets the stall rule bound it (seed 3.5).
            call.consecutive_429 += 1
            step = call.consecutive_429
        delay = backoff_delay(
            step,
            base_s=self._policy.backoff_base_s,
            cap_s=self._policy.backoff_cap_s,
            rng=self._rng,
        )
        left = self._time_left(call)
        if left is not None:
            delay = min(delay, max(left, 0.0))
        # Outside attempting(): back-off is non-productive and bills the stall clock.
        await self._sleep(delay)
        call.pick_started_at = self._now()

    def _text(self, error: BaseException) -> str:
        """An error's message with every credential of the scope's sources scrubbed."""
        return scrub(str(error), self._secrets)

    async def _release(self, lease: Lease, outcome: AttemptOutcome) -> None:
        """Free the permit, shielded from cancellation; a backend failure is logged, not raised.

        The upstream has answered by now: losing the answer to a backend
        hiccup would be worse than a permit the lease's expiry frees anyway.
        """
        try:
            release = self._backend.release(lease, outcome)
            await (release if self._backend.cancel_safe else shielded(release))
        except GovernanceBackendError as exc:
            _log.warning(
                "release of a %s lease at %s failed (its expiry frees the permit): %s",
                outcome.kind,
                lease.source,
                self._text(exc),
            )

    def _emit(
        self,
        call: _Call,
        ctx: AttemptContext,
        outcome: str,
        status_code: int | None,
        error: str | None,
    ) -> None:
        """Keep one attempt's record on the call and hand it to telemetry, inside the attempt."""
        usage = ctx.usage
        record = AttemptRecord(
            call_id=call.call_id,
            scope=self._scope,
            source=ctx.lease.source,
            attempt=ctx.attempt,
            outcome=outcome,
            status_code=status_code,
            latency_s=max(0.0, self._now() - ctx.started_at),
            ttft_s=ctx.ttft_s,
            prompt_tokens=usage.prompt_tokens if usage is not None else 0,
            completion_tokens=usage.completion_tokens if usage is not None else 0,
            permit_wait_s=ctx.permit_wait_s,
            stalled_s=ctx.stalled_s,
            error=error,
        )
        call.records.append(record)
        self._emitter.emit_attempt(record)

    # --- the error that ends a call --------------------------------------------

    async def _exhausted(self, call: _Call, reason: ExhaustedReason) -> AllSourcesExhausted:
        """The error that ends a call, with the time until the earliest source reopens."""
        message = f"{call.op_name}: all sources exhausted: {_EXPLAINED[reason]}"
        last = call.records[-1] if call.records else None
        if last is not None and last.error:
            # Already scrubbed of credentials when the record was made.
            message += f"; last: {last.source}: {last.error}"
        return AllSourcesExhausted(
            message,
            reason=reason,
            scope=self._scope,
            sources=self._names,
            retry_after_s=await self._retry_after(call),
            attempts=tuple(call.records),
        )

    async def _retry_after(self, call: _Call) -> float | None:
        """Seconds until the earliest source reopens by time alone, or ``None``.

        From this call's last rejected acquire when there is one (aged by the
        time since), else from a snapshot of the backend.
        """
        last = call.last
        if last is not None and last.lease is None:
            reopen = last.retry_after_s
            return None if reopen is None else max(0.0, reopen - (self._now() - call.last_at))
        try:
            snap = await self._backend.snapshot(self._scope)
        except GovernanceBackendError as exc:
            _log.warning("snapshot for retry_after_s failed: %s", exc)
            return None
        times: list[float] = []
        for name in self._names:
            s = snap.source(name)
            if s is None:
                continue
            if s.breaker == "open" and s.reopen_in_s is not None:
                times.append(s.reopen_in_s)
            if s.paced_for_s:
                times.append(s.paced_for_s)
            rpm = self._specs[name].rpm
            if rpm and s.rpm_tokens is not None and s.rpm_tokens < 1:
                times.append((1.0 - s.rpm_tokens) * 60.0 / rpm)
        return min(times) if times else None


_EXPLAINED: Final[Mapping[ExhaustedReason, str]] = {
    "retry_exhausted": "every charged attempt failed",
    "stalled": "this call waited past the stall window and the scope made no progress",
    "no_runnable": "no source could take the call at once (fail_fast)",
    "deadline": "the call's deadline passed",
}
