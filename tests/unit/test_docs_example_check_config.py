"""``polygateway check-config`` accepts polygateway.example.toml as committed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from polygateway.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "polygateway.example.toml"
KEY = "sk-example-0123456789abcdef"


@pytest.fixture(autouse=True)
def environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No POLYGATEWAY_* override and no .env; the key variable the example names is set."""
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("POLYGATEWAY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)


def test_check_config_accepts_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 0, every scope of the example shown, the key never printed."""
    assert main(["check-config", "--config", str(EXAMPLE), "--no-env-file"]) == 0
    out = capsys.readouterr().out
    for scope in ("scope chat", "scope embed", "scope ocr"):
        assert scope in out
    assert KEY not in out


def test_check_config_json_says_ok_for_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    """``--json``: one document, ``"ok": true``."""
    assert main(["--json", "check-config", "--config", str(EXAMPLE), "--no-env-file"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_check_config_names_the_missing_key_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the variable ``api_key_env`` names, exit 2 naming it."""
    monkeypatch.delenv("OPENAI_API_KEY")
    assert main(["check-config", "--config", str(EXAMPLE), "--no-env-file"]) == 2
    assert "OPENAI_API_KEY" in capsys.readouterr().err
