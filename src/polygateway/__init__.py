"""PolyGateway: the governance layer for asyncio code that calls LLM, embedding and OCR services.

Everything public is re-exported here. ``RedisBackend`` and
``OpenTelemetryEmitter`` load lazily, so ``import polygateway`` never imports
redis or opentelemetry (nor aiohttp, rich or prometheus_client); using one
without its extra says which extra to install.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings, ScopeConfig, SourceConfig
from polygateway.embedding import EmbeddingClient
from polygateway.errors import (
    AllSourcesExhausted,
    ConfigError,
    GatewayError,
    GatewayUnavailableError,
    GovernanceBackendError,
    RequestRejected,
    ResponseParseError,
    StreamInterrupted,
)
from polygateway.middleware.telemetry import Emitter, LoggingEmitter, PrometheusEmitter
from polygateway.models import (
    AttemptRecord,
    CallRecord,
    ChatChunk,
    ChatResponse,
    Choice,
    EmbeddingProgress,
    EmbeddingResponse,
    LayoutBlock,
    LayoutResult,
    PartialEmbeddingResponse,
    TextResult,
    ToolCall,
    Usage,
)
from polygateway.ocr import OcrClient

if TYPE_CHECKING:
    from polygateway.backends.redis import RedisBackend
    from polygateway.middleware.otel import OpenTelemetryEmitter

logging.getLogger("polygateway").addHandler(logging.NullHandler())

__all__ = [
    "AllSourcesExhausted",
    "AttemptRecord",
    "CallRecord",
    "ChatChunk",
    "ChatClient",
    "ChatResponse",
    "Choice",
    "ConfigError",
    "EmbeddingClient",
    "EmbeddingProgress",
    "EmbeddingResponse",
    "Emitter",
    "GatewayError",
    "GatewaySettings",
    "GatewayUnavailableError",
    "GovernanceBackendError",
    "LayoutBlock",
    "LayoutResult",
    "LoggingEmitter",
    "MemoryBackend",
    "OcrClient",
    "OpenTelemetryEmitter",
    "PartialEmbeddingResponse",
    "PrometheusEmitter",
    "RedisBackend",
    "RequestRejected",
    "ResponseParseError",
    "ScopeConfig",
    "SourceConfig",
    "StreamInterrupted",
    "TextResult",
    "ToolCall",
    "Usage",
]


def __getattr__(name: str) -> Any:
    """Load ``RedisBackend`` and ``OpenTelemetryEmitter`` on first use (optional extras)."""
    if name == "RedisBackend":
        from polygateway.backends.redis import RedisBackend

        return RedisBackend
    if name == "OpenTelemetryEmitter":
        from polygateway.middleware.otel import OpenTelemetryEmitter

        return OpenTelemetryEmitter
    raise AttributeError(f"module 'polygateway' has no attribute {name!r}")
