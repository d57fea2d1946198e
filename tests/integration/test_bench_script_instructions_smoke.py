"""``bench.script_instructions`` end to end with tiny sizes, so the count cannot rot.

The tool runs redis-server under valgrind's callgrind (``make redis-server``
installs valgrind with it) and differences two runs of different lengths.
This runs it as a person would, small: the printed table has every case, and
a pair of the scripts counts more instructions than their commands alone, and
those more than an INCR + DECR pair, and the experiment of several calls a
script run, and the real scripts in runs, count fewer a pair the more calls a
run, which a broken difference (nothing driven, the runs swapped) would not.
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


@pytest.mark.timeout(240)  # eleven cases, each two runs of a server under callgrind
def test_a_tiny_run_counts_every_case() -> None:
    command = [sys.executable, "-m", "bench.script_instructions", "--pairs", "80"]
    command += ["--sources", "3", "--runs"]
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
        ("1 source", "state read once, 1 call a run"),
        ("1 source", "state read once, 4 calls a run"),
        ("1 source", "state read once, 16 calls a run"),
        ("1 source", "ACQUIRE and RELEASE in runs of 4"),
        ("1 source", "ACQUIRE and RELEASE in runs of 16"),
    ]
    calls = rows[("1 source", "its commands alone, no logic")]
    baseline = rows[("INCR + DECR", "baseline")]
    assert rows[("1 source", "current")] > calls > 10 * baseline > 0
    # A run shares its state's reads and writes: the more calls a run, the less a pair.
    runs = [
        rows[("1 source", f"state read once, {n} call{'s' if n > 1 else ''} a run")]
        for n in (1, 4, 16)
    ]
    assert rows[("1 source", "current")] > runs[0] > runs[1] > runs[2] > baseline
    # The real scripts in runs: cheaper a pair than alone, and the longer the run the cheaper.
    real = [rows[("1 source", f"ACQUIRE and RELEASE in runs of {n}")] for n in (4, 16)]
    assert rows[("1 source", "current")] > real[0] > real[1] > baseline
