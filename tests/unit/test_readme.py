"""README.md's example and error table stay true to the code a newcomer will run."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import polygateway
from polygateway import GatewayError

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def python_blocks() -> list[str]:
    """Every fenced python block of the README."""
    return re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)


def test_the_first_example_compiles_and_branches_on_the_reason() -> None:
    """The example catches AllSourcesExhausted, reads .reason, and imports only public names."""
    example = python_blocks()[0]
    compile(example, "README.md", "exec")
    assert "except AllSourcesExhausted as exc:" in example
    assert "exc.reason ==" in example
    imported = re.search(r"from polygateway import (.+)", example)
    assert imported is not None
    for name in imported.group(1).split(", "):
        assert name in polygateway.__all__, name


def test_the_error_table_names_every_error_and_every_reason() -> None:
    """Each public GatewayError subclass and each AllSourcesExhausted reason has a row."""
    table = README.split("### When a call fails", 1)[1].split("\n## ", 1)[0]
    errors = [
        name
        for name in polygateway.__all__
        if isinstance(getattr(polygateway, name), type)
        and issubclass(getattr(polygateway, name), GatewayError)
        and name not in ("GatewayError", "GatewayUnavailableError")
    ]
    assert errors
    for name in errors:
        assert f"| `{name}`" in table, name
    for reason in ("retry_exhausted", "stalled", "no_runnable", "deadline"):
        assert f'reason="{reason}"' in table, reason


def test_the_extras_table_lists_each_install_extra() -> None:
    """The install table has a row per extra of pyproject.toml but the tools' own, and the
    ``dev`` row names the extras ``dev`` installs."""
    install = README.split("## Install", 1)[1].split("\n## ", 1)[0]
    extras = PYPROJECT["project"]["optional-dependencies"]
    rows = dict(re.findall(r"^\| `([a-z]+)` \| (.*)$", install, flags=re.MULTILINE))
    assert set(rows) == set(extras) - {"bench", "mutation"}
    dev = {m.group(1) for d in extras["dev"] if (m := re.match(r"polygateway\[(.*)\]", d))}
    (dev_extras,) = dev
    assert set(re.findall(r"`([a-z]+)`", rows["dev"])) == set(dev_extras.split(","))
