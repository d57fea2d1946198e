"""PolyGateway: the governance layer for asyncio code that calls LLM, embedding and OCR services."""

from __future__ import annotations

import logging

from polygateway.errors import (
    AllSourcesExhausted,
    ConfigError,
    GatewayError,
    GatewayUnavailableError,
    GovernanceBackendError,
    RequestRejected,
    StreamInterrupted,
)

logging.getLogger("polygateway").addHandler(logging.NullHandler())

__all__ = [
    "AllSourcesExhausted",
    "ConfigError",
    "GatewayError",
    "GatewayUnavailableError",
    "GovernanceBackendError",
    "RequestRejected",
    "StreamInterrupted",
]
