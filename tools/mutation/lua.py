"""Mutation testing of the Redis backend's Lua scripts (``make mutation-lua``).

The scripts of ``polygateway/backends/redis/scripts.py`` state the governance
policies a second time (research-wiki/designs/governance-policies.md), so they
are held to the bar of the Python core (research-wiki/MUTATION.md). Each
mutant is one small change to one script's text, applied alone and in memory
(the worker swaps the constant; the file is never edited), and the
Redis half of the backend contract suite plus the differential test run
against it on a real Redis (the suite's own fixture starts one). The mutant
is killed when they fail.

Operators, applied to code only (never inside a comment or a string literal):

- ``comparison``: ``<`` and ``<=``, ``>`` and ``>=``, ``==`` and ``~=`` flipped;
  the inclusive / exclusive bound of a ``ZRANGEBYSCORE`` / ``ZCOUNT`` range too.
- ``constant``: every integer literal one up and one down (indexes included).
- ``key``: each ``KEYS[...]`` index swapped for every other index its script uses.
- ``expire``: an ``EXPIRE`` / ``PEXPIRE`` call, or a ``SET``'s ``EX``, dropped.
- ``sweep``: the dropping of expired leases removed.

The tests: the Redis half of the contract suite and the differential test
(both drive the scripts' ``now`` argument from a fake clock), then the Redis
backend's server-clock tests, ``test_redis_key_expiry.py`` and
``test_redis_script_writes.py``, which see what only a real server shows
(``TIME``, key TTLs, the commands a script ran), and ``test_redis_handoff.py``
(RELEASE's hand-off of a permit to a woken process, ACQUIRE's claim of it).

A mutant's id names its script, its line by the line's own text (a digest, and
which of the lines with that text it is), the column in that line, the operator
and the change: ``ACQUIRE:142124be.0:8:comparison:~=``. Edits elsewhere in a
script leave it as it is, so the reasons reviewed in ``equivalent.toml`` stay
attached to their mutants; an edit of the line itself makes new ids, to review
anew.

Each of ``WORKERS`` workers is one long-lived test process (``lua_worker.py``)
that runs the tests once per mutant it is sent, with the scripts' constants put
back and the mutant's swapped in: no interpreter start-up or test collection per
mutant (a checked run of 92 mutants gave the same verdicts as one fresh process
per mutant, in two thirds of the time).

Two things keep a run short without changing a verdict. Each mutant first runs
the tests that killed mutants of its line (or, none yet, of the nearest lines)
earlier in the run or in the results file it replaces: a failure there kills
it; otherwise the whole list runs, so "survived" still means every test
passed. And a mutant already reviewed as equivalent (``equivalent.toml``,
``[lua]``) is recorded as ``equivalent`` without running (``--all`` runs it
too, to see whether a test written since kills it).

Results go to ``mutants/lua-results.json`` for ``tools/mutation/report.py``,
written again after each mutant, so a run stopped part-way loses nothing:
``--resume`` runs only the mutants that file has no verdict for, provided the
scripts and the tests are those it was made with (their ``fingerprint``), and
the file says ``complete`` once every mutant has one. A full run takes longer
than one sitting on two cores (research-wiki/MUTATION.md).
Run from the repository root:
``python tools/mutation/lua.py [--list] [--resume] [--all] [ID ...]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import re
import select
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "mutants" / "lua-results.json"
# The contract suite's Redis half first (it kills most mutants, in about a second); then,
# in the order that kills the rest soonest (-x stops at the first failure): what a script
# writes, the expiry of every key, the hand-off of a released permit, whose turn a release
# is with priority classes, tenants and reserved floors, the wake-ups, the server-clock
# path, and last the differential test (slow, and it kills few that the others miss).
# Measured on a sample of 105 mutants: the same verdicts in 0.71 of the time of the order
# by topic.
TESTS = [
    "tests/integration/test_backend_contract.py",
    "tests/integration/test_redis_script_writes.py",
    "tests/integration/test_redis_verdicts.py",
    "tests/integration/test_redis_key_expiry.py",
    "tests/integration/test_redis_handoff.py",
    "tests/integration/test_redis_classes.py",
    "tests/integration/test_redis_tenants.py",
    "tests/integration/test_redis_floors.py",
    "tests/integration/test_redis_wakeups.py",
    "tests/integration/test_redis_backend.py",
    "tests/integration/test_redis_differential.py",
    "tests/integration/test_redis_script_numbers.py",
    "-k",
    "redis and (not test_redis_backend or server_clock or real_time or documented_ttl)",
]
OPTIONS = [
    "-x",
    "-q",
    "--no-header",
    "-p",
    "lua_plugin",
    "-p",
    "no:cacheprovider",
    "--hypothesis-seed=0",
]
"""pytest's options for every run: stop at the first failure, the mutation plugin."""
HINTS = 3
"""Tests run first for a mutant: the killers of its line, or of the nearest lines."""
WORKERS = 2
MUTANT_TIMEOUT_S = 600.0
EQUIVALENT = ROOT / "tools" / "mutation" / "equivalent.toml"

