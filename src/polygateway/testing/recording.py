"""Doubles that record what the library did: an emitter and a counting backend."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from polygateway.backends.base import (
    AcquireResult,
    AttemptOutcome,
    Backend,
    Lease,
    ReleaseListener,
    ScopeSnapshot,
    SourceSpec,
)
from polygateway.models import AttemptRecord, CallRecord

__all__ = ["CountingBackend", "Recorder"]

T = TypeVar("T")
_HELD: set[asyncio.Future[Any]] = set()
"""Gated operations whose caller was cancelled, kept alive until they finish."""


def _keep(future: asyncio.Future[Any]) -> None:
    _HELD.add(future)
    future.add_done_callback(_HELD.discard)


async def _to_the_end(
    operation: Coroutine[object, object, T],
    abandoned: Callable[[asyncio.Future[T]], Coroutine[object, object, None]] | None = None,
) -> T:
    """Run ``operation`` in a task of its own that a cancelled caller does not cut short.

    What makes a backend that suspends mid-operation cancellation-safe, as the
    ``Backend`` protocol requires: the caller's ``CancelledError`` passes
    through, the operation finishes without it, and ``abandoned`` (given the
    operation's task) undoes what nobody will use, such as a late grant.
    """
    task = asyncio.ensure_future(operation)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        _keep(task)
        if abandoned is not None:
            _keep(asyncio.ensure_future(abandoned(task)))
        raise


class Recorder:
    """An emitter that keeps every attempt record and every call record, for assertions."""

    __slots__ = ("calls", "records")

    def __init__(self) -> None:
        self.records: list[AttemptRecord] = []
        self.calls: list[CallRecord] = []

    def emit_attempt(self, record: AttemptRecord) -> None:
        """Keep the attempt's record."""
        self.records.append(record)

    def emit_call(self, record: CallRecord) -> None:
        """Keep the call's record."""
        self.calls.append(record)

    def outcomes(self) -> list[str]:
        """The outcome of each attempt record, in order."""
        return [r.outcome for r in self.records]

    def call_outcomes(self) -> list[str]:
        """The outcome of each call record, in order."""
        return [r.outcome for r in self.calls]


class CountingBackend:
    """A ``Backend`` wrapper that counts each operation and can hold ``acquire`` at a gate.

    ``calls["acquire"]`` etc. count backend operations (``on_release`` is
    local and not counted); ``ops`` is their total. While ``hold_acquire``
    (or ``hold_release``) is an event that is not set, every ``acquire``
    (``release``) waits for it before it runs; a caller cancelled meanwhile
    leaves the operation to run on when the gate opens (cancellation-safe).
    """

    __slots__ = ("__weakref__", "calls", "hold_acquire", "hold_release", "inner")

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}
        self.hold_acquire: asyncio.Event | None = None
        self.hold_release: asyncio.Event | None = None

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    @property
    def ops(self) -> int:
        """Backend operations so far."""
        return sum(self.calls.values())

    async def acquire(
        self,
        scope: str,
        candidates: Sequence[SourceSpec],
        *,
        cost_tokens: int = 0,
        ttl_s: float,
        priority_class: str = "",
    ) -> AcquireResult:
        """Count, wait at the gate if one is closed, then delegate."""
        gate = self.hold_acquire
        if gate is None:
            self._count("acquire")
            return await self.inner.acquire(
                scope,
                candidates,
                cost_tokens=cost_tokens,
                ttl_s=ttl_s,
                priority_class=priority_class,
            )

        async def gated() -> AcquireResult:
            await gate.wait()
            self._count("acquire")
            return await self.inner.acquire(
                scope,
                candidates,
                cost_tokens=cost_tokens,
                ttl_s=ttl_s,
                priority_class=priority_class,
            )

        async def give_back(acquiring: asyncio.Future[AcquireResult]) -> None:
            lease = (await acquiring).lease
            if lease is not None:
                await self.inner.release(lease, AttemptOutcome("cancelled"))

        return await _to_the_end(gated(), give_back)

    async def release(self, lease: Lease, outcome: AttemptOutcome) -> None:
        """Count, wait at the gate if one is closed, then delegate."""
        gate = self.hold_release
        if gate is None:
            self._count("release")
            await self.inner.release(lease, outcome)
            return

        async def gated() -> None:
            await gate.wait()
            self._count("release")
            await self.inner.release(lease, outcome)

        await _to_the_end(gated())

    async def renew(self, lease: Lease) -> bool:
        """Count and delegate."""
        self._count("renew")
        return await self.inner.renew(lease)

    async def progress_age_s(self, scope: str) -> float:
        """Count and delegate."""
        self._count("progress_age_s")
        return await self.inner.progress_age_s(scope)

    async def snapshot(self, scope: str) -> ScopeSnapshot:
        """Count and delegate."""
        self._count("snapshot")
        return await self.inner.snapshot(scope)

    def on_release(self, scope: str, listener: ReleaseListener) -> None:
        """The inner backend announces the releases (local state, not an operation)."""
        self.inner.on_release(scope, listener)

    async def aclose(self) -> None:
        """Delegate."""
        await self.inner.aclose()
