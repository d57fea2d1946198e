"""A backend with no synchronous read, as the Redis one: its snapshot must be awaited."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from polygateway.backends.base import (
    AcquireResult,
    AttemptOutcome,
    Lease,
    ReleaseListener,
    ScopeSnapshot,
    SourceSpec,
)
from polygateway.backends.memory import MemoryBackend


class AsyncOnly:
    """A memory backend's state behind reads that suspend, as a network read does.

    The live gauges read a backend without ``snapshot_now`` through its event
    loop. ``gate`` holds snapshots until set, ``error`` fails them, ``reads``
    counts them; every other operation goes straight to the memory backend.
    """

    __slots__ = ("__weakref__", "error", "gate", "inner", "reads")

    def __init__(self, inner: MemoryBackend) -> None:
        self.inner = inner
        self.gate: asyncio.Event | None = None
        self.error: Exception | None = None
        self.reads = 0

    async def acquire(
        self,
        scope: str,
        candidates: Sequence[SourceSpec],
        *,
        cost_tokens: int = 0,
        ttl_s: float,
        priority_class: str = "",
    ) -> AcquireResult:
        return await self.inner.acquire(
            scope, candidates, cost_tokens=cost_tokens, ttl_s=ttl_s, priority_class=priority_class
        )

    async def release(self, lease: Lease, outcome: AttemptOutcome) -> None:
        await self.inner.release(lease, outcome)

    async def renew(self, lease: Lease) -> bool:
        return await self.inner.renew(lease)

    async def progress_age_s(self, scope: str) -> float:
        return await self.inner.progress_age_s(scope)

    async def snapshot(self, scope: str) -> ScopeSnapshot:
        self.reads += 1
        await asyncio.sleep(0)  # suspends, as a network read does
        if self.gate is not None:
            await self.gate.wait()
        if self.error is not None:
            raise self.error
        return await self.inner.snapshot(scope)

    def on_release(self, scope: str, listener: ReleaseListener) -> None:
        self.inner.on_release(scope, listener)

    async def aclose(self) -> None:
        await self.inner.aclose()