sys.path.insert(0, str(ROOT / "src"))
from polygateway.backends.redis import scripts  # noqa: E402

_FLIP = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "~=", "~=": "=="}
# Range bounds written as Redis arguments: inclusive <-> exclusive ('(' prefix).
_BOUNDS = {
    "'-inf', now_s)": "'-inf', '(' .. now_s)",
    "'(' .. now_s, '+inf')": "now_s, '+inf')",
}
_SWEEP_CALL = re.compile(r"\n *redis\.call\('ZREMRANGEBYSCORE', lk, [^\n]*\)\n")
_EXPIRE_CALL = re.compile(r"redis\.call\('P?EXPIRE', ")
_SET_EX = re.compile(r", 'EX', ARGV\[\d+\]")


@dataclass(frozen=True)
class Mutant:
    """One change to one script: where, what, and the whole mutated text."""

    id: str
    constant: str
    operator: str
    line: int
    description: str
    text: str


def _mask(text: str) -> str:
    """``text`` with comments and string literals blanked out, offsets unchanged."""
    out = list(text)
    i = 0
    while i < len(text):
        if text.startswith("--", i):
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            out[i:end] = " " * (end - i)
            i = end
        elif text[i] in "'\"":
            quote, j = text[i], i + 1
            while text[j] != quote:
                j += 2 if text[j] == "\\" else 1
            out[i : j + 1] = " " * (j + 1 - i)
            i = j + 1
        else:
            i += 1
    return "".join(out)


def _closing_paren(masked: str, opening: int) -> int:
    """The offset just past the parenthesis that closes the one at ``opening``."""
    depth = 0
    for i in range(opening, len(masked)):
        depth += {"(": 1, ")": -1}.get(masked[i], 0)
        if depth == 0:
            return i + 1
    raise ValueError("unbalanced parentheses")


def _line_of(text: str, offset: int) -> tuple[int, int, str]:
    """1-based line and column of ``offset``, and that line stripped."""
    line = text.count("\n", 0, offset) + 1
    start = text.rfind("\n", 0, offset) + 1
    end = text.find("\n", offset)
    return line, offset - start + 1, text[start : None if end < 0 else end].strip()


def _place(text: str, offset: int) -> str:
    """Where ``offset`` is, told by its line's own text rather than by its line number.

    A digest of the stripped line, which of the script's lines with that very text it
    is (0 for the first), and the column in the stripped line: a mutant keeps its id
    (and so its reviewed reason in ``equivalent.toml``) when other lines of the script
    move, and gets a new one when its own line changes, which asks for a new review.
    """
    line, col, source = _line_of(text, offset)
    earlier = text.split("\n")[: line - 1]
    occurrence = sum(1 for other in earlier if other.strip() == source)
    raw = text.split("\n")[line - 1]
    indent = len(raw) - len(raw.lstrip())
    digest = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()[:8]
    return f"{digest}.{occurrence}:{col - indent}"


