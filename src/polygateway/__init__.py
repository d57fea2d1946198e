"""PolyGateway: the governance layer for asyncio code that calls LLM, embedding and OCR services.

Everything public is re-exported here. ``RedisBackend`` loads lazily, so
``import polygateway`` never imports redis (nor aiohttp, rich or
prometheus_client); using it without the extra says which extra to install.
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
    """Load ``RedisBackend`` on first use, so the redis extra stays optional."""
    if name == "RedisBackend":
        from polygateway.backends.redis import RedisBackend

        return RedisBackend
    raise AttributeError(f"module 'polygateway' has no attribute {name!r}")
