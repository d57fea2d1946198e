"""``polygateway demo`` as a user runs it: a subprocess, the simulator on real ports, no setup.

One ``--json --status-every 1`` run is shared by the tests that read its
report; the plain run is the one a newcomer sees after ``make demo``.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from cli_run import DEMO_TIMEOUT_S, RunCli, assert_one_line_error, cli_command, cli_env

ROLES = ("healthy", "rate_limited", "failing")
SCOPES = ("demo-chat", "demo-embed", "demo-ocr")


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The JSON report of one demo run with live status samples every second."""
    done = subprocess.run(
        cli_command("demo", "--json", "--status-every", "1"),
        cwd=tmp_path_factory.mktemp("demo"),
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=DEMO_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def test_demo_as_a_newcomer_runs_it_serves_every_call_within_a_minute(run_cli: RunCli) -> None:
    """Plain ``polygateway demo``: exit 0 in under a minute, tables and the verdict printed."""
    started = time.monotonic()
    ran = run_cli("demo", timeout=DEMO_TIMEOUT_S)
    took = time.monotonic() - started
    assert ran.code == 0, (ran.stdout[-3000:], ran.stderr[-3000:])
    assert took < 60.0
    out = ran.stdout
    assert "verdict: every call served" in out
    for table in ("per client", "per source", "simulated upstream", "governance state at the end"):
        assert table in out
    for role in ROLES:
        assert role in out
    assert "failed" not in out.split("per client")[0]  # no call failed during the run
    assert "Traceback" not in ran.output


def test_demo_report_says_every_call_was_served(report: dict[str, Any]) -> None:
    """The report: every planned chat, embedding and OCR call served, none failed."""
    assert report["served_all"] is True
    assert report["failed"] == []
    assert report["verdict"].startswith("verdict: every call served")
    calls = report["calls"]
    assert calls["chat"]["planned"] >= 200
    assert calls["chat"]["streamed"] > 0
    assert calls["embed"]["planned"] >= 1
    assert calls["ocr"]["planned"] >= 5
    for kind in ("chat", "embed", "ocr"):
        assert calls[kind]["served"] == calls[kind]["planned"] == calls[kind]["finished"]
        assert calls[kind]["failed"] == 0


def test_the_simulator_really_answered_429s_failures_and_resets(report: dict[str, Any]) -> None:
    """The upstream's own record: 429s, 5xx and connection resets really happened on the wire."""
    sim = report["simulator"]
    assert sorted(sim) == sorted(
        f"{kind}-{role}" for kind in ("chat", "embed", "ocr") for role in ROLES
    )

    def total(outcome: str) -> int:
        return sum(s["by_outcome"].get(outcome, 0) for s in sim.values())

    assert total("429") > 0
    assert total("5xx") > 0
    assert total("reset") > 0
    assert all(s["by_outcome"].get("5xx", 0) == 0 for n, s in sim.items() if "healthy" in n)


def test_gateway_table_matches_what_the_simulator_saw(report: dict[str, Any]) -> None:
    """Per source, the gateway's attempts equal the simulator's requests; failures were absorbed."""
    sim = report["simulator"]
    rows = {(r["scope"], r["source"]): r for r in report["sources"]}
    assert sorted(rows) == sorted((scope, role) for scope in SCOPES for role in ROLES)
    for (scope, role), row in rows.items():
        seen = sim[f"{scope.removeprefix('demo-')}-{role}"]
        assert row["attempts"] == seen["requests"], (scope, role)
        assert row["successes"] == seen["by_outcome"].get("ok", 0), (scope, role)
        assert row["rate_limited"] == seen["by_outcome"].get("429", 0), (scope, role)
        if row["attempts"]:
            assert row["p50_ms"] is not None
            assert row["p50_ms"] <= row["p99_ms"]
    assert rows[("demo-chat", "failing")]["transient"] > 0
    assert rows[("demo-chat", "failing")]["breaker_trips"] >= 1
    assert sum(row["retries"] for row in rows.values()) > 0
    assert all(rows[(scope, "healthy")]["breaker_trips"] == 0 for scope in SCOPES)


def test_status_of_the_memory_backend_is_shown_by_the_running_demo(report: dict[str, Any]) -> None:
    """Live samples of the demo's memory backend: permits held, breakers open, then all freed."""
    samples = report["status_samples"]
    assert len(samples) >= 3
    assert [s["t_s"] for s in samples] == sorted(s["t_s"] for s in samples)
    live = [scope for sample in samples for scope in sample["scopes"]]
    assert any(scope["in_flight"] > 0 for scope in live)
    assert any(src["breaker"] == "open" for scope in live for src in scope["sources"])
    final = {scope["scope"]: scope for scope in report["status"]}
    assert sorted(final) == sorted(SCOPES)
    for scope in final.values():
        assert scope["in_flight"] == 0
        assert scope["progress_age_s"] is not None
        assert math.isfinite(scope["progress_age_s"])
        sources = {src["name"]: src for src in scope["sources"]}
        assert sorted(sources) == sorted(ROLES)
        healthy = sources["healthy"]
        assert healthy["breaker"] == "closed"
        assert 1.0 <= healthy["limit"] <= healthy["max_concurrency"] == 16


def test_status_command_on_a_memory_config_points_to_the_owning_process(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """``status`` of a memory backend: exit 2, one line saying the owning process shows it."""
    (tmp_path / "polygateway.toml").write_text(
        '[scopes.chat]\nkind = "chat"\n[[scopes.chat.sources]]\nname = "a"\n'
        'protocol = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n'
    )
    line = assert_one_line_error(run_cli("status"), 2)
    assert "lives inside one process" in line
    assert "demo --status-every" in line


def test_demo_on_an_unreachable_redis_fails_at_once_in_one_line(run_cli: RunCli) -> None:
    """``--backend redis`` with nothing listening: exit 1 before any traffic, password masked."""
    ran = run_cli("demo", "--backend", "redis", "--redis-url", "redis://:pw-xyz-123@127.0.0.1:9/0")
    line = assert_one_line_error(ran, 1)
    assert "snapshot" in line
    assert "redis://:***@127.0.0.1:9/0" in line
    assert "pw-xyz-123" not in ran.output
    assert "verdict" not in ran.stdout
