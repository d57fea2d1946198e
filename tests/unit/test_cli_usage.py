"""The command line's usage errors: exit 2 with the sub-command's usage, before any call.

Every run here is refused before a request could be sent (the sources point
at the discard port, and no test reaches them).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from polygateway.cli import EXIT_CONFIG, EXIT_FAILURE, main

SETTINGS = """
[scopes.chat]
kind = "chat"
[[scopes.chat.sources]]
name = "a"
protocol = "openai"
base_url = "http://127.0.0.1:9/v1"
model = "m"

[scopes.embed]
kind = "embed"
[[scopes.embed.sources]]
name = "a"
protocol = "openai"
base_url = "http://127.0.0.1:9/v1"
"""


@pytest.fixture(autouse=True)
def workdir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty directory (no stray .env or settings file), no PolyGateway variables, no stdin."""
    for name in list(os.environ):
        if name.upper().startswith("POLYGATEWAY_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    return tmp_path


@pytest.fixture
def configured(workdir: Path) -> Path:
    """``polygateway.toml`` with a chat and an embed scope in the run's directory."""
    path = workdir / "polygateway.toml"
    path.write_text(SETTINGS, encoding="utf-8")
    return path


def usage_refusal(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The run printed ``command``'s usage then one ``polygateway COMMAND: error:`` line."""
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"usage: polygateway {command} "), captured.err
    last = captured.err.splitlines()[-1]
    assert last.startswith(f"polygateway {command}: error: "), captured.err
    assert "Traceback" not in captured.err
    return last


def json_refusal(capsys: pytest.CaptureFixture[str]) -> str:
    """The run printed one JSON failure of type ``UsageError``; returns its message."""
    captured = capsys.readouterr()
    assert captured.err == ""
    doc = json.loads(captured.out)
    assert doc["ok"] is False
    assert doc["error"]["type"] == "UsageError"
    message: str = doc["error"]["message"]
    return message


# --- nothing to send --------------------------------------------------------------------------


@pytest.mark.usefixtures("configured")
@pytest.mark.parametrize("args", [["chat"], ["chat", "  "], ["chat", "--stream"]])
def test_chat_without_a_prompt_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    """``chat`` with no prompt (nor any on stdin) exits 2 with the usage, as a missing argument."""
    assert main(args) == EXIT_CONFIG
    line = usage_refusal(capsys, "chat")
    assert "nothing to send: give a prompt or pipe one on stdin" in line


@pytest.mark.usefixtures("configured")
def test_chat_without_a_prompt_under_json_is_one_usage_failure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--json chat`` with no prompt: exit 2 and one JSON ``UsageError`` document."""
    assert main(["--json", "chat"]) == EXIT_CONFIG
    assert json_refusal(capsys) == (
        "polygateway chat: nothing to send: give a prompt or pipe one on stdin"
    )


@pytest.mark.usefixtures("configured")
def test_embed_without_texts_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """``embed`` with no texts, no --file and nothing on stdin exits 2 with the usage."""
    assert main(["embed"]) == EXIT_CONFIG
    line = usage_refusal(capsys, "embed")
    assert "nothing to embed: give texts, --file FILE or lines on stdin" in line


def test_embed_of_a_file_without_text_lines_is_a_usage_error(
    configured: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``embed --file FILE`` where FILE holds only blank lines exits 2 naming FILE."""
    (configured.parent / "blank.txt").write_text("\n  \n", encoding="utf-8")
    assert main(["embed", "--file", "blank.txt"]) == EXIT_CONFIG
    line = usage_refusal(capsys, "embed")
    assert "nothing to embed: blank.txt has no text lines" in line


# --- refusals of the commands themselves show the usage, as argparse's do ---------------------


@pytest.mark.usefixtures("configured")
def test_embed_with_texts_and_a_file_shows_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    """``embed a --file F``: exit 2, the embed usage and the conflict, before any settings."""
    assert main(["embed", "a", "--file", "texts.txt"]) == EXIT_CONFIG
    line = usage_refusal(capsys, "embed")
    assert line.endswith("give texts or --file FILE, not both")


# --- flag values that name no file ------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "command", "flag"),
    [
        (["check-config", "--config", ""], "check-config", "--config"),
        (["status", "--env-file", ""], "status", "--env-file"),
        (["chat", "--config", "", "hi"], "chat", "--config"),
        (["embed", "--file", ""], "embed", "--file"),
        (["embed", "a", "--output", ""], "embed", "--output/-o"),
        (["ocr", "page.png", "-o", ""], "ocr", "--output/-o"),
        (["ocr", ""], "ocr", "FILE"),
    ],
)
def test_an_empty_file_name_is_a_usage_error_naming_its_flag(
    capsys: pytest.CaptureFixture[str], args: list[str], command: str, flag: str
) -> None:
    """``--config ''`` and friends exit 2 naming the flag: '' would be ignored or read as '.'."""
    assert main(args) == EXIT_CONFIG
    line = usage_refusal(capsys, command)
    assert f"argument {flag}: expected a file name, not an empty string" in line


