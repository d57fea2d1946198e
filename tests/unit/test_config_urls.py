"""What every call sends is checked at load: the URL, the headers and the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from polygateway.config import GatewaySettings
from polygateway.errors import ConfigError

FIELD = "scopes.chat.sources[0].base_url"


def settings_with(base_url: str, protocol: str = "openai") -> GatewaySettings:
    """Settings of one chat source at ``base_url``, built in code."""
    source = {"name": "a", "protocol": protocol, "base_url": base_url}
    return GatewaySettings(scopes={"chat": {"kind": "chat", "sources": [source]}})


@pytest.mark.parametrize(
    ("base_url", "says"),
    [
        ("http://127.0.0.1:99999/v1", "port outside 1-65535"),
        ("http://127.0.0.1:0/v1", "port outside 1-65535"),
        ("http://127.0.0.1:http/v1", "port outside 1-65535"),
        ("http://exa mple.com/v1", "whitespace"),
        ("http://example.com/v1 ", "whitespace"),
        ("http:///v1", "no host"),
        ("ftp://example.com/v1", "http:// or https://"),
        ("127.0.0.1:8001", "http:// or https://"),
    ],
)
def test_an_unusable_base_url_is_refused_naming_the_field(base_url: str, says: str) -> None:
    """Each unusable URL is a ConfigError on the source's base_url, saying what is wrong."""
    with pytest.raises(ConfigError) as info:
        settings_with(base_url)
    assert info.value.field == FIELD
    assert says in str(info.value)


@pytest.mark.parametrize(
    ("base_url", "protocol", "fixed"),
    [
        ("http://h:8001/v1/chat/completions", "openai", "http://h:8001/v1"),
        ("http://h:8001/v1/chat/completions/", "openai", "http://h:8001/v1"),
        ("https://api.anthropic.com/v1/messages", "anthropic", "https://api.anthropic.com/v1"),
        ("http://h/v1/embeddings", "openai", "http://h/v1"),
        ("http://ocr.local:7861/ocr/text", "openai", "http://ocr.local:7861"),
        ("http://ocr.local:7861/parse", "openai", "http://ocr.local:7861"),
    ],
)
def test_a_base_url_ending_in_an_endpoint_path_is_refused_with_the_fix(
    base_url: str, protocol: str, fixed: str
) -> None:
    """The wire appends the endpoint path: the message gives the URL to write instead."""
    with pytest.raises(ConfigError) as info:
        settings_with(base_url, protocol)
    assert info.value.field == FIELD
    assert f"write {fixed!r}" in str(info.value)


def test_the_corrected_url_keeps_its_password_masked() -> None:
    """A password in the refused URL never reaches the message."""
    with pytest.raises(ConfigError) as info:
        settings_with("http://user:pw-SECRET@h/v1/chat/completions")
    assert "SECRET" not in str(info.value)
    assert "http://user:***@h/v1" in str(info.value)


@pytest.mark.parametrize(
    "base_url",
    [
        "http://127.0.0.1:8001/v1",
        "https://api.openai.com/v1",
        "http://[::1]:65535/v1",
        "https://example.openai.azure.com/openai/deployments/gpt",
        "http://localhost",
    ],
)
def test_a_usable_base_url_is_kept_as_written(base_url: str) -> None:
    """Good URLs pass unchanged."""
    assert settings_with(base_url).scope("chat").sources[0].base_url == base_url


def test_a_file_with_a_bad_port_names_the_field_and_the_file(tmp_path: Path) -> None:
    """Loaded from TOML, the error names the file too, as every load error does."""
    path = tmp_path / "polygateway.toml"
    path.write_text(
        '[scopes.chat]\nkind = "chat"\n[[scopes.chat.sources]]\nname = "a"\n'
        'protocol = "openai"\nbase_url = "http://127.0.0.1:99999/v1"\n'
    )
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(path, env_file=None)
    assert info.value.field == FIELD
    assert info.value.path == str(path)
    assert "port outside 1-65535" in str(info.value)


@pytest.mark.parametrize(
    ("headers", "says"),
    [
        ({"X-Org": "acme\u2019s"}, "cannot carry"),
        ({"X-Org": "a\nb"}, "cannot carry"),
        ({"X Org": "acme"}, "not an HTTP header name"),
    ],
)
def test_a_header_no_request_can_carry_is_refused(headers: dict[str, str], says: str) -> None:
    """Headers are checked at load, naming the header, instead of failing on every call."""
    source = {"name": "a", "protocol": "openai", "base_url": "http://h/v1", "headers": headers}
    with pytest.raises(ConfigError) as info:
        GatewaySettings(scopes={"chat": {"kind": "chat", "sources": [source]}})
    assert info.value.field == f"scopes.chat.sources[0].headers.{next(iter(headers))}"
    assert says in str(info.value)


def test_a_key_given_in_code_must_be_sendable_too() -> None:
    """``api_key=SecretStr(...)`` in code gets the same check, its value never shown."""
    source = {
        "name": "a",
        "protocol": "openai",
        "base_url": "http://h/v1",
        "api_key": SecretStr("sk-\u2019-SECRET"),
    }
    with pytest.raises(ConfigError) as info:
        GatewaySettings(scopes={"chat": {"kind": "chat", "sources": [source]}})
    assert info.value.field == "scopes.chat.sources[0].api_key"
    assert "SECRET" not in str(info.value)
