"""The admission half of the governance loop: how one call gets a permit, or waits its turn.

``retry.py`` holds the loop and decides (stall rule, deadline, what each
failure does, back-off, release, telemetry); this module gets the permit:

- the order of the candidates: selection order (``governance/selection.py``),
  the sources this call has not tried yet first;
- one ``backend.acquire`` over all of them, with the lease's TTL, run in the
  caller's task for a ``cancel_safe`` backend and shielded otherwise;
- the scope's FIFO (``backends/waiting.py``): a call asks at once when
  nobody waits and the backend has room for another operation
  (``Backend.max_inflight_ops``), otherwise it queues and only the head asks;
- the wait of a call that found nothing runnable: the head polls, the
  others sleep until promoted or until their stall deadline;
- the error that ends a call, with how long until a source reopens;
- whether an attempt's timeout was the caller's deadline (``cut_by_deadline``).

A call's state (``CallState``) begins here: both halves read it.
What is fixed for a scope (selection tiers and weights, each source's
timeouts, the TTL of a call without a deadline) is read once, not per call.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Final

from polygateway.backends.base import AcquireResult, AttemptOutcome, Backend, Lease, SourceSpec
from polygateway.errors import (
    AllSourcesExhausted,
    ExhaustedReason,
    GovernanceBackendError,
    RequestRejected,
)
from polygateway.governance.selection import SelectionOrder, untried_first
from polygateway.middleware.attempt import keep_until_done
from polygateway.middleware.policy import LoopPolicy

if TYPE_CHECKING:
    import random

    from polygateway.backends.waiting import Waiter, WaitingRoom
    from polygateway.config import SourceConfig
    from polygateway.models import AttemptRecord

__all__ = ["DEADLINE_EPSILON_S", "Admitter", "CallState"]

Sleep = Callable[[float], Awaitable[None]]

_log = logging.getLogger("polygateway.retry")

_STALL_TIMER_SLACK_S: Final = 1e-3
"""A waiter's stall timer fires just past the window, so the strict ``>`` of the rule holds."""

_REOPEN_SLACK_S: Final = 1e-3
"""The head wakes just after a source reopens, so the backend's ``now < not_before`` is over."""

_CANCELLED: Final = AttemptOutcome("cancelled")

DEADLINE_EPSILON_S: Final = 1e-3
"""No attempt starts with less time left than this: it could only time out.

A timeout this close to the deadline is the deadline's: timers and the
injected clock may disagree by a hair."""

Timeouts = tuple[float, float, float]
"""(timeout, TTFT, idle) of one attempt, in seconds."""

_Candidate = tuple["SourceConfig", SourceSpec]


class CallState:
    """One call's private loop state (never shared between calls).

    The call's ``StallClock`` is not kept here: it is a local of the loop,
    handed to each step that reads it, as research-wiki/designs/stall-budget.md prescribes.
    """

    __slots__ = (
        "age",
        "call_id",
        "consecutive_429",
        "cost_tokens",
        "deadline_at",
        "fail_fast",
        "fails",
        "hint_at",
        "hint_s",
        "last",
        "last_at",
        "op_name",
        "pick_started_at",
        "records",
        "refused",
        "streaming",
        "tried",
        "waiter",
    )

    def __init__(
        self,
        op_name: str,
        cost_tokens: int,
        fail_fast: bool,
        streaming: bool,
        deadline_at: float | None,
        pick_started_at: float,
    ) -> None:
        self.op_name = op_name
        self.cost_tokens = cost_tokens
        self.fail_fast = fail_fast
        self.streaming = streaming
        self.deadline_at = deadline_at
        self.pick_started_at = pick_started_at  # when the search for this attempt's permit began
        self.call_id = os.urandom(8).hex()
        self.fails = 0
        self.consecutive_429 = 0
        self.tried: set[str] = set()
        self.refused: set[str] = set()  # sources that answered 401/403/404
        self.records: list[AttemptRecord] = []
        self.waiter: Waiter | None = None
        self.last: AcquireResult | None = None  # this call's latest acquire, for retry_after_s
        self.last_at = 0.0
        self.age: float | None = None  # progress age read in this iteration, if any
        self.hint_s: float | None = None  # the upstream's latest back-off (clamped), if any
        self.hint_at = 0.0


def _valid_deadline(deadline_s: object) -> bool:
    """A per-call deadline is a real number of seconds, finite and not negative (NaN is not)."""
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float):
        return False
    return math.isfinite(deadline_s) and deadline_s >= 0.0


def _candidate_name(candidate: _Candidate) -> str:
    """The source name of a candidate, for ``untried_first``."""
    return candidate[0].name


