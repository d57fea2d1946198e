"""``polygateway status --watch`` in a real terminal (tmux, 120x40) over a Redis fleet under load.

The test's event loop serves the simulated upstream and keeps calls running
through a ``ChatClient`` on the same Redis (the fleet's traffic), while
``status --watch`` runs in its own process inside a private tmux server. A
frame is captured once it shows the load, Ctrl+C is sent, and the pane's
shell reports the exit status through ``tmux wait-for`` (no sleep waits for
it). The frames themselves can only be polled: a live view never ends by
itself, so the capture is retried until one shows what is looked for.

The same check by hand::

    tmux new-session -d -s pgw -x 120 -y 40 'polygateway status --watch'
    tmux capture-pane -p -t pgw; tmux send-keys -t pgw C-c
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shlex
from pathlib import Path

from cli_run import cli_command, cli_env

from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings
from polygateway.errors import GatewayError
from polygateway.simulator import FaultProfile, SimulatedUpstream

WIDTH, HEIGHT = 120, 40
SCOPE = "fleet"
PROFILES = {
    "steady": FaultProfile(latency_s=0.4, latency_jitter_s=0.05),
    "throttled": FaultProfile(latency_s=0.2, rate_429=0.5, retry_after_s=1.0),
    "spare": FaultProfile(latency_s=0.3),
}
FRAME_TIMEOUT_S = 30.0
"""Bound on the first frame showing the load (interpreter start, imports, one Redis read)."""


def settings_toml(redis_url: str, sim: SimulatedUpstream) -> str:
    """A settings file: one chat scope on Redis whose sources are the simulator's."""
    parts = [
        f'[gateway]\nbackend = "redis"\nredis_url = "{redis_url}"\npoll_interval_s = 0.2\n',
        f'[scopes.{SCOPE}]\nkind = "chat"\n',
    ]
    for name in PROFILES:
        parts.append(
            f'[[scopes.{SCOPE}.sources]]\nname = "{name}"\nprotocol = "openai"\n'
            f'base_url = "{sim.base_url(name)}"\nmodel = "sim"\nmax_concurrency = 3\n'
        )
    return "".join(parts)


async def _load(client: ChatClient) -> None:
    """Calls one after another for as long as the test runs; a failed call is part of load."""
    while True:
        with contextlib.suppress(GatewayError):
            await client.complete([{"role": "user", "content": "hi"}], max_tokens=8)


async def _tmux(*args: str, timeout: float = 10.0) -> str:
    """Run a tmux command without blocking the event loop that serves the load; its stdout."""
    proc = await asyncio.create_subprocess_exec(
        "tmux", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()
    return out.decode()


def _shows_load(pane: str) -> bool:
    """Every source in a table row and at least one permit in flight in the scope's title."""
    lines = pane.splitlines()
    rows = all(any(line.lstrip().startswith(name + " ") for line in lines) for name in PROFILES)
    title = re.search(rf"scope {SCOPE}: (\d+) in flight", pane)
    return rows and title is not None and int(title.group(1)) > 0


async def test_status_watch_shows_every_source_of_a_loaded_fleet_and_ends_on_ctrl_c(
    tmp_path: Path, redis_url: str
) -> None:
    """At 120x40 a frame holds every source, the load in flight and the header; Ctrl+C: 130."""
    async with asyncio.timeout(55.0), SimulatedUpstream(PROFILES) as sim:
        config = tmp_path / "polygateway.toml"
        config.write_text(settings_toml(redis_url, sim))
        client = ChatClient.from_settings(GatewaySettings.load(config, env_file=None), SCOPE)
        socket = str(tmp_path / "tmux.sock")
        status_file = tmp_path / "status"
        env = " ".join(
            f"{k}={shlex.quote(v)}" for k, v in cli_env({"TERM": "xterm-256color"}).items()
        )
        watch = shlex.join(cli_command("status", "--watch", "--interval", "0.5"))
        script = (
            f"env -i {env} {watch}; echo $? > {shlex.quote(str(status_file))}; "
            f"tmux -S {socket} wait-for -S done; tmux -S {socket} wait-for keep"
        )
        async with client:
            load = [asyncio.ensure_future(_load(client)) for _ in range(6)]
            try:
                await _tmux(
                    *("-S", socket, "new-session", "-d", "-s", "watch"),
                    *("-x", str(WIDTH), "-y", str(HEIGHT), "-c", str(tmp_path), script),
                )
                try:
                    pane = ""
                    async with asyncio.timeout(FRAME_TIMEOUT_S):
                        while not _shows_load(pane):
                            await asyncio.sleep(0.2)  # a live view has no end to wait for
                            pane = await _tmux("-S", socket, "capture-pane", "-p", "-t", "watch")
                    await _tmux("-S", socket, "send-keys", "-t", "watch", "C-c")
                    await _tmux("-S", socket, "wait-for", "done", timeout=15.0)
                    after = await _tmux("-S", socket, "capture-pane", "-p", "-t", "watch")
                finally:
                    await _tmux("-S", socket, "kill-server")
            finally:
                for task in load:
                    task.cancel()
                await asyncio.gather(*load, return_exceptions=True)
        await client.backend.aclose()

    lines = pane.rstrip("\n").splitlines()
    assert len(lines) <= HEIGHT
    assert all(len(line) <= WIDTH for line in lines)
    assert lines[0].startswith("polygateway status  backend redis at redis://127.0.0.1:")
    assert "every 0.5 s" in lines[0]
    for name in PROFILES:
        [row] = [line for line in lines if line.lstrip().startswith(name + " ")]
        cells = row.split()
        assert re.fullmatch(r"\d+", cells[1]), row  # permits in flight
        assert (cells[3], cells[4]) == ("/", "3"), row  # limit / max_concurrency
        assert cells[5] in ("closed", "open", "half-open"), row
    assert "…" not in pane
    assert "calls waiting are counted in each process" in pane
    assert status_file.read_text().strip() == "130", after
    # Quietly: the alternate screen is gone, and no error line or traceback is left behind.
    assert "Traceback" not in after
    assert "error:" not in after
    assert "scope fleet" not in after
