"""Helpers of the e2e tests: run ``python -m polygateway ...`` as a user does, read what it said."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

DEMO_TIMEOUT_S = 90.0
"""Hard bound of one demo run (it takes ~13 s on two cores)."""


@dataclass(frozen=True)
class Ran:
    """A finished CLI run."""

    args: tuple[str, ...]
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        """stdout parsed as the one JSON document ``--json`` prints."""
        return json.loads(self.stdout)

    @property
    def output(self) -> str:
        """stdout and stderr together, for "never printed" checks."""
        return self.stdout + self.stderr


def cli_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a CLI run: the caller's, minus every POLYGATEWAY_* override."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLYGATEWAY_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("COLUMNS", None)
    env.update(extra or {})
    return env


def interruptible() -> None:
    """``preexec_fn`` of a CLI a test ends with SIGINT: Ctrl+C's default disposition.

    A test run started in the background of a non-interactive shell ignores
    SIGINT, and a child inherits that: without this, SIGINT would not reach it.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cli_command(*args: str) -> list[str]:
    """``python -m polygateway ARGS`` with the interpreter running the tests."""
    return [sys.executable, "-m", "polygateway", *args]


RunCli = Callable[..., "Ran"]


def assert_one_line_error(ran: Ran, code: int) -> str:
    """The run failed with ``code`` and exactly one ``error:`` line, no traceback; returns it."""
    assert ran.code == code, (ran.code, ran.stdout, ran.stderr)
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, ran.stderr
    assert lines[0].startswith("error: "), ran.stderr
    assert "Traceback" not in ran.output
    return lines[0]


def serve_simulator(*args: str) -> Iterator[str]:
    """``polygateway simulate ARGS --port 0`` until the caller is done; yields its root URL.

    For a fixture: ``yield from serve_simulator("--sources", "a")``. The process
    is stopped with SIGINT as a user stops it, and killed if it does not end.
    """
    proc = subprocess.Popen(
        cli_command("simulate", *args, "--port", "0"),
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
