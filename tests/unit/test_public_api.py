"""The public names (README.md, polygateway.__all__), and what `import polygateway` may load."""

from __future__ import annotations

import json
import subprocess
import sys

import polygateway

CONTRACT = {
    "GatewaySettings",
    "ChatClient",
    "EmbeddingClient",
    "OcrClient",
    "MemoryBackend",
    "RedisBackend",
    "GatewayError",
    "ConfigError",
    "RequestRejected",
    "GatewayUnavailableError",
    "AllSourcesExhausted",
    "GovernanceBackendError",
    "StreamInterrupted",
    "ResponseParseError",
}


def test_all_is_sorted_and_pinned() -> None:
    """`__all__` is sorted and holds exactly the names the package promises."""
    assert polygateway.__all__ == sorted(polygateway.__all__)
    assert set(polygateway.__all__) == CONTRACT | {
        "AttemptRecord",
        "CallRecord",
        "ChatChunk",
        "ChatResponse",
        "Choice",
        "EmbeddingProgress",
        "EmbeddingResponse",
        "Emitter",
        "LayoutBlock",
        "LayoutResult",
        "LoggingEmitter",
        "OpenTelemetryEmitter",
        "PartialEmbeddingResponse",
        "PrometheusEmitter",
        "ScopeConfig",
        "SourceConfig",
        "TextResult",
        "ToolCall",
        "Usage",
    }


def test_every_public_name_resolves() -> None:
    """Each name in `__all__` is importable from the top-level package."""
    for name in polygateway.__all__:
        assert getattr(polygateway, name) is not None, name


def test_import_loads_no_optional_extra() -> None:
    """`import polygateway` imports no optional extra: redis, opentelemetry, prometheus_client..."""
    code = (
        "import json, sys; import polygateway; "
        "print(json.dumps([m for m in ('redis', 'aiohttp', 'rich', 'prometheus_client', "
        "'starlette', 'uvicorn', 'opentelemetry', 'polygateway.middleware.otel') "
        "if m in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert json.loads(out.stdout) == []


def test_redis_backend_loads_lazily() -> None:
    """`polygateway.RedisBackend` is the Redis backend class, loaded on first access."""
    from polygateway.backends.redis import RedisBackend

    assert polygateway.RedisBackend is RedisBackend


def test_opentelemetry_emitter_loads_lazily() -> None:
    """`polygateway.OpenTelemetryEmitter` is the emitter class, loaded on first access."""
    from polygateway.middleware.otel import OpenTelemetryEmitter

    assert polygateway.OpenTelemetryEmitter is OpenTelemetryEmitter


def test_library_logger_has_a_null_handler() -> None:
    """The `polygateway` logger stays quiet unless the application configures logging."""
    import logging

    handlers = logging.getLogger("polygateway").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)
