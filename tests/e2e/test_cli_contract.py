"""The command line's contract with a newcomer: bad URLs refused at load, typed errors only.

Each test runs ``python -m polygateway ...`` as a user does and pins the exact
exit code, stdout and stderr.
"""

from __future__ import annotations

import argparse
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_run import Ran, RunCli, assert_one_line_error, cli_command, cli_env

from polygateway.cli import build_parser
from polygateway.cli.samples import tiny_png

BAD_PORT = """
[gateway]
max_attempts = 2
backoff_base_s = 0.01
backoff_cap_s = 0.02

[scopes.chat]
kind = "chat"
[[scopes.chat.sources]]
name = "a"
protocol = "openai"
base_url = "{url}"
model = "m"
"""


def write_config(tmp_path: Path, url: str) -> None:
    """``polygateway.toml`` with one chat source at ``url``."""
    (tmp_path / "polygateway.toml").write_text(BAD_PORT.format(url=url))


def test_a_port_out_of_range_is_refused_by_check_config_and_chat(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """Port 99999: check-config and chat both exit 2 naming the field and the file, no group."""
    write_config(tmp_path, "http://127.0.0.1:99999/v1")
    for args in (("check-config",), ("chat", "hi")):
        ran = run_cli(*args)
        line = assert_one_line_error(ran, 2)
        assert "base_url has a port outside 1-65535" in line
        assert "scopes.chat.sources[0].base_url" in line
        assert "polygateway.toml" in line
        assert "ExceptionGroup" not in ran.output
        assert ran.stdout == ""


def test_a_base_url_with_the_endpoint_path_is_refused_with_the_fix(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """``.../v1/chat/completions``: exit 2 and the URL to write instead."""
    write_config(tmp_path, "http://127.0.0.1:8001/v1/chat/completions")
    line = assert_one_line_error(run_cli("check-config"), 2)
    assert "write 'http://127.0.0.1:8001/v1'" in line


# --- --json: one document on stdout, success or failure ---------------------------------

SIMULATED = """
[gateway]
max_attempts = 2
backoff_base_s = 0.01
backoff_cap_s = 0.02

[scopes.chat]
kind = "chat"
[[scopes.chat.sources]]
name = "a"
protocol = "openai"
base_url = "{url}/a/v1"
model = "sim"

[scopes.embed]
kind = "embed"
[[scopes.embed.sources]]
name = "a"
protocol = "openai"
base_url = "{url}/a/v1"

[scopes.ocr]
kind = "ocr"
[[scopes.ocr.sources]]
name = "a"
protocol = "monkey_ocr"
base_url = "{url}/a"
"""

NOBODY = "http://127.0.0.1:9"
"""The discard port: nothing listens, every connect is refused."""


def error_of(ran: Ran, code: int) -> dict[str, Any]:
    """The run failed with ``code``, printed one JSON failure on stdout and nothing on stderr."""
    assert ran.code == code, (ran.code, ran.stdout, ran.stderr)
    assert ran.stderr == ""
    assert ran.stdout.count("\n") == 1
    doc = ran.json()
    assert doc["ok"] is False
    assert set(doc) == {"ok", "error"}
    error: dict[str, Any] = doc["error"]
    assert {"type", "message", "reason"} <= set(error)
    return error


@pytest.mark.parametrize("where", ["before", "after"])
def test_json_is_global_before_or_after_the_command(
    tmp_path: Path, run_cli: RunCli, simulator: str, where: str
) -> None:
    """``polygateway --json chat hi`` and ``polygateway chat hi --json``: the same one document."""
    (tmp_path / "polygateway.toml").write_text(SIMULATED.format(url=simulator))
    args = ("--json", "chat", "hi") if where == "before" else ("chat", "hi", "--json")
    ran = run_cli(*args)
    assert ran.code == 0, ran.stderr
    assert ran.stderr == ""
    doc = ran.json()
    assert doc["ok"] is True
    assert doc["source"] == "a"
    assert doc["text"]


@pytest.mark.parametrize(
    "args",
    [
        ("chat", "hi"),
        ("chat", "--stream", "hi"),
        ("embed", "alpha", "beta"),
        ("ocr", "page.png"),
        ("ocr", "--layout", "page.png"),
    ],
)
def test_a_call_that_fails_prints_one_json_failure_with_its_reason(
    tmp_path: Path, run_cli: RunCli, args: tuple[str, ...]
) -> None:
    """Nothing listening upstream: exit 1, ``AllSourcesExhausted`` with reason and scope."""
    (tmp_path / "polygateway.toml").write_text(SIMULATED.format(url=NOBODY))
    (tmp_path / "page.png").write_bytes(tiny_png())
    error = error_of(run_cli("--json", *args), 1)
    assert error["type"] == "AllSourcesExhausted"
    assert error["reason"] == "retry_exhausted"
    assert error["scope"] == args[0]
    assert error["sources"] == ["a"]
    assert "connect error" in error["message"]


def test_bad_settings_and_bad_usage_print_one_json_failure(tmp_path: Path, run_cli: RunCli) -> None:
    """A refused settings file and an unknown option: exit 2, one JSON document each."""
    write_config(tmp_path, "http://exa mple.com/v1")
    for args in (("check-config", "--json"), ("--json", "chat", "hi")):
        error = error_of(run_cli(*args), 2)
        assert error["type"] == "ConfigError"
        assert error["reason"] is None
        assert error["field"] == "scopes.chat.sources[0].base_url"
        assert error["path"] == "polygateway.toml"
        assert "whitespace" in error["message"]
    error = error_of(run_cli("--json", "chat", "--bogus"), 2)
    assert error == {
        "type": "UsageError",
        "message": "polygateway: unrecognized arguments: --bogus",
        "reason": None,
    }


def test_a_missing_input_file_prints_one_json_failure(tmp_path: Path, run_cli: RunCli) -> None:
    """``ocr missing.png --json``: exit 1, a ``CliError`` naming the file."""
    (tmp_path / "polygateway.toml").write_text(SIMULATED.format(url=NOBODY))
    error = error_of(run_cli("ocr", "missing.png", "--json"), 1)
    assert error["type"] == "CliError"
    assert "cannot read missing.png" in error["message"]


def test_status_json_of_a_memory_backend_is_one_json_failure(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """A memory backend has no shared state to read: exit 2, JSON saying so."""
    (tmp_path / "polygateway.toml").write_text(SIMULATED.format(url=NOBODY))
    error = error_of(run_cli("status", "--json"), 2)
    assert error["type"] == "ConfigError"
    assert error["field"] == "backend"
    assert "memory backend lives inside one process" in error["message"]


def test_status_json_of_a_redis_that_is_down_is_one_json_failure(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """Redis not listening: exit 1, ``GovernanceBackendError``, the password masked."""
    (tmp_path / "polygateway.toml").write_text(
        '[gateway]\nbackend = "redis"\nredis_url = "redis://:pw-SECRET@127.0.0.1:9/0"\n'
        + SIMULATED.format(url=NOBODY).removeprefix("\n[gateway]\n")
    )
    ran = run_cli("--json", "status")
    error = error_of(ran, 1)
    assert error["type"] == "GovernanceBackendError"
    assert error["scope"] == "chat"
    assert "SECRET" not in ran.output


def test_a_closed_stdout_ends_the_command_quietly(tmp_path: Path) -> None:
    """``check-config | head`` (and ``simulate``) whose reader is gone: exit 141, no stderr."""
    (tmp_path / "polygateway.toml").write_text(SIMULATED.format(url=NOBODY))
    for args in (
        ("check-config",),
        ("check-config", "--json"),
        ("--debug", "simulate", "--list-profiles"),
    ):
        with subprocess.Popen(
            cli_command(*args),
            cwd=tmp_path,
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        ) as proc:
            assert proc.stdout is not None
            assert proc.stderr is not None
            proc.stdout.close()  # before the interpreter has even started: every write fails
            stderr = proc.stderr.read().decode()
            assert proc.wait(timeout=60) == 141, stderr
        assert stderr == ""


# --- a base install: plain text without rich, missing extras named -----------------------


@pytest.fixture
def without(tmp_path: Path) -> Callable[..., dict[str, str]]:
    """The environment of a run where the named packages cannot be imported (a base install)."""

    def env(*packages: str) -> dict[str, str]:
        stubs = tmp_path / "not-installed"
        for package in packages:
            (stubs / package).mkdir(parents=True, exist_ok=True)
            (stubs / package / "__init__.py").write_text("raise ImportError('not installed')\n")
        return {"PYTHONPATH": str(stubs)}

    return env


def test_chat_and_embed_print_plain_text_without_rich(
    tmp_path: Path, run_cli: RunCli, simulator: str, without: Callable[..., dict[str, str]]
) -> None:
    """No rich: ``chat hi`` prints the answer, ``embed`` a plain table, no install hint."""
    (tmp_path / "polygateway.toml").write_text(SIMULATED.format(url=simulator))
    env = without("rich")
    chat = run_cli("chat", "hi", env=env)
    assert chat.code == 0, chat.stderr
    assert chat.stdout.strip()
    assert "source a, 1 attempt(s)" in chat.stderr
    embed = run_cli("embed", "alpha", "beta", env=env)
    assert embed.code == 0, embed.stderr
    header, rule, first, second = [line for line in embed.stdout.splitlines() if line]
    assert header.split() == ["#", "text", "dim", "first", "values"]
    assert set(rule.replace(" ", "")) == {"-"}
    assert first.split()[:2] == ["0", "alpha"]
    assert second.split()[:2] == ["1", "beta"]
    assert "pip install" not in chat.output + embed.output


def test_check_config_prints_plain_tables_without_rich(
    tmp_path: Path, run_cli: RunCli, without: Callable[..., dict[str, str]]
) -> None:
    """No rich: check-config still shows the gateway keys and each scope, then ``ok``."""
    (tmp_path / "polygateway.toml").write_text(SIMULATED.format(url=NOBODY))
    ran = run_cli("check-config", env=without("rich"))
    assert ran.code == 0, ran.stderr
    assert ran.stderr == ""
    assert "stall_window_s" in ran.stdout
    assert "scope embed (kind embed)" in ran.stdout
    assert ran.stdout.splitlines()[-1] == "ok: polygateway.toml is valid (3 scopes, 3 sources)"


@pytest.mark.parametrize(
    ("gateway", "package", "says"),
    [
        (
            'backend = "redis"',
            "redis",
            "backend = 'redis' needs the redis extra: pip install 'polygateway[redis]'",
        ),
        (
            'transport = "aiohttp"',
            "aiohttp",
            "transport = 'aiohttp' needs the aiohttp extra: pip install 'polygateway[aiohttp]'",
        ),
    ],
)
def test_check_config_reports_an_extra_the_settings_need(
    tmp_path: Path,
    run_cli: RunCli,
    without: Callable[..., dict[str, str]],
    gateway: str,
    package: str,
    says: str,
) -> None:
    """backend = "redis" without redis, transport = "aiohttp" without aiohttp: exit 2, not ok."""
    body = SIMULATED.format(url=NOBODY).replace("[gateway]\n", f"[gateway]\n{gateway}\n")
    (tmp_path / "polygateway.toml").write_text(body)
    line = assert_one_line_error(run_cli("check-config", env=without(package)), 2)
    assert says in line
    error = error_of(run_cli("check-config", "--json", env=without(package)), 2)
    assert error["field"] == gateway.split()[0]
    assert says in error["message"]


# --- errors name the variable a bad value came from -------------------------------------


def test_a_bad_override_names_its_variable_not_the_file(tmp_path: Path, run_cli: RunCli) -> None:
    """POLYGATEWAY_STALL_WINDOW_S=-1: exit 2 naming the variable, as a line and as JSON."""
    (tmp_path / "base.toml").write_text(SIMULATED.format(url=NOBODY))
    env = {"POLYGATEWAY_STALL_WINDOW_S": "-1"}
    ran = run_cli("check-config", "--config", "base.toml", env=env)
    line = assert_one_line_error(ran, 2)
    assert line == (
        "error: invalid setting: Input should be greater than 0 "
        "[field 'stall_window_s' from environment variable POLYGATEWAY_STALL_WINDOW_S]"
    )
    error = error_of(run_cli("--json", "check-config", "--config", "base.toml", env=env), 2)
    assert error["env"] == "POLYGATEWAY_STALL_WINDOW_S"
    assert error["field"] == "stall_window_s"
    assert "path" not in error


def test_an_unknown_variable_is_reported_with_a_suggestion(tmp_path: Path, run_cli: RunCli) -> None:
    """POLYGATEWAY_STALL_WINDOW=10 is not silently ignored: exit 2, did you mean ..._S?"""
    (tmp_path / "polygateway.toml").write_text(SIMULATED.format(url=NOBODY))
    ran = run_cli("check-config", env={"POLYGATEWAY_STALL_WINDOW": "10"})
    line = assert_one_line_error(ran, 2)
    assert "unknown setting variable POLYGATEWAY_STALL_WINDOW" in line
    assert "did you mean POLYGATEWAY_STALL_WINDOW_S?" in line


def test_an_empty_key_variable_is_reported_as_empty(tmp_path: Path, run_cli: RunCli) -> None:
    """OPENAI_API_KEY= (set, empty): exit 2 saying empty, not "not set"."""
    body = SIMULATED.format(url=NOBODY).replace(
        'model = "sim"\n', 'model = "sim"\napi_key_env = "OPENAI_API_KEY"\n'
    )
    (tmp_path / "polygateway.toml").write_text(body)
    line = assert_one_line_error(run_cli("check-config", env={"OPENAI_API_KEY": ""}), 2)
    assert (
        "'OPENAI_API_KEY' (api_key_env of source 'a') is set but empty in the environment" in line
    )


# --- help and --debug ---------------------------------------------------------------------


def test_every_command_and_option_has_a_help_line() -> None:
    """Each sub-command has a help line and a description; each option a help text."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert all(choice.help for choice in commands._choices_actions)
    for name, command in commands.choices.items():
        if name != "simulate":  # its help is the simulator's own parser
            assert command.description, name
        undocumented = [a.dest for a in command._actions if not a.help]
        assert undocumented == [], name


@pytest.mark.parametrize(
    ("command", "says"),
    [
        ("chat", "Send one chat completion through a scope"),
        ("embed", "Embed texts through a scope"),
        ("ocr", "Recognise the text of PNG, JPEG or PDF files"),
    ],
)
def test_call_commands_describe_themselves(run_cli: RunCli, command: str, says: str) -> None:
    """``chat|embed|ocr --help``: exit 0, the description, the global options explained."""
    ran = run_cli(command, "--help")
    assert (ran.code, ran.stderr) == (0, "")
    text = " ".join(ran.stdout.split())
    assert says in text
    assert "--json print exactly one JSON document on stdout" in text
    assert "--debug show tracebacks and the library's debug log" in text
    if command == "chat":
        assert "--max-tokens N most tokens the answer may have (default 256)" in text


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_turns_on_the_librarys_debug_log(
    tmp_path: Path, run_cli: RunCli, simulator: str, where: str
) -> None:
    """``--debug``, before or after the command, logs each attempt on stderr; stdout: the answer."""
    (tmp_path / "polygateway.toml").write_text(SIMULATED.format(url=simulator))
    args = ("--debug", "chat", "hi") if where == "before" else ("chat", "hi", "--debug")
    ran = run_cli(*args)
    assert ran.code == 0, ran.stderr
    assert "DEBUG:polygateway.attempts:attempt scope=chat source=a n=1 outcome=success" in (
        ran.stderr
    )
    assert "DEBUG" not in ran.stdout
    quiet = run_cli("chat", "hi")
    assert "DEBUG" not in quiet.output


# --- check-config: every effective value and its origin, in 80 columns -------------------

REPORTED = """
[gateway]
backend = "redis"
redis_url = "redis://:hunter2-SECRET@10.0.0.5:6380/2"
max_attempts = 4

[scopes.chat]
kind = "chat"
[[scopes.chat.sources]]
name = "primary"
protocol = "openai"
base_url = "https://user:pw-SECRET@api.example.com/a/rather/long/path/to/the/v1"
model = "gpt-4o-mini"
api_key_env = "DEMO_CHAT_KEY"
rpm = 600
[[scopes.chat.sources]]
name = "backup"
protocol = "openai"
base_url = "http://127.0.0.1:8001/v1"
"""


def test_check_config_shows_every_value_and_its_origin_in_80_columns(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """File, environment variable, default: each value says where it came from; secrets masked."""
    (tmp_path / "polygateway.toml").write_text(REPORTED)
    env = {"DEMO_CHAT_KEY": "sk-chat-SECRET", "POLYGATEWAY_STALL_WINDOW_S": "120"}
    ran = run_cli("check-config", env=env)
    assert ran.code == 0, ran.stderr
    assert ran.stderr == ""
    lines = ran.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, ran.stdout
    rows = {tuple(line.split()) for line in lines}
    assert ("max_attempts", "4", "polygateway.toml") in rows
    assert ("stall_window_s", "120", "env", "POLYGATEWAY_STALL_WINDOW_S") in rows
    assert ("breaker_failures", "5", "default") in rows
    assert ("redis_url", "redis://:***@10.0.0.5:6380/2", "polygateway.toml") in rows
    assert ("api", "key", "$DEMO_CHAT_KEY", "(set)", "env", "DEMO_CHAT_KEY") in rows
    assert ("rpm", "600", "polygateway.toml") in rows
    assert ("tpm", "-", "default") in rows
    # One block per source, the long URL on a line of its own under its key.
    assert lines.index("  source primary") < lines.index("  source backup")
    url = lines.index("    base_url" + " " * 40 + "polygateway.toml")
    assert lines[url + 1].strip() == "https://user:***@api.example.com/a/rather/long/path/to/the/v1"
    assert "SECRET" not in ran.output
    assert lines[-1] == "ok: polygateway.toml is valid (1 scopes, 2 sources)"
    doc = run_cli("check-config", "--json", env=env).json()
    assert doc["origins"]["gateway"]["stall_window_s"] == "env POLYGATEWAY_STALL_WINDOW_S"
    assert doc["origins"]["gateway"]["max_attempts"] == "polygateway.toml"
    assert doc["origins"]["scopes"]["chat"]["sources"]["backup"]["rpm"] == "default"


def test_a_key_with_a_curly_quote_is_a_settings_error_not_a_crash(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """A key holding U+2019: exit 2 naming the variable, no UnicodeEncodeError, no value."""
    body = SIMULATED.format(url=NOBODY).replace(
        'model = "sim"\n', 'model = "sim"\napi_key_env = "OPENAI_API_KEY"\n'
    )
    (tmp_path / "polygateway.toml").write_text(body)
    ran = run_cli("chat", "hi", env={"OPENAI_API_KEY": "sk-abc\u2019def-SECRET"})
    line = assert_one_line_error(ran, 2)
    assert "'OPENAI_API_KEY' (api_key_env of source 'a') holds characters" in line
    assert "UnicodeEncodeError" not in ran.output
    assert "SECRET" not in ran.output


def test_global_options_before_simulate_reach_the_simulator(run_cli: RunCli) -> None:
    """``polygateway --debug simulate --list-profiles``: the simulator's own command line."""
    ran = run_cli("--debug", "simulate", "--list-profiles")
    assert (ran.code, ran.stderr) == (0, "")
    assert "healthy:" in ran.stdout


def test_status_prints_a_plain_table_without_rich(
    tmp_path: Path, run_cli: RunCli, redis_url: str, without: Callable[..., dict[str, str]]
) -> None:
    """No rich: ``status`` of a live Redis still prints each scope's table, as text."""
    (tmp_path / "polygateway.toml").write_text(
        f'[gateway]\nbackend = "redis"\nredis_url = "{redis_url}"\n'
        + SIMULATED.format(url=NOBODY).removeprefix("\n[gateway]\n")
    )
    ran = run_cli("status", "--scope", "chat", env=without("rich"))
    assert ran.code == 0, ran.stderr
    assert ran.stderr == ""
    lines = [line for line in ran.stdout.splitlines() if line]
    assert lines[0].startswith("backend redis at redis://")
    assert lines[1] == "scope chat: 0 in flight, never served"
    assert lines[2].split()[:3] == ["source", "in", "flight"]
    assert lines[4].split()[:4] == ["a", "(not", "asked", "yet)"]