# --- input that cannot be read ----------------------------------------------------------------


@pytest.mark.usefixtures("configured")
def test_a_texts_file_that_is_not_utf8_is_one_error_line(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``embed --file`` of a Latin-1 file: exit 1, ``cannot read`` naming it, no exception name."""
    (workdir / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    assert main(["embed", "--file", "latin1.txt"]) == EXIT_FAILURE
    captured = capsys.readouterr()
    assert captured.err == (
        "error: cannot read latin1.txt: not UTF-8 text (an undecodable byte at offset 3)\n"
    )


@pytest.mark.usefixtures("configured")
@pytest.mark.parametrize("command", ["chat", "embed"])
def test_stdin_that_is_not_utf8_is_one_error_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """A prompt or texts piped in another encoding: exit 1, ``cannot read stdin``, no exception."""
    piped = io.TextIOWrapper(io.BytesIO(b"caf\xe9\n"), encoding="utf-8", errors="strict")
    monkeypatch.setattr("sys.stdin", piped)
    assert main([command]) == EXIT_FAILURE
    captured = capsys.readouterr()
    assert captured.err == (
        "error: cannot read stdin: not UTF-8 text (an undecodable byte at offset 3)\n"
    )


# --- flags that would be ignored without a word ------------------------------------------------


def test_status_interval_without_watch_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``status --interval 5`` would show one snapshot, never refreshed: exit 2, before settings."""
    assert main(["status", "--interval", "5"]) == EXIT_CONFIG
    line = usage_refusal(capsys, "status")
    assert line.endswith("--interval is only read with --watch")


def test_status_watch_seconds_with_an_interval_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``status --watch 2 --interval 5``: two refresh periods, one would be dropped: exit 2."""
    assert main(["status", "--watch", "2", "--interval", "5"]) == EXIT_CONFIG
    line = usage_refusal(capsys, "status")
    assert line.endswith("give --watch SECONDS or --watch --interval SECONDS, not both")


# --- demo ---------------------------------------------------------------------------------------


def test_demo_redis_url_without_the_redis_backend_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``demo --redis-url URL`` on the memory backend would ignore the URL without a word."""
    assert main(["demo", "--redis-url", "redis://:hunter2@127.0.0.1:9/0"]) == EXIT_CONFIG
    line = usage_refusal(capsys, "demo")
    assert "--redis-url needs --backend redis" in line
    assert "hunter2" not in line


# --- a terminal on stdin ------------------------------------------------------------------------


class _Terminal(io.StringIO):
    """Stdin as a terminal: what a user typed, then Ctrl-D."""

    def isatty(self) -> bool:
        return True


@pytest.mark.usefixtures("configured")
def test_chat_reading_a_terminal_says_so_before_it_waits(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no prompt at a terminal the command waits for typing: it says so, not a silent hang."""
    monkeypatch.setattr("sys.stdin", _Terminal(""))
    assert main(["chat"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("polygateway chat: reading the prompt from stdin (end with Ctrl-D)\n")


@pytest.mark.usefixtures("configured")
def test_piped_stdin_reads_without_a_word(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["embed"]) == EXIT_CONFIG
    assert "reading" not in capsys.readouterr().err


@pytest.mark.usefixtures("configured")
def test_embed_reading_a_terminal_says_so_before_it_waits(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", _Terminal(""))
    assert main(["embed"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith(
        "polygateway embed: reading texts, one per line, from stdin (end with Ctrl-D)\n"
    )
