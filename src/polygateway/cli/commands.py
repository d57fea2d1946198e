"""The sub-commands that serve a real configuration: check-config, status, chat, embed, ocr.

Each handler takes the parsed arguments and returns the exit status; errors
are raised (``ConfigError``, ``GatewayError``, ``CliError``) and turned into
one line by ``polygateway.cli.main``. The clients are imported inside their
commands, so ``check-config`` and ``status`` need none of them.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polygateway.backends.base import Backend, ScopeSnapshot
from polygateway.backends.factory import shared_backend
from polygateway.cli import EXIT_INTERRUPTED, jobs, refuse_usage, render
from polygateway.cli.render import CliError
from polygateway.cli.settings_report import origins_json, report_lines, setting_rows
from polygateway.config import GatewaySettings
from polygateway.config.loading import file_layer, read_toml, value_origin
from polygateway.config.masking import scrub, url_secrets
from polygateway.errors import ConfigError

if TYPE_CHECKING:
    from polygateway.middleware.lifecycle import ClientParts, GovernedClient

__all__ = [
    "MEMORY_STATUS_NOTE",
    "WATCH_AT_INTERVAL",
    "WATCH_INTERVAL_S",
    "check_config",
    "env_file_of",
    "load_settings",
    "max_concurrency_of",
    "missing_extras",
    "run_chat",
    "run_embed",
    "run_ocr",
    "status",
]

MEMORY_STATUS_NOTE = (
    "a memory backend lives inside one process; its status is shown by the process that "
    "owns it (e.g. `polygateway demo --status-every 2`). `status` reads a shared backend: "
    'set backend = "redis" and redis_url in the [gateway] table'
)


def env_file_of(args: argparse.Namespace) -> str | None:
    """The dotenv file to read: none with ``--no-env-file``, else ``--env-file`` or ``.env``.

    ``.env`` is optional; a file named with ``--env-file`` must exist, or its
    overrides would be dropped without a word.
    """
    if args.no_env_file:
        return None
    if args.env_file is None:
        return ".env"
    if not Path(args.env_file).is_file():
        raise ConfigError("dotenv file not found (--env-file)", path=args.env_file)
    env_file: str = args.env_file
    return env_file


def load_settings(args: argparse.Namespace) -> GatewaySettings:
    """The settings named by ``--config`` (and ``--env-file``), validated."""
    return GatewaySettings.load(args.config, env_file=env_file_of(args))


def max_concurrency_of(settings: GatewaySettings, scope: str) -> dict[str, int]:
    """Each configured source's ``max_concurrency``, to show next to its AIMD limit."""
    config = settings.scopes.get(scope)
    return {} if config is None else {s.name: s.max_concurrency for s in config.sources}


# -- check-config ------------------------------------------------------------------------

_EXTRAS = (
    ("backend", "redis", "redis", "redis"),
    ("transport", "aiohttp", "aiohttp", "aiohttp"),
)
"""(setting, value, module it needs, extra that installs it)."""


def missing_extras(settings: GatewaySettings) -> list[tuple[str, str]]:
    """(field, problem) for each extra the settings need that cannot be imported."""
    missing = []
    for field, value, module, extra in _EXTRAS:
        if getattr(settings, field) != value:
            continue
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(
                (
                    field,
                    f"{field} = {value!r} needs the {extra} extra: "
                    f"pip install 'polygateway[{extra}]'",
                )
            )
    return missing


def check_config(args: argparse.Namespace) -> int:
    """Validate a settings file and show what it configures, secrets masked."""
    settings = load_settings(args)
    missing = missing_extras(settings)
    if missing:
        field, _ = missing[0]
        problems = "; ".join(problem for _, problem in missing)
        raise ConfigError(problems, field=field, path=str(args.config))
    if settings.backend == "redis":
        _check_redis_url(settings, args)
    summary = render.settings_summary(settings)
    n_sources = sum(len(scope["sources"]) for scope in summary["scopes"].values())
    verdict = f"ok: {args.config} is valid ({len(summary['scopes'])} scopes, {n_sources} sources)"
    shown = str(args.config)
    env_file = env_file_of(args)
    rows = setting_rows(settings, file_layer(read_toml(Path(shown), shown), shown), shown, env_file)
    if args.json:
        render.dump_json({"ok": True, "path": shown, **summary, "origins": origins_json(rows)})
        return 0
    for line in report_lines(rows):
        print(line)
    if not summary["scopes"]:
        print("no scopes configured")
    print(verdict)
    return 0


