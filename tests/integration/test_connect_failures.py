"""A connect that cannot even start is a typed failure counted against its source.

Settings refuse a port out of range at load; a source built around that check
(``model_copy``) shows the transport's own boundary: the real httpx
stack's grouped ``OverflowError`` ends as ``AllSourcesExhausted``, not a raw
``ExceptionGroup``, and the source's breaker counts each attempt.
"""

from __future__ import annotations

import pytest

from polygateway import (
    AllSourcesExhausted,
    ChatClient,
    EmbeddingClient,
    GatewaySettings,
    MemoryBackend,
)
from polygateway.config import ScopeConfig, SourceConfig


def unchecked_settings(base_url: str) -> GatewaySettings:
    """One chat source at ``base_url``, its URL check skipped as code could do."""
    checked = SourceConfig(name="a", protocol="openai", base_url="http://h/v1")
    source = checked.model_copy(update={"base_url": base_url})  # model_copy validates nothing
    return GatewaySettings(
        _env_file=None,
        max_attempts=2,
        backoff_base_s=0.01,
        backoff_cap_s=0.02,
        scopes={"chat": ScopeConfig(kind="chat", sources=(source,))},
    )


async def test_a_port_out_of_range_fails_typed_and_counts_against_the_source() -> None:
    """Port 99999 through the real httpx transport: retry_exhausted, two breaker failures."""
    settings = unchecked_settings("http://127.0.0.1:99999/v1")
    backend = MemoryBackend()
    async with ChatClient.from_settings(settings, scope="chat", backend=backend) as chat:
        with pytest.raises(AllSourcesExhausted) as info:
            await chat.complete([{"role": "user", "content": "hi"}])
    assert info.value.reason == "retry_exhausted"
    assert [a.outcome for a in info.value.attempts] == ["transient", "transient"]
    assert "connect error" in str(info.value)
    snap = (await backend.snapshot("chat")).source("a")
    assert snap is not None
    assert snap.consecutive_failures == 2


async def test_an_embedding_batch_that_cannot_connect_fails_typed_naming_the_batch() -> None:
    """The same through EmbeddingClient's batch task group: AllSourcesExhausted, batch named."""
    checked = SourceConfig(name="a", protocol="openai", base_url="http://h/v1")
    source = checked.model_copy(update={"base_url": "http://127.0.0.1:99999/v1"})
    settings = GatewaySettings(
        _env_file=None,
        max_attempts=2,
        backoff_base_s=0.01,
        backoff_cap_s=0.02,
        scopes={"embed": ScopeConfig(kind="embed", sources=(source,))},
    )
    async with EmbeddingClient.from_settings(settings, scope="embed") as emb:
        with pytest.raises(AllSourcesExhausted) as info:
            await emb.embed(["alpha", "beta"])
    assert info.value.reason == "retry_exhausted"
    assert info.value.batch == (0, 2)
    assert "connect error" in str(info.value)
