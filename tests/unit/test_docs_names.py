"""README.md and the guides name only settings, commands and public names that exist.

Covers README.md, research-wiki/guides/observability.md and
research-wiki/guides/redis-fleet.md: their Python snippets are scripts or
say they are fragments, import only what the package exports, their TOML
blocks load as settings, their command lines parse with the CLI's own
parser, and every setting, environment variable and constant they state is
the code's. tests/integration/test_docs_snippets.py runs the snippets.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import os
import re
import shlex
from pathlib import Path

import pytest

import polygateway
from polygateway.backends.redis import RedisBackend, limiter
from polygateway.cli import build_parser
from polygateway.config import PROGRESS_TTL_S, GatewaySettings, ScopeConfig, SourceConfig
from polygateway.config.models import PriorityClassConfig
from polygateway.middleware import gauges, otel

REPO = Path(__file__).resolve().parents[2]
DOCS = {
    name: (REPO / name).read_text(encoding="utf-8")
    for name in (
        "README.md",
        "research-wiki/guides/observability.md",
        "research-wiki/guides/redis-fleet.md",
    )
}
SETTINGS_FIELDS = (
    set(GatewaySettings.model_fields)
    | set(ScopeConfig.model_fields)
    | set(SourceConfig.model_fields)
    | set(PriorityClassConfig.model_fields)
)
PACKAGES = {p.name for p in (REPO / "src/polygateway").iterdir() if p.is_dir()}
"""The package's subpackages: a dotted name under one of them is code."""
SCOPE = """
[scopes.chat]
kind = "chat"
[[scopes.chat.sources]]
name = "a"
protocol = "openai"
base_url = "http://127.0.0.1:9/v1"
"""
"""A scope for a TOML block that shows only ``[gateway]`` keys."""


def blocks(lang: str) -> list[tuple[str, str]]:
    """Every fenced ``lang`` block of the documents, as ``(document, text)``."""
    return [
        (name, block)
        for name, text in DOCS.items()
        for block in re.findall(rf"```{lang}\n(.*?)```", text, flags=re.DOTALL)
    ]


def free_names(tree: ast.Module) -> set[str]:
    """Names a snippet reads but neither binds nor gets from builtins."""
    bound: set[str] = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return read - bound


@pytest.mark.parametrize(("doc", "snippet"), blocks("python"))
def test_a_python_snippet_is_a_script_or_says_it_is_a_fragment(doc: str, snippet: str) -> None:
    """A snippet that needs names from elsewhere, or awaits at top level, starts ``# Fragment:``."""
    tree = ast.parse(snippet)
    try:
        compile(snippet, doc, "exec")
        whole = not free_names(tree)
    except SyntaxError:  # `await` or `async with` outside a function
        whole = False
    if not whole:
        assert snippet.startswith("# Fragment: "), (doc, free_names(tree))


@pytest.mark.parametrize(("doc", "snippet"), blocks("python"))
def test_a_python_snippet_imports_only_what_exists(doc: str, snippet: str) -> None:
    """``from polygateway import X`` names a public name; other imports resolve."""
    tree = ast.parse(snippet)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] == "opentelemetry" and "sdk" in node.module:
                continue  # the SDK is the application's, not an extra of ours
            module = importlib.import_module(node.module)
            for alias in node.names:
                if node.module == "polygateway":
                    assert alias.name in polygateway.__all__, (doc, alias.name)
                assert hasattr(module, alias.name), (doc, node.module, alias.name)


def test_snippet_names_of_the_package_exist() -> None:
    """Dotted names a document writes out (``polygateway.middleware.telemetry.X``) import."""
    for doc, text in DOCS.items():
        for dotted in set(re.findall(r"`(polygateway(?:\.[A-Za-z_]+)+)`", text)):
            if dotted.split(".")[1] not in PACKAGES:
                continue  # an attribute name (`polygateway.scope`) or a file, not code
            module, _, name = dotted.rpartition(".")
            try:
                importlib.import_module(dotted)
            except ImportError:
                assert hasattr(importlib.import_module(module), name), (doc, dotted)


def command_lines() -> list[tuple[str, str]]:
    """Every ``polygateway ...`` command line of the documents, comments cut off."""
    found = []
    for doc, text in DOCS.items():
        for block in re.findall(r"```(?:sh|bash|)\n(.*?)```", text, flags=re.DOTALL):
            for line in block.splitlines():
                line = line.split("#", 1)[0].strip().strip("'")
                if line.startswith("polygateway "):
                    found.append((doc, line))
        for inline in re.findall(r"`(polygateway [^`]+)`", text):
            found.append((doc, inline))
    return found