def _check_redis_url(settings: GatewaySettings, args: argparse.Namespace) -> None:
    """Refuse a ``redis_url`` the backend refuses (port, database, options), as every run would.

    The settings check its scheme only (they cannot import the backend); without
    this, ``check-config`` would call "ok" a URL every command then refuses.
    """
    from polygateway.backends.redis.endpoint import Endpoint

    url = settings.get_redis_url()
    try:
        Endpoint.from_url(url, connect_timeout_s=settings.redis_socket_timeout_s)
    except ValueError as exc:
        path, env = value_origin(
            "redis_url", str(args.config), env_file_of(args), settings_cls=GatewaySettings
        )
        raise ConfigError(
            f"invalid redis url {settings.redis_url_masked}: {scrub(str(exc), url_secrets(url))}",
            field="redis_url",
            path=path,
            env=env,
        ) from None


# -- status ------------------------------------------------------------------------------


def status(args: argparse.Namespace) -> int:
    """Show a shared backend's live state per scope, once or, with ``--watch``, until Ctrl+C.

    ``--watch`` on a terminal is the live view of ``cli/watch.py`` (Ctrl+C:
    exit 130, quietly). ``--watch --json`` is a stream, one document per
    refresh, for scripts that follow it; they end it with Ctrl+C, exit 0 (a
    single snapshot is ``status --json``). ``--watch`` into a pipe prints the
    tables once per refresh.
    """
    if args.interval is not None and args.watch is None:
        refuse_usage(args, "--interval is only read with --watch")
    if args.interval is not None and args.watch != WATCH_AT_INTERVAL:
        refuse_usage(args, "give --watch SECONDS or --watch --interval SECONDS, not both")
    settings = load_settings(args)
    if settings.backend == "memory":
        raise ConfigError(MEMORY_STATUS_NOTE, field="backend", path=str(args.config))
    scopes = list(args.scope) if args.scope else list(settings.scopes)
    if not scopes:
        raise ConfigError("no scope to show: the file configures none", path=str(args.config))
    for name in scopes:
        settings.scope(name)  # an unknown scope is a ConfigError listing the known ones
    every: float | None = None
    if args.watch is not None:
        every = args.watch
        if every == WATCH_AT_INTERVAL:
            every = WATCH_INTERVAL_S if args.interval is None else args.interval
    try:
        return asyncio.run(_status(settings, scopes, args.json, every))
    except KeyboardInterrupt:
        if every is None:
            raise
        return 0 if args.json else EXIT_INTERRUPTED  # Ctrl+C is how a watch ends: no error line


WATCH_AT_INTERVAL = -1.0
"""``--watch`` given without seconds: refresh every ``--interval`` seconds."""
WATCH_INTERVAL_S = 1.0
"""Seconds between two refreshes of ``--watch`` when neither it nor ``--interval`` says."""


async def _status(
    settings: GatewaySettings, scopes: Sequence[str], as_json: bool, watch: float | None
) -> int:
    """Read the snapshots (repeatedly when watching) and print them."""
    backend = shared_backend(settings)
    try:
        if as_json or watch is None or not render.has_rich() or not render.output().is_terminal:
            while True:
                snaps = [await backend.snapshot(name) for name in scopes]
                _print_status(settings, snaps, as_json)
                if watch is None:
                    return 0
                await asyncio.sleep(watch)
        from polygateway.cli.watch import watch_live

        await watch_live(
            settings, backend, scopes, watch, lambda scope: max_concurrency_of(settings, scope)
        )
        return 0
    finally:
        await backend.aclose()


