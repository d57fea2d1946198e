"""Sources, one-scope settings and clients for the embedding and OCR unit tests.

Shared by ``test_embedding.py``, ``test_embedding_review.py``,
``test_batch_review.py``, ``test_ocr_client.py`` and ``test_ocr_review.py``:
a source as settings take it, settings with that one scope (no .env read),
and a client on a MemoryBackend and a FakeClock, closed when the test ends.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, TypeVar

import httpx
from _closing import closing

from polygateway.backends.memory import MemoryBackend
from polygateway.config import GatewaySettings
from polygateway.embedding import EmbeddingClient
from polygateway.ocr import OcrClient
from polygateway.testing import FakeClock
from polygateway.transport.http import Transport
from polygateway.transport.httpx_client import HttpxTransport

__all__ = [
    "embed_settings",
    "embedding_source",
    "mock_wire",
    "monkey",
    "ocr_settings",
    "on_clock",
    "vision",
]

Handler = Callable[[httpx.Request], httpx.Response]
Client = TypeVar("Client", EmbeddingClient, OcrClient)


def embedding_source(name: str = "emb", **fields: Any) -> dict[str, Any]:
    """An OpenAI-compatible embedding source as settings take it."""
    return {
        "name": name,
        "protocol": "openai",
        "base_url": f"http://127.0.0.1:9/{name}/v1",
        "model": "text-embedding-3-small",
        **fields,
    }


def monkey(name: str = "monkey", **fields: Any) -> dict[str, Any]:
    """A MonkeyOCR source."""
    return {
        "name": name,
        "protocol": "monkey_ocr",
        "base_url": f"http://127.0.0.1:7861/{name}",
        **fields,
    }


def vision(name: str = "vision", **fields: Any) -> dict[str, Any]:
    """A vision-model source behind an OpenAI-compatible API."""
    return {
        "name": name,
        "protocol": "vision_ocr",
        "base_url": f"http://127.0.0.1:8002/{name}/v1",
        "model": "Qwen2.5-VL-7B-Instruct",
        **fields,
    }


def embed_settings(*sources: dict[str, Any], **gateway: Any) -> GatewaySettings:
    """Settings with one ``embed`` scope (one default source if none given); no .env is read."""
    scope = {"kind": "embed", "sources": list(sources) or [embedding_source()]}
    return GatewaySettings(_env_file=None, scopes={"embed": scope}, **gateway)


def ocr_settings(*sources: dict[str, Any], **gateway: Any) -> GatewaySettings:
    """Settings with one ``ocr`` scope (MonkeyOCR if no source given); no .env is read."""
    scope = {"kind": "ocr", "sources": list(sources) or [monkey()]}
    return GatewaySettings(_env_file=None, scopes={"ocr": scope}, **gateway)


def mock_wire(settings: GatewaySettings, scope: str, upstream: Handler) -> HttpxTransport:
    """The real httpx transport of ``scope``'s sources, sending through httpx.MockTransport."""
    return HttpxTransport(
        settings.scope(scope).sources,
        max_connections=4,
        mock_transport=httpx.MockTransport(upstream),
    )


def on_clock(
    kind: type[Client],
    settings: GatewaySettings,
    scope: str,
    transport: Transport,
    clock: FakeClock,
    *,
    seed: int,
    emitter: Any = None,
) -> Client:
    """A ``kind`` client on ``transport``, a MemoryBackend and ``clock``; closed at test end."""
    return closing(
        kind(
            settings,
            scope,
            backend=MemoryBackend(now=clock),
            transport=transport,
            now=clock,
            sleep=clock.sleep,
            rng=random.Random(seed),
            emitter=emitter,
        )
    )