def _mutant(
    constant: str, text: str, start: int, end: int, new: str, operator: str, note: str = ""
) -> Mutant:
    line, _, source = _line_of(text, start)
    old = text[start:end]
    shown = note or f"`{old.strip()}` -> `{new.strip()}`"
    return Mutant(
        id=f"{constant}:{_place(text, start)}:{operator}:{new.strip()}",
        constant=constant,
        operator=operator,
        line=line,
        description=f"{shown} in `{source}`",
        text=text[:start] + new + text[end:],
    )


def mutants_of(constant: str, text: str) -> Iterator[Mutant]:
    """Every mutant of one script, in the order of the operators, then of the text."""
    masked = _mask(text)
    keys = [(m.start(1), m.end(1)) for m in re.finditer(r"KEYS\[([^\]]+)\]", masked)]

    def in_key(offset: int) -> bool:
        return any(start <= offset < end for start, end in keys)

    for m in re.finditer(r"<=|>=|==|~=|<|>", masked):
        yield _mutant(constant, text, m.start(), m.end(), _FLIP[m.group()], "comparison")
    for old, new in _BOUNDS.items():
        for m in re.finditer(re.escape(old), text):
            if masked[m.start() + old.index(",")] == ",":
                note = "inclusive bound made exclusive"
                if old.startswith("'('"):
                    note = "exclusive bound made inclusive"
                yield _mutant(constant, text, m.start(), m.end(), new, "comparison", note)
    for m in re.finditer(r"(?<![\w.])\d+(?![\w.])", masked):
        if in_key(m.start()):
            continue
        value = int(m.group())
        for changed in (value + 1, value - 1):
            yield _mutant(constant, text, m.start(), m.end(), str(changed), "constant")
    exprs = sorted({" ".join(text[s:e].split()) for s, e in keys})
    for start, end in keys:
        current = " ".join(text[start:end].split())
        for other in exprs:
            if other != current:
                yield _mutant(constant, text, start, end, other, "key")
    for m in _EXPIRE_CALL.finditer(text):
        if masked[m.start()] != " ":
            end = _closing_paren(masked, m.start() + len("redis.call"))
            yield _mutant(constant, text, m.start(), end, "", "expire", "call dropped")
    for m in _SET_EX.finditer(text):
        yield _mutant(constant, text, m.start(), m.end(), "", "expire", "`EX` dropped")
    for m in _SWEEP_CALL.finditer(text):
        yield _mutant(
            constant, text, m.start() + 1, m.end() - 1, "", "sweep", "lease sweep dropped"
        )


def all_mutants() -> list[Mutant]:
    """The mutants of every script constant."""
    found = [m for name in scripts.__all__ for m in mutants_of(name, getattr(scripts, name))]
    for old in _BOUNDS:  # a pattern that matches nothing means the scripts changed shape
        if not any(old in getattr(scripts, name) for name in scripts.__all__):
            raise SystemExit(f"lua.py: bound pattern {old!r} no longer in the scripts")
    return found


@dataclass
class Result:
    """What the suite did with one mutant."""

    id: str
    constant: str
    operator: str
    line: int
    description: str
    status: str  # killed | survived | timeout | error
    seconds: float
    killed_by: str


WORKER = Path(__file__).with_name("lua_worker.py")


def fingerprint() -> str:
    """A digest of what decides the verdicts: the scripts' text, the tests and their files."""
    digest = hashlib.sha1(usedforsecurity=False)
    for name in scripts.__all__:
        digest.update(getattr(scripts, name).encode())
    digest.update("\0".join(TESTS).encode())
    for test in TESTS:
        path = ROOT / test
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _earlier(resume: bool, mark: str) -> tuple[list[Result], float]:
    """The verdicts and seconds of the run to resume; none when starting afresh."""
    if not resume or not RESULTS.exists():
        return [], 0.0
    data = json.loads(RESULTS.read_text(encoding="utf-8"))
    if data.get("fingerprint") != mark:
        raise SystemExit(
            f"lua.py: {RESULTS.name} was made with other scripts or tests"
            f" ({data.get('fingerprint')} here {mark}); run without --resume"
        )
    return [Result(**r) for r in data["results"]], float(data["seconds"])


