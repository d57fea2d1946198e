"""The simulator's command line: ``polygateway simulate`` (``cli.py`` delegates to ``main``).

Serves until SIGINT / SIGTERM (or ``--duration`` seconds), then prints what
each source saw. ``--wire`` makes every source imitate one provider
(``openai``, ``azure``, ``anthropic``, ``litellm``, ``vllm``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import fields, replace

from polygateway.simulator.profiles import PROFILES, WIRES, FaultProfile, Wire, get_profile
from polygateway.simulator.server import SimulatedUpstream
from polygateway.simulator.stats import format_stats

__all__ = ["build_parser", "main", "parse_sources"]


def build_parser(prog: str = "polygateway simulate") -> argparse.ArgumentParser:
    """The argument parser, public so ``polygateway``'s CLI can mount it as a sub-command."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a fault-injecting simulated upstream "
        "(OpenAI, Azure OpenAI, Anthropic, LiteLLM or vLLM wire; MonkeyOCR).",
    )
    parser.add_argument(
        "--profile",
        default="healthy",
        help=f"profile of every source named by --sources ({', '.join(PROFILES)}; default healthy)",
    )
    parser.add_argument("--sources", default="a", help="comma-separated source names (default: a)")
    parser.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=PROFILE",
        help="a source with its own profile; repeatable, added to --sources",
    )
    parser.add_argument(
        "--wire",
        default="openai",
        choices=WIRES,
        help="the provider every source imitates on the wire (default openai)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind (default: a free one)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault dice (default 0)")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    parser.add_argument(
        "--list-profiles", action="store_true", help="print the built-in profiles and exit"
    )
    return parser


def parse_sources(
    profile: str, names: str, extra: Sequence[str], wire: Wire = "openai"
) -> dict[str, FaultProfile]:
    """The sources the command line asks for: ``names`` share ``profile``, ``extra`` say theirs.

    Every source speaks ``wire``.
    """
    sources = {n.strip(): get_profile(profile) for n in names.split(",") if n.strip()}
    for item in extra:
        name, sep, prof = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--source wants NAME=PROFILE, not {item!r}")
        sources[name.strip()] = get_profile(prof.strip())
    if not sources:
        raise ValueError("no source to simulate")
    return {name: replace(p, wire=wire) for name, p in sources.items()}


def _describe(sim: SimulatedUpstream, name: str, profile: FaultProfile) -> str:
    """One line naming a source, its profile, its wire and the URLs a client configures."""
    kind = next(
        (k for k, p in PROFILES.items() if replace(p, wire=profile.wire) == profile), "custom"
    )
    ocr = sim.base_url(name, "monkey_ocr")
    wire = profile.wire
    if wire == "openai":
        return f"  {name} ({kind}): {sim.base_url(name)}  ocr: {ocr}"
    if wire == "anthropic":
        where = f"{sim.base_url(name, 'anthropic')}/messages"
    elif wire == "azure":
        where = (
            f"{sim.base_url(name, 'azure', deployment='DEPLOYMENT')}/chat/completions"
            "?api-version=VERSION"
        )
    else:
        where = sim.base_url(name)
    return f"  {name} ({kind}, {wire}): {where}  ocr: {ocr}"


async def _serve(sim: SimulatedUpstream, duration: float | None) -> None:
    """Serve until a stop signal or the end of ``duration``, then print the record."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        # Windows has no loop signal handlers; Ctrl+C still ends asyncio.run there.
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
            handled.append(sig)
    try:
        async with sim:
            print(f"PolyGateway simulator listening on {sim.url}", flush=True)
            for name, profile in sim.sources.items():
                print(_describe(sim, name, profile), flush=True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(duration):
                    await stop.wait()
            print(format_stats(sim.record.values()), flush=True)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the simulator from the command line; returns the process exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list_profiles:
        default = FaultProfile()
        for name, profile in PROFILES.items():
            changed = [
                f"{f.name}={getattr(profile, f.name)!r}"
                for f in fields(profile)
                if getattr(profile, f.name) != getattr(default, f.name)
            ]
            print(f"{name}: {', '.join(changed) or 'no delay, no fault'}")
        return 0
    try:
        sources = parse_sources(args.profile, args.sources, args.source, args.wire)
    except (KeyError, ValueError) as exc:
        parser.error(str(exc.args[0]) if exc.args else str(exc))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    sim = SimulatedUpstream(sources, host=args.host, port=args.port, seed=args.seed)
    try:
        asyncio.run(_serve(sim, args.duration))
    except OSError as exc:
        print(
            f"polygateway simulate: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr
        )
        return 1
    return 0
