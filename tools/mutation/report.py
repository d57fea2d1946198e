"""Write research-wiki/MUTATION.md from one ``make mutation`` run (the last step of the target).

Reads what the two runners left in ``mutants/``: mutmut's per-file results
(``*.py.meta``, one exit code per mutant) and ``lua-results.json`` from
``tools/mutation/lua.py``; and ``tools/mutation/equivalent.toml``, the
reviewed reasons why a surviving mutant cannot be told apart from the
original. A survivor without a reason there counts against the score: the
page lists it as unexplained, and the fix is a test that kills it.

Runs in the mutation venv (mutmut pinned in pyproject's ``mutation`` extra),
from the repository root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = ROOT / "mutants"
PAGE = ROOT / "research-wiki" / "MUTATION.md"
EQUIVALENT = ROOT / "tools" / "mutation" / "equivalent.toml"
TARGET = 0.95

KILLED = {"killed", "timeout"}

_CHOICES = [
    "## Choices",
    "",
    "- **mutmut 3, not cosmic-ray.** mutmut runs the suite once to learn which tests",
    "  reach each function, then forks a warm interpreter per mutant and runs only those",
    "  tests: a few thousand mutants in under half an hour on two cores. cosmic-ray starts",
    "  a fresh test command per mutant; at the unit suite's ~8 s (plus start-up) that is",
    "  hours on two cores, past the 60-minute budget, or a test selection too thin to trust.",
    "  mutmut is pinned (mutant names, and so `equivalent.toml`, depend on its version).",
    "- **Tests per mutant.** `tests/unit` (FakeClock, FakeTransport, no network) and the",
    "  memory half of the backend contract suite, which is where the memory backend's",
    "  behaviour is specified; the Redis half and the differential test guard the Lua",
    "  scripts (below). A test that hangs under a mutant fails after 10 s.",
    "- **Left out of mutation:** `GovernedClient.__del__` (`# pragma: no mutate block`). The",
    "  collector runs a finalizer anywhere, including inside mutmut's own bookkeeping",
    "  (a context variable it sets on every call), which crashed the interpreter.",
    "- **Lua.** A runner of our own (`tools/mutation/lua.py`, not collected by pytest):",
    "  each mutant swaps one script constant in memory, and the tests start a fresh",
    "  Redis. Each of its two workers is one long-lived test process",
    "  (`tools/mutation/lua_worker.py`) that runs the suite once per mutant, so a mutant",
    "  pays no interpreter start-up or collection (about 2 s: most mutants are killed in",
    "  under one). A mutant first runs the tests that killed mutants of its line (or of",
    "  the nearest lines) earlier in the run, then the whole list if none failed, so a",
    "  survivor is one every test let pass; a mutant with a reviewed reason in",
    "  `equivalent.toml` is not run again (status *equivalent*; `lua.py --all` runs them).",
    "  Operators: comparisons flipped (`<`/`<=`, `>`/`>=`, `==`/`~=`, and the",
    "  inclusive or exclusive bound of a `ZRANGEBYSCORE` / `ZCOUNT`), every integer one up",
    "  and one down, every `KEYS[...]` index swapped for each other one of its script, each",
    "  `EXPIRE` (and the progress key's `EX`) dropped, the lease sweep dropped.",
    "- **Tests added for this page** (each kills survivors of an earlier run):",
    "  `tests/unit/test_mutants_{governance,memory,waiting,admission,retry,middleware}.py`,",
    "  `tests/unit/test_mutants_{gauges,otel,telemetry,flow}.py`,",
    "  one OCR test in `tests/unit/test_ocr_client.py`, the sweeps past one Lua chunk in",
    "  `tests/integration/test_backend_contract.py` and",
    "  `tests/integration/test_redis_key_expiry.py`. Before them the Python score was",
    "  82.1% (2,548 mutants: 2,046 killed, 45 timed out, 441 survived, 16 without a test,",
    "  on `tests/unit` alone).",
]


def _git(*args: str) -> str:
    done = subprocess.run(  # noqa: S603 - fixed git arguments
        ["git", *args],  # noqa: S607 - git from PATH, as the Makefile uses it
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def _module_of(mutant: str) -> str:
    """``polygateway.governance.aimd.x_on_success__mutmut_3`` -> ``governance/aimd.py``."""
    module = mutant.split(".x", 1)[0] if ".x" in mutant else mutant.rsplit(".", 1)[0]
    return module.removeprefix("polygateway.").replace(".", "/") + ".py"


def _changed_lines(mutant: str) -> str:
    """The mutant's diff reduced to its removed and added lines, for one table cell."""
    diff = get_diff_for_mutant(mutant).splitlines()[2:]
    minus = [line[1:].strip() for line in diff if line.startswith("-")]
    plus = [line[1:].strip() for line in diff if line.startswith("+")]
    return f"`{' / '.join(minus)}` -> `{' / '.join(plus) or '(removed)'}`"


