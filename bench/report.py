"""Turn a run's results into ``research-wiki/BENCHMARKS.md`` (template: ``bench/template.md``).

``python -m bench`` renders the page at the end of a run; ``python -m
bench.report bench/results/latest.json`` renders it again from a saved run
(after editing ``bench/notes.md`` or the template). Every figure on the page
is a median over the rounds of one run; every ratio is between two medians
of that same run. Targets are checked here and each one says met or missed;
a missed target links to its explanation in ``bench/notes.md`` (written by
hand, kept next to the harness).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

from bench.harness import IMPORT_MODULES, SCENARIO_CONFIGS

__all__ = [
    "Check",
    "evaluate_targets",
    "fmt_number",
    "keep_sections",
    "load_notes",
    "main",
    "md_table",
    "render",
    "replace_section",
    "write_page",
]

_HERE = Path(__file__).parent
_LABELS = {
    "pgw_memory_instant": "PolyGateway, memory, instant transport",
    "pgw_redis_instant": "PolyGateway, Redis, instant transport",
    "raw_httpx": "raw httpx",
    "raw_aiohttp": "raw aiohttp",
    "openai_sdk": "openai SDK",
    "litellm_router": "LiteLLM Router (num_retries=2)",
    "litellm_router_default": "LiteLLM Router (defaults)",
    "pgw_memory_httpx": "PolyGateway, memory, httpx",
    "pgw_memory_aiohttp": "PolyGateway, memory, aiohttp",
    "pgw_redis_httpx": "PolyGateway, Redis, httpx",
    "pgw_redis_aiohttp": "PolyGateway, Redis, aiohttp",
    "pgw_instant_null": "PolyGateway, instant, NullEmitter",
    "pgw_instant_bare": "PolyGateway, instant, an emitter that does nothing",
    "pgw_instant_logging": "PolyGateway, instant, LoggingEmitter (level off)",
    "pgw_instant_prometheus": "PolyGateway, instant, PrometheusEmitter",
    "pgw_instant_otel_noop": "PolyGateway, instant, OpenTelemetryEmitter (no-op API)",
    "pgw_instant_otel_sdk": "PolyGateway, instant, OpenTelemetryEmitter (SDK, in memory)",
}
_IMPORT_LABELS = {"-": "bare Python (nothing imported)"}
X = "\u00d7"
"""The multiplication sign of ratio cells (written as an escape: ruff flags it as ambiguous)."""
DASH = "\u2013"
"""The en dash of ranges."""

Medians = dict[str, dict[str, Any]]


_SECTION = re.compile(r"<!-- begin:(?P<name>[\w-]+)\b.*?<!-- end:(?P=name) -->", re.DOTALL)
"""A section of the page another command writes (``make bench-fleet``): ``make bench`` keeps it."""


def keep_sections(page: str, old_page: str) -> str:
    """``page`` with each marked section replaced by the same section of ``old_page``, if any.

    A section of ``old_page`` that ``page`` has no place for is kept too, at the end: a
    benchmark of its own wrote it, and only that benchmark replaces it.
    """
    kept = {m["name"]: m[0] for m in _SECTION.finditer(old_page)}
    out = _SECTION.sub(lambda m: kept.get(m["name"], m[0]), page)
    placed = {m["name"] for m in _SECTION.finditer(page)}
    for name, block in kept.items():
        if name not in placed:
            out = out.rstrip("\n") + "\n\n" + block.strip() + "\n"
    return out


def replace_section(page: str, block: str) -> str:
    """``page`` with ``block`` (one marked section) in place of its namesake, else at the end."""
    found = _SECTION.fullmatch(block.strip())
    if found is None:
        raise ValueError("not one marked section: <!-- begin:NAME ... --> ... <!-- end:NAME -->")
    name = found["name"]
    for m in _SECTION.finditer(page):
        if m["name"] == name:
            return page[: m.start()] + block.strip() + page[m.end() :]
    return page.rstrip("\n") + "\n\n" + block.strip() + "\n"


def write_page(path: Path, page: str) -> None:
    """Write the page, keeping the marked sections the page already there has."""
    if path.exists():
        page = keep_sections(page, path.read_text(encoding="utf-8"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")


def _get(medians: Medians, key: str, field: str) -> float | None:
    """A median figure, or None when the job did not run or failed every round."""
    value = medians.get(key, {}).get(field)
    if isinstance(value, int | float) and not (isinstance(value, float) and math.isnan(value)):
        return float(value)
    return None


def fmt_number(value: float | None, digits: int = 0) -> str:
    """A number for a table cell; an em dash when missing."""
    if value is None:
        return "—"
    if digits == 0:
        return f"{value:,.0f}"
    return f"{value:,.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def _xfmt(value: float | None) -> str:
    """A ratio cell, e.g. ``1.23x`` with a multiplication sign."""
    return "—" if value is None else f"{value:.2f}{X}"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _failures(medians: Medians, key: str) -> str:
    """A note on rounds that failed, for the errors column."""
    reduced = medians.get(key, {})
    failures = reduced.get("failures") or []
    if not failures:
        return ""
    return f" ({len(failures)} round(s) failed: {failures[0][:120]})"


def _chat_tables(medians: Medians, n: int, concurrencies: tuple[int, ...]) -> str:
    """One table per concurrency for the non-streaming chat scenario."""
    out = []
    for c in concurrencies:
        rows = []
        raw_h = _get(medians, f"chat/raw_httpx/n{n}/c{c}", "cpu_us_per_op")
        raw_a = _get(medians, f"chat/raw_aiohttp/n{n}/c{c}", "cpu_us_per_op")
        for name in SCENARIO_CONFIGS["chat"]:
            key = f"chat/{name}/n{n}/c{c}"
            if key not in medians:
                continue
            cpu = _get(medians, key, "cpu_us_per_op")
            spread = (
                f"{fmt_number(_get(medians, key, 'cpu_us_per_op_min'))}{DASH}"
                f"{fmt_number(_get(medians, key, 'cpu_us_per_op_max'))}"
            )
            rt = _get(medians, key, "redis_round_trips_per_call")
            scripts = _get(medians, key, "redis_script_calls_per_call")
            inside = _get(medians, key, "redis_commands_per_call")
            errors = medians[key].get("errors_total")
            rows.append(
                [
                    _LABELS[name],
                    f"**{fmt_number(cpu)}**",
                    spread,
                    _xfmt(_ratio(cpu, raw_h)),
                    _xfmt(_ratio(cpu, raw_a)),
                    fmt_number(_get(medians, key, "ops_per_s")),
                    fmt_number(_get(medians, key, "p50_ms"), 2),
                    fmt_number(_get(medians, key, "p99_ms"), 2),
                    fmt_number(_get(medians, key, "rss_mib"), 1),
                    "—" if rt is None else f"{rt:.2f}",
                    "—" if scripts is None else f"{scripts:.2f} / {inside:.1f}",
                    ("—" if errors is None else str(int(errors))) + _failures(medians, key),
                ]
            )
        header = [
            "configuration",
            "client CPU µs/call",
            f"min{DASH}max over rounds",
            f"{X} raw httpx",
            f"{X} raw aiohttp",
            "calls/s",
            "p50 ms",
            "p99 ms",
            "RSS MiB",
            "Redis round trips/call",
            "Redis scripts / commands per call",
            "errors",
        ]
        out.append(f"**Concurrency {c}** ({n:,} calls per run)\n\n" + md_table(header, rows))
    return "\n\n".join(out)


def _loop_table(medians: Medians, n: int, concurrencies: tuple[int, ...]) -> str:
    """The governance loop alone, beside the overhead the 1.3x targets allow per transport."""
    rows = []
    for name in SCENARIO_CONFIGS["loop"]:
        for c in concurrencies:
            key = f"loop/{name}/n{n}/c{c}"
            if key not in medians:
                continue
            allowed = [
                _get(medians, f"chat/raw_{t}/n{n}/c{c}", "cpu_us_per_op")
                for t in ("httpx", "aiohttp")
            ]
            rt = _get(medians, key, "redis_round_trips_per_call")
            rows.append(
                [
                    _LABELS[name],
                    str(c),
                    f"**{fmt_number(_get(medians, key, 'cpu_us_per_op'))}**",
                    fmt_number(_get(medians, key, "ops_per_s")),
                    *("—" if a is None else fmt_number(0.3 * a) for a in allowed),
                    "—" if rt is None else f"{rt:.2f}",
                    str(int(medians[key].get("errors_total", 0))) + _failures(medians, key),
                ]
            )
    header = [
        "configuration",
        "concurrency",
        "client CPU µs/call",
        "calls/s",
        f"overhead allowed on httpx (0.3 {X} raw httpx)",
        f"overhead allowed on aiohttp (0.3 {X} raw aiohttp)",
        "Redis round trips/call",
        "errors",
    ]
    return md_table(header, rows)


def _telemetry_table(medians: Medians, n: int, concurrencies: tuple[int, ...]) -> str:
    """The governance loop alone with each emitter, beside the same loop with none."""
    rows = []
    for c in concurrencies:
        base = _get(medians, f"telemetry/pgw_memory_instant/n{n}/c{c}", "cpu_us_per_op")
        for name in SCENARIO_CONFIGS["telemetry"]:
            key = f"telemetry/{name}/n{n}/c{c}"
            if key not in medians:
                continue
            cpu = _get(medians, key, "cpu_us_per_op")
            added = None if cpu is None or base is None else cpu - base
            label = "PolyGateway, instant, no emitter" if name == "pgw_memory_instant" else None
            rows.append(
                [
                    label or _LABELS[name],
                    str(c),
                    f"**{fmt_number(cpu, 1)}**",
                    "—" if added is None else f"{added:+.1f}",
                    "—" if added is None or not base else f"{100 * added / base:+.0f}%",
                    fmt_number(_get(medians, key, "cpu_us_per_op_min"), 1)
                    + f" {DASH} "
                    + fmt_number(_get(medians, key, "cpu_us_per_op_max"), 1),
                    fmt_number(_get(medians, key, "ops_per_s")),
                    str(int(medians[key].get("errors_total", 0))) + _failures(medians, key),
                ]
            )
    header = [
        "configuration",
        "concurrency",
        "client CPU µs/call",
        "added µs/call",
        "added",
        f"min{DASH}max of rounds",
        "calls/s",
        "errors",
    ]
    return md_table(header, rows)


def _stream_table(medians: Medians, n: int, c: int) -> str:
    """The streaming scenario: CPU per stream and per chunk, TTFT and its overhead."""
    base_ttft = _get(medians, f"stream/raw_httpx/n{n}/c{c}", "ttft_p50_ms")
    raw_h = _get(medians, f"stream/raw_httpx/n{n}/c{c}", "cpu_us_per_chunk")
    raw_a = _get(medians, f"stream/raw_aiohttp/n{n}/c{c}", "cpu_us_per_chunk")
    rows = []
    for name in SCENARIO_CONFIGS["stream"]:
        key = f"stream/{name}/n{n}/c{c}"
        if key not in medians:
            continue
        ttft = _get(medians, key, "ttft_p50_ms")
        over = None if ttft is None or base_ttft is None else ttft - base_ttft
        per_chunk = _get(medians, key, "cpu_us_per_chunk")
        rows.append(
            [
                _LABELS[name],
                f"**{fmt_number(_get(medians, key, 'cpu_us_per_op'))}**",
                fmt_number(per_chunk, 1),
                _xfmt(_ratio(per_chunk, raw_h)),
                _xfmt(_ratio(per_chunk, raw_a)),
                fmt_number(_get(medians, key, "chunks_per_stream"), 1),
                fmt_number(ttft, 3),
                "—" if over is None else f"{over:+.3f}",
                fmt_number(_get(medians, key, "ttft_p99_ms"), 3),
                fmt_number(_get(medians, key, "ops_per_s")),
                str(int(medians[key].get("errors_total", 0))) + _failures(medians, key),
            ]
        )
    header = [
        "configuration",
        "client CPU µs/stream",
        "µs/chunk",
        f"{X} raw httpx",
        f"{X} raw aiohttp",
        "chunks/stream",
        "TTFT p50 ms",
        "TTFT over raw httpx, ms",
        "TTFT p99 ms",
        "streams/s",
        "errors",
    ]
    return md_table(header, rows)


def _scale_table(medians: Medians, ns: tuple[int, ...]) -> str:
    """The scale scenario: N calls submitted at once to max_concurrency=100."""
    rows = []
    for name in SCENARIO_CONFIGS["scale"]:
        for n in ns:
            key = f"scale/{name}/n{n}/c{n}"
            if key not in medians:
                continue
            rows.append(
                [
                    _LABELS[name],
                    f"{n:,}",
                    fmt_number(_get(medians, key, "cpu_s"), 2),
                    f"**{fmt_number(_get(medians, key, 'cpu_us_per_op'))}**",
                    fmt_number(_get(medians, key, "ops_per_s")),
                    fmt_number(_get(medians, key, "p50_ms"), 1),
                    fmt_number(_get(medians, key, "p99_ms"), 1),
                    fmt_number(_get(medians, key, "peak_rss_mib"), 1),
                    str(int(medians[key].get("errors_total", 0))) + _failures(medians, key),
                ]
            )
    header = [
        "configuration",
        "calls submitted at once",
        "total client CPU s",
        "CPU µs/call",
        "calls/s",
        "p50 ms",
        "p99 ms",
        "peak RSS MiB",
        "errors",
    ]
    return md_table(header, rows)


def _embed_table(medians: Medians, n: int) -> str:
    """The embedding scenario: texts/s and CPU per text."""
    raw = _get(medians, f"embed/raw_httpx/n{n}/c8", "texts_per_s")
    rows = []
    for name in SCENARIO_CONFIGS["embed"]:
        key = f"embed/{name}/n{n}/c8"
        if key not in medians:
            continue
        tps = _get(medians, key, "texts_per_s")
        rows.append(
            [
                _LABELS[name],
                f"**{fmt_number(tps)}**",
                _xfmt(_ratio(tps, raw)),
                fmt_number(_get(medians, key, "cpu_us_per_text"), 1),
                fmt_number(_get(medians, key, "wall_s"), 2),
                fmt_number(_get(medians, key, "peak_rss_mib"), 1),
                str(int(medians[key].get("errors_total", 0))) + _failures(medians, key),
            ]
        )
    header = [
        "configuration",
        "texts/s",
        f"{X} raw httpx",
        "client CPU µs/text",
        "wall s",
        "peak RSS MiB",
        "errors",
    ]
    return md_table(header, rows)


def _storm_table(medians: Medians, n: int) -> str:
    """The 429 storm: calls served and failed."""
    rows = []
    for name in SCENARIO_CONFIGS["storm"]:
        key = f"storm/{name}/n{n}/c{n}"
        if key not in medians:
            continue
        reduced = medians[key]
        ok, errors = reduced.get("ok_total"), reduced.get("errors_total")
        kinds = reduced.get("error_kinds") or {}
        top = next(iter(sorted(kinds.items(), key=lambda kv: -kv[1])), None)
        rows.append(
            [
                _LABELS[name],
                "—" if ok is None else str(int(ok)),
                "—" if errors is None else f"**{int(errors)}**",
                fmt_number(_get(medians, key, "wall_s"), 2),
                fmt_number(_get(medians, key, "p99_ms")),
                "" if top is None else f"`{_cell(top[0])[:90]}`",
            ]
        )
    header = [
        "configuration",
        "served (all rounds)",
        "failed (all rounds)",
        "wall s (median)",
        "p99 ms of served",
        "most common error",
    ]
    return md_table(header, rows)


def _import_table(medians: Medians) -> str:
    """Import cost of each module measured."""
    rows = []
    for module in IMPORT_MODULES:
        key = f"import/{module}"
        if key not in medians:
            continue
        reduced = medians[key]
        extras = reduced.get("extras_loaded") or []
        seconds = _get(medians, key, "import_s")
        rows.append(
            [
                _IMPORT_LABELS.get(module, f"`import {module}`"),
                f"**{fmt_number(None if seconds is None else seconds * 1000, 1)}**",
                fmt_number(_get(medians, key, "rss_over_bare_mib"), 1),
                fmt_number(_get(medians, key, "bare_rss_mib"), 1),
                ", ".join(extras) or "none",
            ]
        )
    header = ["import", "ms", "RSS over bare MiB", "bare RSS MiB", "optional extras it loaded"]
    return md_table(header, rows)


def _cell(text: str) -> str:
    """Text made safe for a table cell."""
    return text.replace("|", "/").replace("\n", " ").replace("`", "'")


@dataclass(frozen=True, slots=True)
class Check:
    """One target: what it asks, what was measured, and whether it was met."""

    id: str
    target: str
    measured: str
    met: bool | None


def evaluate_targets(medians: Medians, meta: dict[str, Any]) -> list[Check]:
    """Check every target the issue sets against this run's medians."""
    sizes = meta["sizes"]
    n = sizes["chat_n"]
    checks: list[Check] = []

    def cpu(config: str, c: int) -> float | None:
        return _get(medians, f"chat/{config}/n{n}/c{c}", "cpu_us_per_op")

    def ratio_check(
        id_: str, text: str, a: float | None, b: float | None, limit: float, what: str
    ) -> None:
        r = _ratio(a, b)
        measured = (
            "not measured"
            if r is None
            else f"{r:.2f}{X} ({fmt_number(a)} / {fmt_number(b)} µs{what})"
        )
        checks.append(Check(id_, text, measured, None if r is None else r <= limit))

    for c in sizes["concurrencies"]:
        for transport in ("httpx", "aiohttp"):
            ratio_check(
                f"memory-{transport}-c{c}",
                f"memory backend on {transport}, concurrency {c}: "
                f"CPU/call ≤ 1.3{X} raw {transport}",
                cpu(f"pgw_memory_{transport}", c),
                cpu(f"raw_{transport}", c),
                1.3,
                "",
            )
        ratio_check(
            f"memory-vs-litellm-c{c}",
            f"memory backend (httpx), concurrency {c}: CPU/call ≤ 1/5 of LiteLLM Router's",
            cpu("pgw_memory_httpx", c),
            cpu("litellm_router", c),
            0.2,
            "",
        )
        ratio_check(
            f"aiohttp-vs-litellm-c{c}",
            f"memory backend on aiohttp, concurrency {c}: CPU/call ≤ 1/10 of LiteLLM Router's",
            cpu("pgw_memory_aiohttp", c),
            cpu("litellm_router", c),
            0.1,
            "",
        )
        for transport in ("httpx", "aiohttp"):
            ratio_check(
                f"redis-{transport}-c{c}",
                f"Redis backend on {transport}, concurrency {c}: CPU/call ≤ 2{X} raw {transport}",
                cpu(f"pgw_redis_{transport}", c),
                cpu(f"raw_{transport}", c),
                2.0,
                "",
            )
    for transport in ("httpx", "aiohttp"):
        keys = [f"chat/pgw_redis_{transport}/n{n}/c{c}" for c in sizes["concurrencies"]]
        trips = [_get(medians, k, "redis_round_trips_per_call") for k in keys]
        scripts = [_get(medians, k, "redis_script_calls_per_call") for k in keys]
        seen = [t for t in trips if t is not None]
        parts = [
            f"c{c}: {t:.2f} round trips (MONITOR sample), {x:.2f} scripts/call (measured loop)"
            for c, t, x in zip(sizes["concurrencies"], trips, scripts, strict=True)
            if t is not None and x is not None
        ]
        # A call's own round trips are two (MONITOR, one call at a time); calls asking at
        # once share script runs (backends/redis/runs.py), so the loop runs at most two
        # scripts a call, fewer when runs form.
        checks.append(
            Check(
                f"redis-round-trips-{transport}",
                f"Redis backend on {transport}: exactly 2 Redis round trips per call that "
                "does not wait (at most 2 scripts a call under load: runs share them)",
                "; ".join(parts) or "not measured",
                None
                if not seen
                else all(abs(t - 2.0) < 0.005 for t in seen)
                and all(x <= 2.005 for x in scripts if x is not None),
            )
        )
    for c in sizes["concurrencies"]:

        def loop_cpu(config: str, c: int = c) -> float | None:
            return _get(medians, f"telemetry/{config}/n{n}/c{c}", "cpu_us_per_op")

        ratio_check(
            f"telemetry-null-c{c}",
            f"telemetry, concurrency {c}: NullEmitter adds nothing measurable "
            f"(CPU/call ≤ 1.05{X} no emitter)",
            loop_cpu("pgw_instant_null"),
            loop_cpu("pgw_memory_instant"),
            1.05,
            "/call",
        )
        ratio_check(
            f"telemetry-otel-noop-c{c}",
            f"telemetry, concurrency {c}: OpenTelemetry on the no-op API ≤ 1.1{X} NullEmitter",
            loop_cpu("pgw_instant_otel_noop"),
            loop_cpu("pgw_instant_null"),
            1.1,
            "/call",
        )
        ratio_check(
            f"telemetry-otel-own-c{c}",
            f"telemetry, concurrency {c}: OpenTelemetry on the no-op API ≤ 1.1{X} an emitter "
            "that does nothing (the emitter's own share)",
            loop_cpu("pgw_instant_otel_noop"),
            loop_cpu("pgw_instant_bare"),
            1.1,
            "/call",
        )
    ns = sizes["scale_ns"]
    if len(ns) >= 2:
        small, big = min(ns), max(ns)
        a = _get(medians, f"scale/pgw_memory_aiohttp/n{big}/c{big}", "cpu_us_per_op")
        b = _get(medians, f"scale/pgw_memory_aiohttp/n{small}/c{small}", "cpu_us_per_op")
        ratio_check(
            "scale",
            f"{big:,} waiting calls cost no more CPU per call than {small:,} (within 20%)",
            a,
            b,
            1.2,
            "/call",
        )
    sn, sc = sizes["stream_n"], sizes["stream_concurrency"]
    base = _get(medians, f"stream/raw_httpx/n{sn}/c{sc}", "ttft_p50_ms")
    for transport in ("httpx", "aiohttp"):
        ttft = _get(medians, f"stream/pgw_memory_{transport}/n{sn}/c{sc}", "ttft_p50_ms")
        over = None if ttft is None or base is None else ttft - base
        checks.append(
            Check(
                f"ttft-{transport}",
                f"streaming on {transport}: median TTFT overhead over raw httpx < 1 ms",
                "not measured" if over is None else f"{over:+.3f} ms ({ttft:.3f} vs {base:.3f})",
                None if over is None else over < 1.0,
            )
        )
        ratio_check(
            f"chunk-cpu-{transport}",
            f"streaming on {transport}: client CPU per chunk ≤ 2{X} raw {transport}",
            _get(medians, f"stream/pgw_memory_{transport}/n{sn}/c{sc}", "cpu_us_per_chunk"),
            _get(medians, f"stream/raw_{transport}/n{sn}/c{sc}", "cpu_us_per_chunk"),
            2.0,
            "/chunk",
        )
    imp_s = _get(medians, "import/polygateway", "import_s")
    imp_rss = _get(medians, "import/polygateway", "rss_over_bare_mib")
    extras = medians.get("import/polygateway", {}).get("extras_loaded")
    loaded = ", ".join(extras or []) or "none"
    checks.append(
        Check(
            "import",
            "`import polygateway`: under 0.3 s and under 40 MiB of RSS over bare Python, "
            "no optional extra loaded",
            "not measured"
            if imp_s is None or imp_rss is None
            else f"{imp_s * 1000:.1f} ms, +{imp_rss:.1f} MiB, extras: {loaded}",
            None
            if imp_s is None or imp_rss is None
            else imp_s < 0.3 and imp_rss < 40 and not extras,
        )
    )
    storm_n = sizes["storm_n"]
    for name in SCENARIO_CONFIGS["storm"]:
        if not name.startswith("pgw_"):
            continue
        storm = medians.get(f"storm/{name}/n{storm_n}/c{storm_n}")
        failed = None if storm is None else storm.get("errors_total")
        served = None if storm is None else storm.get("ok_total")
        checks.append(
            Check(
                "storm",
                "429 storm (25% of answers 429 with Retry-After 1, two sources): "
                f"every call served ({_LABELS[name]})",
                "not measured"
                if failed is None
                else f"{int(served or 0)} served, {int(failed)} failed",
                None
                if storm is None or failed is None
                else failed == 0 and not storm.get("failures"),
            )
        )
    return checks


