"""The command line as a user runs it: ``python -m polygateway ...`` in a subprocess, real ports."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from cli_run import Ran, RunCli, cli_command, cli_env, serve_simulator


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
    yield from serve_simulator("--sources", "a")
