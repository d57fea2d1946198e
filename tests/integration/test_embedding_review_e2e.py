"""Embedding vector sizes end to end: simulator on 127.0.0.1, real client, both transports.

The simulator answers vectors of its profile's ``embedding_dim`` whatever
``dimensions`` asks, as a server that ignores the parameter does: those
vectors must never pass for the asked ones, and two sources of different
sizes must never mix sizes in one call's result.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from polygateway.backends.memory import MemoryBackend
from polygateway.config import GatewaySettings, ScopeConfig, SourceConfig
from polygateway.embedding import EmbeddingClient
from polygateway.errors import AllSourcesExhausted
from polygateway.simulator import FaultProfile, SimulatedUpstream

# Bounds the tests' own waits, never a timing under test.
BOUND_S = 20.0
TEXTS = [f"text {i}" for i in range(24)]


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedUpstream]:
    """Source ``small`` answers 8-float vectors, ``large`` 16-float ones."""
    profiles = {"small": FaultProfile(embedding_dim=8), "large": FaultProfile(embedding_dim=16)}
    async with SimulatedUpstream(profiles, seed=5) as upstream:
        yield upstream


def settings(
    sim: SimulatedUpstream, transport: str, *names: str, **gateway: Any
) -> GatewaySettings:
    """One embed scope over the named simulator sources, two texts per batch."""
    sources = tuple(
        SourceConfig(
            name=name,
            protocol="openai",
            base_url=sim.base_url(name, "openai"),
            model="sim",
            max_batch_size=2,
            max_concurrency=4,
            timeout_s=2.0,
        )
        for name in names
    )
    return GatewaySettings(
        _env_file=None,
        scopes={"embed": ScopeConfig(kind="embed", sources=sources)},  # type: ignore[arg-type]
        transport=transport,
        backoff_base_s=0.01,
        backoff_cap_s=0.05,
        breaker_failures=1000,
        **gateway,
    )


async def test_two_sources_of_different_sizes_never_mix_sizes_in_one_call(
    sim: SimulatedUpstream, transport: str
) -> None:
    """Twelve batches spread on an 8- and a 16-float source come back all of one size."""
    backend = MemoryBackend()
    config = settings(sim, transport, "small", "large", max_attempts=6)
    async with EmbeddingClient(config, "embed", backend=backend) as emb:
        async with asyncio.timeout(BOUND_S):
            result = await emb.embed(TEXTS, partial=True)
    sizes = {len(v) for v in result.vectors if v is not None}
    assert len(sizes) == 1, sizes
    assert sim.stats("small").requests + sim.stats("large").requests >= 12
    assert (await backend.snapshot("embed")).in_flight == 0


async def test_dimensions_a_source_ignores_fail_typed_keeping_nothing_wrong(
    sim: SimulatedUpstream, transport: str
) -> None:
    """``dimensions=4`` answered with 8 floats: every batch a failed span, the cause named."""
    backend = MemoryBackend()
    config = settings(sim, transport, "small", max_attempts=2)
    async with EmbeddingClient(config, "embed", backend=backend) as emb:
        async with asyncio.timeout(BOUND_S):
            result = await emb.embed(TEXTS[:4], dimensions=4, partial=True)
            served = await emb.embed(TEXTS[:4], dimensions=8)
        with pytest.raises(AllSourcesExhausted) as caught:
            async with asyncio.timeout(BOUND_S):
                await emb.embed(TEXTS[:4], dimensions=4)
    assert result.vectors == [None] * 4
    assert result.failed_spans == ((0, 2), (2, 4))
    assert {len(v) for v in served.vectors} == {8}
    assert caught.value.reason == "retry_exhausted"
    assert caught.value.batch == (0, 2)
    assert "where dimensions=4 was asked" in str(caught.value.attempts[-1].error)
    assert (await backend.snapshot("embed")).in_flight == 0
