"""A fake sleep that plays another holder of a scope's only permit, for the stall-budget tests."""

from __future__ import annotations

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.testing import FakeClock


class PermitThief:
    """Sleeps on ``clock``; takes the only permit at the first sleep, gives it back at the next.

    The first sleep is the loop's back-off after a failed attempt: the permit
    is taken then, so the loop's next pick finds nothing runnable. The sleep
    after that is the loop waiting its turn (one no-runnable round): the
    permit goes back and the call can be served.
    """

    __slots__ = ("_backend", "_clock", "_held", "_scope", "_source", "no_runnable_rounds")

    def __init__(self, backend: MemoryBackend, clock: FakeClock, scope: str, source: str) -> None:
        self._backend = backend
        self._clock = clock
        self._scope = scope
        self._source = source
        self._held: list[Lease] = []
        self.no_runnable_rounds = 0

    async def __call__(self, seconds: float) -> None:
        if not self._held and self.no_runnable_rounds == 0:
            granted = await self._backend.acquire(
                self._scope, [SourceSpec(name=self._source, max_concurrency=1)], ttl_s=600.0
            )
            assert granted.lease is not None
            self._held.append(granted.lease)
        elif self._held:
            self.no_runnable_rounds += 1
            await self._backend.release(self._held.pop(), AttemptOutcome("cancelled"))
        await self._clock.sleep(seconds)