def _write(results: list[Result], seconds: float, mark: str, complete: bool) -> None:
    """Every verdict so far, replacing the file at once (a reader never sees half of it)."""
    RESULTS.parent.mkdir(exist_ok=True)
    data = {
        "fingerprint": mark,
        "complete": complete,
        "seconds": seconds,
        "results": [asdict(r) for r in results],
    }
    partial = RESULTS.with_suffix(".json.part")
    partial.write_text(json.dumps(data, indent=1), encoding="utf-8")
    partial.replace(RESULTS)


class Killers:
    """Which tests killed mutants of which line: the tests a mutant of that line runs first."""

    def __init__(self, earlier: list[Result]) -> None:
        self._by_line: dict[tuple[str, int], list[str]] = {}
        self._lock = threading.Lock()
        for r in earlier:
            self.note(r)

    def note(self, result: Result) -> None:
        """Remember ``result``'s killer, if it was killed by a test."""
        if result.status != "killed" or not result.killed_by:
            return
        with self._lock:
            tests = self._by_line.setdefault((result.constant, result.line), [])
            if result.killed_by not in tests:
                tests.append(result.killed_by)

    def hints(self, mutant: Mutant) -> list[str]:
        """Up to ``HINTS`` tests: the killers of the mutant's line, then of the lines nearest."""
        with self._lock:
            lines = sorted(
                (abs(line - mutant.line), line)
                for constant, line in self._by_line
                if constant == mutant.constant
            )
            out: list[str] = []
            for _, line in lines:
                for test in self._by_line[(mutant.constant, line)]:
                    if test not in out:
                        out.append(test)
                if len(out) >= HINTS:
                    break
            return out[:HINTS]


def reviewed_equivalent() -> set[str]:
    """The mutant ids ``equivalent.toml`` gives a reason for (``[lua]``)."""
    return set(tomllib.loads(EQUIVALENT.read_text(encoding="utf-8")).get("lua", {}))


def plan(mutants: list[Mutant], equivalent: set[str]) -> tuple[list[Mutant], list[Result]]:
    """The mutants to run, and a result for each reviewed equivalent one, which is not run."""
    run = [m for m in mutants if m.id not in equivalent]
    skipped = [
        Result(m.id, m.constant, m.operator, m.line, m.description, "equivalent", 0.0, "")
        for m in mutants
        if m.id in equivalent
    ]
    return run, skipped


