"""The fleet benchmark end to end with tiny sizes, so ``make bench-fleet`` cannot rot.

Runs ``python -m bench.fleet`` as ``make bench-fleet`` does (its own
redis-server, the simulator in its process, one worker process per fleet
member), with fleets of 1 and 2 processes for 2 s each, into a page that
already has a fleet section. No timing is compared with a target here: only
that every figure is reported, that the page's section is rewritten in
place, and that a call that does not wait costs Redis exactly two round
trips, acquire and release, as the server counts them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not installed
from bench.fleet import COLUMNS, evaluate
from bench.report import keep_sections, replace_section

ROOT = Path(__file__).resolve().parents[2]

FLEETS = (1, 2)
PERMITS = 2
OLD_PAGE = """# Benchmarks

<!-- begin:fleet (an older run) -->
## Fleet

an older run's table
<!-- end:fleet -->

## Analysis

written by make bench
"""


@pytest.fixture(scope="module")
def fleet_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One tiny run; its results JSON and the page it rewrote."""
    out = tmp_path_factory.mktemp("fleet")
    page, results = out / "BENCHMARKS.md", out / "fleet.json"
    page.write_text(OLD_PAGE, encoding="utf-8")
    command = [
        sys.executable,
        "-m",
        "bench.fleet",
        "--n",
        ",".join(map(str, FLEETS)),
        "--seconds",
        "2",
        "--callers",
        "4",
        "--permits",
        str(PERMITS),
        "--sample-calls",
        "20",
        "--monitor-calls",
        "10",
        "--out",
        str(page),
        "--results",
        str(results),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BENCH_", "MAKE"))}
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {
        "results": json.loads(results.read_text(encoding="utf-8")),
        "page": page.read_text(encoding="utf-8"),
    }


def _fields(field: str) -> tuple[str, ...]:
    """The row fields a table column is made of."""
    return ("share_min", "share_max") if field == "share_of_mean" else (field,)


@pytest.mark.parametrize("processes", FLEETS)
def test_every_fleet_reports_every_column(fleet_run: dict[str, Any], processes: int) -> None:
    """Each fleet's row has every figure of the table, measured, and no call failed."""
    rows = {r["processes"]: r for r in fleet_run["results"]["measured"]["rows"]}
    row = rows[processes]
    maybe_absent = {
        # None only when no call of the kind happened in the run, which the row says.
        "round_trips_per_non_waiting_call": row["non_waiting_calls"] == 0,
        "polls_per_waiting_process_per_s": row["denied_acquires"] == 0,
    }
    for field, _ in COLUMNS:
        for name in _fields(field):
            assert name in row, name
            if not maybe_absent.get(name, False):
                assert row[name] is not None, name
    assert row["served"] > 0
    assert row["failed"] == 0
    assert row["redis_cpu_us_per_call"] > 0
    assert row["calls_per_s_per_redis_core"] > 0
    assert row["upstream_max_concurrent"] <= PERMITS
    assert sum(row["served_per_process"]) == row["served"]
    assert len(row["served_per_process"]) == processes


def test_a_call_that_does_not_wait_costs_two_round_trips(fleet_run: dict[str, Any]) -> None:
    """Uncontended, the server sees two EVALSHA per call (acquire, release) and nothing else."""
    un = fleet_run["results"]["measured"]["uncontended"]
    assert un["round_trip_note"] is None
    assert un["waited"] == 0
    assert un["round_trips_per_call"] == 2.0
    assert un["round_trip_commands"] == {"evalsha": 2 * 10}
    assert un["scripts_per_call"] == 2.0
    assert un["client_round_trips_per_call"] == 2.0
    for row in fleet_run["results"]["measured"]["rows"]:
        if row["non_waiting_calls"]:
            assert row["round_trips_per_non_waiting_call"] == 2.0, row["processes"]


def test_page_section_is_rewritten_in_place_with_every_column(fleet_run: dict[str, Any]) -> None:
    """The run replaces the page's fleet section, keeps the rest, and names both targets."""
    page = fleet_run["page"]
    assert "an older run's table" not in page
    assert page.count("<!-- begin:fleet") == page.count("<!-- end:fleet -->") == 1
    assert page.index("<!-- end:fleet -->") < page.index("## Analysis\n\nwritten by make bench")
    header = next(line for line in page.splitlines() if line.startswith("| processes |"))
    assert [cell.strip() for cell in header.strip("|").split("|")] == [h for _, h in COLUMNS]
    assert fleet_run["results"]["meta"]["command"] in page
    for check in fleet_run["results"]["checks"]:
        assert check["target"] in page
        assert check["met"] is not None, check["id"]


def test_make_bench_keeps_the_fleet_section_it_does_not_write() -> None:
    """A page rendered again by ``make bench`` keeps the fleet section already on the page."""
    measured = "<!-- begin:fleet (x) -->\n## Fleet\n\nmeasured\n<!-- end:fleet -->"
    fresh = "# B\n\nnew tables\n\n<!-- begin:fleet (x) -->\nnot measured\n<!-- end:fleet -->\n"
    kept = keep_sections(fresh, replace_section(OLD_PAGE, measured))
    assert kept == fresh.replace(
        "<!-- begin:fleet (x) -->\nnot measured\n<!-- end:fleet -->", measured
    )
    assert keep_sections(fresh, "# B\n\nold page without the section\n") == fresh


def _row(processes: int, served: list[int], p99: float, callers: int = 200) -> dict[str, Any]:
    mean = sum(served) / len(served)
    return {
        "processes": processes,
        "callers": callers,
        "served_per_process": served,
        "share_min": min(served) / mean,
        "share_max": max(served) / mean,
        "wait_p99_ms": p99,
        "wait_p99_vs_one_process": None,
    }


@pytest.mark.parametrize(
    ("served", "p99", "verdicts"),
    [
        ([80, 100, 120], 1000.0, [True, True]),
        ([74, 100, 126], 1000.0, [False, True]),
        ([100, 100, 100], 1001.0, [True, False]),
    ],
)
def test_targets_are_judged_on_the_largest_fleet(
    served: list[int], p99: float, verdicts: list[bool]
) -> None:
    """Shares within ±25% of the mean and a p99 within 2x one process's are met, else missed."""
    one, fleet = _row(1, [300], 500.0), _row(3, served, p99)
    fleet["wait_p99_vs_one_process"] = p99 / 500.0
    assert [c["met"] for c in evaluate([one, fleet])] == verdicts
    assert [c["met"] for c in evaluate([one])] == [None, None]
