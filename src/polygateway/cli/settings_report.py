"""``check-config``'s report: every effective setting, where it came from, in 80 columns.

Each value is shown as the settings will use it (URLs and headers masked,
API keys reduced to the variable's name and "set" / "not set") beside its
origin: the settings file, an environment variable (``env NAME``), a
variable of the ``.env`` file (``.env NAME``), or ``default``. One block per
source keeps the report inside 80 columns however many sources there are.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from polygateway.config import GatewaySettings
from polygateway.config.loading import value_origin

__all__ = ["WIDTH", "Row", "origins_json", "report_lines", "setting_rows"]

WIDTH = 80
"""The report's width: a terminal's default, and what a pasted report keeps."""

_KEY_WIDTH = 27
_ORIGIN_COLUMN = 52


@dataclass(frozen=True, slots=True)
class Row:
    """One setting: its name, its value as shown, and where the value came from."""

    key: str
    value: str
    origin: str


def _shown(value: Any) -> str:
    """A value as the report prints it: ``-`` for none, JSON-ish for tables."""
    if value is None or value == "" or value == {}:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _table(value: object) -> Mapping[str, Any]:
    """A TOML table of the file, or an empty one where the file has something else (or none)."""
    return value if isinstance(value, dict) else {}


def _variable_origin(path: str | None, env: str) -> str:
    """``env NAME`` for the process environment, ``<dotenv> NAME`` for a dotenv file."""
    return f"env {env}" if path is None else f"{path} {env}"


def setting_rows(
    settings: GatewaySettings,
    file_layer: Mapping[str, Any],
    path: str | None,
    env_file: str | None,
) -> dict[str, Any]:
    """Every effective value with its origin: ``{"gateway": [Row], "scopes": {name: ...}}``.

    ``file_layer`` is the settings file flattened as ``GatewaySettings.load``
    reads it (empty without a file); ``path`` names it.
    """
    dumped = settings.model_dump(mode="json")  # URLs, proxy, headers and query masked
    file_shown = path or "file"

    def origin(field: str, in_file: bool) -> str:
        where, env = value_origin(field, path, env_file, settings_cls=GatewaySettings)
        if env is not None:
            return _variable_origin(where, env)
        return file_shown if in_file else "default"

    gateway = [
        Row(field, _shown(dumped[field]), origin(field, field in file_layer))
        for field in type(settings).model_fields
        if field != "scopes"
    ]
    raw_scopes = _table(file_layer.get("scopes"))
    scopes: dict[str, Any] = {}
    for name, scope in settings.scopes.items():
        raw_scope = _table(raw_scopes.get(name))
        listed = raw_scope.get("sources")
        raw_sources = [_table(raw) for raw in listed] if isinstance(listed, list) else []

        def where(raw: Mapping[str, Any], key: str, *within: int | str) -> str:
            # POLYGATEWAY_SCOPES merges key by key: it answers only for what it sets.
            env_where, env = value_origin(
                "scopes", path, env_file, settings_cls=GatewaySettings, within=within
            )
            if env is not None:
                return _variable_origin(env_where, env)
            return file_shown if key in raw else "default"

        shown_scope = dumped["scopes"][name]
        sources = []
        for index, (source, shown) in enumerate(
            zip(scope.sources, shown_scope["sources"], strict=True)
        ):
            raw = raw_sources[index] if index < len(raw_sources) else {}
            rows = [
                Row(key, _shown(value), where(raw, key, name, "sources", index, key))
                for key, value in shown.items()
                if key not in ("name", "api_key", "api_key_env")
            ]
            key = _key_row(source.api_key_env, source.api_key is not None, env_file)
            rows.insert(1, key)
            sources.append((source.name, rows))
        scopes[name] = {
            "kind": scope.kind,
            "rows": [
                Row(
                    "exempt_429",
                    _shown(scope.exempt_429),
                    where(raw_scope, "exempt_429", name, "exempt_429"),
                )
            ],
            "sources": sources,
        }
    return {"gateway": gateway, "scopes": scopes}


def _key_row(env: str | None, is_set: bool, env_file: str | None) -> Row:
    """The API key: which variable, set or not, and where it was found; never its value."""
    if env is None:
        return Row("api key", "set in code" if is_set else "none", "code" if is_set else "default")
    where = "env" if os.environ.get(env) else (env_file or ".env")
    return Row("api key", f"${env} ({'set' if is_set else 'not set'})", f"{where} {env}")


def origins_json(rows: Mapping[str, Any]) -> dict[str, Any]:
    """Each value's origin for ``--json``, keyed like the values."""
    return {
        "gateway": {row.key: row.origin for row in rows["gateway"]},
        "scopes": {
            name: {
                **{row.key: row.origin for row in scope["rows"]},
                "sources": {
                    source: {row.key: row.origin for row in source_rows}
                    for source, source_rows in scope["sources"]
                },
            }
            for name, scope in rows["scopes"].items()
        },
    }


def _line(indent: int, row: Row) -> list[str]:
    """One setting as ``key  value  origin``; a long one keeps its origin right-aligned below."""
    # A name wider than its column keeps two spaces before its value.
    key_width = max(_KEY_WIDTH - indent, len(row.key) + 2)
    head = f"{' ' * indent}{row.key:<{key_width}}{row.value}"
    if len(head) > WIDTH:
        # A value too long for its column (a URL) gets a line of its own below its key.
        return [*_line(indent, Row(row.key, "", row.origin)), f"{' ' * (indent + 2)}{row.value}"]
    column = max(len(head) + 2, _ORIGIN_COLUMN)
    if column + len(row.origin) <= WIDTH:
        return [f"{head.ljust(column)}{row.origin}"]
    if len(head) + 2 + len(row.origin) <= WIDTH:
        return [f"{head}  {row.origin.rjust(WIDTH - len(head) - 2)}"]
    return [head, row.origin.rjust(WIDTH)]


def report_lines(rows: Mapping[str, Any]) -> Sequence[str]:
    """The report as lines of at most ``WIDTH`` columns (a very long value aside)."""
    lines = ["gateway"]
    for row in rows["gateway"]:
        lines += _line(2, row)
    for name, scope in rows["scopes"].items():
        lines += ["", f"scope {name} (kind {scope['kind']})"]
        for row in scope["rows"]:
            lines += _line(2, row)
        for source, source_rows in scope["sources"]:
            lines.append(f"  source {source}")
            for row in source_rows:
                lines += _line(4, row)
    return lines
