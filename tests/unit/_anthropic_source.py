"""The Anthropic source the Anthropic wire's unit tests build their requests for."""

from __future__ import annotations

from pydantic import SecretStr

from polygateway.config import SourceConfig

__all__ = ["claude_source"]


def claude_source() -> SourceConfig:
    """An Anthropic source ``claude`` at a test host, its key a secret no error may show."""
    return SourceConfig(
        name="claude",
        protocol="anthropic",
        base_url="https://api.anthropic.test/v1/",
        model="claude-test",
        api_key=SecretStr("sk-ant-test-SECRET-0123"),
    )
