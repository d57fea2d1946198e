"""``polygateway status`` against a real Redis that another process drives.

The demo runs with ``--backend redis`` on a password-protected ``redis-server``;
``status`` reads the same Redis from its own process while the traffic flows
and after it ends. The password appears in neither command's output.

How many ``status`` runs fit in the demo's run, and what each one catches of
its traffic (a permit held for a few milliseconds, a breaker open between two
probes), depends on the machine's speed. So the live samples are checked only
for what holds at every instant, the counters that only grow (breaker trips)
at the end, and permits held and a breaker open are shown without a race by
state this test writes to Redis itself.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_run import DEMO_TIMEOUT_S, RunCli, cli_command, cli_env, interruptible

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend

ROLES = ("healthy", "rate_limited", "failing")
SCOPES = ("demo-chat", "demo-embed", "demo-ocr")
PASSWORD = "e2e-redis-Pa55word"
CAPS = {"healthy": 16, "rate_limited": 4, "failing": 4}


def status_config(url: str) -> str:
    """A settings file naming the demo's scopes on the given Redis, sources as the demo has them."""
    parts = [f'[gateway]\nbackend = "redis"\nredis_url = "{url}"\n']
    for scope in SCOPES:
        kind = scope.removeprefix("demo-")
        protocol = "monkey_ocr" if kind == "ocr" else "openai"
        parts.append(f'[scopes.{scope}]\nkind = "{kind}"\n')
        for role in ROLES:
            parts.append(
                f'[[scopes.{scope}.sources]]\nname = "{role}"\nprotocol = "{protocol}"\n'
                f'base_url = "http://127.0.0.1:9/{role}"\nmax_concurrency = {CAPS[role]}\n'
            )
    return "".join(parts)


