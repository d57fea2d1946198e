"""Where a source's key goes, and the query every request carries: Azure's wire by configuration."""

from __future__ import annotations

import pytest
from pydantic import SecretStr, ValidationError

from polygateway.config import SourceConfig
from polygateway.transport.anthropic import messages_request
from polygateway.transport.openai import chat_request, embedding_request

KEY = "sk-azure-Secret-0123456789"
MESSAGES = [{"role": "user", "content": "hi"}]


def _source(**fields: object) -> SourceConfig:
    base: dict[str, object] = {
        "name": "s",
        "protocol": "openai",
        "base_url": "https://res.openai.azure.com/openai/deployments/gpt4o",
        "api_key": SecretStr(KEY),
    }
    base.update(fields)
    return SourceConfig.model_validate(base)


def test_default_key_is_a_bearer_token() -> None:
    """Without api_key_header the OpenAI wire sends ``Authorization: Bearer``."""
    request = chat_request(_source(), MESSAGES, {}, stream=False, timeout_s=5)
    assert request.headers["Authorization"] == f"Bearer {KEY}"


def test_azure_key_header_and_api_version() -> None:
    """``api_key_header = "api-key"`` sends the key bare; ``query`` lands on every URL."""
    source = _source(api_key_header="api-key", query={"api-version": "2024-10-21"})
    for request in (
        chat_request(source, MESSAGES, {}, stream=False, timeout_s=5),
        embedding_request(source, ["a"], {}, timeout_s=5),
    ):
        assert request.headers["api-key"] == KEY
        assert "Authorization" not in request.headers
        assert request.url.endswith("?api-version=2024-10-21")
    assert chat_request(source, MESSAGES, {}, stream=False, timeout_s=5).url == (
        "https://res.openai.azure.com/openai/deployments/gpt4o/chat/completions"
        "?api-version=2024-10-21"
    )


def test_anthropic_key_header_default_and_override() -> None:
    """Anthropic's key goes in ``x-api-key`` unless api_key_header names another header."""
    plain = messages_request(_source(protocol="anthropic"), MESSAGES, {}, stream=False, timeout_s=5)
    assert plain.headers["x-api-key"] == KEY
    custom = messages_request(
        _source(protocol="anthropic", api_key_header="Authorization"),
        MESSAGES,
        {},
        stream=False,
        timeout_s=5,
    )
    assert custom.headers["Authorization"] == f"Bearer {KEY}"
    assert "x-api-key" not in custom.headers


def test_key_never_in_repr() -> None:
    """The key is in no repr of the source or the request, whatever header carries it."""
    source = _source(api_key_header="api-key")
    request = chat_request(source, MESSAGES, {}, stream=False, timeout_s=5)
    assert KEY not in repr(source)
    assert KEY not in repr(request)


@pytest.mark.parametrize("name", ["api key", "", "api:key"])
def test_api_key_header_must_be_a_header_name(name: str) -> None:
    """A header name cannot hold spaces or colons."""
    with pytest.raises(ValidationError, match="api_key_header"):
        _source(api_key_header=name)


def test_headers_must_not_set_the_key_header() -> None:
    """A fixed value for the key's own header would clash with the key."""
    with pytest.raises(ValidationError, match="carries the key"):
        _source(api_key_header="api-key", headers={"API-Key": "x"})