class Admitter:
    """Permits for the calls of one scope: selection order, one acquire, the FIFO of waiters."""

    __slots__ = (
        "_backend",
        "_free_ttl",
        "_names",
        "_now",
        "_order",
        "_policy",
        "_rng",
        "_scope",
        "_sleep",
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
    ) -> None:
        self._scope = scope
        self._policy = policy
        self._backend = backend
        self._now = now
        self._sleep = sleep
        self._rng = rng
        self._names = tuple(s.name for s in sources)
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
        self._timeouts: dict[str, Timeouts] = {
            s.name: (float(s.timeout_s), float(s.ttft_timeout_s), float(s.stream_idle_timeout_s))
            for s in sources
        }
        # Without a deadline nothing clips the timeouts, and every call's candidates are
        # all the scope's sources: the TTL is one figure per kind of call.
        every = [self._timeouts[s.name] for s in sources]
        self._free_ttl = (
            self._longest(every, streaming=False),
            self._longest(every, streaming=True),
        )

    def begin(
        self,
        op_name: str,
        cost_tokens: int,
        fail_fast: bool,
        deadline_s: float | None,
        *,
        streaming: bool,
    ) -> CallState:
        """A new call's state; ``RequestRejected`` for a deadline that is not a number."""
        if deadline_s is not None and not _valid_deadline(deadline_s):
            raise RequestRejected(
                f"{op_name}: deadline_s must be a finite, non-negative number of seconds, "
                f"not {deadline_s!r}",
                scope=self._scope,
                sources=tuple(source.name for source, _ in self._order.sources),
            )
        started = self._now()
        deadline_at = None if deadline_s is None else started + deadline_s
        return CallState(op_name, cost_tokens, fail_fast, streaming, deadline_at, started)

    def time_left(self, call: CallState) -> float | None:
        """Seconds before the call's deadline, or ``None`` without one."""
        return None if call.deadline_at is None else call.deadline_at - self._now()

    def timeouts(self, source: SourceConfig, call: CallState) -> Timeouts:
        """(timeout, TTFT, idle) of one attempt at ``source``, each clipped to the time left."""
        return self.clip(source, self.time_left(call))

    def clip(self, source: SourceConfig, left: float | None) -> Timeouts:
        """(timeout, TTFT, idle) of ``source``, each clipped to ``left`` (``None``: unclipped)."""
        timeouts = self._timeouts[source.name]
        if left is None:
            return timeouts
        timeout_s, ttft_s, idle_s = timeouts
        return min(timeout_s, left), min(ttft_s, left), min(idle_s, left)

    def cut_by_deadline(self, call: CallState, timeout_s: float, source: str) -> bool:
        """Whether an attempt's timeout was the caller's deadline rather than the source's own.

        Only once no time is left (a timeout before that is the source's). A
        request's one bound is ``timeout_s`` (its effective value given), so
        the deadline cut it only if it clipped it; a stream's end is the
        deadline itself.
        """
        deadline_at = call.deadline_at
        if deadline_at is None or deadline_at - self._now() > DEADLINE_EPSILON_S:
            return False
        return call.streaming or timeout_s < self._timeouts[source][0]

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

    def _ttl(self, call: CallState, candidates: Sequence[_Candidate]) -> float:
        """The TTL of the lease a call with a deadline asks for now (clipped timeouts)."""
        every = [self.timeouts(source, call) for source, _ in candidates]
        return self._longest(every, streaming=call.streaming)

    def _full(self, room: WaitingRoom) -> bool:
        """Whether a call that finds nobody waiting must still queue: the backend has no room.

        The head of the queue asks whatever the count (nobody else would ask
        for it), so the fast path stops one short of the backend's bound: at
        most ``max_inflight_ops`` acquires of the scope at once in this process.
        """
        bound = self._backend.max_inflight_ops
        return bound is not None and room.asking >= bound - 1

    async def pick(self, call: CallState, room: WaitingRoom) -> Lease | None:
        """A lease on the best runnable source, or ``None`` (not our turn, or nothing runnable).

        One ``acquire`` over every source in selection order, this call's
        untried ones first: a busy or closed tier spills over to the next at
        no extra cost. Fast path: with nobody waiting (and fewer acquires in
        flight than the backend serves at once) a call asks at once;
        otherwise it joins the tail of the FIFO and only the head asks.
        ``fail_fast`` calls never queue: they ask once.
        """
        if call.waiter is None and not call.fail_fast and (not room.empty or self._full(room)):
            call.waiter = room.enter()
        if call.waiter is not None and not room.is_head(call.waiter):
            return None
        candidates = self._order.order(self._rng)
        if call.tried:
            candidates = untried_first(candidates, call.tried, name=_candidate_name)
        if call.deadline_at is None:
            ttl_s = self._free_ttl[call.streaming]
        else:
            ttl_s = self._ttl(call, candidates)
        backend = self._backend
        acquire = backend.acquire(
            self._scope,
            [spec for _, spec in candidates],
            cost_tokens=call.cost_tokens,
            ttl_s=ttl_s,
        )
        room.asking += 1
        try:
            if backend.cancel_safe:
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
        lease = result.lease
        if lease is None:
            call.last_at = self._now()  # retry_after_s is aged from here
            return None
        if call.waiter is not None:
            room.leave(call.waiter)
            call.waiter = None
        return lease

    async def _release_late(self, acquiring: asyncio.Future[AcquireResult]) -> None:
        """Release the lease of an acquire whose caller was cancelled while it ran."""
        result = await acquiring
        if result.lease is not None:
            await self._backend.release(result.lease, _CANCELLED)

    async def wait_turn(
        self, call: CallState, room: WaitingRoom, stalled_s: float, sources: tuple[str, ...]
    ) -> None:
        """Wait in the scope's FIFO after finding nothing runnable (the stall rule passed).

        The head polls every ``[0.5p, 1.0p]`` of ``poll_interval_s`` (jitter
        against herds), is woken early by a local release, and wakes when the
        earliest source that refused it reopens by time (a pause's end, a
        breaker's cool-down, a rate window) if that comes sooner. A call behind
        the head sleeps until promoted or until its own stall deadline (one
        timer, no polling). ``stalled_s`` is the call's non-productive time now.
        """
        if call.waiter is None:
            call.waiter = room.enter()
        stall = self._policy.stall_window_s
        poll = self._policy.poll_interval_s
        if room.is_head(call.waiter):
            timeout = self._rng.uniform(0.5 * poll, poll)
            reopen = self._reopen_in(call)
            if reopen is not None and reopen + _REOPEN_SLACK_S < timeout:
                timeout = reopen + _REOPEN_SLACK_S
        else:
            local_left = stall - stalled_s
            if local_left >= 0.0:
                timeout = local_left + _STALL_TIMER_SLACK_S
            else:
                # Our window is spent but the scope serves others: look again when
                # its progress would go stale if nobody served meanwhile.
                age = call.age if call.age is not None else 0.0
                timeout = max(stall - age + _STALL_TIMER_SLACK_S, poll)
        left = self.time_left(call)
        if left is not None:
            timeout = min(timeout, max(left, 0.0))
        await room.wait(call.waiter, timeout, self._sleep)
        failure = call.waiter.failure
        if failure is not None:
            raise GovernanceBackendError(
                f"the backend failed for a call ahead of this one in the queue: {failure}",
                operation=getattr(failure, "operation", "acquire"),
                scope=self._scope,
                sources=sources,
            ) from failure

    def _reopen_in(self, call: CallState) -> float | None:
        """Seconds until a source that refused the call's last acquire reopens, or ``None``."""
        last = call.last
        if last is None or last.lease is not None:
            return None
        reopen = last.retry_after_s
        return None if reopen is None else max(0.0, reopen - (self._now() - call.last_at))

    def remember_hint(self, call: CallState, hint_s: float | None) -> None:
        """Keep the upstream's latest back-off for the call's final error (``retry_after``)."""
        if hint_s is not None:
            call.hint_s = hint_s
            call.hint_at = self._now()

    async def retry_after(self, call: CallState) -> float | None:
        """Seconds until a source may serve again, or ``None`` when nothing says.

        From this call's last refused acquire when it was refused by time
        (aged by the time since), else from a snapshot of the backend. When
        neither names a time still to come and an upstream named a back-off
        during the call: what is left of it, or the whole hint once it has run
        out (a source that keeps refusing asks again for as long).
        """
        last = call.last
        if last is None or last.lease is not None:
            reopen = await self._snapshot_reopen()
        else:
            reopen = self._reopen_in(call)
        if (reopen is None or reopen <= 0.0) and call.hint_s is not None:
            left = call.hint_s - (self._now() - call.hint_at)
            reopen = left if left > 0.0 else call.hint_s
        return reopen

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

    async def exhausted(self, call: CallState, reason: ExhaustedReason) -> AllSourcesExhausted:
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
            retry_after_s=await self.retry_after(call),
            attempts=tuple(call.records),
        )


_EXPLAINED: Final[Mapping[ExhaustedReason, str]] = {
    "retry_exhausted": "every charged attempt failed",
    "stalled": "this call waited past the stall window and the scope made no progress",
    "no_runnable": "no source could take the call at once (fail_fast)",
    "deadline": "the call's deadline passed",
}
