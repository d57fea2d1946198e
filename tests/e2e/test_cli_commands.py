"""``polygateway chat|embed|ocr|simulate`` for a real configuration file, against a simulator.

The simulator itself is started the way a user would: ``polygateway simulate``
in its own process, on a free port read from its first line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_run import RunCli, assert_one_line_error, cli_env

from polygateway.cli.samples import tiny_pdf, tiny_png

KEY = "sk-sim-e2e-secret-key-42"


def config(url: str, *, max_attempts: int = 3) -> str:
    """Chat, embed and OCR scopes on the simulator's source ``a``; the key comes from SIM_KEY."""
    return f"""
[gateway]
max_attempts = {max_attempts}
backoff_base_s = 0.01
backoff_cap_s = 0.02

[scopes.chat]
kind = "chat"
[[scopes.chat.sources]]
name = "a"
protocol = "openai"
base_url = "{url}/a/v1"
model = "sim"
api_key_env = "SIM_KEY"
timeout_s = 5

[scopes.embed]
kind = "embed"
[[scopes.embed.sources]]
name = "a"
protocol = "openai"
base_url = "{url}/a/v1"
api_key_env = "SIM_KEY"
max_batch_size = 2

[scopes.ocr]
kind = "ocr"
[[scopes.ocr.sources]]
name = "a"
protocol = "monkey_ocr"
base_url = "{url}/a"
"""


@pytest.fixture
def configured(tmp_path: Path, simulator: str) -> Path:
    """``polygateway.toml`` in the run's directory, pointing at the simulator."""
    path = tmp_path / "polygateway.toml"
    path.write_text(config(simulator))
    return path


ENV = {"SIM_KEY": KEY}


@pytest.mark.usefixtures("configured")
def test_chat_json_returns_the_answer_its_source_and_attempts(run_cli: RunCli) -> None:
    """``chat --json``: the text, the serving source, usage and one successful attempt."""
    ran = run_cli("chat", "--json", "hello", "there", env=ENV)
    assert ran.code == 0, ran.stderr
    doc = ran.json()
    assert doc["text"]
    assert doc["source"] == "a"
    assert doc["usage"]["total_tokens"] > 0
    assert [a["outcome"] for a in doc["attempts"]] == ["success"]
    assert KEY not in ran.output


@pytest.mark.usefixtures("configured")
def test_chat_stream_prints_the_answer_as_it_comes(run_cli: RunCli) -> None:
    """``chat --stream`` with the prompt on stdin: the streamed text on stdout, exit 0."""
    ran = run_cli("chat", "--stream", stdin="tell me a story", env=ENV)
    assert ran.code == 0, ran.stderr
    assert ran.stdout.strip()
    streamed = run_cli("chat", "--stream", "--json", "again", env=ENV)
    assert streamed.code == 0, streamed.stderr
    assert streamed.json()["finish_reason"] == "stop"
    assert streamed.json()["source"] == "a"


@pytest.mark.usefixtures("configured")
def test_embed_returns_one_vector_per_text_in_batches(run_cli: RunCli, tmp_path: Path) -> None:
    """``embed``: vectors in input order from args (JSON) and from a file (table)."""
    ran = run_cli("embed", "--json", "alpha", "beta", "gamma", env=ENV)
    assert ran.code == 0, ran.stderr
    doc = ran.json()
    assert len(doc["vectors"]) == 3
    assert doc["batches"] == [[0, 2], [2, 3]]
    assert doc["sources"] == ["a", "a"]
    (tmp_path / "texts.txt").write_text("one\n\ntwo\n")
    table = run_cli("embed", "--file", "texts.txt", env=ENV)
    assert table.code == 0, table.stderr
    assert "one" in table.stdout
    assert "two" in table.stdout
    assert "2 vectors of dimension" in table.stderr


