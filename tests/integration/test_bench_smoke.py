"""The benchmark harness, end to end with tiny sizes, so ``make bench`` cannot rot.

Runs ``python -m bench`` exactly as ``make bench`` does (simulator and
redis-server in their own processes, one client process per job), for the
configurations the dev venv has: raw httpx, raw aiohttp, and PolyGateway on
both transports (memory backend) and on the Redis backend. The openai SDK
and LiteLLM live in the bench venv only, so they are not in this list. No
figure is compared with a target here: timing is not asserted, only that
every job produced its figures and the page was written from them.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAT_CONFIGS = (
    "raw_httpx",
    "raw_aiohttp",
    "pgw_memory_httpx",
    "pgw_memory_aiohttp",
    "pgw_redis_aiohttp",
)
LOOP_CONFIGS = ("pgw_memory_instant", "pgw_redis_instant")
CONFIGS = CHAT_CONFIGS + LOOP_CONFIGS
N, STREAM_N, SCALE_NS, EMBED_N, STORM_N = 20, 4, (20, 40), 300, 4


def _bench_module(name: str) -> ModuleType:
    """Import ``bench.<name>`` from the repository root (bench/ is not an installed package)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"bench.{name}")


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One tiny run of every scenario; its results JSON, page text and process output."""
    out = tmp_path_factory.mktemp("bench")
    page, results = out / "BENCHMARKS.md", out / "results.json"
    command = [
        sys.executable,
        "-m",
        "bench",
        "--n",
        str(N),
        "--rounds",
        "1",
        "--stream-n",
        str(STREAM_N),
        "--scale-ns",
        ",".join(map(str, SCALE_NS)),
        "--embed-n",
        str(EMBED_N),
        "--storm-n",
        str(STORM_N),
        "--configs",
        ",".join(CONFIGS),
        "--out",
        str(page),
        "--results",
        str(results),
        "--timeout",
        "60",
    ]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=100, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return {
        "results": json.loads(results.read_text(encoding="utf-8")),
        "page": page.read_text(encoding="utf-8"),
        "stderr": done.stderr,
    }


def _only_run(smoke_run: dict[str, Any], key: str) -> dict[str, Any]:
    """The single round of job ``key``, which must have succeeded."""
    runs = smoke_run["results"]["runs"][key]
    assert len(runs) == 1, key
    run: dict[str, Any] = runs[0]
    assert "failed" not in run, f"{key}: {run.get('failed')}"
    return run


def _assert_figures(run: dict[str, Any], n: int) -> None:
    """The figures every call-making job reports, present and positive."""
    for field in ("cpu_s", "cpu_us_per_op", "wall_s", "ops_per_s", "rss_mib", "peak_rss_mib"):
        assert run[field] > 0, field
    assert 0 < run["p50_ms"] <= run["p99_ms"]
    assert run["n"] == n


@pytest.mark.parametrize("config", CHAT_CONFIGS)
@pytest.mark.parametrize("concurrency", [1, 64])
def test_chat_job_reports_cpu_latency_and_memory(
    smoke_run: dict[str, Any], config: str, concurrency: int
) -> None:
    """Each chat job serves every call and reports CPU per call, throughput, p50/p99 and RSS."""
    run = _only_run(smoke_run, f"chat/{config}/n{N}/c{concurrency}")
    _assert_figures(run, N)
    assert (run["ok"], run["errors"]) == (N, 0)


@pytest.mark.parametrize("config", LOOP_CONFIGS)
def test_governance_loop_job_runs_without_an_upstream(
    smoke_run: dict[str, Any], config: str
) -> None:
    """The instant-transport jobs measure PolyGateway's own cost; Redis still does 2 round trips."""
    run = _only_run(smoke_run, f"loop/{config}/n{N}/c1")
    _assert_figures(run, N)
    assert (run["ok"], run["errors"]) == (N, 0)
    if "redis" in config:
        assert run["redis_round_trips_per_call"] == 2.0


@pytest.mark.parametrize("concurrency", [1, 64])
def test_redis_job_counts_two_round_trips_per_call_from_the_server(
    smoke_run: dict[str, Any], concurrency: int
) -> None:
    """The Redis job reads redis-server's own counts: two EVALSHA round trips per call; with
    many calls asking at once, their ACQUIREs and RELEASEs go in runs (backends/redis/
    runs.py), so fewer scripts than two a call run, and at least two every 16 calls."""
    run = _only_run(smoke_run, f"chat/pgw_redis_aiohttp/n{N}/c{concurrency}")
    assert run["redis_round_trips_per_call"] == 2.0
    assert run["redis_round_trip_commands"] == {"evalsha": 2 * run["redis_round_trip_sample"]}
    if concurrency == 1:
        assert run["redis_script_calls_per_call"] == 2.0
    else:
        assert 2 / 16 <= run["redis_script_calls_per_call"] < 2.0
    # The scripts' own commands are counted by commandstats but are not round trips.
    assert run["redis_commands_per_call"] > run["redis_script_calls_per_call"]


