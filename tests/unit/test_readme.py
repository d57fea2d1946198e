"""README.md's example and error table stay true to the code a newcomer will run."""

from __future__ import annotations

import re
from pathlib import Path

import polygateway
from polygateway import GatewayError

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


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
    """The install section names each extra a user may need."""
    install = README.split("## Install", 1)[1].split("\n## ", 1)[0]
    for extra in ("redis", "aiohttp", "prometheus", "cli", "sim", "dev"):
        assert f"| `{extra}` |" in install, extra
