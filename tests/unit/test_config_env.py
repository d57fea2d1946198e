"""Errors say where a bad value came from: a variable of the environment or .env, else the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from polygateway.config import GatewaySettings
from polygateway.errors import ConfigError

ONE_SOURCE = """
[scopes.chat]
kind = "chat"
[[scopes.chat.sources]]
name = "a"
protocol = "openai"
base_url = "http://127.0.0.1:8001/v1"
"""


pytestmark = pytest.mark.usefixtures("clean_environment")
"""An empty directory and no PolyGateway variables (``conftest.clean_environment``)."""


def base_toml(tmp_path: Path, extra: str = "") -> Path:
    """``base.toml`` with one chat source (plus ``extra`` lines in its source table)."""
    path = tmp_path / "base.toml"
    path.write_text(ONE_SOURCE + extra)
    return path


def test_a_bad_value_from_the_environment_names_the_variable_not_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """POLYGATEWAY_STALL_WINDOW_S=-1 is reported as that variable, not as base.toml."""
    monkeypatch.setenv("POLYGATEWAY_STALL_WINDOW_S", "-1")
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(base_toml(tmp_path))
    assert info.value.field == "stall_window_s"
    assert info.value.env == "POLYGATEWAY_STALL_WINDOW_S"
    assert info.value.path is None
    assert "from environment variable POLYGATEWAY_STALL_WINDOW_S" in str(info.value)
    assert "base.toml" not in str(info.value)


def test_a_bad_value_from_dotenv_names_the_variable_and_the_dotenv_file(tmp_path: Path) -> None:
    """A bad POLYGATEWAY_MAX_ATTEMPTS in .env names the variable and .env."""
    (tmp_path / ".env").write_text("POLYGATEWAY_MAX_ATTEMPTS=0\n")
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(base_toml(tmp_path))
    assert (info.value.field, info.value.env, info.value.path) == (
        "max_attempts",
        "POLYGATEWAY_MAX_ATTEMPTS",
        ".env",
    )
    assert "from POLYGATEWAY_MAX_ATTEMPTS in .env" in str(info.value)


def test_the_stall_guard_rail_names_the_variable_that_set_the_window(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """stall_window_s below a TTFT timeout, set by a variable: that variable is named."""
    monkeypatch.setenv("POLYGATEWAY_STALL_WINDOW_S", "5")
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(base_toml(tmp_path))
    assert info.value.env == "POLYGATEWAY_STALL_WINDOW_S"
    assert "base.toml" not in str(info.value)


def test_a_bad_value_in_the_file_still_names_the_file(tmp_path: Path) -> None:
    """No variable involved: the file is named, as before."""
    path = tmp_path / "base.toml"
    path.write_text("[gateway]\nmax_attempts = 0\n" + ONE_SOURCE)
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(path)
    assert (info.value.env, info.value.path) == (None, str(path))


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [
        ("POLYGATEWAY_STALL_WINDOW", "POLYGATEWAY_STALL_WINDOW_S"),
        ("POLYGATEWAY_MAX_ATEMPTS", "POLYGATEWAY_MAX_ATTEMPTS"),
        ("polygateway_backend_kind", "POLYGATEWAY_BACKEND"),
    ],
)
def test_an_unknown_variable_is_refused_with_the_closest_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, suggestion: str
) -> None:
    """A misspelt POLYGATEWAY_* variable is an error suggesting the one meant, not ignored."""
    monkeypatch.setenv(name, "10")
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(base_toml(tmp_path))
    assert info.value.env == name
    assert f"unknown setting variable {name}: did you mean {suggestion}?" in str(info.value)


def test_an_unknown_variable_in_dotenv_is_refused_naming_dotenv(tmp_path: Path) -> None:
    """The same in .env, which is named."""
    (tmp_path / ".env").write_text("POLYGATEWAY_STALL_WINDOW=10\n")
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(base_toml(tmp_path))
    assert (info.value.env, info.value.path) == ("POLYGATEWAY_STALL_WINDOW", ".env")


def test_a_key_variable_with_the_prefix_is_not_an_unknown_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A variable an api_key_env names is a key, whatever its prefix."""
    monkeypatch.setenv("POLYGATEWAY_OPENAI_KEY", "sk-test")
    settings = GatewaySettings.load(base_toml(tmp_path, 'api_key_env = "POLYGATEWAY_OPENAI_KEY"\n'))
    key = settings.scope("chat").sources[0].api_key
    assert key is not None
    assert key.get_secret_value() == "sk-test"


def test_an_empty_key_variable_is_reported_as_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OPENAI_API_KEY= is set but empty, which is not what "not set" would send one to fix."""
    monkeypatch.setenv("OPENAI_API_KEY", "")
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(base_toml(tmp_path, 'api_key_env = "OPENAI_API_KEY"\n'))
    assert "'OPENAI_API_KEY'" in str(info.value)
    assert "is set but empty in the environment" in str(info.value)
    assert "not set" not in str(info.value)


def test_an_empty_key_in_dotenv_is_reported_as_empty_there(tmp_path: Path) -> None:
    """OPENAI_API_KEY= in .env: empty in .env."""
    (tmp_path / ".env").write_text("OPENAI_API_KEY=\n")
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(base_toml(tmp_path, 'api_key_env = "OPENAI_API_KEY"\n'))
    assert "is set but empty in .env" in str(info.value)


def test_a_missing_key_variable_is_still_not_set(tmp_path: Path) -> None:
    """Absent everywhere: not set, naming .env too."""
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(base_toml(tmp_path, 'api_key_env = "OPENAI_API_KEY"\n'))
    assert "is not set in the environment nor in .env" in str(info.value)


@pytest.mark.parametrize("value", ["sk-abc\u2019def-SECRET", "sk-abc\x07def-SECRET", "sk-é-SECRET"])
def test_a_key_no_header_can_carry_is_refused_at_load_without_its_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """A pasted curly quote or control character: ConfigError naming the variable, not the value."""
    monkeypatch.setenv("OPENAI_API_KEY", value)
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(base_toml(tmp_path, 'api_key_env = "OPENAI_API_KEY"\n'))
    assert "'OPENAI_API_KEY'" in str(info.value)
    assert "cannot carry" in str(info.value)
    assert "SECRET" not in str(info.value)
    assert info.value.field == "scopes.chat.sources[0].api_key_env"


def test_a_key_with_surrounding_whitespace_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trailing newline (``$(cat key.txt)``) is sendable: the HTTP client trims it."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test\n")
    settings = GatewaySettings.load(base_toml(tmp_path, 'api_key_env = "OPENAI_API_KEY"\n'))
    assert settings.scope("chat").sources[0].api_key is not None
