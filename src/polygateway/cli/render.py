"""Output of the command line: rich tables for people, JSON for scripts, one-line errors.

rich is the ``cli`` extra: it is imported only when a table is drawn, and
without it tables are aligned plain text, so ``import polygateway.cli`` and
every command but ``demo`` work on a base install. Every
value printed here comes from masked dumps (URLs with ``***`` for passwords,
API keys reduced to "set" / "not set"): no secret reaches a terminal.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TextIO

from polygateway.backends.base import ScopeSnapshot
from polygateway.errors import AllSourcesExhausted
from polygateway.governance.source_state import SourceSnapshot

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from polygateway.config import GatewaySettings

__all__ = [
    "ByClass",
    "CliError",
    "PlainConsole",
    "PlainTable",
    "class_summary",
    "console",
    "dump_json",
    "error_json",
    "fmt_age",
    "fmt_num",
    "fmt_seconds",
    "has_rich",
    "jsonable",
    "make_table",
    "need_rich",
    "output",
    "print_error",
    "scope_status_table",
    "settings_summary",
    "snapshot_json",
    "text_table",
    "with_configured",
]

RICH_MISSING = "this display needs rich: pip install 'polygateway[cli]' (or pass --json)"


class CliError(Exception):
    """A problem with what the user asked the command line for (not with a call); exit 1."""


def need_rich() -> None:
    """Fail with the install hint when the ``cli`` extra is missing."""
    try:
        import rich  # noqa: F401
    except ImportError:
        raise CliError(RICH_MISSING) from None


_PIPE_WIDTH = 140
"""Width of tables written to a pipe or file: rich's 80 columns would truncate them."""


@functools.cache
def _console_class() -> type[Console]:
    """rich's Console, except that a closed stdout raises ``BrokenPipeError`` for ``main``.

    rich's own handling exits with status 1 from inside ``print``, bypassing
    the command line's one place that decides how a run ends.
    """
    need_rich()
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return _Console


def console(*, stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr); rich itself turns colour off when not a terminal."""
    out = _console_class()(stderr=stderr, highlight=False, soft_wrap=False)
    if not out.is_terminal:
        out.width = max(out.width, _PIPE_WIDTH)
    return out


def has_rich() -> bool:
    """Whether the ``cli`` extra (rich) can be imported."""
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


class PlainTable:
    """A table as aligned text: what ``text_table`` draws when rich is not installed."""

    def __init__(self, title: str | None, columns: Sequence[str], right_from: int) -> None:
        self.title = title
        self.columns = tuple(columns)
        self.right_from = right_from
        self.rows: list[tuple[str, ...]] = []

    def add_row(self, *cells: str) -> None:
        """One row, a cell per column."""
        self.rows.append(tuple(cells))

    def __str__(self) -> str:
        widths = [
            max(len(cell) for cell in column)
            for column in zip(self.columns, *self.rows, strict=True)
        ]

        def line(cells: Sequence[str]) -> str:
            parts = [
                cell.ljust(width) if index < self.right_from else cell.rjust(width)
                for index, (cell, width) in enumerate(zip(cells, widths, strict=True))
            ]
            return "  ".join(parts).rstrip()

        lines = [self.title] if self.title else []
        lines += [line(self.columns), "  ".join("-" * width for width in widths)]
        lines += [line(row) for row in self.rows]
        return "\n".join(lines) + "\n"


class PlainConsole:
    """``print`` to stdout or stderr: what ``output`` gives when rich is not installed."""

    def __init__(self, *, stderr: bool = False) -> None:
        self._stream = sys.stderr if stderr else sys.stdout

    @property
    def is_terminal(self) -> bool:
        """Whether a person is reading (a terminal, not a pipe or file)."""
        return self._stream.isatty()

    def print(self, *objects: object) -> None:
        """Each object's text, space-separated, on one line."""
        print(*objects, file=self._stream, flush=True)


def output(*, stderr: bool = False) -> Console | PlainConsole:
    """Where a command prints for people: rich's console when installed, plain text otherwise."""
    return console(stderr=stderr) if has_rich() else PlainConsole(stderr=stderr)


