"""``status`` lists every configured source, those the backend has not seen yet included.

A backend knows a source once an acquire examined it, and an acquire stops at
the first candidate that grants: a source that was never needed (the first in
order always had room) is absent from the snapshot. ``status`` reads the
configuration too, so such a source is shown as the fresh source it is, marked
as not asked yet, instead of silently missing.
"""

from __future__ import annotations

import math

from polygateway.backends.base import ScopeSnapshot
from polygateway.cli import render
from polygateway.governance.source_state import SourceSnapshot

CAPS = {"healthy": 16, "rate_limited": 4, "failing": 4}


def seen(name: str, in_flight: int, limit: float) -> SourceSnapshot:
    return SourceSnapshot(
        name=name,
        in_flight=in_flight,
        limit=limit,
        breaker="closed",
        consecutive_failures=0,
        trips=0,
        reopen_in_s=None,
        paced_for_s=None,
        rpm_tokens=None,
        tpm_tokens=None,
    )


SNAP = ScopeSnapshot(
    scope="chat",
    progress_age_s=0.5,
    sources=(seen("failing", 1, 2.0), seen("healthy", 3, 16.0), seen("retired", 0, 1.0)),
)
"""Two configured sources seen, ``rate_limited`` never asked, ``retired`` no longer configured."""


def test_json_lists_a_configured_source_never_asked_as_a_fresh_one_not_seen() -> None:
    shown = render.snapshot_json(SNAP, CAPS)
    by_name = {src["name"]: src for src in shown["sources"]}
    assert [src["name"] for src in shown["sources"]] == [
        "failing",
        "healthy",
        "retired",
        "rate_limited",
    ]
    assert by_name["rate_limited"] == {
        "name": "rate_limited",
        "in_flight": 0,
        "limit": 4.0,
        "breaker": "closed",
        "consecutive_failures": 0,
        "trips": 0,
        "reopen_in_s": None,
        "paced_for_s": None,
        "rpm_tokens": None,
        "tpm_tokens": None,
        "max_concurrency": 4,
        "seen": False,
    }
    assert by_name["failing"]["seen"] is True
    assert by_name["failing"]["limit"] == 2.0
    assert by_name["retired"]["max_concurrency"] is None
    assert by_name["retired"]["seen"] is True
    assert shown["in_flight"] == 4


def test_table_has_a_row_per_configured_source_the_unseen_one_marked() -> None:
    table = render.scope_status_table(SNAP, CAPS)
    rows = _rows(table)
    assert [row[0] for row in rows] == [
        "failing",
        "healthy",
        "retired",
        "rate_limited (not asked yet)",
    ]
    assert rows[3][1:4] == ["0", "4.0 / 4", "closed"]


def test_a_scope_whose_configured_sources_were_never_asked_lists_them_all() -> None:
    empty = ScopeSnapshot(scope="chat", progress_age_s=math.inf, sources=())
    rows = _rows(render.scope_status_table(empty, {"primary": 2}))
    assert [row[0] for row in rows] == ["primary (not asked yet)"]
    assert [row[0] for row in _rows(render.scope_status_table(empty, {}))] == [
        "(no source seen yet)"
    ]


def _rows(table: object) -> list[list[str]]:
    """The cells of a rich ``Table`` or a ``PlainTable``, row by row."""
    columns = getattr(table, "columns", None)
    if columns is not None and columns and hasattr(columns[0], "_cells"):
        cells = [list(map(str, column._cells)) for column in columns]
        return [list(row) for row in zip(*cells, strict=True)]
    return [list(map(str, row)) for row in table.rows]  # type: ignore[attr-defined]
