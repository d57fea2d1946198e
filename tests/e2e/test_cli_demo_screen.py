"""The demo's last screen in a real terminal: tmux at 120x40, captured when the demo ends.

The same check by hand (README, "The demo's last screen")::

    tmux new-session -d -s pgw -x 120 -y 40 \
        'polygateway demo --scale 0.3; tmux wait-for -S pgw-done; tmux wait-for pgw-keep'
    tmux wait-for pgw-done; tmux capture-pane -p -t pgw; tmux kill-session -t pgw
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from cli_run import DEMO_TIMEOUT_S, cli_command, cli_env

from polygateway.cli.demo_report import LEGEND

WIDTH, HEIGHT = 120, 40


def _final_screen(tmp_path: Path) -> tuple[str, str]:
    """Run ``polygateway demo --scale 0.3`` in a private tmux server; its pane and exit status."""
    socket = str(tmp_path / "tmux.sock")
    tmux = ["tmux", "-S", socket]
    status = tmp_path / "status"
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in cli_env({"TERM": "xterm-256color"}).items())
    demo = shlex.join(cli_command("demo", "--scale", "0.3"))
    # The pane's shell writes the exit status, wakes this test (no polling, no sleeps), then
    # waits on a channel nobody signals, so the pane stays until kill-server.
    script = (
        f"env -i {env} {demo}; echo $? > {shlex.quote(str(status))}; "
        f"tmux -S {socket} wait-for -S done; tmux -S {socket} wait-for keep"
    )
    subprocess.run(
        [
            *tmux,
            "new-session",
            "-d",
            "-s",
            "demo",
            "-x",
            str(WIDTH),
            "-y",
            str(HEIGHT),
            "-c",
            str(tmp_path),
            script,
        ],
        check=True,
        timeout=10,
    )
    try:
        subprocess.run([*tmux, "wait-for", "done"], check=True, timeout=DEMO_TIMEOUT_S)
        pane = subprocess.run(
            [*tmux, "capture-pane", "-p", "-t", "demo"],
            check=True,
            timeout=10,
            capture_output=True,
            text=True,
        ).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], check=False, timeout=10)
    return pane, status.read_text().strip()


def test_the_verdict_and_every_summary_fit_the_last_screen_of_a_120x40_terminal(
    tmp_path: Path,
) -> None:
    """At 120x40 the captured pane holds the per-client table's title, every table, the legend
    and the verdict, with no line cut short."""
    pane, status = _final_screen(tmp_path)
    assert status == "0", pane
    lines = pane.rstrip("\n").splitlines()
    assert len(lines) <= HEIGHT
    assert all(len(line) <= WIDTH for line in lines)
    text = "\n".join(lines)
    # The top of the summary is still on screen: nothing scrolled away.
    assert "per client (what the application saw)" in text
    for client in ("chat", "embed", "ocr"):
        assert any(line.startswith(client + " ") for line in lines), client
    assert "per source (what the gateway did)" in text
    assert "governance state at the end" in text
    for scope in ("demo-chat", "demo-embed", "demo-ocr"):
        assert sum(line.startswith(scope + " ") for line in lines) == 6, scope
    for legend in LEGEND:
        assert legend in text, legend
    assert "verdict: every call served" in lines[-1]
    assert "…" not in text  # no cell elided
