"""``polygateway.example.toml`` against the settings model it claims to document in full."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from polygateway.config import GatewaySettings
from polygateway.config.models import ScopeConfig, SourceConfig

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "polygateway.example.toml"


def _generator() -> ModuleType:
    """``tools/example_config.py``, imported from its path (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "example_config", REPO / "tools/example_config.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("example_config", module)
    spec.loader.exec_module(module)
    return module


gen = _generator()


def _chat_source_block(text: str) -> str:
    """The lines of the first ``[[scopes.chat.sources]]`` table, comments included."""
    block = text.split("[[scopes.chat.sources]]", 1)[1]
    return block.split("\n\n", 1)[0]


def problems(text: str) -> list[str]:
    """What is missing from ``text`` or differs from the model's defaults (empty: all good).

    ``[gateway]``: every setting present with the model's default. The first
    chat source: every field present, as ``key = value`` or ``# key = value``;
    a value other than the default says ``(default: X)`` with the model's X on
    its line, and a commented-out key has no default (setting it changes
    behaviour). ``api_key`` is refused in a file: named in a comment instead.
    """
    found: list[str] = []
    data = tomllib.loads(text)
    gateway = data.get("gateway", {})
    for name in GatewaySettings.model_fields:
        if name == "scopes":
            continue
        if name not in gateway:
            found.append(f"[gateway] lacks {name}")
        elif gateway[name] != gen.model_default(GatewaySettings, name):
            found.append(f"[gateway] {name} = {gateway[name]!r}, model default differs")
    chat = data.get("scopes", {}).get("chat", {})
    for name in ScopeConfig.model_fields:
        if name not in chat and not re.search(rf"^# {name} = ", text, re.MULTILINE):
            found.append(f"[scopes.chat] lacks {name}")
    source: dict[str, Any] = (chat.get("sources") or [{}])[0]
    block = _chat_source_block(text) if "[[scopes.chat.sources]]" in text else ""
    for name in SourceConfig.model_fields:
        default = gen.model_default(SourceConfig, name)
        line = re.search(rf"^(# )?{name}( =|:) .*$", block, re.MULTILINE)
        if line is None:
            found.append(f"chat source lacks {name}")
            continue
        if line.group(1):  # commented out
            if default is not None and name != "api_key":
                found.append(f"chat source {name} is commented out but has a default")
            continue
        value = source.get(name)
        if value == default or name in ("name", "protocol", "base_url"):
            continue
        shown = "none" if default is None else gen.toml_value(default)
        if f"(default: {shown})" not in line.group(0):
            found.append(f"chat source {name}: the line does not give the default {shown}")
    return found


def test_committed_example_is_what_make_example_config_writes() -> None:
    """The committed file is the generator's output byte for byte (else: make example-config)."""
    assert EXAMPLE.read_text(encoding="utf-8") == gen.render()


def test_committed_example_has_every_key_with_the_models_default() -> None:
    """Every model field is in the example, and every value shown is the default or says it."""
    assert problems(EXAMPLE.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        ("tpm_burst = 2000", "", "chat source lacks tpm_burst"),
        ("connect_timeout_s = 5.0", "", "chat source lacks connect_timeout_s"),
        ("lease_grace_s = 30.0", "lease_grace_s = 31.0", "lease_grace_s = 31.0"),
        ("max_attempts = 3", "", "[gateway] lacks max_attempts"),
        ("(default: none)", "(default: 5)", "does not give the default none"),
        ("timeout_s = 60.0", "timeout_s = 61.0", "timeout_s: the line does not give"),
        ("# exempt_429", "# exempt-429", "[scopes.chat] lacks exempt_429"),
    ],
)
def test_the_check_catches_a_missing_key_or_a_stale_default(
    old: str, new: str, problem: str
) -> None:
    """The check fails on an example with one key dropped or one default changed."""
    text = gen.render()
    assert old in text
    doctored = text.replace(old, new, 1)
    assert any(problem in p for p in problems(doctored)), problems(doctored)


def test_a_model_field_without_a_note_stops_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new setting cannot be left out: a field the generator has no line for is an error."""
    notes = dict(gen.SOURCE_NOTES)
    del notes["tpm_burst"]
    monkeypatch.setattr(gen, "SOURCE_NOTES", notes)
    with pytest.raises(SystemExit, match=r"undocumented fields \['tpm_burst'\]"):
        gen.render()


def test_check_mode_reports_a_stale_file(tmp_path: Path) -> None:
    """``--check PATH``: exit 1 for a stale copy, 0 for a fresh one."""
    path = tmp_path / "example.toml"
    path.write_text(gen.render().replace("max_attempts = 3", "max_attempts = 4"), encoding="utf-8")
    assert gen.main(["--check", str(path)]) == 1
    assert gen.main([str(path)]) == 0
    assert gen.main(["--check", str(path)]) == 0


def test_example_loads_as_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The example is a valid settings file as committed (the key variable set)."""
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("POLYGATEWAY_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-example")
    settings = GatewaySettings.load(EXAMPLE, env_file=None)
    assert sorted(settings.scopes) == ["chat", "embed", "ocr"]
    assert settings.scope("chat").sources[0].tpm_burst is None