def _python_results() -> dict[str, str]:
    """Every Python mutant's status, by mutmut's name for it."""
    statuses: dict[str, str] = {}
    for meta in sorted((MUTANTS / "src").rglob("*.py.meta")):
        data = json.loads(meta.read_text(encoding="utf-8"))
        for name, code in data["exit_code_by_key"].items():
            statuses[name] = status_by_exit_code[code]
    return statuses


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _later(later: dict[str, str], name: str) -> str:
    """The note for a survivor that a test added after the run kills, if there is one."""
    test = later.get(name)
    return f"not equivalent; now killed by `{test}` (added after this run)" if test else ""


def _score(killed: int, total: int, equivalent: int) -> str:
    relevant = total - equivalent
    return f"{100.0 * killed / relevant:.1f}%" if relevant else "-"


def main() -> int:
    """Build the page; exit 1 when a part of the run is missing."""
    reasons: dict[str, Any] = tomllib.loads(EQUIVALENT.read_text(encoding="utf-8"))
    py_reasons: dict[str, str] = reasons.get("python", {})
    lua_reasons: dict[str, str] = reasons.get("lua", {})
    # Survivors of the measured run that a test added since kills: named, still not counted.
    later: dict[str, str] = reasons.get("python_killed_later", {}) | reasons.get(
        "lua_killed_later", {}
    )
    statuses = _python_results()
    lua_path = MUTANTS / "lua-results.json"
    if not statuses or not lua_path.exists():
        print("report.py: run `make mutation` first (mutants/ holds no complete run)")
        return 1
    lua = json.loads(lua_path.read_text(encoding="utf-8"))
    if not lua.get("complete", True):
        print("report.py: the Lua run stopped part-way; finish it with `lua.py --resume`")
        return 1
    py_seconds = int((MUTANTS / "python-seconds.txt").read_text().strip())
    lua_seconds = int(lua["seconds"])

    by_module: dict[str, Counter[str]] = defaultdict(Counter)
    survivors: list[tuple[str, str, str]] = []
    for name, status in sorted(statuses.items()):
        module = _module_of(name)
        counts = by_module[module]
        counts["total"] += 1
        if status in KILLED:
            counts[status] += 1
            continue
        if status == "survived" and name in py_reasons:
            counts["equivalent"] += 1
        else:
            counts["not killed"] += 1
        survivors.append((name, status, py_reasons.get(name, "")))

    lua_counts: dict[str, Counter[str]] = defaultdict(Counter)
    lua_survivors: list[dict[str, Any]] = []
    for r in lua["results"]:
        counts = lua_counts[r["constant"]]
        counts["total"] += 1
        if r["status"] in KILLED:
            counts[r["status"]] += 1
            continue
        if r["status"] in ("survived", "equivalent") and r["id"] in lua_reasons:
            counts["equivalent"] += 1
        else:
            counts["not killed"] += 1
        lua_survivors.append(r)

    # The Makefile notes the commit and start of the run: the page may be rebuilt later.
    started_file, commit_file = MUTANTS / "run-started.txt", MUTANTS / "run-commit.txt"
    started = (
        started_file.read_text().strip()
        if started_file.exists()
        else f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC"
    )
    commit = (
        commit_file.read_text().strip()
        if commit_file.exists()
        else _git("rev-parse", "--short=12", "HEAD")
    )
    dirty = "" if commit_file.exists() else _git("status", "--porcelain", "--untracked-files=no")
    lines = [
        "# Mutation testing",
        "",
        "How well the tests guard the governance core: every small change to the policy",
        "code (a flipped comparison, a constant off by one, a dropped call) should make a",
        "test fail. A mutant no test notices is either *equivalent* (it cannot change any",
        "behaviour: the reason is given below) or a hole in the suite, closed by a test.",
        "Target: at least 95% of the non-equivalent mutants killed, in every part;",
        "for the Lua scripts, every mutant of a comparison, a constant or a key.",
        "",
        "- Command: `make mutation` (from a clean checkout: `git clone` then `make mutation`).",
        f"- Run: started {started}, commit `{commit}`"
        + (" (working tree modified)" if dirty else " (clean checkout)")
        + ", on a 2-core machine.",
        f"- Time: Python {py_seconds / 60:.1f} min, Lua {lua_seconds / 60:.1f} min, "
        f"total {(py_seconds + lua_seconds) / 60:.1f} min (budget: 60).",
        *([f"- Note: {note}"] if (note := os.environ.get("MUTATION_NOTE", "").strip()) else []),
        "- Python: mutmut 3.8.1 (`[tool.mutmut]` in pyproject.toml) mutates",
        "  `src/polygateway/governance/`, `middleware/` (the loop, its waiting room,",
        "  telemetry) and `backends/memory.py`; each mutant runs the tests that reach the mutated",
        "  function, out of `tests/unit` and the memory half of",
        "  `tests/integration/test_backend_contract.py` (no network), each test bounded",
        "  at 10 s. *Timed out* counts as killed (the mutant hangs a test).",
        "- Lua: `tools/mutation/lua.py` mutates the scripts of",
        "  `src/polygateway/backends/redis/scripts.py` one change at a time, in memory,",
        "  and runs the Redis half of the contract suite, the differential test and the",
        "  server-clock and key-expiry tests of the Redis backend on a real Redis.",
        "- Equivalent mutants: `tools/mutation/equivalent.toml`, one reviewed reason each.",
        "- Score: (killed + timed out) / (mutants - equivalent). A mutant whose function no",
        "  test reaches (*no tests*) counts as not killed.",
        "",
        *_CHOICES,
        "",
        "## Python: per module",
        "",
        "| module | mutants | killed | timed out | equivalent | not killed | score |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    total: Counter[str] = Counter()
    for module in sorted(by_module):
        c = by_module[module]
        total.update(c)
        lines.append(
            f"| `{module}` | {c['total']} | {c['killed']} | {c['timeout']} | "
            f"{c['equivalent']} | {c['not killed']} | "
            f"{_score(c['killed'] + c['timeout'], c['total'], c['equivalent'])} |"
        )
    lines.append(
        f"| **all** | {total['total']} | {total['killed']} | {total['timeout']} | "
        f"{total['equivalent']} | {total['not killed']} | "
        f"**{_score(total['killed'] + total['timeout'], total['total'], total['equivalent'])}** |"
    )
    lines += [
        "",
        "## Lua: per script",
        "",
        "| script | mutants | killed | timed out | equivalent | not killed | score |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    lua_total: Counter[str] = Counter()
    for constant in sorted(lua_counts):
        c = lua_counts[constant]
        lua_total.update(c)
        lines.append(
            f"| `{constant}` | {c['total']} | {c['killed']} | {c['timeout']} | "
            f"{c['equivalent']} | {c['not killed']} | "
            f"{_score(c['killed'] + c['timeout'], c['total'], c['equivalent'])} |"
        )
    lua_killed = lua_total["killed"] + lua_total["timeout"]
    lines.append(
        f"| **all** | {lua_total['total']} | {lua_total['killed']} | {lua_total['timeout']} | "
        f"{lua_total['equivalent']} | {lua_total['not killed']} | "
        f"**{_score(lua_killed, lua_total['total'], lua_total['equivalent'])}** |"
    )
    py_later = sum(1 for n, _, _ in survivors if n in later)
    lua_later = sum(1 for r in lua_survivors if r["id"] in later)
    lines.insert(
        lines.index("## Lua: per script") - 1,
        f"\nOf the {total['not killed']} not killed, {py_later} are killed by tests written "
        "after this run (see the survivors below).",
    )
    lines.append("")
    lines.append(
        f"Of the {lua_total['not killed']} not killed, {lua_later} are killed by tests "
        "written after this run (see the survivors below)."
    )
    operators = Counter(r["operator"] for r in lua["results"])
    lines += [
        "",
        "Lua mutants by operator: "
        + ", ".join(f"{op} {n}" for op, n in sorted(operators.items()))
        + ".",
        "",
        "## Python survivors",
        "",
        "Each mutant that no test killed, with the change it makes and why it is",
        "equivalent; *now killed by* names a test written after this run for a hole the",
        "run found (the score above still counts it as not killed); *not explained* is a",
        "hole still open.",
        "",
        "| mutant | change | why it survives |",
        "|---|---|---|",
    ]
    for name, status, reason in survivors:
        why = reason or _later(later, name) or f"**not explained** ({status})"
        short = name.removeprefix("polygateway.")
        lines.append(f"| `{short}` | {_cell(_changed_lines(name))} | {_cell(why)} |")
    lines += [
        "",
        "## Lua survivors",
        "",
        "| mutant | change | why it survives |",
        "|---|---|---|",
    ]
    for r in lua_survivors:
        why = (
            lua_reasons.get(r["id"], "")
            or _later(later, r["id"])
            or f"**not explained** ({r['status']})"
        )
        change = f"line {r['line']}: {r['description']}"
        lines.append(f"| `{r['id']}` | {_cell(change)} | {_cell(why)} |")
    lines.append("")
    PAGE.write_text("\n".join(lines), encoding="utf-8")

    survived = {n for n, _, _ in survivors} | {r["id"] for r in lua_survivors}
    stale = sorted((set(py_reasons) | set(lua_reasons) | set(later)) - survived)
    for name in stale:
        print(f"report.py: equivalent.toml names {name}, which did not survive: drop it")
    py_relevant = total["total"] - total["equivalent"]
    py_score = (total["killed"] + total["timeout"]) / py_relevant if py_relevant else 1.0
    print(
        f"Python {py_score:.1%} of {py_relevant} non-equivalent mutants killed; "
        f"Lua {lua_total['not killed']} not killed; page: {PAGE.relative_to(ROOT)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