@pytest.mark.parametrize(("doc", "line"), command_lines())
def test_a_command_line_parses(doc: str, line: str) -> None:
    """Each command line a document shows is one the CLI's parser accepts."""
    argv = shlex.split(line.replace("; tmux wait-for -S pgw-done", ""))[1:]
    if argv[0] == "simulate":
        return  # handed whole to the simulator's own parser
    args = build_parser().parse_args(argv)
    assert args.command == argv[0] or argv[0].startswith("-"), (doc, line)


def test_every_setting_a_document_assigns_is_a_field() -> None:
    """Each backticked ``name = value`` and each ``redis_*`` name is a settings field."""
    for doc, text in DOCS.items():
        for code in re.findall(r"`([^`\n]+)`", text):
            assigned = re.match(r"([a-z][a-z0-9_]*) = ", code)
            if assigned:
                assert assigned.group(1) in SETTINGS_FIELDS, (doc, code)
            if re.fullmatch(r"redis_[a-z_]+", code):
                assert code in GatewaySettings.model_fields, (doc, code)


def test_every_environment_variable_named_is_a_setting() -> None:
    """``POLYGATEWAY_X`` in a document overrides the gateway setting ``x``."""
    for doc, text in DOCS.items():
        for name in re.findall(r"POLYGATEWAY_([A-Z_]+[A-Z])", text):
            assert name.lower() in GatewaySettings.model_fields, (doc, name)


def load(text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> GatewaySettings:
    """``text`` as a settings file, with the README's key variables set."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-docs-0123456789")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-docs-0123")
    path = tmp_path / "polygateway.toml"
    path.write_text(text, encoding="utf-8")
    return GatewaySettings.load(path, env_file=None)


@pytest.mark.parametrize(("doc", "block"), blocks("toml"))
def test_a_toml_block_loads_as_settings(
    doc: str, block: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A TOML block loads (a ``[gateway]``-only block with a scope added; the README's classes
    added to its first block's scope)."""
    for name in [n for n in os.environ if n.startswith("POLYGATEWAY_")]:
        monkeypatch.delenv(name)
    readme_first = blocks("toml")[0][1]
    if block.startswith("[scopes.chat]\nkind"):  # the README's classes for its first scope
        classes = block.split('kind = "chat"\n', 1)[1]
        text = readme_first.replace('kind = "chat"\n', 'kind = "chat"\n' + classes, 1)
    elif "[scopes." not in block:
        text = block + SCOPE
    else:
        text = block
    settings = load(text, tmp_path, monkeypatch)
    assert settings.scopes


def test_constants_the_guides_state_are_the_codes() -> None:
    """Timeouts, windows and lifetimes the guides state are the code's constants."""
    guide = " ".join(DOCS["research-wiki/guides/observability.md"].split())
    assert gauges.SCRAPE_TIMEOUT_S == 2.0
    assert guide.count("at most 2 s") == 2
    assert otel._MAX_PENDING_CALLS == 4096
    assert "latest 4,096 calls" in guide
    fleet = " ".join(DOCS["research-wiki/guides/redis-fleet.md"].split())
    timeout = inspect.signature(RedisBackend).parameters["socket_timeout_s"].default
    assert timeout == GatewaySettings.model_fields["redis_socket_timeout_s"].default == 1.0
    assert "(`socket_timeout_s`, default 1 s," in fleet
    assert limiter._HANDOFF_TTL_S == 1.0
    assert "holds it `min(1 s, redis_socket_timeout_s)` at most" in fleet
    assert limiter._WAITING_TTL_S == 60
    assert "Registrations lapse 60 s after a process's last refused poll" in fleet
    assert limiter._LATE_REPLY_S == 60.0
    assert "a connection silent for 60 s with replies due is remade" in fleet
    assert PROGRESS_TTL_S == 3600.0
    assert "| when the scope last served; TTL 3600 s |" in fleet
    emitter = (
        "`OpenTelemetryEmitter(tracer_provider=None, meter_provider=None, *, propagate=False)`"
    )
    assert emitter in guide
    assert str(inspect.signature(polygateway.OpenTelemetryEmitter)) == (
        "(tracer_provider: 'Any' = None, meter_provider: 'Any' = None, *, "
        "propagate: 'bool' = False) -> 'None'"
    )


def test_every_file_a_document_names_exists() -> None:
    """Paths to pages, tests and modules resolve (from the root, the wiki, or their folders)."""
    bases = [
        REPO / base
        for base in (
            ".",
            "research-wiki",
            "research-wiki/guides",
            "tests/integration",
            "tests/e2e",
            "src/polygateway",
            "src/polygateway/backends/redis",
        )
    ]
    for doc, text in DOCS.items():
        for path in set(re.findall(r"[\w./-]+\.(?:py|md|toml)\b", text)):
            if path == "polygateway.toml":
                continue  # the reader's own settings file
            assert any((base / path).exists() for base in bases), (doc, path)
