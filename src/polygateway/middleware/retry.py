"""The one governance loop every client runs its calls through (research-wiki/ARCHITECTURE.md §2).

One call, whatever the client::

    clock = StallClock(now)                          one per call, never an attribute
    loop:
        exempt_429 and stall rule            -> AllSourcesExhausted("stalled")
        no time left before the deadline     -> AllSourcesExhausted("deadline")
        admission (admission.py): selection order + one backend.acquire, or queue
        nothing runnable -> _on_no_runnable: fail_fast -> "no_runnable";
                            stall rule -> "stalled"; else wait in the scope's FIFO
        clock.attempting():                  productive time: request, release, telemetry
            _attempt(...)                    (for a stream, until the stream closes)
        success -> return; request_rejected -> RequestRejected at once
        timeout cut by the caller's deadline -> released cancelled, "deadline" at once
        exempt 429 -> not charged; else fails += 1 -> "retry_exhausted" at max_attempts
        back-off sleep, then back to the tail of the waiting room

The stall budget (research-wiki/designs/stall-budget.md) bills only
non-productive time: a real attempt is governed by ``max_attempts``, so it is
subtracted from the call's elapsed time. Embedding and OCR run the same loop
with ``exempt_429=False``: every failure is charged and the main-loop stall
check is off (the design page's §3).

A stream is one attempt that outlives the loop: ``session()`` hands the open
attempt to its body with the permit still held and ``attempting()`` still
open, and releases when the body ends (see ``Served``).

``deadline_s`` is a hard bound: attempts' timeouts are clipped to the time
left, a stream is cut at it, and a timeout the deadline caused is released as
cancelled (``classify.DEADLINE_CUT``), not charged to the source.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

from polygateway.backends.base import AttemptOutcome, Backend, Lease
from polygateway.errors import GovernanceBackendError, RequestRejected
from polygateway.middleware.admission import DEADLINE_EPSILON_S, Admitter, CallState, Sleep
from polygateway.middleware.attempt import (
    AttemptContext,
    AttemptFn,
    Served,
    release_failed,
    release_quietly,
)
from polygateway.middleware.classify import (
    DEADLINE_CUT,
    FAILURE_TABLE,
    FailureRule,
    Verdict,
    clamped_hint,
    verdict_for,
)
from polygateway.middleware.policy import LoopPolicy
from polygateway.middleware.telemetry import Emitter, NullEmitter, attempt_record
from polygateway.models import positional_builder
from polygateway.transport.hints import ServerHint
from polygateway.transport.http import TransientError, scrub, secrets_in
from polygateway.transport.wire import source_headers

if TYPE_CHECKING:
    from polygateway.backends.waiting import WaitingRoom
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

_log = logging.getLogger("polygateway.retry")

_CANCELLED: Final = AttemptOutcome("cancelled")

_new_outcome = positional_builder(AttemptOutcome)
"""``AttemptOutcome`` without the frozen dataclass's per-field ``__setattr__``."""


class StallClock:
    """Per-call stall timer: counts only non-productive waiting.

    See research-wiki/designs/stall-budget.md §1.

    The stall budget governs waiting nobody else governs (429 back-off, polling
    for a permit, breaker cool-down); real attempts are already governed by
    ``max_attempts``, so their time is subtracted. Billing both budgets for
    the same seconds let one slow attempt end a call as stalled.

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

    def attempting(self) -> _Span:
        """Wrap one real attempt; its duration counts as productive (the ``_attempt`` boundary).

        An async context manager; the loop also opens and closes it by hand,
        because a stream's attempt outlives the loop's own frame.
        """
        return _Span(self)


class _Span:
    """One attempt's productive stretch of a ``StallClock``: a class, not a generator (per call)."""

    __slots__ = ("_clock", "_started")

    def __init__(self, clock: StallClock) -> None:
        self._clock = clock
        self._started = 0.0

    def open(self) -> _Span:
        """The attempt begins now."""
        self._started = self._clock._now()
        return self

    def close(self) -> None:
        """The attempt has ended: add its duration to the productive time."""
        clock = self._clock
        clock._productive_s += clock._now() - self._started

    async def __aenter__(self) -> None:
        self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Arithmetic only: nothing is swallowed, CancelledError passes through untouched.
        self.close()


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
    """A failed attempt, already released and emitted: what the loop does next depends on it."""

    source: str
    verdict: Verdict
    error: TransientError