def text_table(
    title: str | None, columns: Sequence[str], *, right_from: int = 1
) -> Table | PlainTable:
    """``make_table`` when rich is installed, else a ``PlainTable`` with the same layout."""
    if has_rich():
        return make_table(title, columns, right_from=right_from)
    return PlainTable(title, columns, right_from)


def make_table(title: str | None, columns: Sequence[str], *, right_from: int = 1) -> Table:
    """A plain table: the first ``right_from`` columns left-aligned (names), the rest numbers."""
    need_rich()
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAVY, title_justify="left", pad_edge=False)
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index < right_from else "right", no_wrap=True)
    return table


def print_error(message: str, *, stream: TextIO | None = None) -> None:
    """One line on stderr: ``error: <message>``; newlines are folded so it stays one line."""
    line = " ".join(message.split())
    print(f"error: {line}", file=stream if stream is not None else sys.stderr, flush=True)


def jsonable(value: Any) -> Any:
    """``value`` with infinities and NaN as ``None``: JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def error_json(exc: BaseException) -> dict[str, Any]:
    """The ``error`` object of a failed command's ``--json`` document.

    ``type``, ``message`` and ``reason`` are always present (``reason`` is
    ``AllSourcesExhausted.reason``, else ``null``); the context a script may
    branch on (scope, sources, retry_after_s, field, path, env, batch) follows
    when the error carries it; ``env`` is the variable a bad setting came from.
    Messages are the errors' own: they never hold a secret.
    """
    doc: dict[str, Any] = {
        "type": type(exc).__name__,
        "message": str(exc) or type(exc).__name__,
        "reason": exc.reason if isinstance(exc, AllSourcesExhausted) else None,
    }
    for key in (
        "scope",
        "sources",
        "retry_after_s",
        "field",
        "path",
        "env",
        "batch",
        "status_code",
    ):
        value = getattr(exc, key, None)
        if value is not None and value != ():
            doc[key] = list(value) if isinstance(value, tuple) else value
    return doc


def dump_json(data: Any, *, stream: TextIO | None = None) -> None:
    """Print ``data`` as one JSON document (strict: no Infinity / NaN)."""
    text = json.dumps(jsonable(data), allow_nan=False, sort_keys=False)
    print(text, file=stream if stream is not None else sys.stdout, flush=True)


def fmt_num(value: float | None, digits: int = 1) -> str:
    """A number for a table cell; ``-`` for none."""
    if value is None:
        return "-"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.{digits}f}"


def fmt_seconds(value: float | None) -> str:
    """A duration for a table cell: ``1.25 s``, ``-`` for none."""
    if value is None:
        return "-"
    return f"{value:.2f} s"


def fmt_age(age_s: float) -> str:
    """A progress age: ``never`` for a scope that has not served."""
    if not math.isfinite(age_s):
        return "never served"
    return f"served {age_s:.1f} s ago"


# -- settings ----------------------------------------------------------------------------

_GATEWAY_KEYS = (
    "backend",
    "redis_url",
    "transport",
    "stall_window_s",
    "max_attempts",
    "poll_interval_s",
    "backoff_base_s",
    "backoff_cap_s",
    "breaker_failures",
    "breaker_cooldown_s",
    "breaker_cooldown_max_s",
    "lease_grace_s",
    "close_grace_s",
)


def settings_summary(settings: GatewaySettings) -> dict[str, Any]:
    """The settings as they may be shown: URLs masked, each API key reduced to set / not set."""
    dumped = settings.model_dump(mode="json")  # masks redis_url, base_url, proxy, headers, query
    gateway = {key: dumped[key] for key in _GATEWAY_KEYS}
    scopes: dict[str, Any] = {}
    for name, scope in settings.scopes.items():
        shown = dumped["scopes"][name]
        sources = []
        for source, source_dump in zip(scope.sources, shown["sources"], strict=True):
            entry = {k: v for k, v in source_dump.items() if k != "api_key"}
            entry["api_key_set"] = source.api_key is not None
            sources.append(entry)
        scopes[name] = {
            "kind": shown["kind"],
            "exempt_429": shown["exempt_429"],
            "sources": sources,
        }
    return {"gateway": gateway, "scopes": scopes}


# -- backend state -----------------------------------------------------------------------


ByClass = Mapping[str, tuple[int, int]]
"""Per priority class, (calls waiting, permits in use) in one process (``WaitingRoom.by_class``)."""


def with_configured(
    snap: ScopeSnapshot, max_concurrency: Mapping[str, int]
) -> list[tuple[SourceSnapshot, bool]]:
    """The snapshot's sources (seen: ``True``), then each configured one it lacks, as fresh.

    A backend knows a source once an acquire examined it, and an acquire stops
    at the first candidate that grants: a source never needed is absent from
    the snapshot. Configured (``max_concurrency`` names it), it is shown as a
    source at first sight reads (nothing held, limit at its max, breaker
    closed), marked unseen, rather than missing.
    """
    shown = [(source, True) for source in snap.sources]
    known = {source.name for source in snap.sources}
    for name, cap in max_concurrency.items():
        if name not in known:
            fresh = SourceSnapshot(
                name=name,
                in_flight=0,
                limit=float(cap),
                breaker="closed",
                consecutive_failures=0,
                trips=0,
                reopen_in_s=None,
                paced_for_s=None,
                rpm_tokens=None,
                tpm_tokens=None,
            )
            shown.append((fresh, False))
    return shown


def snapshot_json(
    snap: ScopeSnapshot, max_concurrency: Mapping[str, int], by_class: ByClass | None = None
) -> dict[str, Any]:
    """A scope snapshot for ``--json`` (``progress_age_s`` is ``null`` when never served).

    ``by_class``, where the caller runs the scope's calls (a memory backend's
    process), adds ``"this_process": {class: {"waiting": n, "in_use": n}}``.
    """
    sources = []
    for source, seen in with_configured(snap, max_concurrency):
        entry = asdict(source)
        entry["max_concurrency"] = max_concurrency.get(source.name)
        entry["seen"] = seen
        sources.append(entry)
    out: dict[str, Any] = {
        "scope": snap.scope,
        "progress_age_s": snap.progress_age_s,
        "in_flight": snap.in_flight,
        "sources": sources,
    }
    if by_class is not None:
        out["this_process"] = {
            name: {"waiting": waiting, "in_use": in_use}
            for name, (waiting, in_use) in by_class.items()
        }
    return out


def class_summary(by_class: ByClass) -> str:
    """``interactive 2 waiting, 1 in use; batch 40 waiting, 7 in use`` (no classes: no names)."""
    return "; ".join(
        f"{name + ' ' if name else ''}{waiting} waiting, {in_use} in use"
        for name, (waiting, in_use) in by_class.items()
    )


def scope_status_table(
    snap: ScopeSnapshot, max_concurrency: Mapping[str, int], by_class: ByClass | None = None
) -> Table | PlainTable:
    """One scope's live governance state: permits, AIMD limit, breaker, pacing, buckets.

    ``by_class`` (given only where the scope's calls run: its waiting room is
    per process) adds this process's calls waiting and permits in use per
    priority class to the title.
    """
    title = f"scope {snap.scope}: {snap.in_flight} in flight, {fmt_age(snap.progress_age_s)}"
    if by_class:
        title += f"; this process: {class_summary(by_class)}"
    table = text_table(
        title,
        (
            "source",
            "in flight",
            "limit / max",
            "breaker",
            "failures",
            "trips",
            "reopens in",
            "paced for",
            "rpm tokens",
            "tpm tokens",
        ),
    )
    shown = with_configured(snap, max_concurrency)
    if not shown:
        table.add_row("(no source seen yet)", *([""] * 9))
    for s, seen in shown:
        cap = max_concurrency.get(s.name)
        table.add_row(
            s.name if seen else f"{s.name} (not asked yet)",
            str(s.in_flight),
            f"{s.limit:.1f} / {cap if cap is not None else '?'}",
            s.breaker.replace("_", "-"),
            str(s.consecutive_failures),
            str(s.trips),
            fmt_seconds(s.reopen_in_s),
            fmt_seconds(s.paced_for_s),
            fmt_num(s.rpm_tokens),
            fmt_num(s.tpm_tokens),
        )
    return table