def load_notes(path: Path = _HERE / "notes.md") -> tuple[str, dict[str, str]]:
    """The notes file: its preamble, and one section per target id (``### <id>`` headings)."""
    if not path.exists():
        return "", {}
    text = path.read_text(encoding="utf-8")
    parts = re.split(r"^### +(\S+) *$", text, flags=re.MULTILINE)
    preamble, sections = parts[0].strip(), {}
    for i in range(1, len(parts) - 1, 2):
        sections[parts[i]] = parts[i + 1].strip()
    return preamble, sections


def _targets_section(checks: list[Check], notes: dict[str, str]) -> tuple[str, str]:
    """The targets table and the explanations of the missed ones."""
    rows = []
    why: list[str] = []
    for check in checks:
        if check.met is None:
            verdict = "not measured"
        elif check.met:
            verdict = "met"
        else:
            verdict = "**missed**"
        link = ""
        if check.met is False:
            link = f"[why](#why-{check.id})"
            note = notes.get(check.id, "No analysis has been written for this miss yet.")
            why.append(f'<a id="why-{check.id}"></a>\n#### Why: {check.id}\n\n{note}')
        rows.append([check.target, check.measured, verdict, link])
    table = md_table(["target", "measured (medians of this run)", "verdict", ""], rows)
    return table, "\n\n".join(why) if why else "Every measured target was met."


