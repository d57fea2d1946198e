"""``polygateway check-config`` as a user runs it: valid files, each kind of bad one, secrets."""

from __future__ import annotations

from pathlib import Path

import pytest
from cli_run import RunCli, assert_one_line_error

CHAT_KEY = "sk-chat-very-secret-0001"
EMBED_KEY = "sk-embed-very-secret-0002"
KEYS = {"DEMO_CHAT_KEY": CHAT_KEY, "DEMO_EMBED_KEY": EMBED_KEY}

VALID = """
[gateway]
backend = "memory"
stall_window_s = 120
max_attempts = 4

[scopes.chat]
kind = "chat"
[[scopes.chat.sources]]
name = "primary"
protocol = "openai"
base_url = "https://api.example.com/v1"
model = "gpt-4o-mini"
api_key_env = "DEMO_CHAT_KEY"
max_concurrency = 8
rpm = 600
[[scopes.chat.sources]]
name = "backup"
protocol = "openai"
base_url = "http://127.0.0.1:8001/v1"
model = "local"
priority = 1

[scopes.embed]
kind = "embed"
[[scopes.embed.sources]]
name = "emb"
protocol = "openai"
base_url = "https://api.example.com/v1"
model = "text-embedding-3-small"
api_key_env = "DEMO_EMBED_KEY"
max_batch_size = 32

[scopes.ocr]
kind = "ocr"
[[scopes.ocr.sources]]
name = "monkey"
protocol = "monkey_ocr"
base_url = "http://127.0.0.1:7861"
"""

ONE_SOURCE = """
[scopes.chat]
kind = "chat"
[[scopes.chat.sources]]
name = "a"
protocol = "openai"
base_url = "http://127.0.0.1:8001/v1"
"""


