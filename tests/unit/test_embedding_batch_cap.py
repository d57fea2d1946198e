"""``max_batch_size`` above what the source's provider accepts in one request is refused at load.

OpenAI and Azure OpenAI refuse an embeddings ``input`` array of more than
2048 items with a 400: a larger ``max_batch_size`` on such a source would
fail every full batch at run time, so the settings are refused instead,
naming the source, the field, the value and the provider's limit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from polygateway.config import GatewaySettings
from polygateway.errors import ConfigError

OPENAI = "https://api.openai.com/v1"
AZURE = "https://contoso.openai.azure.com/openai/deployments/embedder"


pytestmark = pytest.mark.usefixtures("clean_environment")
"""An empty directory and no PolyGateway variables (``conftest.clean_environment``)."""


def embed_file(tmp_path: Path, base_url: str, batch: int, *, kind: str = "embed") -> Path:
    """``polygateway.toml`` with one scope of one source ``primary`` at ``base_url``."""
    path = tmp_path / "polygateway.toml"
    path.write_text(
        f"""
[scopes.{kind}]
kind = "{kind}"
[[scopes.{kind}.sources]]
name = "primary"
protocol = "openai"
base_url = "{base_url}"
model = "text-embedding-3-small"
max_batch_size = {batch}
""",
        encoding="utf-8",
    )
    return path


def load_error(path: Path) -> ConfigError:
    """Load ``path`` (no .env) expecting a ConfigError, and return it."""
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(path, env_file=None)
    return info.value


def in_code(*sources: dict[str, Any]) -> GatewaySettings:
    """Settings built in code with one embed scope of ``sources``."""
    return GatewaySettings(scopes={"embed": {"kind": "embed", "sources": list(sources)}})


@pytest.mark.parametrize(("base_url", "service"), [(OPENAI, "OpenAI"), (AZURE, "Azure OpenAI")])
def test_a_source_over_2048_inputs_is_refused_at_load(
    tmp_path: Path, base_url: str, service: str
) -> None:
    """``max_batch_size = 2049``: ConfigError naming the source, the field, the service, 2048."""
    error = load_error(embed_file(tmp_path, base_url, 2049))
    assert error.field == "scopes.embed.sources[0].max_batch_size"
    assert error.scope == "embed"
    message = str(error)
    assert "'primary'" in message
    assert "max_batch_size = 2049" in message
    assert service in message
    assert "2048" in message


@pytest.mark.parametrize("base_url", [OPENAI, AZURE])
def test_a_source_at_2048_inputs_loads(tmp_path: Path, base_url: str) -> None:
    """2048 is what OpenAI and Azure OpenAI accept: the settings load and keep it."""
    settings = GatewaySettings.load(embed_file(tmp_path, base_url, 2048), env_file=None)
    assert settings.scope("embed").sources[0].max_batch_size == 2048


def test_openai_regional_host_is_capped_like_the_global_one(tmp_path: Path) -> None:
    """``eu.api.openai.com`` (data residency) is OpenAI too: 2049 refused."""
    error = load_error(embed_file(tmp_path, "https://eu.api.openai.com/v1", 2049))
    assert error.field == "scopes.embed.sources[0].max_batch_size"
    assert "OpenAI" in str(error)


def test_azure_openai_route_on_a_cognitive_services_host_is_capped(tmp_path: Path) -> None:
    """An Azure OpenAI route (``/openai/...``) on a ``*.cognitiveservices.azure.com`` resource."""
    url = "https://contoso.cognitiveservices.azure.com/openai/deployments/embedder"
    error = load_error(embed_file(tmp_path, url, 2049))
    assert "Azure OpenAI" in str(error)


def test_self_hosted_openai_compatible_server_has_no_cap(tmp_path: Path) -> None:
    """A server of unknown provider (vLLM, say) documents no such limit: 5000 loads."""
    url = "http://127.0.0.1:8000/v1"
    settings = GatewaySettings.load(embed_file(tmp_path, url, 5000), env_file=None)
    assert settings.scope("embed").sources[0].max_batch_size == 5000


def test_chat_scope_source_is_not_capped(tmp_path: Path) -> None:
    """A chat scope sends no batches: its sources' max_batch_size is not checked."""
    path = embed_file(tmp_path, OPENAI, 5000, kind="chat")
    settings = GatewaySettings.load(path, env_file=None)
    assert settings.scope("chat").sources[0].max_batch_size == 5000


def test_the_capped_source_is_named_by_its_index_among_several() -> None:
    """The second source over the cap is the one the field names."""
    with pytest.raises(ConfigError) as info:
        in_code(
            {"name": "local", "protocol": "openai", "base_url": "http://127.0.0.1:8000/v1"},
            {"name": "cloud", "protocol": "openai", "base_url": OPENAI, "max_batch_size": 4096},
        )
    assert info.value.field == "scopes.embed.sources[1].max_batch_size"
    assert "'cloud'" in str(info.value)


def test_the_refusal_shows_no_key_nor_url_credentials() -> None:
    """Neither the API key nor a password in base_url appears in the message."""
    with pytest.raises(ConfigError) as info:
        in_code(
            {
                "name": "cloud",
                "protocol": "openai",
                "base_url": "https://user:url-pass-SECRET@api.openai.com/v1",
                "api_key": "sk-key-SECRET",
                "max_batch_size": 2049,
            }
        )
    message = str(info.value)
    assert "SECRET" not in message
    assert "2048" in message
