"""A long-lived test process for ``tools/mutation/lua.py``: the suite once per mutant it is sent.

Starting an interpreter and collecting the tests cost about two seconds, as
much as running the tests that kill most mutants; a worker pays them once.
It reads one JSON object per line on standard input (``{"constant": ...,
"text": ..., "runs": [[test, ...], ...]}``, no constant for the unmutated
scripts), puts every script constant of ``polygateway.backends.redis.scripts``
back to its own text and then swaps in the mutant's (``RedisBackend`` reads
the constants when it is built, so each test's backends run the mutant), runs
pytest in this process once per selection of tests in ``runs``, with the
options it was started with, until one fails (the last is the whole list; the
ones before it are the tests likeliest to kill the mutant, and a selection
that does not fail, or names a test gone, only passes to the next), and
answers one JSON line on the file descriptor named by its second argument:
pytest's exit code, the first failed test and the seconds it took. pytest's
own output goes to a buffer, returned only when the run ended in neither a
pass nor a failure. The parent kills a worker that does not answer in time.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time

import pytest

from polygateway.backends.redis import scripts

ORIGINAL = {name: getattr(scripts, name) for name in scripts.__all__}


class _FirstFailure:
    """Remembers the first test that failed (setup and teardown included)."""

    def __init__(self) -> None:
        self.nodeid = ""

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed and not self.nodeid:
            self.nodeid = report.nodeid


def main() -> None:
    """Answer each job on standard input with one JSON line on the answers' pipe."""
    args: list[str] = json.loads(sys.argv[1])
    answers = os.fdopen(int(sys.argv[2]), "w", encoding="utf-8")
    for line in sys.stdin:
        job = json.loads(line)
        for name, text in ORIGINAL.items():
            setattr(scripts, name, text)
        if job.get("constant"):
            setattr(scripts, job["constant"], job["text"])
        first = _FirstFailure()
        output = io.StringIO()
        started = time.monotonic()
        runs: list[list[str]] = job["runs"]
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            for tests in runs:
                code = int(pytest.main([*args, *tests], plugins=[first]))
                if code == 1:
                    break
        answer = {"code": code, "failed": first.nodeid, "seconds": time.monotonic() - started}
        if code not in (0, 1):
            answer["output"] = output.getvalue()[-6000:]
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
