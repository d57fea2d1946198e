"""Memory backend edges that mutation testing found unpinned (research-wiki/MUTATION.md)."""

from __future__ import annotations

import math

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.testing import FakeClock

SCOPE = "chat"
TPM = SourceSpec("a", max_concurrency=4, tpm=600.0, tpm_burst=50.0)


async def test_an_acquire_without_a_cost_reserves_no_tokens() -> None:
    """cost_tokens defaults to 0: a tpm bucket stays full after a plain acquire."""
    backend = MemoryBackend(now=FakeClock())
    result = await backend.acquire(SCOPE, [TPM], ttl_s=30.0)
    assert result.lease is not None
    assert result.lease.tokens == 0
    assert (await backend.snapshot(SCOPE)).sources[0].tpm_tokens == 50.0


async def test_an_acquire_over_no_candidates_grants_and_refuses_nothing() -> None:
    """No candidate: no lease and no rejection (an empty tuple, not an error)."""
    backend = MemoryBackend(now=FakeClock())
    result = await backend.acquire(SCOPE, [], ttl_s=30.0)
    assert (result.lease, result.rejections) == (None, ())


async def test_releasing_a_lease_of_a_source_the_scope_never_saw_is_a_no_op() -> None:
    """A lease naming an unknown source of a known scope changes nothing."""
    backend = MemoryBackend(now=FakeClock())
    granted = await backend.acquire(SCOPE, [TPM], ttl_s=30.0)
    assert granted.lease is not None
    stranger = Lease(SCOPE, "nobody", "99", 30.0, 0, False)
    await backend.release(stranger, AttemptOutcome("success"))
    assert await backend.progress_age_s(SCOPE) == math.inf
    assert (await backend.snapshot(SCOPE)).in_flight == 1


async def test_a_snapshot_ages_the_scope_progress_from_zero() -> None:
    """Right after a success the snapshot's progress age is 0; two seconds on, 2."""
    clock = FakeClock()
    backend = MemoryBackend(now=clock)
    granted = await backend.acquire(SCOPE, [TPM], ttl_s=30.0)
    assert granted.lease is not None
    await backend.release(granted.lease, AttemptOutcome("success"))
    assert (await backend.snapshot(SCOPE)).progress_age_s == 0.0
    clock.advance(2.0)
    assert (await backend.snapshot(SCOPE)).progress_age_s == 2.0