def write(tmp_path: Path, text: str, name: str = "polygateway.toml") -> Path:
    """Write a settings file into the run's directory."""
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_valid_file_shows_scopes_and_sources_and_exits_zero(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """A valid file: exit 0, every scope and source listed, keys shown as set but never printed."""
    write(tmp_path, VALID)
    ran = run_cli("check-config", env=KEYS)
    assert ran.code == 0, ran.stderr
    for shown in ("scope chat", "scope embed", "scope ocr", "primary", "backup", "monkey"):
        assert shown in ran.stdout
    assert "$DEMO_CHAT_KEY (set)" in ran.stdout
    assert "is valid (3 scopes, 4 sources)" in ran.stdout
    assert CHAT_KEY not in ran.output
    assert EMBED_KEY not in ran.output


def test_valid_file_as_json_is_machine_readable_and_masks_keys(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """``--json``: one document with the gateway knobs and per-source settings, keys as booleans."""
    write(tmp_path, VALID, "custom.toml")
    ran = run_cli("check-config", "--config", "custom.toml", "--json", env=KEYS)
    assert ran.code == 0, ran.stderr
    doc = ran.json()
    assert doc["ok"] is True
    assert doc["gateway"]["max_attempts"] == 4
    assert doc["gateway"]["stall_window_s"] == 120
    assert sorted(doc["scopes"]) == ["chat", "embed", "ocr"]
    chat = doc["scopes"]["chat"]
    assert chat["exempt_429"] is True
    assert doc["scopes"]["embed"]["exempt_429"] is False
    primary, backup = chat["sources"]
    assert (primary["name"], primary["api_key_set"], primary["rpm"]) == ("primary", True, 600)
    assert (backup["name"], backup["api_key_set"], backup["priority"]) == ("backup", False, 1)
    assert "api_key" not in primary
    assert CHAT_KEY not in ran.output


def test_redis_url_password_is_masked_in_every_output(tmp_path: Path, run_cli: RunCli) -> None:
    """A password in ``redis_url`` (and in a base_url) shows as *** in tables and JSON alike."""
    password = "hunter2-redis-pass"
    text = ONE_SOURCE.replace("127.0.0.1:8001", f"user:{password}@127.0.0.1:8001")
    write(
        tmp_path,
        f'[gateway]\nbackend = "redis"\nredis_url = "redis://:{password}@10.0.0.5:6380/2"\n' + text,
    )
    for args in (("check-config",), ("check-config", "--json")):
        ran = run_cli(*args)
        assert ran.code == 0, ran.stderr
        assert password not in ran.output
        assert "redis://:***@10.0.0.5:6380/2" in ran.stdout
        assert "http://user:***@127.0.0.1:8001/v1" in ran.stdout


def test_api_key_in_the_file_is_refused_pointing_to_api_key_env(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """``api_key = ...`` in a file: exit 2 naming the field and api_key_env, as a line or JSON."""
    write(tmp_path, ONE_SOURCE + 'api_key = "sk-written-in-the-file-123"\n')
    ran = run_cli("check-config")
    line = assert_one_line_error(ran, 2)
    assert "api_key_env" in line
    assert "scopes.chat.sources[0].api_key" in line
    assert "polygateway.toml" in line
    assert "sk-written-in-the-file-123" not in ran.output
    as_json = run_cli("check-config", "--json")
    assert (as_json.code, as_json.stderr) == (2, "")
    doc = as_json.json()
    assert doc["ok"] is False
    assert doc["error"]["field"] == "scopes.chat.sources[0].api_key"
    assert doc["error"]["path"] == "polygateway.toml"
    assert "api_key_env" in doc["error"]["message"]
    assert "sk-written-in-the-file-123" not in as_json.output


INVALID = {
    "invalid TOML": ("[gateway\nmax_attempts = 3\n", "not valid TOML"),
    "unknown gateway key": ("[gateway]\nmax_atempts = 3\n" + ONE_SOURCE, "max_atempts"),
    "unknown top-level table": ("[gatway]\nmax_attempts = 3\n", "unknown key 'gatway'"),
    "non-positive limit": (
        ONE_SOURCE + "max_concurrency = 0\n",
        "scopes.chat.sources[0].max_concurrency",
    ),
    "duplicate source names": (
        ONE_SOURCE + ONE_SOURCE.split('kind = "chat"\n')[1],
        "duplicate source name 'a'",
    ),
    "empty scope": ('[scopes.chat]\nkind = "chat"\nsources = []\n', "at least one source"),
    "protocol that does not fit the kind": (
        ONE_SOURCE.replace('"openai"', '"monkey_ocr"'),
        "does not fit scope kind 'chat'",
    ),
    "stall window over the progress TTL": (
        "[gateway]\nstall_window_s = 7200\n" + ONE_SOURCE,
        "stall_window_s must be <= 3600",
    ),
    "stall window under a TTFT timeout": (
        "[gateway]\nstall_window_s = 5\n" + ONE_SOURCE + "ttft_timeout_s = 10\n",
        "largest ttft_timeout_s",
    ),
    "redis url with a wrong scheme": (
        '[gateway]\nredis_url = "http://127.0.0.1:6379"\n' + ONE_SOURCE,
        "redis_url must start with redis://",
    ),
    "api_key_env naming an unset variable": (
        ONE_SOURCE + 'api_key_env = "SURELY_UNSET_POLYGATEWAY_TEST_KEY"\n',
        "'SURELY_UNSET_POLYGATEWAY_TEST_KEY'",
    ),
    "credential header": (
        ONE_SOURCE + 'headers = { "X-Api-Key" = "abc" }\n',
        "api_key_env",
    ),
    "unknown source key": (ONE_SOURCE + "max_concurency = 3\n", "max_concurency"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_each_kind_of_invalid_file_exits_2_with_one_config_error_line(
    case: str, tmp_path: Path, run_cli: RunCli
) -> None:
    """Every kind of bad file: exit 2 and the ConfigError message as one line, no traceback."""
    text, expected = INVALID[case]
    write(tmp_path, text)
    ran = run_cli("check-config")
    line = assert_one_line_error(ran, 2)
    assert expected in line, line
    assert "polygateway.toml" in line
    assert ran.stdout == ""


def test_missing_file_exits_2_naming_it(run_cli: RunCli) -> None:
    """A settings file that does not exist: exit 2, one line naming the file."""
    ran = run_cli("check-config", "--config", "nowhere.toml")
    line = assert_one_line_error(ran, 2)
    assert "settings file not found" in line
    assert "nowhere.toml" in line


def test_debug_shows_the_traceback(tmp_path: Path, run_cli: RunCli) -> None:
    """``--debug`` adds the traceback to the same error and keeps the exit status."""
    write(tmp_path, "[gateway\n")
    ran = run_cli("check-config", "--debug")
    assert ran.code == 2
    assert "Traceback" in ran.stderr
    assert "ConfigError" in ran.stderr
    assert ran.stderr.rstrip().splitlines()[-1].startswith("error: ")