def _previous_results() -> list[Result]:
    """The results file's verdicts, whatever run made them: hints only, never verdicts."""
    try:
        data = json.loads(RESULTS.read_text(encoding="utf-8"))
        return [Result(**r) for r in data["results"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


class _Worker:
    """One long-lived ``lua_worker.py``: the suite run once per mutant, in one interpreter.

    Its answers come on a pipe of their own (the tests' output, and that of the
    redis-servers their fixtures start, cannot mix into them). A mutant that
    hangs the suite past ``MUTANT_TIMEOUT_S`` costs the worker: it is killed
    and the next mutant starts a new one.
    """

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        self._answers: Any = None

    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tools" / "mutation"), str(ROOT / "src")])
        env.pop("PGW_LUA_MUTANT", None)
        read, write = os.pipe()
        self._process = subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
            [sys.executable, str(WORKER), json.dumps(OPTIONS), str(write)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            pass_fds=(write,),
        )
        os.close(write)
        self._answers = os.fdopen(read, encoding="utf-8")

    def stop(self) -> None:
        """Kill the worker (a hung suite, or the end of the run)."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._answers.close()
            self._process = None

    def run(self, mutant: Mutant | None, first: Sequence[str] = ()) -> tuple[str, float, str, str]:
        """The suite with ``mutant`` applied (none: the baseline), the tests ``first`` before it;
        status, time, test, output."""
        if self._process is None or self._process.poll() is not None:
            self._start()
        assert self._process is not None
        assert self._process.stdin is not None
        runs = [list(first), TESTS] if first else [TESTS]
        job: dict[str, Any] = {"runs": runs}
        if mutant is not None:
            job |= {"constant": mutant.constant, "text": mutant.text}
        started = time.monotonic()
        self._process.stdin.write(json.dumps(job) + "\n")
        self._process.stdin.flush()
        ready, _, _ = select.select([self._answers], [], [], MUTANT_TIMEOUT_S)
        line = self._answers.readline() if ready else ""
        seconds = time.monotonic() - started
        if not line:
            self.stop()
            return "timeout" if not ready else "error", seconds, "", "the worker stopped"
        answer = json.loads(line)
        if answer["code"] == 0:
            return "survived", seconds, "", ""
        if answer["code"] == 1:
            return "killed", seconds, answer["failed"], ""
        return "error", seconds, answer["failed"], answer.get("output", "")


def main() -> int:
    """Generate the mutants, check the baseline passes, run them all, write the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the mutants and stop")
    parser.add_argument(
        "--resume", action="store_true", help="keep the verdicts of a stopped run, run the rest"
    )
    parser.add_argument(
        "--all", action="store_true", help="run the mutants reviewed as equivalent too"
    )
    parser.add_argument("ids", nargs="*", help="run only these mutant ids")
    args = parser.parse_args()
    mutants = all_mutants()
    if args.list:
        for m in mutants:
            print(f"{m.id}\t{m.description}")
        print(f"{len(mutants)} mutants", file=sys.stderr)
        return 0
    if args.ids:
        mutants = [m for m in mutants if m.id in set(args.ids)]
    mark = fingerprint()
    wanted = {m.id for m in mutants}
    killers = Killers(_previous_results())
    earlier, earlier_s = _earlier(args.resume, mark)
    results = [r for r in earlier if r.id in wanted]
    done = {r.id for r in results}
    mutants = [m for m in mutants if m.id not in done]
    if done:
        print(f"resuming: {len(done)} verdicts kept, {len(mutants)} mutants to run")
    if not args.all:
        mutants, skipped = plan(mutants, reviewed_equivalent())
        results += skipped
        print(f"{len(skipped)} mutants reviewed as equivalent, not run (--all runs them)")

    started = time.monotonic()
    workers = queue.SimpleQueue[_Worker]()
    for _ in range(WORKERS):
        workers.put(_Worker())
    first = workers.get()
    status, seconds, _, output = first.run(None)
    workers.put(first)
    if status != "survived":
        print(output)
        print(f"lua.py: the unmutated scripts fail the tests ({status}); nothing to measure")
        return 1
    print(f"baseline passes in {seconds:.1f} s; {len(mutants)} Lua mutants on {WORKERS} workers")

    lock = threading.Lock()

    def one(m: Mutant) -> None:
        worker = workers.get()
        try:
            status, seconds, test, output = worker.run(m, killers.hints(m))
        finally:
            workers.put(worker)
        if status == "error":
            print(output[-3000:])
        print(f"{status:8} {seconds:6.1f} s  {m.id}", flush=True)
        result = Result(m.id, m.constant, m.operator, m.line, m.description, status, seconds, test)
        killers.note(result)
        with lock:
            results.append(result)
            _write(results, earlier_s + time.monotonic() - started, mark, complete=False)

    try:
        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            list(pool.map(one, mutants))
    finally:
        while not workers.empty():
            workers.get().stop()
    elapsed = earlier_s + time.monotonic() - started
    _write(results, elapsed, mark, complete=len(results) == len(wanted))
    statuses = ("killed", "survived", "timeout", "equivalent")
    counts = {s: sum(r.status == s for r in results) for s in statuses}
    print(f"Lua: {len(results)} mutants, {counts} in {elapsed / 60:.1f} min -> {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
