"""Doubles that record what the library did: an emitter and a counting backend."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from polygateway.backends.base import (
    AcquireResult,
    AttemptOutcome,
    Backend,
    Lease,
    ScopeSnapshot,
    SourceSpec,
)
from polygateway.backends.waiting import WaitingRoom
from polygateway.models import AttemptRecord

__all__ = ["CountingBackend", "Recorder"]


class Recorder:
    """An emitter that keeps every attempt record, for assertions."""

    __slots__ = ("records",)

    def __init__(self) -> None:
        self.records: list[AttemptRecord] = []

    def emit_attempt(self, record: AttemptRecord) -> None:
        """Keep the record."""
        self.records.append(record)

    def outcomes(self) -> list[str]:
        """The outcome of each record, in order."""
        return [r.outcome for r in self.records]


class CountingBackend:
    """A ``Backend`` wrapper that counts each operation and can hold ``acquire`` at a gate.

    ``calls["acquire"]`` etc. count backend operations (``waiting_room`` is
    local and not counted); ``ops`` is their total. While ``hold_acquire``
    (or ``hold_release``) is an event that is not set, every ``acquire``
    (``release``) waits for it before it runs.
    """

    __slots__ = ("calls", "hold_acquire", "hold_release", "inner")

    # A held gate suspends the operation without any shield of its own: the
    # loop must protect it, as it would any backend that is not cancel-safe.
    cancel_safe = False

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

    @property
    def max_inflight_ops(self) -> int | None:
        """The inner backend's figure: counting adds no pool of its own."""
        return self.inner.max_inflight_ops

    async def acquire(
        self,
        scope: str,
        candidates: Sequence[SourceSpec],
        *,
        cost_tokens: int = 0,
        ttl_s: float,
    ) -> AcquireResult:
        """Count, wait at the gate if one is closed, then delegate."""
        if self.hold_acquire is not None:
            await self.hold_acquire.wait()
        self._count("acquire")
        return await self.inner.acquire(scope, candidates, cost_tokens=cost_tokens, ttl_s=ttl_s)

    async def release(self, lease: Lease, outcome: AttemptOutcome) -> None:
        """Count, wait at the gate if one is closed, then delegate."""
        if self.hold_release is not None:
            await self.hold_release.wait()
        self._count("release")
        await self.inner.release(lease, outcome)

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

    def waiting_room(self, scope: str) -> WaitingRoom:
        """The inner backend's room (local state, not an operation)."""
        return self.inner.waiting_room(scope)

    async def aclose(self) -> None:
        """Delegate."""
        await self.inner.aclose()