@pytest.mark.usefixtures("configured")
def test_ocr_reads_text_of_a_png_and_layout_of_a_pdf(run_cli: RunCli, tmp_path: Path) -> None:
    """``ocr page.png`` gives text; ``ocr --layout doc.pdf --json`` gives blocks and markdown."""
    (tmp_path / "page.png").write_bytes(tiny_png())
    (tmp_path / "doc.pdf").write_bytes(tiny_pdf())
    text = run_cli("ocr", "page.png", env=ENV)
    assert text.code == 0, text.stderr
    assert text.stdout.strip()
    layout = run_cli("ocr", "--layout", "--json", "doc.pdf", env=ENV)
    assert layout.code == 0, layout.stderr
    doc = layout.json()
    assert doc["blocks"]
    assert doc["markdown"]
    assert doc["source"] == "a"


def test_a_call_the_gateway_cannot_serve_fails_in_one_line(tmp_path: Path, run_cli: RunCli) -> None:
    """Nothing listening upstream: exit 1, one line with the typed reason, no key, no traceback."""
    (tmp_path / "polygateway.toml").write_text(config("http://127.0.0.1:9", max_attempts=2))
    ran = run_cli("chat", "hello", env=ENV)
    line = assert_one_line_error(ran, 1)
    assert "retry_exhausted" in line
    assert "scope='chat'" in line
    assert KEY not in ran.output


@pytest.mark.usefixtures("configured")
def test_unknown_scope_and_unreadable_file_are_one_line_errors(run_cli: RunCli) -> None:
    """A scope the file lacks is a config error (2); a missing input file is an error (1)."""
    line = assert_one_line_error(run_cli("chat", "--scope", "nope", "hi", env=ENV), 2)
    assert "no scope named 'nope'" in line
    line = assert_one_line_error(run_cli("ocr", "missing.png", env=ENV), 1)
    assert "cannot read missing.png" in line


@pytest.mark.usefixtures("configured")
def test_chat_without_a_prompt_is_a_usage_error(run_cli: RunCli) -> None:
    """``chat`` with no prompt and nothing on stdin: exit 2 with chat's usage, no call made."""
    ran = run_cli("chat", stdin="", env=ENV)
    assert ran.code == 2, ran.output
    assert ran.stderr.startswith("usage: polygateway chat ")
    assert ran.stderr.splitlines()[-1] == (
        "polygateway chat: error: nothing to send: give a prompt or pipe one on stdin"
    )
    assert ran.stdout == ""
    doc = run_cli("--json", "chat", stdin="", env=ENV).json()
    assert doc["error"]["type"] == "UsageError"


def test_simulate_is_the_simulators_own_command_line(run_cli: RunCli) -> None:
    """``simulate --list-profiles`` reaches the simulator's parser and lists its profiles."""
    ran = run_cli("simulate", "--list-profiles")
    assert ran.code == 0, ran.stderr
    for name in ("healthy", "rate_limited", "failing", "flaky"):
        assert f"{name}:" in ran.stdout


def test_help_lists_every_command_and_no_command_is_a_usage_error(run_cli: RunCli) -> None:
    """``--help`` names every sub-command; no sub-command exits 2 with usage."""
    ran = run_cli("--help")
    assert ran.code == 0
    for command in ("demo", "simulate", "check-config", "status", "chat", "embed", "ocr"):
        assert command in ran.stdout
    bare = run_cli()
    assert bare.code == 2
    assert "usage:" in bare.stderr
    assert "Traceback" not in bare.output


def test_importing_the_cli_loads_neither_rich_nor_the_simulator() -> None:
    """``import polygateway.cli`` (and building its parser) leaves rich and uvicorn unloaded."""
    code = (
        "import sys, polygateway.cli as c; c.build_parser(); "
        "print(sorted(m for m in ('rich', 'uvicorn', 'starlette', 'redis') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_make_demo_installs_what_it_needs_before_running(tmp_path: Path) -> None:
    """``make -n demo`` on a fresh tree: create the venv, install sim and cli, then run the demo."""
    root = Path(__file__).resolve().parents[2]
    for name in ("Makefile", "pyproject.toml"):
        (tmp_path / name).write_bytes((root / name).read_bytes())
    done = subprocess.run(
        ["make", "-n", "demo"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    venv = next(i for i, line in enumerate(lines) if "-m venv .venv" in line)
    install = next(i for i, line in enumerate(lines) if "pip install" in line and "sim" in line)
    run = next(i for i, line in enumerate(lines) if "-m polygateway demo" in line)
    assert venv < install < run
    assert "cli" in lines[install]