def _print_status(settings: GatewaySettings, snaps: Sequence[ScopeSnapshot], as_json: bool) -> None:
    """One status report: a JSON document, or one table per scope."""
    if as_json:
        render.dump_json(
            {
                "ok": True,
                "backend": settings.backend,
                "redis_url": settings.redis_url_masked,
                "redis_where": settings.redis_where,
                "scopes": [
                    render.snapshot_json(s, max_concurrency_of(settings, s.scope)) for s in snaps
                ],
            }
        )
        return
    out = render.output()
    out.print(f"backend {settings.backend} at {settings.redis_where}")
    for snap in snaps:
        out.print(render.scope_status_table(snap, max_concurrency_of(settings, snap.scope)))
    if any(settings.scopes[s.scope].priority_classes for s in snaps if s.scope in settings.scopes):
        from polygateway.cli.watch import WAITING_NOTE

        # The backend is read from outside every process: their waiting rooms are not in it.
        out.print(WAITING_NOTE)


# -- chat / embed / ocr -------------------------------------------------------------------


@contextmanager
def _spinner(text: str, enabled: bool) -> Iterator[None]:
    """A spinner on stderr while a call runs, when a person is watching."""
    if not enabled or not sys.stderr.isatty() or not render.has_rich():
        yield
        return
    with render.console(stderr=True).status(text):
        yield


def _parts(args: argparse.Namespace) -> ClientParts:
    """The client's parts: under ``--debug``, every attempt logged (``polygateway.attempts``)."""
    if not args.debug:
        return {}
    from polygateway.middleware.telemetry import LoggingEmitter

    return {"emitter": LoggingEmitter()}


@asynccontextmanager
async def _closing_backend(client: GovernedClient) -> AsyncIterator[None]:
    """Close the shared backend after the client: a CLI run owns it (Redis: its pool)."""
    backend: Backend = client.backend
    try:
        async with client:
            yield
    finally:
        await backend.aclose()


def _read_input(file: str | None, waiting_for: str = "") -> str:
    """The text of ``file``, else of stdin; ``CliError`` naming it when it cannot be read.

    Stdin at a terminal waits for typing: ``waiting_for`` ("polygateway chat:
    reading the prompt") is said on stderr first, so that it is no silent hang.
    """
    where = file or "stdin"
    if file is None and waiting_for and sys.stdin.isatty():
        print(f"{waiting_for} from stdin (end with Ctrl-D)", file=sys.stderr, flush=True)
    try:
        return Path(file).read_text(encoding="utf-8") if file else sys.stdin.read()
    except OSError as exc:
        raise CliError(f"cannot read {where}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise CliError(
            f"cannot read {where}: not {exc.encoding.upper()} text (an undecodable byte at "
            f"offset {exc.start})"
        ) from None


def _read_text_arg(values: Sequence[str], file: str | None) -> list[str]:
    """Texts from the command line, else from ``--file`` or stdin, one per non-empty line."""
    if values:
        return list(values)
    text = _read_input(file, "polygateway embed: reading texts, one per line,")
    return [line for line in text.splitlines() if line.strip()]


def _attempts_json(attempts: Sequence[Any]) -> list[dict[str, Any]]:
    """Attempt records for ``--json`` (names, classes, status codes, timings: no secrets)."""
    return [asdict(a) for a in attempts]


