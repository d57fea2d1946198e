"""The command line's contract with a newcomer: bad URLs refused at load, typed errors only.

Each test runs ``python -m polygateway ...`` as a user does and pins the exact
exit code, stdout and stderr.
"""

from __future__ import annotations

from pathlib import Path

from cli_run import RunCli, assert_one_line_error

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
