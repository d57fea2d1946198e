"""The priority-classes fleet benchmark's arithmetic and page section, without running it.

``make bench-classes`` takes minutes (worker processes, one minute per
scenario); what can rot unseen is how its records become figures and verdicts,
checked here on records made up for the purpose.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not installed
from bench.fleet_classes import _first_full, _round_trips_per_waiting_s, render_section
from bench.fleet_worker import _CountingBackend
from bench.report import replace_section

from polygateway.backends.redis import RedisBackend


def test_first_full_is_when_every_permit_is_held_after_the_moment() -> None:
    calls = [
        {"acquired": 0.0, "ended": 5.0},
        {"acquired": 1.0, "ended": 2.0},
        {"acquired": 3.0, "ended": 6.0},
    ]
    assert _first_full(calls, since=0.5, permits=2) == 0.5  # 1.0: two held
    assert _first_full(calls, since=2.5, permits=2) == 0.5  # 3.0: two held again
    assert _first_full(calls, since=0.0, permits=3) is None


def test_round_trips_per_waiting_call_count_only_the_calls_that_waited() -> None:
    records = [
        {"ok": True, "started": 0.0, "acquired": 2.0, "denied": 1, "acquires": 2, "releases": 1},
        {"ok": True, "started": 0.0, "acquired": 0.0, "acquires": 1, "releases": 1},
    ]
    assert _round_trips_per_waiting_s(records) == 1.5


def _results(ratio_low: int) -> dict[str, object]:
    flood = {
        "interactive_calls": 10,
        "interactive_failed": 0,
        "batch_served": 900,
        "attempt_ms": 200.0,
        "wait_p50_ms": 10.0,
        "wait_max_ms": 30.0,
        "within_bound": 10,
        "round_trips_per_waiting_call_s": 4.0,
        "upstream_max_concurrent": 20,
    }
    return {
        "meta": {
            "command": "make bench-classes",
            "inner_command": "python -m bench.fleet_classes",
            "date": "2026-12-01 00:00",
            "revision": "abc",
            "duration_s": 200.0,
            "load_average": {"before": 0.5, "after": 1.5},
            "machine": {"cpu_model": "cpu", "nproc": 2, "python": "3.11", "redis_server": "7"},
            "sizes": {
                "seconds": 60.0,
                "permits": 20,
                "latency_s": 0.2,
                "batch_processes": 4,
                "batch_callers": 25,
                "share_callers": 20,
            },
        },
        "measured": {
            "flood_classes": {**flood, "classes": True},
            "flood_fifo": {**flood, "classes": False, "within_bound": 4},
            "shares": {
                "granted_high": 300,
                "granted_low": ratio_low,
                "ratio": 300 / ratio_low,
                "attempt_ms": 200.0,
                "low_full_after_ms": 50.0,
                "upstream_max_concurrent": 20,
            },
        },
    }


def test_the_section_says_each_verdict_and_replaces_its_namesake() -> None:
    met = render_section(_results(100))
    assert met.count("**met**") == 3
    missed = render_section(_results(150))  # 2:1, not within 10% of 3:1
    assert "| shares 3:1 across 4 processes, within 10% | 2.00 : 1 | **missed** |" in missed
    page = replace_section("# Benchmarks\n", met)
    assert replace_section(page, missed).count("begin:fleet-classes") == 1


def test_a_full_bench_run_keeps_the_classes_section_of_the_page() -> None:
    """``make bench`` rewrites the page from its template and keeps every measured section."""
    from bench.report import keep_sections

    section = render_section(_results(100))
    old_page = replace_section("# Benchmarks\n\nold figures\n", section)
    fresh = "# Benchmarks\n\nnew figures\n"
    kept = keep_sections(fresh, old_page)
    assert "new figures" in kept
    assert section.strip() in kept
    template = (Path(__file__).resolve().parents[2] / "bench" / "template.md").read_text()
    assert "<!-- begin:fleet-classes" in template, "the template has a place for it"


def test_the_workers_counting_backend_takes_every_argument_of_acquire() -> None:
    """The fleet workers wrap the backend to count acquires: a call of a scope with classes
    names its class, and a wrapper that did not take it crashed every worker."""
    wrapped = inspect.signature(RedisBackend.acquire).parameters
    assert inspect.signature(_CountingBackend.acquire).parameters.keys() == wrapped.keys()