class RetryMW:
    """The governance loop for one scope; shared by the chat, embedding and OCR clients.

    ``run`` serves a request/response call; ``session`` serves a call whose
    attempt outlives the loop (a stream). Both are the same loop (``_serve``).
    """

    __slots__ = (
        "_admit",
        "_backend",
        "_by_name",
        "_emits",
        "_emitter",
        "_names",
        "_now",
        "_policy",
        "_rng",
        "_room",
        "_scope",
        "_secrets",
        "_sleep",
        "_sources",
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
        # Records are built for the call's attempts anyway; only a real emitter is called.
        self._emits = type(self._emitter) is not NullEmitter
        self._names = tuple(s.name for s in self._sources)
        self._by_name = {s.name: s for s in self._sources}
        # Defence in depth: transports scrub their messages already, but nothing
        # that reaches a record, a log or an error may carry a source's credentials.
        self._secrets = tuple(
            sorted({v for s in self._sources for v in secrets_in(source_headers(s))}, key=len)[::-1]
        )
        # One FIFO per scope and process, the backend's: looked up once, not per call.
        self._room = backend.waiting_room(scope)
        self._admit = Admitter(
            scope=scope,
            sources=self._sources,
            policy=policy,
            backend=backend,
            now=now,
            sleep=sleep,
            rng=rng,
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

    async def run(
        self,
        attempt_fn: AttemptFn[T],
        *,
        cost_tokens: int = 0,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        op_name: str = "call",
    ) -> Served[T]:
        """Serve one request/response call; the permit is released before this returns.

        ``session`` with an empty body, without a context manager object per call.
        """
        call = self._admit.begin(op_name, cost_tokens, fail_fast, deadline_s, streaming=False)
        clock = StallClock(self._now)  # one per call, never an attribute
        room = self._room
        try:
            served, span = await self._serve(call, clock, room, attempt_fn)
            served.complete()
            try:
                await self._finish(call, served, None)
            finally:
                span.close()
        finally:
            self._leave(call, room)
        return served

    def session(
        self,
        attempt_fn: AttemptFn[T],
        *,
        cost_tokens: int = 0,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        op_name: str = "call",
        streaming: bool = False,
    ) -> AbstractAsyncContextManager[Served[T]]:
        """Run the loop until an attempt succeeds, then hand it to the body with the permit held.

        The attempt (and ``attempting()``) lasts until the body ends, so a
        stream's attempt spans request to close. A body that raises releases
        with the matching outcome and re-raises; one that ends without
        ``complete()`` releases as cancelled. A body cut by the call's deadline
        (a timeout once no time is left) releases as cancelled and ends the
        call with ``AllSourcesExhausted(reason="deadline")`` instead.
        """
        return _Session(
            self,
            attempt_fn,
            (op_name, cost_tokens, fail_fast, deadline_s, streaming),
        )

    # --- the steps of the loop -------------------------------------------------

    async def _serve(
        self, call: CallState, clock: StallClock, room: WaitingRoom, attempt_fn: AttemptFn[T]
    ) -> tuple[Served[T], _Span]:
        """The loop: until an attempt succeeds, returned with its permit held and its span open.

        The span (``clock.attempting()``) is opened here by hand and closed by
        the caller after the release: for a stream it outlives this method.
        """
        admit = self._admit
        now = self._now
        # Chat only: 429s are not charged, so the stall rule is what bounds a saturated scope.
        stall = self._policy.stall_window_s if self._policy.exempt_429 else None
        while True:
            call.age = None
            # The local measure first (clock.stalled_s() read inline, once per iteration):
            # a call that has not waited long needs no await.
            if (
                stall is not None
                and now() - clock._entered_at - clock._productive_s > stall
                and await self._stalled(call, clock)
            ):
                raise await self._admit.exhausted(call, "stalled")
            deadline_at = call.deadline_at
            if deadline_at is not None and deadline_at - now() <= DEADLINE_EPSILON_S:
                raise await self._admit.exhausted(call, "deadline")
            lease = await admit.pick(call, room)
            if lease is None:
                await self._on_no_runnable(call, room, clock)
                continue
            span = _Span(clock).open()  # clock.attempting().open(), one call fewer
            try:
                result = await self._attempt(call, clock, lease, attempt_fn)
            except BaseException:
                span.close()
                raise
            if isinstance(result, Served):
                return result, span
            span.close()
            await self._after_failure(call, result)

    @staticmethod
    def _leave(call: CallState, room: WaitingRoom) -> None:
        """The call is over: give up its place in the queue, if it holds one."""
        if call.waiter is not None:
            room.leave(call.waiter)
            call.waiter = None

    async def _stalled(self, call: CallState, clock: StallClock) -> bool:
        """The stall rule: this call's non-productive time AND the scope's progress age exceed it.

        The local measure comes first, so a call that has not waited long
        never asks the backend; the age is read at most once per iteration.
        ``inf`` (never served) counts as exceeded (research-wiki/designs/stall-budget.md,
        "Never served counts as stale").
        """
        stall = self._policy.stall_window_s
        if clock.stalled_s() <= stall:
            return False
        if call.age is None:
            call.age = await self._backend.progress_age_s(self._scope)
        return call.age > stall

    async def _on_no_runnable(self, call: CallState, room: WaitingRoom, clock: StallClock) -> None:
        """Nothing runnable: fail fast, apply the stall rule, or wait our turn in the FIFO."""
        if call.fail_fast:
            # Never the stall rule: the caller asked not to wait at all.
            raise await self._admit.exhausted(call, "no_runnable")
        if await self._stalled(call, clock):
            raise await self._admit.exhausted(call, "stalled")
        await self._admit.wait_turn(call, room, clock.stalled_s(), self._names)

    async def _attempt(
        self, call: CallState, clock: StallClock, lease: Lease, attempt_fn: AttemptFn[T]
    ) -> Served[T] | _Failed:
        """One real request on a held permit; a failure is released and emitted here.

        Success comes back as ``Served`` with the permit still held: ``_finish``
        releases it when the session's body ends.
        """
        source = self._by_name[lease.source]
        call.tried.add(source.name)
        admit = self._admit
        left = admit.time_left(call)
        timeout_s, ttft_s, idle_s = admit.clip(source, left)
        started = self._now()
        ctx = AttemptContext(
            call.call_id,
            len(call.records) + 1,  # attempt
            lease,
            timeout_s,
            ttft_s,
            idle_s,
            started,  # started_at
            max(0.0, started - call.pick_started_at),  # permit_wait_s
            clock.stalled_s(),
            left,  # deadline_in_s
        )
        try:
            value = await attempt_fn(source, ctx)
        except TransientError as error:
            if error.timeout and admit.cut_by_deadline(call, ctx.timeout_s, source.name):
                verdict = DEADLINE_CUT
            else:
                verdict = self._verdict(call, error, source.name)
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
                await self._release(lease, _CANCELLED)
            finally:
                self._emit(call, ctx, "cancelled", None, "cancelled")
            raise
        return Served(value, ctx, call.records, self._backend, self._now)

    def _verdict(self, call: CallState, error: TransientError, source: str) -> Verdict:
        """The table's verdict on a failure, its back-off clamped to the stall window and kept."""
        stall = self._policy.stall_window_s
        hint = error.retry_after_s
        if hint is not None and hint > stall:
            _log.warning(
                "%s asked to be left alone for %.0f s; paused for the stall window "
                "(%.0f s) instead",
                source,
                hint,
                stall,
            )
        verdict = verdict_for(error, exempt_429=self._policy.exempt_429, max_pause_s=stall)
        self._admit.remember_hint(call, verdict.outcome.retry_after_s)
        return verdict

    def _success_pause(self, call: CallState, hint: ServerHint) -> float | None:
        """How long a success announced its source's window spent (clamped), or ``None``."""
        return clamped_hint(hint.exhausted_for_s(call.cost_tokens), self._policy.stall_window_s)

    async def _finish(
        self, call: CallState, served: Served[Any], exc: BaseException | None
    ) -> bool:
        """Release the serving attempt's permit according to how its body ended; emit its record.

        Returns whether the body was cut by the call's deadline.
        """
        ctx = served.ctx
        status: int | None = None
        error: str | None = None
        cut = False
        if isinstance(exc, TransientError):
            cut = exc.timeout and self._admit.cut_by_deadline(call, ctx.timeout_s, ctx.source)
            verdict = DEADLINE_CUT if cut else self._verdict(call, exc, ctx.source)
            outcome = verdict.outcome
            status, error = exc.status_code, self._text(exc)
        elif exc is None and served.completed:
            used = ctx.usage.total_tokens if ctx.usage is not None else 0
            hint = ctx.hint
            pause = None if hint is None else self._success_pause(call, hint)
            # Every field, in order (kind, aimd_decrease, retry_after_s, tokens_used): one per call.
            outcome = _new_outcome("success", False, pause, used or None)
        else:
            outcome = _CANCELLED
            error = "cancelled"
        backend = self._backend
        try:
            if backend.cancel_safe:
                # release_quietly's common case without its coroutine: once per call.
                try:
                    await backend.release(ctx.lease, outcome)
                except GovernanceBackendError as exc:
                    release_failed(ctx.lease, outcome, exc, self._text)
            else:
                await release_quietly(backend, ctx.lease, outcome, self._text)
        finally:
            # A cancellation during the release must not lose the served attempt's record.
            self._emit(call, ctx, outcome.kind, status, error)
        return cut

    async def _after_failure(self, call: CallState, failed: _Failed) -> None:
        """Apply the table's verdict to the loop: raise, charge, then back off."""
        verdict, error = failed.verdict, failed.error
        if verdict is DEADLINE_CUT:
            # No time is left: another attempt could only time out at once.
            raise await self._admit.exhausted(call, "deadline")
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
                raise await self._admit.exhausted(call, "retry_exhausted")
            step = call.fails
        else:
            call.consecutive_429 += 1
            hinted = error.retry_after_s
            if hinted is not None and hinted > 0.0:
                # An exempt 429 that named its back-off: the source is paused for exactly
                # that long, fleet-wide, and reopens through one probe. The call moves on
                # at once: to another source, or into the queue until the reopen, where
                # its wait is non-productive and bills the stall clock. (A hint of 0 asks
                # for nothing: the call's own back-off keeps it from spinning.)
                call.pick_started_at = self._now()
                return
            # An exempt 429 without a hint: free of charge, but a saturated scope still
            # backs off exponentially, which is what lets the stall rule bound it.
            step = call.consecutive_429
        delay = backoff_delay(
            step,
            base_s=self._policy.backoff_base_s,
            cap_s=self._policy.backoff_cap_s,
            rng=self._rng,
        )
        left = self._admit.time_left(call)
        if left is not None:
            delay = min(delay, max(left, 0.0))
        # Outside attempting(): back-off is non-productive and bills the stall clock.
        await self._sleep(delay)
        call.pick_started_at = self._now()

    def _text(self, error: BaseException) -> str:
        """An error's message with every credential of the scope's sources scrubbed."""
        return scrub(str(error), self._secrets)

    async def _release(self, lease: Lease, outcome: AttemptOutcome) -> None:
        """Free the permit whatever befalls the caller; a backend failure is only logged."""
        await release_quietly(self._backend, lease, outcome, self._text)

    def _emit(
        self,
        call: CallState,
        ctx: AttemptContext,
        outcome: str,
        status_code: int | None,
        error: str | None,
    ) -> None:
        """Keep one attempt's record on the call and hand it to telemetry, inside the attempt."""
        record = attempt_record(
            ctx,
            scope=self._scope,
            outcome=outcome,
            status_code=status_code,
            error=error,
            ended_at=self._now(),
        )
        call.records.append(record)
        if self._emits:
            self._emitter.emit_attempt(record)


class _Session(Generic[T]):
    """What ``RetryMW.session`` returns: the loop runs on entry, the release on exit.

    A class rather than a generator-based context manager: one is made per call.
    """

    __slots__ = ("_args", "_attempt_fn", "_call", "_mw", "_room", "_served", "_span")

    def __init__(
        self,
        mw: RetryMW,
        attempt_fn: AttemptFn[T],
        args: tuple[str, int, bool, float | None, bool],
    ) -> None:
        self._mw = mw
        self._attempt_fn = attempt_fn
        self._args = args
        self._call: CallState | None = None
        self._room: WaitingRoom | None = None
        self._served: Served[T] | None = None
        self._span: _Span | None = None

    async def __aenter__(self) -> Served[T]:
        mw = self._mw
        op_name, cost_tokens, fail_fast, deadline_s, streaming = self._args
        call = mw._admit.begin(op_name, cost_tokens, fail_fast, deadline_s, streaming=streaming)
        clock = StallClock(mw._now)  # one per call, never an attribute
        room = mw._room
        try:
            served, span = await mw._serve(call, clock, room, self._attempt_fn)
        except BaseException:
            mw._leave(call, room)
            raise
        self._call, self._room, self._served, self._span = call, room, served, span
        return served

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        call, room, served, span = self._call, self._room, self._served, self._span
        if call is None or room is None or served is None or span is None:
            return
        self._call = self._room = self._served = self._span = None
        mw = self._mw
        try:
            try:
                # The body's exception (stream cut, consumer gone, cancellation) passes
                # on after the release, which records how the body ended.
                cut = await mw._finish(call, served, exc)
            finally:
                span.close()
            if cut:
                # Cut at the call's deadline: the call ends as the loop ends any call
                # whose time is up, with the stream's attempt among its records.
                raise await mw._admit.exhausted(call, "deadline") from exc
        finally:
            RetryMW._leave(call, room)
