"""``bench.script_instructions`` end to end with tiny sizes, so the count cannot rot.

The tool runs redis-server under valgrind's callgrind (``make redis-server``
installs valgrind with it) and differences two runs of different lengths.
This runs it as a person would, small: the printed table has every case, and
a pair of the scripts counts more instructions than their commands alone, and
those more than an INCR + DECR pair, which a broken difference (nothing
driven, the runs swapped) would not.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not installed
from bench.script_instructions import callgrind_total

ROOT = Path(__file__).resolve().parents[2]


def test_the_total_is_read_from_either_line_callgrind_writes() -> None:
    assert callgrind_total("events: Ir\nsummary: 1234\n") == 1234
    assert callgrind_total("fl=x\ntotals: 99\n") == 99
    with pytest.raises(ValueError, match="no summary"):
        callgrind_total("events: Ir\n")


def test_a_tiny_run_counts_every_case() -> None:
    command = [sys.executable, "-m", "bench.script_instructions", "--pairs", "10"]
    command += ["--sources", "3"]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {}
    for line in done.stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[2].replace(",", "").isdigit():
            rows[(cells[0], cells[1])] = int(cells[2].replace(",", ""))
    assert list(rows) == [
        ("INCR + DECR", "baseline"),
        ("1 source", "current"),
        ("1 source", "its commands alone, no logic"),
        ("1 source, 50 leases live", "current"),
        ("2 sources, 1st full", "current"),
        ("3 sources, 2 full", "current"),
    ]
    calls = rows[("1 source", "its commands alone, no logic")]
    assert rows[("1 source", "current")] > calls > 10 * rows[("INCR + DECR", "baseline")] > 0
