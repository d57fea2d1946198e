"""A memory backend that frees a permit while the next acquire is in flight.

Shared by the waiting-room race tests (``test_waiting_cancellation.py``) and
the retry loop's mutation tests (``test_mutants_retry.py``).
"""

from __future__ import annotations

from typing import Any

from polygateway.backends.base import AttemptOutcome
from polygateway.backends.memory import MemoryBackend
from polygateway.testing import FakeClock

__all__ = ["ReleasedDuringAcquire"]


class ReleasedDuringAcquire(MemoryBackend):
    """A memory backend on which ``lease`` is released while the next acquire is in flight.

    The acquire is refused (the permit was still held when it ran), and the
    permit is freed before its answer reaches the caller: the race of a
    release elsewhere in the process against a call that asked at once. With
    ``retake``, a holder outside the loop takes the permit back at once, so
    the call's next acquire is refused as well, although it heard the release.
    """

    def __init__(self, clock: FakeClock, *, retake: bool = False) -> None:
        super().__init__(now=clock)
        self.lease: Any = None
        self._retake = retake

    async def acquire(self, scope: str, candidates: Any, **options: Any) -> Any:
        result = await super().acquire(scope, candidates, **options)
        lease, self.lease = self.lease, None
        if lease is not None:
            await self.release(lease, AttemptOutcome("success"))
            if self._retake:
                again = await super().acquire(scope, candidates, ttl_s=1e6)
                assert again.lease is not None
        return result
