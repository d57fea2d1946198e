"""``polygateway status --watch`` on a terminal: a live view of a fleet's governance state.

One frame per refresh, redrawn in place on the terminal's alternate screen
(as ``top`` does): per scope its permits in flight and progress, per source
permits, AIMD limit against ``max_concurrency``, breaker, pacing and rate
buckets, all read from the shared backend. Calls waiting, and permits in use
per priority class, are counted inside each process that makes them (the
waiting room is not shared state), so the view names the gauges that have
them instead of guessing.

A backend read that fails does not end the watch: the frame says so and the
next refresh tries again. Ctrl+C ends it quietly (exit 130, the shell's code
for an interrupted command; ``cli.main``'s caller sees no error line).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from polygateway.backends.base import Backend, ScopeSnapshot
from polygateway.cli import render
from polygateway.errors import GatewayError

if TYPE_CHECKING:
    from rich.console import RenderableType

    from polygateway.config import GatewaySettings

__all__ = ["WAITING_NOTE", "frame", "watch_live"]

WAITING_NOTE = (
    "calls waiting are counted in each process that makes them, as are permits in use per "
    "priority class: polygateway_scope_calls_waiting, polygateway_scope_calls_waiting_by_class "
    "and polygateway_scope_permits_in_use (PrometheusEmitter)"
)


def frame(
    settings: GatewaySettings,
    snaps: Sequence[ScopeSnapshot],
    max_concurrency: Callable[[str], dict[str, int]],
    *,
    every: float,
    error: str | None = None,
    clock: str = "",
) -> RenderableType:
    """One frame of the live view: a header, a table per scope (or the read's failure), a note."""
    from rich.console import Group
    from rich.text import Text

    header = Text.assemble(
        ("polygateway status", "bold"),
        f"  backend {settings.backend} at {settings.redis_where}",
        f"  every {every:g} s  {clock}  (Ctrl+C to quit)",
    )
    parts: list[Any] = [header]
    if error is not None:
        parts.append(Text(f"backend read failed: {error}; trying again", style="bold red"))
    for snap in snaps:
        parts.append(render.scope_status_table(snap, max_concurrency(snap.scope)))
    parts.append(Text(WAITING_NOTE, style="dim"))
    return Group(*parts)


async def watch_live(
    settings: GatewaySettings,
    backend: Backend,
    scopes: Sequence[str],
    every: float,
    max_concurrency: Callable[[str], dict[str, int]],
) -> None:
    """Redraw the frame every ``every`` seconds until cancelled (Ctrl+C); rich is installed."""
    from rich.live import Live

    out = render.console()
    snaps: list[ScopeSnapshot] = []
    with Live(console=out, auto_refresh=False, screen=True, transient=True) as live:
        while True:
            error = None
            try:
                snaps = [await backend.snapshot(name) for name in scopes]
            except GatewayError as exc:
                error = str(exc)  # the last good frame stays below the failure line
            shown = frame(
                settings,
                snaps,
                max_concurrency,
                every=every,
                error=error,
                clock=time.strftime("%H:%M:%S"),  # edge: wall-clock time for the reader
            )
            live.update(shown, refresh=True)
            await asyncio.sleep(every)
