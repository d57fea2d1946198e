"""The Lua mutation runner's mutant ids: stable across edits elsewhere in a script.

``tools/mutation/equivalent.toml`` keys each reviewed reason by a mutant's id
(research-wiki/MUTATION.md); an id tied to a line number would move to another
mutant whenever a line is added above it, and a reason would then explain the
wrong change.
"""

from __future__ import annotations

from _mutation_tools import lua_runner as _runner

SCRIPT = """local now = tonumber(ARGV[1])
if now == nil then
  return 1
end
if now == nil then
  return 2
end
"""


def _ids(text: str) -> dict[tuple[int, str], str]:
    """Each mutant's id by (which occurrence of its line, description)."""
    out: dict[tuple[int, str], str] = {}
    for m in _runner().mutants_of("T", text):
        key = (sum(1 for k in out if k[1] == m.description), m.description)
        out[key] = m.id
    return out


def test_an_id_stays_when_lines_are_added_above_or_reindented() -> None:
    before = _ids(SCRIPT)
    after = _ids("-- a comment\nlocal unused = {}\n" + SCRIPT.replace("\n  return", "\n    return"))
    assert {k: v for k, v in after.items() if k in before} == before
    assert len(before) > 4


def test_identical_lines_have_ids_of_their_own_and_an_edited_line_new_ones() -> None:
    before = _ids(SCRIPT)
    flips = [v for (_, d), v in before.items() if d.startswith("`==` -> `~=`")]
    assert len(flips) == 2
    assert len(set(flips)) == 2, "two `if now == nil` lines, two ids"
    on_the_line = {v for (_, d), v in before.items() if d.endswith("in `return 2`")}
    assert on_the_line, "the constant 2 is mutated up and down"
    edited = _ids(SCRIPT.replace("return 2", "return 20"))
    assert not on_the_line & set(edited.values())
    unchanged = {v for (_, d), v in before.items() if d.endswith("in `return 1`")}
    assert unchanged <= set(edited.values())