def _versions(meta: dict[str, Any]) -> str:
    """Package versions as a table."""
    versions = meta["versions"]
    rows = [[name, version or "not installed"] for name, version in versions.items()]
    machine = meta["machine"]
    rows.append(["redis-server", machine.get("redis_server") or "not installed"])
    return md_table(["package", "version"], rows)


def _machine(meta: dict[str, Any]) -> str:
    """The machine as a bullet list."""
    m = meta["machine"]
    layout = meta["layout"]
    if layout["client_cpu"] is None:
        placement = "one usable CPU: the simulator, Redis and the client shared it"
    else:
        placement = (
            f"simulator and redis-server pinned to CPU {layout['service_cpu']}, "
            f"each measured client process pinned to CPU {layout['client_cpu']}"
        )
    memory = m.get("memory_gib")
    return "\n".join(
        [
            f"- CPU: {m['cpu_model']}, {m['nproc']} logical CPUs ({m['cpus_usable']} usable)",
            f"- memory: {memory:.1f} GiB" if memory else "- memory: unknown",
            f"- OS: {m['kernel']}",
            f"- Python: {m['python']} ({m['python_impl']})",
            f"- placement: {placement}",
        ]
    )


def _skipped(meta: dict[str, Any]) -> str:
    """What was not measured in this run, and why."""
    skipped = meta.get("skipped") or {}
    if not skipped:
        return "Nothing: every configuration of every scenario ran."
    return "\n".join(f"- {name}: {reason}" for name, reason in sorted(skipped.items()))


