"""``polygateway demo``: real traffic through the three clients against a misbehaving upstream.

Nothing to configure: the demo starts the simulator on 127.0.0.1 with three
sources per capability (one healthy, one rate-limited, one failing), builds
the settings in code (memory backend by default, ``--backend redis`` for a
shared one), drives a few hundred chat calls (a quarter streamed), a batch
embedding job and a handful of OCR pages concurrently, shows live progress,
and ends with what the application saw, what the gateway did per source and
what the simulator really played on the wire. Exit 0 only when every call
was served.

The demo's scopes are ``demo-chat``, ``demo-embed`` and ``demo-ocr``: on a
shared Redis they can never be mistaken for an application's scopes (a
success here marks fleet-wide progress for its scope).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr

from polygateway.cli import positive_float, refuse_usage, render
from polygateway.cli.demo_report import (
    LEGEND,
    CallResult,
    DemoEmitter,
    TripCounter,
    calls_json,
    calls_table,
    end_table,
    simulator_json,
    sources_json,
    sources_table,
)
from polygateway.cli.samples import tiny_pdf, tiny_png
from polygateway.config import GatewaySettings
from polygateway.errors import GatewayError
from polygateway.middleware.waiting import room_for

if TYPE_CHECKING:
    from rich.console import Console

    from polygateway.backends.base import Backend, ScopeSnapshot
    from polygateway.chat import ChatClient
    from polygateway.embedding import EmbeddingClient
    from polygateway.ocr import OcrClient
    from polygateway.simulator import FaultProfile, SimulatedUpstream

__all__ = [
    "CONCURRENCY",
    "ROLES",
    "SCOPES",
    "add_demo_parser",
    "demo_settings",
    "run_demo",
    "tiny_pdf",
    "tiny_png",
]

SCOPES = {"chat": "demo-chat", "embed": "demo-embed", "ocr": "demo-ocr"}
"""Client kind -> the demo's scope name."""

ROLES = ("healthy", "rate_limited", "failing")
"""The three sources of every demo scope."""

CONCURRENCY = {"healthy": 16, "rate_limited": 4, "failing": 4}
"""Each role's ``max_concurrency`` (the same in every demo scope)."""

_REDIS_URL = "redis://127.0.0.1:6379/0"
"""The Redis ``--backend redis`` uses when no ``--redis-url`` names one."""

_SAMPLE_EVERY_S = 0.2
"""Snapshot period of the breaker-trip sampler (a trip stays open for seconds)."""
_PLAIN_PROGRESS_EVERY_S = 2.0
"""Progress line period when the output is not a terminal (CI logs, pipes)."""
_FAILED_SHOWN = 3
"""Failed calls listed by name on the last screen (``--json`` lists every one)."""