def test_status_reads_live_redis_state_of_a_running_demo(
    tmp_path: Path, run_cli: RunCli, make_redis_server: Callable[..., Any]
) -> None:
    """``status`` from another process reads a Redis demo's state while it runs, then all freed."""
    server = make_redis_server(password=PASSWORD)
    (tmp_path / "polygateway.toml").write_text(status_config(server.url))
    demo = subprocess.Popen(
        cli_command("demo", "--backend", "redis", "--redis-url", server.url, "--json"),
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    samples: list[dict[str, Any]] = []  # status documents read while the demo still ran
    try:
        deadline = time.monotonic() + DEMO_TIMEOUT_S
        while demo.poll() is None and time.monotonic() < deadline:
            ran = run_cli("status", "--json")
            assert ran.code == 0, ran.stderr
            assert PASSWORD not in ran.output
            if demo.poll() is None:
                samples.append(ran.json())
            time.sleep(0.1)
        stdout, stderr = demo.communicate(timeout=DEMO_TIMEOUT_S)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate()
    assert demo.returncode == 0, (stdout[-2000:], stderr[-2000:])
    assert PASSWORD not in stdout + stderr
    assert json.loads(stdout)["served_all"] is True

    # The demo's traffic lasts 12 s or more; one status run takes a second or two at most.
    assert samples, "no status run ended while the demo ran"
    assert samples[0]["redis_url"] == f"redis://:***@127.0.0.1:{server.port}/0"
    live = [scope for sample in samples for scope in sample["scopes"]]
    # Read from this process while the demo served through the same Redis.
    assert any(scope["progress_age_s"] is not None for scope in live)
    for src in (src for scope in live for src in scope["sources"]):
        assert 1.0 <= src["limit"] <= CAPS[src["name"]] == src["max_concurrency"]
        assert 0 <= src["in_flight"] <= CAPS[src["name"]]

    after = run_cli("status", "--json")
    assert after.code == 0, after.stderr
    final = {scope["scope"]: scope for scope in after.json()["scopes"]}
    assert sorted(final) == sorted(SCOPES)
    for scope in final.values():
        assert scope["in_flight"] == 0
        assert math.isfinite(scope["progress_age_s"])
        # Each configured source is listed, asked during the run or not (one never needed,
        # the first in order always having room, is shown fresh, "seen": false).
        assert sorted(src["name"] for src in scope["sources"]) == sorted(ROLES)
    # Trips only grow: the failing chat source (95 % errors) tripped during the run.
    chat_sources = {src["name"]: src for src in final["demo-chat"]["sources"]}
    assert chat_sources["failing"]["seen"] is True
    assert chat_sources["failing"]["trips"] >= 1
    assert chat_sources["healthy"]["trips"] == 0

    table = run_cli("status", "--scope", "demo-chat")
    assert table.code == 0, table.stderr
    assert "scope demo-chat: 0 in flight, served" in table.stdout
    assert "16.0 / 16" in table.stdout
    assert "scope demo-ocr" not in table.stdout
    assert PASSWORD not in table.output


HEALTHY = SourceSpec("healthy", max_concurrency=CAPS["healthy"])
TRIPPING = SourceSpec(
    "failing",
    max_concurrency=CAPS["failing"],
    breaker_failures=1,
    cooldown_s=600.0,
    cooldown_max_s=600.0,
)


async def _hold_permits_and_trip_a_breaker(url: str, permits: int) -> list[Lease]:
    """Hold ``permits`` of demo-chat's healthy source and open its failing source's breaker."""
    backend = RedisBackend(url)
    try:
        leases = []
        for _ in range(permits):
            granted = await backend.acquire("demo-chat", [HEALTHY], ttl_s=600.0)
            assert granted.lease is not None
            leases.append(granted.lease)
        probe = await backend.acquire("demo-chat", [TRIPPING], ttl_s=600.0)
        assert probe.lease is not None
        await backend.release(probe.lease, AttemptOutcome("transient"))
        # Behind the release on the one connection: the state is written when this returns.
        snap = await backend.snapshot("demo-chat")
        assert snap.in_flight == permits
        return leases
    finally:
        await backend.aclose()


async def _release(url: str, leases: list[Lease]) -> None:
    """Give the held permits back."""
    backend = RedisBackend(url)
    try:
        for lease in leases:
            await backend.release(lease, AttemptOutcome("cancelled"))
        assert (await backend.snapshot("demo-chat")).in_flight == 0
    finally:
        await backend.aclose()


def test_status_shows_permits_and_an_open_breaker_held_in_redis_by_another_process(
    tmp_path: Path, run_cli: RunCli, redis_url: str
) -> None:
    """Permits held and a breaker opened in Redis by this process: status shows both, then 0."""
    (tmp_path / "polygateway.toml").write_text(status_config(redis_url))
    leases = asyncio.run(_hold_permits_and_trip_a_breaker(redis_url, permits=3))

    held = run_cli("status", "--json")
    assert held.code == 0, held.stderr
    scopes = {scope["scope"]: scope for scope in held.json()["scopes"]}
    chat = scopes["demo-chat"]
    assert chat["in_flight"] == 3
    assert chat["progress_age_s"] is None  # nothing has served
    sources = {src["name"]: src for src in chat["sources"]}
    assert (sources["healthy"]["in_flight"], sources["healthy"]["breaker"]) == (3, "closed")
    assert (sources["failing"]["breaker"], sources["failing"]["trips"]) == ("open", 1)
    assert 500.0 < sources["failing"]["reopen_in_s"] <= 600.0
    assert scopes["demo-embed"]["in_flight"] == scopes["demo-ocr"]["in_flight"] == 0
    table = run_cli("status", "--scope", "demo-chat")
    assert table.code == 0, table.stderr
    assert "scope demo-chat: 3 in flight" in table.stdout

    asyncio.run(_release(redis_url, leases))
    freed = run_cli("status", "--json")
    assert freed.code == 0, freed.stderr
    chat = {scope["scope"]: scope for scope in freed.json()["scopes"]}["demo-chat"]
    assert chat["in_flight"] == 0
    assert {src["name"]: src["breaker"] for src in chat["sources"]}["failing"] == "open"


def test_status_of_an_unreachable_redis_fails_in_one_line(tmp_path: Path, run_cli: RunCli) -> None:
    """Redis down: exit 1 with one line naming the operation, the password masked."""
    url = f"redis://:{PASSWORD}@127.0.0.1:9/0"
    (tmp_path / "polygateway.toml").write_text(status_config(url))
    ran = run_cli("status")
    assert ran.code == 1, ran.output
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: ")
    assert "snapshot" in lines[0]
    assert PASSWORD not in ran.output
    assert "Traceback" not in ran.output


def test_status_of_an_unknown_scope_lists_the_known_ones(tmp_path: Path, run_cli: RunCli) -> None:
    """``--scope nope``: exit 2 naming the configured scopes, before touching Redis."""
    (tmp_path / "polygateway.toml").write_text(status_config("redis://127.0.0.1:9/0"))
    ran = run_cli("status", "--scope", "nope")
    assert ran.code == 2
    assert "no scope named 'nope'" in ran.stderr
    assert "demo-chat" in ran.stderr


def test_status_watch_reports_every_period_and_ends_cleanly_on_ctrl_c(
    tmp_path: Path, redis_url: str
) -> None:
    """``status --watch --json``: a document per period until SIGINT, which ends it with exit 0."""
    (tmp_path / "polygateway.toml").write_text(status_config(redis_url))
    # faulthandler: a process still running 15 s after SIGINT is sent SIGABRT, and the
    # failure then shows where every thread of it was.
    proc = subprocess.Popen(
        cli_command("status", "--watch", "0.2", "--json"),
        cwd=tmp_path,
        env={**cli_env(), "PYTHONFAULTHANDLER": "1"},
        preexec_fn=interruptible,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = [proc.stdout.readline() for _ in range(3)]
        proc.send_signal(signal.SIGINT)
        try:
            rest, stderr = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            _, stacks = proc.communicate(timeout=15)
            pytest.fail(f"status --watch --json still ran 15 s after SIGINT:\n{stacks}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert stderr == ""
    docs = [json.loads(line) for line in [*first, *rest.splitlines()] if line.strip()]
    assert len(docs) >= 3
    for doc in docs:
        assert [scope["scope"] for scope in doc["scopes"]] == list(SCOPES)
        assert all(scope["progress_age_s"] is None for scope in doc["scopes"])
        for scope in doc["scopes"]:  # nothing asked yet: each configured source, fresh
            assert [src["name"] for src in scope["sources"]] == list(ROLES)
            assert not any(src["seen"] or src["in_flight"] for src in scope["sources"])
