"""Settings review: bad values refused at load with the key path, secrets never shown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from polygateway.cli.settings_report import report_lines, setting_rows
from polygateway.config import GatewaySettings, SourceConfig
from polygateway.errors import ConfigError

QUERY_KEY = "AIza-query-key-SECRET"

ONE_SOURCE = """
[scopes.chat]
kind = "chat"
[[scopes.chat.sources]]
name = "a"
protocol = "openai"
base_url = "http://127.0.0.1:8001/v1"
"""


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An empty directory (no stray .env) and no PolyGateway variables."""
    for name in list(os.environ):
        if name.upper().startswith("POLYGATEWAY_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def settings_file(tmp_path: Path, extra: str = "") -> Path:
    """``polygateway.toml`` with one chat source (plus ``extra`` lines in its source table)."""
    path = tmp_path / "polygateway.toml"
    path.write_text(ONE_SOURCE + extra, encoding="utf-8")
    return path


def load_error(path: Path) -> ConfigError:
    """Load ``path`` (no .env) expecting a ConfigError, and return it."""
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(path, env_file=None)
    return info.value


# --- secrets never printed ---------------------------------------------------------------


def test_a_credential_query_parameter_is_masked_when_printed() -> None:
    """``query = {key = ...}`` is masked in repr and dumps as ``?key=`` in base_url is."""
    src = SourceConfig(
        name="a",
        protocol="openai",
        base_url="https://api.example/v1",
        query={"key": QUERY_KEY, "api-version": "2024-06-01"},
    )
    assert src.query["key"] == QUERY_KEY
    for shown in (repr(src), str(src), src.model_dump_json(), str(src.model_dump())):
        assert QUERY_KEY not in shown
        assert "2024-06-01" in shown


def test_check_config_report_masks_a_credential_query_parameter(tmp_path: Path) -> None:
    """The check-config report shows a credential query value as ``***``, never the value."""
    path = settings_file(tmp_path, f'query = {{key = "{QUERY_KEY}", "api-version" = "v1"}}\n')
    settings = GatewaySettings.load(path, env_file=None)
    rows = setting_rows(settings, {"scopes": {}}, str(path), None)
    report = "\n".join(report_lines(rows))
    assert QUERY_KEY not in report
    assert "key=***, api-version=v1" in report