@pytest.mark.parametrize("config", ["raw_httpx", "raw_aiohttp", "pgw_memory_httpx"])
def test_stream_job_reads_fifty_chunks_and_measures_ttft(
    smoke_run: dict[str, Any], config: str
) -> None:
    """Each stream job reads the 50 chunks of every stream and reports TTFT and CPU per chunk."""
    run = _only_run(smoke_run, f"stream/{config}/n{STREAM_N}/c1")
    _assert_figures(run, STREAM_N)
    assert run["chunks"] == 50 * STREAM_N
    assert run["cpu_us_per_chunk"] > 0
    assert 0 < run["ttft_p50_ms"] <= run["ttft_p99_ms"]


def test_scale_and_embedding_jobs_serve_everything(smoke_run: dict[str, Any]) -> None:
    """Scale jobs serve every call submitted at once; embedding jobs return every vector."""
    for n in SCALE_NS:
        run = _only_run(smoke_run, f"scale/pgw_memory_aiohttp/n{n}/c{n}")
        _assert_figures(run, n)
        assert run["ok"] == n
    for config in ("raw_httpx", "pgw_memory_httpx", "pgw_memory_aiohttp"):
        run = _only_run(smoke_run, f"embed/{config}/n{EMBED_N}/c8")
        assert run["vectors"] == EMBED_N
        assert run["texts_per_s"] > 0


def test_storm_job_accounts_for_every_call(smoke_run: dict[str, Any]) -> None:
    """Under the 429 storm every call is either served or counted as failed, never lost."""
    for config in ("raw_httpx", "pgw_memory_httpx"):
        run = _only_run(smoke_run, f"storm/{config}/n{STORM_N}/c{STORM_N}")
        assert run["ok"] + run["errors"] == STORM_N
    assert _only_run(smoke_run, f"storm/pgw_memory_httpx/n{STORM_N}/c{STORM_N}")["ok"] == STORM_N


def test_import_probe_measures_polygateway_without_extras(smoke_run: dict[str, Any]) -> None:
    """The import job measures time and RSS over bare Python, and which extras got loaded."""
    run = _only_run(smoke_run, "import/polygateway")
    assert run["import_s"] > 0
    assert run["rss_over_bare_mib"] > 0
    assert run["extras_loaded"] == []


def test_page_names_machine_versions_command_and_every_configuration(
    smoke_run: dict[str, Any],
) -> None:
    """The generated page carries the machine, the versions, the command and each table row."""
    page = smoke_run["page"]
    meta = smoke_run["results"]["meta"]
    assert meta["command"] in page
    assert "- CPU: " in page
    assert "| polygateway | " in page
    assert "not installed" in page  # openai and litellm are absent from the dev venv
    labels = (
        "raw httpx",
        "raw aiohttp",
        "PolyGateway, memory, httpx",
        "PolyGateway, memory, instant",
    )
    for label in labels:
        assert f"| {label}" in page
    assert "$" not in page.split("## Summary")[1].split("## Machine")[0]


def test_percentile_is_nearest_rank() -> None:
    """Percentiles are nearest-rank: p50 of 1..100 is 50, p99 is 99, p100 the maximum."""
    percentile = _bench_module("run_one").percentile
    values = [float(v) for v in range(100, 0, -1)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (
        50.0,
        99.0,
        100.0,
    )


def test_reduce_runs_takes_medians_and_sums_errors() -> None:
    """Figures are medians over rounds; errors add up; a failed round is reported, not averaged."""
    reduce_runs = _bench_module("harness").reduce_runs
    runs = [
        {"cpu_us_per_op": 300.0, "errors": 1, "ok": 9, "error_kinds": {"E: x": 1}},
        {"cpu_us_per_op": 100.0, "errors": 0, "ok": 10, "error_kinds": {}},
        {"cpu_us_per_op": 200.0, "errors": 2, "ok": 8, "error_kinds": {"E: x": 2}},
        {"failed": "exit 1: boom"},
    ]
    reduced = reduce_runs(runs)
    assert reduced["cpu_us_per_op"] == 200.0
    assert (reduced["cpu_us_per_op_min"], reduced["cpu_us_per_op_max"]) == (100.0, 300.0)
    assert (reduced["errors_total"], reduced["ok_total"]) == (3, 27)
    assert reduced["error_kinds"] == {"E: x": 3}
    assert (reduced["rounds"], reduced["failures"]) == (3, ["exit 1: boom"])


def test_targets_are_judged_on_ratios_of_medians() -> None:
    """A ratio within its target is met, one over it is missed, a missing figure is unmeasured."""
    report = _bench_module("report")
    meta = {
        "sizes": {
            "chat_n": 10,
            "concurrencies": [1],
            "stream_n": 1,
            "stream_concurrency": 1,
            "scale_ns": [1, 2],
            "embed_n": 1,
            "storm_n": 1,
        }
    }
    medians = {
        "chat/raw_httpx/n10/c1": {"cpu_us_per_op": 100.0},
        "chat/pgw_memory_httpx/n10/c1": {"cpu_us_per_op": 129.0},
        "chat/raw_aiohttp/n10/c1": {"cpu_us_per_op": 100.0},
        "chat/pgw_memory_aiohttp/n10/c1": {"cpu_us_per_op": 131.0},
    }
    checks = {c.id: c.met for c in report.evaluate_targets(medians, meta)}
    assert checks["memory-httpx-c1"] is True
    assert checks["memory-aiohttp-c1"] is False
    assert checks["memory-vs-litellm-c1"] is None