def render(results: dict[str, Any], template: Path = _HERE / "template.md") -> str:
    """The whole page."""
    meta, medians = results["meta"], results["medians"]
    sizes = meta["sizes"]
    preamble, notes = load_notes()
    checks = evaluate_targets(medians, meta)
    targets, why = _targets_section(checks, notes)
    met = sum(1 for c in checks if c.met)
    missed = sum(1 for c in checks if c.met is False)
    values: dict[str, Callable[[], str]] = {
        "date": lambda: meta["date"],
        "command": lambda: meta["command"],
        "inner_command": lambda: meta["inner_command"],
        "revision": lambda: meta.get("revision", "unknown"),
        "polygateway_path": lambda: meta.get("polygateway_path", "unknown"),
        "duration": lambda: f"{meta['duration_s'] / 60:.1f} min",
        "rounds": lambda: str(meta["rounds"]),
        "machine": lambda: _machine(meta),
        "versions": lambda: _versions(meta),
        "summary": lambda: (
            f"{met} of {len(checks)} targets met, {missed} missed, "
            f"{len(checks) - met - missed} not measured."
        ),
        "targets": lambda: targets,
        "why": lambda: why,
        "analysis": lambda: preamble or "No analysis written.",
        "chat_n": lambda: f"{sizes['chat_n']:,}",
        "chat_tables": lambda: _chat_tables(
            medians, sizes["chat_n"], tuple(sizes["concurrencies"])
        ),
        "loop_table": lambda: _loop_table(medians, sizes["chat_n"], tuple(sizes["concurrencies"])),
        "telemetry_table": lambda: _telemetry_table(
            medians, sizes["chat_n"], tuple(sizes["concurrencies"])
        ),
        "stream_n": lambda: f"{sizes['stream_n']:,}",
        "stream_concurrency": lambda: str(sizes["stream_concurrency"]),
        "stream_table": lambda: _stream_table(
            medians, sizes["stream_n"], sizes["stream_concurrency"]
        ),
        "scale_table": lambda: _scale_table(medians, tuple(sizes["scale_ns"])),
        "embed_n": lambda: f"{sizes['embed_n']:,}",
        "embed_table": lambda: _embed_table(medians, sizes["embed_n"]),
        "storm_n": lambda: str(sizes["storm_n"]),
        "storm_table": lambda: _storm_table(medians, sizes["storm_n"]),
        "import_table": lambda: _import_table(medians),
        "skipped": lambda: _skipped(meta),
    }
    page = Template(template.read_text(encoding="utf-8"))
    return page.substitute({k: f() for k, f in values.items()})


def main(argv: list[str] | None = None) -> int:
    """Render the page from a saved results file."""
    parser = argparse.ArgumentParser(prog="python -m bench.report")
    parser.add_argument("results", type=Path, help="a results JSON written by python -m bench")
    parser.add_argument("--out", type=Path, default=Path("research-wiki/BENCHMARKS.md"))
    parser.add_argument(
        "--telemetry", action="store_true", help="print the telemetry table only (no page)"
    )
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text(encoding="utf-8"))
    if args.telemetry:
        sizes = results["meta"]["sizes"]
        medians = results["medians"]
        print(_telemetry_table(medians, sizes["chat_n"], tuple(sizes["concurrencies"])))
        for check in evaluate_targets(medians, results["meta"]):
            if check.id.startswith("telemetry-"):
                print(f"- {check.target}: {check.measured}, met: {check.met}")
        return 0
    write_page(args.out, render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
