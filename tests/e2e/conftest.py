"""The command line as a user runs it: ``python -m polygateway ...`` in a subprocess, real ports."""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from cli_run import Ran, RunCli, cli_command, cli_env, interruptible


@pytest.fixture
def run_cli(tmp_path: Path) -> RunCli:
    """Run the CLI to completion in ``tmp_path`` (no stray .env or polygateway.toml there)."""

    def run(
        *args: str,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
    ) -> Ran:
        done = subprocess.run(
            cli_command(*args),
            cwd=tmp_path,
            env=cli_env(env),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return Ran(tuple(args), done.returncode, done.stdout, done.stderr)

    return run


@pytest.fixture(scope="module")
def simulator() -> Iterator[str]:
    """``polygateway simulate`` with one healthy source ``a``; yields its root URL."""
    proc = subprocess.Popen(
        cli_command("simulate", "--sources", "a", "--port", "0"),
        env=cli_env(),
        preexec_fn=interruptible,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", first)
        assert found, (first, proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        yield found.group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