def add_demo_parser(sub: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    """Mount ``demo`` on the ``polygateway`` sub-command parser."""
    demo = sub.add_parser(
        "demo",
        parents=list(parents),
        help="real traffic through the three clients against a misbehaving simulated upstream",
        description="Start the simulator (a healthy, a rate-limited and a failing source per "
        "capability), drive chat, embedding and OCR traffic through the clients, show live "
        "progress, then a per-source table and the verdict. Exit 0 only when every call was "
        "served. A memory backend lives inside this process: --status-every shows its live "
        "state (`polygateway status` reads a shared Redis backend).",
    )
    demo.add_argument(
        "--backend", choices=("memory", "redis"), default="memory", help="governance state"
    )
    demo.add_argument(
        "--redis-url",
        default=None,
        help=f"Redis for --backend redis (default {_REDIS_URL}; a password in it is never printed)",
    )
    demo.add_argument(
        "--transport", choices=("httpx", "aiohttp"), default="httpx", help="HTTP client"
    )
    demo.add_argument(
        "--scale",
        type=positive_float,
        default=1.0,
        help="multiply the workload (calls and arrival window; default 1 = ~300 chat calls)",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the faults and arrivals")
    demo.add_argument(
        "--status-every",
        type=positive_float,
        default=None,
        metavar="SECONDS",
        help="show the backend's live state (permits, breakers, pacing, AIMD) every SECONDS",
    )
    demo.set_defaults(handler=run_demo, usage_error=demo.error)


# -- the upstream and the settings ------------------------------------------------------------


def demo_profiles() -> dict[str, FaultProfile]:
    """The misbehaviour per role: healthy, at its quota, and down (503s and connection resets)."""
    from polygateway.simulator import FaultProfile

    healthy = FaultProfile(
        latency_s=0.03, latency_jitter_s=0.02, ttft_s=0.03, chunk_interval_s=0.005
    )
    rate_limited = FaultProfile(
        latency_s=0.03,
        latency_jitter_s=0.02,
        ttft_s=0.03,
        chunk_interval_s=0.005,
        rate_429=0.15,
        retry_after_s=1.0,
        rpm_limit=30,
        max_concurrency=4,
    )
    # Resets dominate, so that the few requests a failing source gets before its breaker
    # opens (breaker_failures of them at least) show both kinds of failure on the wire.
    failing = FaultProfile(latency_s=0.02, rate_5xx=0.3, statuses_5xx=(502, 503), rate_reset=0.65)
    # A reset in the middle of a stream that already reached the caller is, by design,
    # StreamInterrupted (never silently retried); the chat source fails before any body.
    failing_chat = FaultProfile(latency_s=0.02, rate_5xx=0.95, statuses_5xx=(502, 503))
    profiles: dict[str, FaultProfile] = {}
    for kind in SCOPES:
        profiles[f"{kind}-healthy"] = healthy
        profiles[f"{kind}-rate_limited"] = rate_limited
        profiles[f"{kind}-failing"] = failing_chat if kind == "chat" else failing
    return profiles


def demo_settings(
    sim: SimulatedUpstream, *, backend: str, redis_url: str, transport: str
) -> GatewaySettings:
    """Settings built in code for the demo's scopes: small timeouts, quick breakers and back-off."""
    key = SecretStr("demo-key")
    scopes: dict[str, Any] = {}
    for kind, scope in SCOPES.items():
        sources = []
        for role in ROLES:
            sim_name = f"{kind}-{role}"
            source: dict[str, Any] = {
                "name": role,
                "protocol": "monkey_ocr" if kind == "ocr" else "openai",
                "base_url": sim.base_url(sim_name, "monkey_ocr" if kind == "ocr" else "openai"),
                "model": f"sim-{kind}",
                "api_key": key,
                "max_concurrency": CONCURRENCY[role],
                "timeout_s": 2.0,
                "ttft_timeout_s": 1.0,
                "stream_idle_timeout_s": 1.0,
                "connect_timeout_s": 1.0,
            }
            if kind == "embed":
                source["max_batch_size"] = 16
            sources.append(source)
        scopes[scope] = {"kind": kind, "sources": sources}
    return GatewaySettings(
        _env_file=None,  # the demo depends on nothing around it: no .env is read
        backend=backend,
        redis_url=SecretStr(redis_url),
        transport=transport,
        stall_window_s=30.0,
        max_attempts=5,
        poll_interval_s=0.05,
        backoff_base_s=0.05,
        backoff_cap_s=1.0,
        breaker_failures=3,
        breaker_cooldown_s=2.0,
        breaker_cooldown_max_s=8.0,
        lease_grace_s=5.0,
        close_grace_s=5.0,
        scopes=scopes,
    )


# -- the workload ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Planned:
    """One call of the workload: what it is, when it starts, how to run it."""

    kind: str
    index: int
    label: str
    at_s: float
    streamed: bool
    run: Callable[[], Awaitable[int]]
    """Runs the call; returns the number of attempts it took."""


@dataclass(frozen=True, slots=True)
class _Clients:
    """The three clients the workload calls through, sharing one backend."""

    chat: ChatClient
    embed: EmbeddingClient
    ocr: OcrClient


def _plan(clients: _Clients, scale: float, rng: random.Random) -> list[_Planned]:
    """A few hundred chat calls (every fourth streamed), an embedding job, some OCR pages."""
    window_s = 12.0 * scale
    n_chat = max(1, round(300 * scale))
    n_embed = max(1, round(8 * scale))
    n_ocr = max(1, round(12 * scale))
    texts_per_embed = 64
    png, pdf = tiny_png(), tiny_pdf()
    plan: list[_Planned] = []

    def chat_call(i: int) -> Callable[[], Awaitable[int]]:
        messages = [{"role": "user", "content": f"demo question {i}: what is governance?"}]

        async def complete() -> int:
            r = await clients.chat.complete(messages=messages, max_tokens=32)
            return len(r.attempts)

        async def stream() -> int:
            finish = None
            async with clients.chat.stream(messages=messages, max_tokens=32) as s:
                async for chunk in s:
                    finish = chunk.finish_reason or finish
                attempts = len(s.attempts)
            if finish is None:
                raise GatewayError("the stream ended without a finish_reason")
            return attempts

        return stream if i % 4 == 3 else complete

    for i in range(n_chat):
        plan.append(
            _Planned("chat", i, f"chat #{i}", rng.uniform(0, window_s), i % 4 == 3, chat_call(i))
        )

    def embed_call(i: int) -> Callable[[], Awaitable[int]]:
        texts = [f"document {i}, paragraph {j}" for j in range(texts_per_embed)]

        async def embed() -> int:
            e = await clients.embed.embed(texts)
            if len(e.vectors) != len(texts):
                raise GatewayError(f"{len(e.vectors)} vectors for {len(texts)} texts")
            return len(e.attempts)

        return embed

    for i in range(n_embed):
        at = window_s * i / n_embed
        plan.append(_Planned("embed", i, f"embedding batch job part {i}", at, False, embed_call(i)))

    def ocr_call(i: int) -> Callable[[], Awaitable[int]]:
        async def text() -> int:
            t = await clients.ocr.recognize_text(png)
            return len(t.attempts)

        async def layout() -> int:
            d = await clients.ocr.parse_layout(pdf)
            return len(d.attempts)

        return layout if i % 3 == 2 else text

    for i in range(n_ocr):
        kind = "PDF layout" if i % 3 == 2 else "PNG text"
        plan.append(
            _Planned(
                "ocr", i, f"OCR page {i} ({kind})", rng.uniform(0, window_s), False, ocr_call(i)
            )
        )
    plan.sort(key=lambda p: p.at_s)
    return plan


# -- running it --------------------------------------------------------------------------------


class _Run:
    """The demo's moving parts while it runs: results, samples, trip counts."""

    def __init__(self, backend: Backend, emitter: DemoEmitter, planned: dict[str, int]) -> None:
        self.backend = backend
        self.emitter = emitter
        self.planned = planned
        self.results: list[CallResult] = []
        self.trips = TripCounter()
        self.samples: list[dict[str, Any]] = []
        self.started = time.monotonic()  # edge: the demo is a program, not policy code

    def elapsed(self) -> float:
        """Seconds since the workload started."""
        return time.monotonic() - self.started  # edge

    def done(self, kind: str) -> tuple[int, int]:
        """(served, failed) so far for one kind of call."""
        served = sum(1 for r in self.results if r.kind == kind and r.served)
        failed = sum(1 for r in self.results if r.kind == kind and not r.served)
        return served, failed

    def progress_line(self) -> str:
        """One line: per client, calls done and what its own attempts met so far."""
        parts = []
        for kind, total in self.planned.items():
            served, failed = self.done(kind)
            parts.append(
                f"{kind} {served + failed}/{total} calls"
                + (f" ({failed} failed)" if failed else "")
                + f" ({self.emitter.attempts_note(SCOPES[kind])})"
            )
        return f"[{self.elapsed():5.1f} s] " + "; ".join(parts)

    async def snapshots(self) -> list[ScopeSnapshot]:
        """The backend's state of every demo scope, now."""
        return [await self.backend.snapshot(scope) for scope in SCOPES.values()]


async def _one(run: _Run, call: _Planned) -> None:
    """Start ``call`` at its time, run it, and record how it ended (a failure is data here)."""
    await asyncio.sleep(max(0.0, call.at_s - run.elapsed()))
    started = time.monotonic()  # edge
    try:
        attempts = await call.run()
    except GatewayError as exc:
        found = getattr(exc, "attempts", ())
        run.results.append(
            CallResult(
                call.kind,
                call.index,
                call.label,
                served=False,
                latency_s=time.monotonic() - started,  # edge
                attempts=len(found),
                streamed=call.streamed,
                error=type(exc).__name__,
                message=str(exc),
            )
        )
        return
    latency = time.monotonic() - started  # edge
    run.results.append(
        CallResult(call.kind, call.index, call.label, True, latency, attempts, call.streamed)
    )


def _by_class(run: _Run, scope: str) -> render.ByClass:
    """This process's calls waiting and permits in use per class: the memory backend is ours."""
    return room_for(run.backend, scope).by_class()


async def _sample(
    run: _Run, status_every: float | None, show: Callable[[Sequence[ScopeSnapshot]], None]
) -> None:
    """Sample the backend for breaker trips; every ``status_every`` s keep (and show) the state."""
    next_status = status_every
    while True:
        snaps = await run.snapshots()
        at = run.elapsed()
        for snap in snaps:
            run.trips.observe(snap, at)
        if next_status is not None and status_every is not None and at >= next_status:
            next_status += status_every
            run.samples.append(
                {
                    "t_s": round(at, 2),
                    "scopes": [
                        render.snapshot_json(s, CONCURRENCY, _by_class(run, s.scope)) for s in snaps
                    ],
                }
            )
            show(snaps)
        await asyncio.sleep(_SAMPLE_EVERY_S)


def run_demo(args: argparse.Namespace) -> int:
    """The ``demo`` sub-command."""
    if args.redis_url is not None and args.backend != "redis":
        refuse_usage(args, "--redis-url needs --backend redis (the demo runs in memory otherwise)")
    try:
        import polygateway.simulator  # noqa: F401
    except ImportError:
        raise render.CliError(
            "the demo needs the sim extra: pip install 'polygateway[sim,cli]'"
        ) from None
    out: Console | None = None if args.json else render.console()
    return asyncio.run(_demo(args, out))


async def _demo(args: argparse.Namespace, out: Console | None) -> int:
    from polygateway.simulator import SimulatedUpstream

    async with SimulatedUpstream(demo_profiles(), seed=args.seed) as sim:
        settings = demo_settings(
            sim,
            backend=args.backend,
            redis_url=args.redis_url or _REDIS_URL,
            transport=args.transport,
        )
        if out is not None:
            where = "in memory" if args.backend == "memory" else f"on {settings.redis_where}"
            out.print(f"PolyGateway demo: a misbehaving simulated upstream on {sim.url}")
            out.print(
                f"scopes {', '.join(SCOPES.values())}, each with sources {', '.join(ROLES)}; "
                f"governance state {where}"
            )
        return await _drive(args, out, sim, settings)


async def _drive(
    args: argparse.Namespace, out: Console | None, sim: SimulatedUpstream, settings: GatewaySettings
) -> int:
    from polygateway.chat import ChatClient
    from polygateway.embedding import EmbeddingClient
    from polygateway.ocr import OcrClient

    emitter = DemoEmitter()
    chat = ChatClient.from_settings(settings, scope=SCOPES["chat"], emitter=emitter)
    backend = chat.backend
    try:
        # Entered first, so an unreachable backend below still closes it.
        async with chat:
            # Fail at once, in one line, when a shared backend is unreachable.
            await backend.snapshot(SCOPES["chat"])
            async with (
                EmbeddingClient.from_settings(
                    settings, scope=SCOPES["embed"], emitter=emitter
                ) as emb,
                OcrClient.from_settings(settings, scope=SCOPES["ocr"], emitter=emitter) as ocr,
            ):
                clients = _Clients(chat, emb, ocr)
                plan = _plan(clients, args.scale, random.Random(args.seed))  # noqa: S311
                planned = {kind: sum(1 for p in plan if p.kind == kind) for kind in SCOPES}
                run = _Run(backend, emitter, planned)
                await _with_progress(run, plan, args, out)
                final = await run.snapshots()
    finally:
        await backend.aclose()
    return _report(args, out, sim, run, final)


async def _with_progress(
    run: _Run, plan: Sequence[_Planned], args: argparse.Namespace, out: Console | None
) -> None:
    """Run every call concurrently while the sampler and the progress display run beside them."""

    def show_status(snaps: Sequence[ScopeSnapshot]) -> None:
        if out is None:
            return
        out.print(f"live state at {run.elapsed():.1f} s:")
        for snap in snaps:
            out.print(render.scope_status_table(snap, CONCURRENCY, _by_class(run, snap.scope)))

    sampler = asyncio.create_task(_sample(run, args.status_every, show_status))
    calls = [asyncio.create_task(_one(run, call)) for call in plan]
    try:
        if out is None:
            await asyncio.gather(*calls)
        elif out.is_terminal:
            await _live_bars(run, calls, out)
        else:
            await _plain_progress(run, calls, out)
        # Every call is done; a call that raised something other than a GatewayError is a
        # bug, not a verdict: re-raise it instead of reporting a half-empty table.
        await asyncio.gather(*calls)
    finally:
        sampler.cancel()
        for task in calls:
            task.cancel()
        await asyncio.gather(sampler, *calls, return_exceptions=True)


async def _live_bars(run: _Run, calls: Sequence[asyncio.Task[None]], out: Console) -> None:
    """Three progress bars and a line of attempt outcomes, redrawn in place."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description:<6}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        console=out,
        transient=False,
    ) as progress:
        bars = {
            kind: progress.add_task(kind, total=total, note="")
            for kind, total in run.planned.items()
        }
        pending = set(calls)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=0.1)
            for kind, bar in bars.items():
                served, failed = run.done(kind)
                note = f"[red]{failed} failed[/red] " if failed else ""
                note += run.emitter.attempts_note(SCOPES[kind])
                progress.update(bar, completed=served + failed, note=note)


async def _plain_progress(run: _Run, calls: Sequence[asyncio.Task[None]], out: Console) -> None:
    """A progress line every few seconds, for logs and pipes."""
    pending = set(calls)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=_PLAIN_PROGRESS_EVERY_S)
        out.print(run.progress_line(), markup=False)


def _report(
    args: argparse.Namespace,
    out: Console | None,
    sim: SimulatedUpstream,
    run: _Run,
    final: Sequence[ScopeSnapshot],
) -> int:
    """Print the tables (or the JSON document) and return the exit status: 0 iff all served."""
    order = [(scope, role) for scope in SCOPES.values() for role in ROLES]
    sources = sources_json(run.emitter.records, run.trips.trips, order)
    calls = calls_json(run.results, SCOPES, run.planned)
    stats = simulator_json(sim.record)
    failed = sorted((r for r in run.results if not r.served), key=lambda r: (r.kind, r.index))
    total = sum(run.planned.values())
    served_all = not failed and len(run.results) == total
    verdict = _verdict(calls, failed, total, served_all)
    if out is None:
        render.dump_json(
            {
                "ok": served_all,
                "served_all": served_all,
                "verdict": verdict,
                "elapsed_s": round(run.elapsed(), 2),
                "backend": args.backend,
                "calls": calls,
                "failed": [
                    {"kind": r.kind, "call": r.label, "error": r.error, "message": r.message}
                    for r in failed
                ],
                "sources": sources,
                "simulator": stats,
                "status": [render.snapshot_json(s, CONCURRENCY) for s in final],
                "status_samples": run.samples,
            }
        )
        return 0 if served_all else 1
    from rich.markup import escape

    out.print()
    out.print(calls_table(calls))
    out.print(sources_table(sources))
    wire_order = [
        (scope, role, f"{kind}-{role}") for kind, scope in SCOPES.items() for role in ROLES
    ]
    out.print(end_table(stats, final, wire_order, CONCURRENCY))
    for line in LEGEND:
        out.print(line, markup=False, highlight=False)
    # The last screen (120x40) keeps the tables and the verdict: a few failures here, every one
    # in --json.
    for r in failed[:_FAILED_SHOWN]:
        out.print(f"[red]failed[/red] {escape(_clip(f'{r.label}: {r.error}: {r.message}'))}")
    if len(failed) > _FAILED_SHOWN:
        out.print(f"... and {len(failed) - _FAILED_SHOWN} more failed calls (--json lists each)")
    style = "bold green" if served_all else "bold red"
    out.print(
        f"[{style}]{escape(verdict)}[/{style}] ({run.elapsed():.1f} s, {args.backend} backend)"
    )
    return 0 if served_all else 1


def _clip(text: str, width: int = 110) -> str:
    """One line of at most ``width`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1] + "…"


def _verdict(
    calls: dict[str, dict[str, Any]], failed: Sequence[CallResult], total: int, served_all: bool
) -> str:
    """One sentence: every call served, or how many failed and why."""
    if served_all:
        parts = ", ".join(f"{row['served']} {kind}" for kind, row in calls.items())
        return f"verdict: every call served ({parts}) despite 429s, 5xx and resets upstream"
    reasons: dict[str, int] = {}
    for r in failed:
        reasons[r.error or "unknown"] = reasons.get(r.error or "unknown", 0) + 1
    finished = sum(row["finished"] for row in calls.values())
    why = ", ".join(f"{n} {name}" for name, n in sorted(reasons.items()))
    unfinished = f", {total - finished} unfinished" if finished < total else ""
    return f"verdict: {len(failed)} of {total} calls failed ({why}{unfinished})"
