"""The Lua mutation runner keeps each verdict as it comes, and resumes only the same run.

A full Lua run takes longer than one sitting (research-wiki/MUTATION.md); a
run stopped part-way must lose no verdict, and verdicts made with other
scripts or tests must not be mixed into a resumed one.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from _mutation_tools import lua_runner


@pytest.fixture
def runner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = lua_runner()
    monkeypatch.setattr(module, "RESULTS", tmp_path / "lua-results.json")
    return module


def _result(runner: ModuleType, mutant_id: str, status: str = "killed") -> object:
    return runner.Result(mutant_id, "ACQUIRE", "constant", 3, "`1` -> `2`", status, 1.5, "t")


def test_verdicts_written_part_way_are_kept_by_a_resumed_run(runner: ModuleType) -> None:
    mark = runner.fingerprint()
    runner._write([_result(runner, "A"), _result(runner, "B", "survived")], 90.0, mark, False)
    data = json.loads(runner.RESULTS.read_text(encoding="utf-8"))
    assert (data["complete"], data["seconds"], data["fingerprint"]) == (False, 90.0, mark)
    results, seconds = runner._earlier(True, mark)
    assert [(r.id, r.status) for r in results] == [("A", "killed"), ("B", "survived")]
    assert seconds == 90.0
    assert not runner.RESULTS.with_suffix(".json.part").exists()


def test_a_fresh_run_keeps_nothing(runner: ModuleType) -> None:
    mark = runner.fingerprint()
    runner._write([_result(runner, "A")], 90.0, mark, False)
    assert runner._earlier(False, mark) == ([], 0.0)


def test_verdicts_of_other_scripts_or_tests_are_not_resumed(runner: ModuleType) -> None:
    runner._write([_result(runner, "A")], 90.0, "0123456789abcdef", False)
    with pytest.raises(SystemExit, match="other scripts or tests"):
        runner._earlier(True, runner.fingerprint())


def test_the_fingerprint_follows_the_scripts_and_the_tests(
    runner: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    mark = runner.fingerprint()
    assert mark == runner.fingerprint()
    monkeypatch.setattr(runner.scripts, "RENEW", runner.scripts.RENEW + "\n-- changed\n")
    changed_script = runner.fingerprint()
    monkeypatch.undo()
    monkeypatch.setattr(runner, "RESULTS", runner.RESULTS)
    monkeypatch.setattr(runner, "TESTS", [*runner.TESTS[:-2], "-k", "redis"])
    assert len({mark, changed_script, runner.fingerprint()}) == 3


def _mutant(runner: ModuleType, line: int, mutant_id: str = "M") -> object:
    return runner.Mutant(mutant_id, "ACQUIRE", "constant", line, "`1` -> `2`", "text")


def _killed(runner: ModuleType, line: int, test: str, constant: str = "ACQUIRE") -> object:
    return runner.Result("K", constant, "constant", line, "", "killed", 1.0, test)


def test_a_mutant_first_runs_the_killers_of_its_line_then_of_the_nearest_lines(
    runner: ModuleType,
) -> None:
    killers = runner.Killers(
        [
            _killed(runner, 10, "t::same_line"),
            _killed(runner, 10, "t::same_line"),
            _killed(runner, 14, "t::four_below"),
            _killed(runner, 8, "t::two_above"),
            _killed(runner, 30, "t::far"),
            _killed(runner, 10, "t::other_script", constant="RELEASE"),
            runner.Result("S", "ACQUIRE", "constant", 10, "", "survived", 9.0, ""),
        ]
    )
    assert killers.hints(_mutant(runner, 10)) == ["t::same_line", "t::two_above", "t::four_below"]
    killers.note(_killed(runner, 11, "t::next_line"))
    assert killers.hints(_mutant(runner, 11)) == ["t::next_line", "t::same_line", "t::two_above"]
    assert killers.hints(runner.Mutant("M", "RENEW", "constant", 3, "", "")) == []


def test_mutants_reviewed_as_equivalent_are_recorded_without_running(runner: ModuleType) -> None:
    mutants = [_mutant(runner, 1, "A"), _mutant(runner, 2, "B"), _mutant(runner, 3, "C")]
    run, skipped = runner.plan(mutants, {"B", "Z"})
    assert [m.id for m in run] == ["A", "C"]
    assert [(r.id, r.status, r.seconds) for r in skipped] == [("B", "equivalent", 0.0)]
    reviewed = tomllib.loads(
        (Path(__file__).parents[2] / "tools" / "mutation" / "equivalent.toml").read_text()
    )["lua"]
    assert reviewed  # the reasons of [lua], and only those
    assert runner.reviewed_equivalent() == set(reviewed)