def run_chat(args: argparse.Namespace) -> int:
    """One chat completion (or stream) through a configured scope."""
    settings = load_settings(args)
    prompt = (
        " ".join(args.prompt)
        if args.prompt
        else _read_input(None, "polygateway chat: reading the prompt")
    )
    if not prompt.strip():
        # No prompt is a missing argument (stdin only stands in for it): bad usage, exit 2.
        refuse_usage(args, "nothing to send: give a prompt or pipe one on stdin")
    messages: list[dict[str, Any]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": prompt})
    return asyncio.run(_chat(settings, args, messages))


async def _chat(
    settings: GatewaySettings, args: argparse.Namespace, messages: list[dict[str, Any]]
) -> int:
    from polygateway.chat import ChatClient

    client = ChatClient.from_settings(settings, scope=args.scope, **_parts(args))
    async with _closing_backend(client):
        if args.stream:
            pieces: list[str] = []
            source = ""
            finish: str | None = None
            async with client.stream(messages=messages, max_tokens=args.max_tokens) as stream:
                async for chunk in stream:
                    pieces.append(chunk.text)
                    source = chunk.source or source
                    finish = chunk.finish_reason or finish
                    if not args.json:
                        print(chunk.text, end="", flush=True)
            if args.json:
                text = "".join(pieces)
                render.dump_json(
                    {"ok": True, "text": text, "source": source, "finish_reason": finish}
                )
            else:
                print()
            return 0
        with _spinner(f"chat via scope {client.scope}", not args.json):
            r = await client.complete(messages=messages, max_tokens=args.max_tokens)
        if args.json:
            render.dump_json(
                {
                    "ok": True,
                    "text": r.text,
                    "source": r.source,
                    "finish_reason": r.finish_reason,
                    "tool_calls": [asdict(t) for t in r.tool_calls],
                    "usage": asdict(r.usage),
                    "attempts": _attempts_json(r.attempts),
                }
            )
        else:
            print(r.text)
            _note(f"source {r.source}, {len(r.attempts)} attempt(s), {r.usage.total_tokens} tokens")
    return 0


def run_embed(args: argparse.Namespace) -> int:
    """Embed texts through a configured scope (``cli/jobs.py``: progress, JSON lines)."""
    jobs.check_output_options(args)
    if args.texts and args.file:
        # Texts on the command line would win, and the file's be dropped without a word.
        refuse_usage(args, "give texts or --file FILE, not both")
    settings = load_settings(args)
    texts = _read_text_arg(args.texts, args.file)
    if not texts:
        if args.file:
            refuse_usage(args, f"nothing to embed: {args.file} has no text lines")
        refuse_usage(args, "nothing to embed: give texts, --file FILE or lines on stdin")
    return asyncio.run(jobs.embed_job(settings, args, texts, _parts(args)))


def run_ocr(args: argparse.Namespace) -> int:
    """Recognise the text of images (or parse documents' layout) through a configured scope.

    One file prints its text; several (or ``--jsonl`` / ``--output``) run as a
    job of ``cli/jobs.py``: concurrently, with a progress bar, results in input order.
    """
    jobs.check_output_options(args)
    settings = load_settings(args)
    if len(args.files) > 1 or jobs.wants_lines(args):
        return asyncio.run(jobs.ocr_job(settings, args, args.files, _parts(args)))
    (name,) = args.files
    try:
        data = Path(name).read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {name}: {exc.strerror}") from None
    return asyncio.run(_ocr(settings, args, name, data))


async def _ocr(settings: GatewaySettings, args: argparse.Namespace, name: str, data: bytes) -> int:
    from polygateway.ocr import OcrClient

    client = OcrClient.from_settings(settings, scope=args.scope, **_parts(args))
    spinning = _spinner(f"OCR of {name} via scope {client.scope}", not args.json)
    async with _closing_backend(client):
        if args.layout:
            with spinning:
                d = await client.parse_layout(data, filename=name)
            if args.json:
                render.dump_json(
                    {
                        "ok": True,
                        "markdown": d.markdown,
                        "source": d.source,
                        "blocks": [asdict(b) for b in d.blocks],
                        "attempts": _attempts_json(d.attempts),
                    }
                )
            else:
                print(d.markdown)
                _note(f"source {d.source}, {len(d.blocks)} block(s), {len(d.attempts)} attempt(s)")
            return 0
        with spinning:
            t = await client.recognize_text(data, filename=name)
    if args.json:
        render.dump_json(
            {"ok": True, "text": t.text, "source": t.source, "attempts": _attempts_json(t.attempts)}
        )
    else:
        print(t.text)
        _note(f"source {t.source}, {len(t.attempts)} attempt(s)")
    return 0


def _note(text: str) -> None:
    """A short line about the call on stderr, so stdout stays the answer alone."""
    print(text, file=sys.stderr, flush=True)
