"""The ``polygateway`` command line (also ``python -m polygateway``).

Sub-commands::

    demo           real traffic through the three clients against a misbehaving simulator
    simulate       serve the fault-injecting simulated upstream (polygateway.simulator)
    check-config   validate a settings file and show it, secrets masked
    status         a shared backend's live state per scope
    chat, embed, ocr   one call through a scope of a real configuration

``--json`` and ``--debug`` are global: accepted before or after the
sub-command. With ``--json`` every run prints exactly one JSON document on
stdout, success (``{"ok": true, ...}``) or failure (``{"ok": false, "error":
{"type", "message", "reason", ...}}``), and nothing else; ``status --watch``
prints one per refresh (a stream a script follows; ``status --json`` is one
snapshot). Without it, errors are one line on stderr (``error: ...``);
``--debug`` adds the traceback and the library's debug log.

Exit status: 0 success; 1 the call failed (or a file could not be read, or the
demo did not serve every call); 2 bad usage or bad settings; 130 interrupted;
141 stdout closed by its reader (``| head``), which ends the run quietly.
Nothing here imports rich, the simulator or the clients at import time: each
command loads what it needs, and says which extra to install when it is missing.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import NoReturn

from polygateway.cli.render import CliError, dump_json, error_json, print_error
from polygateway.errors import ConfigError, GatewayError

__all__ = [
    "EXIT_CONFIG",
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_PIPE_CLOSED",
    "build_parser",
    "file_name",
    "main",
    "positive_float",
    "positive_int",
    "refuse_usage",
]

EXIT_OK = 0
"""The command did what was asked."""

EXIT_FAILURE = 1
"""A call failed, a file could not be read, or the demo did not serve every call."""
EXIT_CONFIG = 2
"""Bad settings or bad usage (argparse uses 2 for usage errors too)."""
EXIT_INTERRUPTED = 130
"""Ctrl+C (128 + SIGINT, as shells report it)."""
EXIT_PIPE_CLOSED = 141
"""stdout's reader went away (128 + SIGPIPE, as a shell reports a tool ended by it)."""

Handler = Callable[[argparse.Namespace], int]


def _version() -> str:
    """The installed version, or a plain note when running from an uninstalled tree."""
    try:
        return metadata.version("polygateway")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


class UsageError(Exception):
    """A command line argparse refused; ``main`` reports it (as JSON under ``--json``).

    A command refuses its own arguments the same way, usage included, with
    ``refuse_usage`` (its sub-command parser's ``error``).
    """

    def __init__(self, message: str, usage: str, prog: str) -> None:
        super().__init__(message)
        self.usage = usage
        self.prog = prog


def refuse_usage(args: argparse.Namespace, message: str) -> NoReturn:
    """Refuse a command's arguments as argparse does: its usage, then ``message``; exit 2."""
    usage_error: Callable[[str], NoReturn] = args.usage_error
    usage_error(message)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are raised, so ``--json`` can report them too."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, self.format_usage(), self.prog)


_DEBUG_HELP = "show tracebacks and the library's debug log (logger 'polygateway') on stderr"
_JSON_HELP = "print exactly one JSON document on stdout, success or failure (for scripts)"


def _common() -> _Parser:
    """Options every sub-command takes; SUPPRESS keeps the global option's value when absent."""
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=_DEBUG_HELP)
    return common


def _config_options() -> _Parser:
    """Options of the sub-commands that read a settings file."""
    config = _Parser(add_help=False)
    config.add_argument(
        "--config",
        type=file_name,
        default="polygateway.toml",
        metavar="FILE",
        help="settings file (TOML; default: polygateway.toml)",
    )
    dotenv = config.add_mutually_exclusive_group()
    # None: the optional .env of the current directory; a file named here must exist.
    dotenv.add_argument(
        "--env-file",
        type=file_name,
        default=None,
        metavar="FILE",
        help="dotenv file read for POLYGATEWAY_* overrides and api_key_env (default: .env, "
        "if there is one)",
    )
    dotenv.add_argument(
        "--no-env-file", action="store_true", help="read no dotenv file, only the environment"
    )
    return config


def _json_option() -> _Parser:
    """``--json``: one machine-readable document on stdout instead of tables."""
    flag = _Parser(add_help=False)
    flag.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=_JSON_HELP)
    return flag


def _output_options(item: str) -> _Parser:
    """``--jsonl`` and ``--output``: where the results of a long job go (``cli/jobs.py``)."""
    out = _Parser(add_help=False)
    out.add_argument(
        "--jsonl",
        action="store_true",
        help=f"print one JSON object per input (its {item} or its error) on stdout, in input "
        "order; not with --json (use --json --output FILE)",
    )
    out.add_argument(
        "--output",
        "-o",
        type=file_name,
        default=None,
        metavar="FILE",
        help="write the JSON lines to FILE instead (stdout: nothing, or the --json summary)",
    )
    return out


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``polygateway`` with every sub-command."""
    from polygateway.cli.demo import add_demo_parser

    parser = _Parser(
        prog="polygateway",
        description="Governance for asyncio calls to LLM, embedding and OCR services.",
        epilog="`polygateway demo` shows what it is for, with nothing configured. "
        "Exit status: 0 ok, 1 the call failed, 2 bad usage or settings.",
    )
    parser.add_argument("--version", action="version", version=f"polygateway {_version()}")
    parser.add_argument("--json", action="store_true", help=_JSON_HELP)
    parser.add_argument("--debug", action="store_true", help=_DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common, config, as_json = _common(), _config_options(), _json_option()

    add_demo_parser(sub, [common, as_json])

    # `simulate` is handed whole to the simulator's own parser (see main); this entry
    # is only for the command list.
    sub.add_parser(
        "simulate",
        help="serve the fault-injecting simulated upstream (see `simulate --help`)",
        add_help=False,
    )

    check = sub.add_parser(
        "check-config",
        parents=[common, config, as_json],
        help="validate a settings file and show its scopes and sources, secrets masked",
        description="Validate a settings file (TOML, then POLYGATEWAY_* env and .env) and show "
        "every effective value, one block per source, with where it came from (the file, an "
        "environment variable, .env, or the default) and every secret masked. Exits 2 with the "
        "ConfigError message when anything is wrong, an extra the settings need (redis, "
        "aiohttp) included.",
    )
    check.set_defaults(handler=_lazy("check_config"), usage_error=check.error)

    status = sub.add_parser(
        "status",
        parents=[common, config, as_json],
        help="a shared (Redis) backend's live state: permits, breakers, pacing, AIMD, progress",
        description="Show a shared backend's live state per scope: permits in use, AIMD limits, "
        "breakers, pacing deadlines, rate buckets and progress age. A memory backend lives "
        "inside one process; status of it is shown by the process that owns it "
        "(`polygateway demo --status-every 2` shows the demo's own).",
    )
    status.add_argument(
        "--scope", action="append", default=[], help="a scope to show (repeatable; default all)"
    )
    status.add_argument(
        "--watch",
        type=positive_float,
        nargs="?",
        const=-1.0,  # commands.WATCH_AT_INTERVAL: imported lazily, as every command is
        default=None,
        metavar="SECONDS",
        help="keep showing it, refreshed every --interval (or SECONDS) until Ctrl+C: a live "
        "view on a terminal (Ctrl+C exits 130); with --json a stream of documents, one per "
        "refresh (Ctrl+C exits 0)",
    )
    status.add_argument(
        "--interval",
        type=positive_float,
        default=None,  # None: not given, so refused without --watch (commands.status)
        metavar="SECONDS",
        help="seconds between two refreshes of --watch (default 1)",
    )
    status.set_defaults(handler=_lazy("status"), usage_error=status.error)

    chat = sub.add_parser(
        "chat",
        parents=[common, config, as_json],
        help="one chat completion through a scope",
        description="Send one chat completion through a scope of the settings file, governed "
        "like any call (source choice, permits, rate limits, retries on another source), and "
        "print the answer on stdout; the serving source, attempts and tokens go to stderr. "
        "Exit 1 when the gateway cannot serve it (the error names the reason).",
    )
    chat.add_argument("prompt", nargs="*", help="the user message (default: read stdin)")
    chat.add_argument("--scope", default="chat", help="scope to use (default chat)")
    chat.add_argument("--system", default=None, help="a system message sent before the prompt")
    chat.add_argument(
        "--max-tokens",
        type=positive_int,
        default=256,
        metavar="N",
        help="most tokens the answer may have (default 256)",
    )
    chat.add_argument("--stream", action="store_true", help="stream the answer as it comes")
    chat.set_defaults(handler=_lazy("run_chat"), usage_error=chat.error)

    embed = sub.add_parser(
        "embed",
        parents=[common, config, as_json, _output_options("vector")],
        help="embed texts through a scope",
        description="Embed texts through a scope of the settings file: split into batches "
        "(max_batch_size, max_batch_tokens), each governed like any call, the vectors "
        "reassembled in input order. Prints a table of the first texts' first values; "
        "--jsonl (stdout) or --output FILE writes every vector as JSON lines, one object per "
        "text in input order. A progress bar shows on a terminal. When a batch cannot be "
        "served, every other vector is still written, the failed texts' lines say why, and "
        "the exit status is 1.",
    )
    embed.add_argument("texts", nargs="*", help="texts (default: one per line of --file or stdin)")
    embed.add_argument(
        "--file",
        type=file_name,
        default=None,
        metavar="FILE",
        help="read texts from FILE, one per line",
    )
    embed.add_argument("--scope", default="embed", help="scope to use (default embed)")
    embed.set_defaults(handler=_lazy("run_embed"), usage_error=embed.error)

    ocr = sub.add_parser(
        "ocr",
        parents=[common, config, as_json, _output_options("file's result")],
        help="OCR images or PDFs through a scope",
        description="Recognise the text of PNG, JPEG or PDF files through a scope of the "
        "settings file (MonkeyOCR or a vision model), or with --layout parse their layout into "
        "blocks and markdown (MonkeyOCR). One file: its text on stdout. Several: read "
        "concurrently with a progress bar on a terminal, each text under a '==> FILE <==' "
        "line, or as JSON lines with --jsonl / --output FILE, in input order. A file that "
        "fails does not stop the others; the exit status is then 1.",
    )
    ocr.add_argument(
        "files", nargs="+", type=file_name, metavar="FILE", help="PNG, JPEG or PDF files"
    )
    ocr.add_argument("--scope", default="ocr", help="scope to use (default ocr)")
    ocr.add_argument(
        "--layout", action="store_true", help="parse the layout (blocks, markdown) instead"
    )
    ocr.set_defaults(handler=_lazy("run_ocr"), usage_error=ocr.error)
    return parser


def _lazy(name: str) -> Handler:
    """A handler of ``commands`` resolved when it runs (the module is light, but stays lazy)."""

    def run(args: argparse.Namespace) -> int:
        from polygateway.cli import commands

        handler: Handler = getattr(commands, name)
        return handler(args)

    return run


def file_name(text: str) -> str:
    """An argparse type: a file name, not ``''`` (read as the current directory, or as no file)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file name, not an empty string")
    return text


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (inf seconds never pass; an inf scale overflows)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, not {text}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def _simulate(argv: Sequence[str]) -> int:
    """``polygateway simulate ...``: the simulator's own command line, argv handed over whole."""
    try:
        from polygateway.simulator.command import main as simulate_main
    except ImportError:
        print_error("the simulator needs the sim extra: pip install 'polygateway[sim]'")
        return EXIT_FAILURE
    return simulate_main(list(argv))


def _wants_json(argv: Sequence[str]) -> bool:
    """``--json`` among the options (before any ``--``), known even when parsing fails."""
    options = argv[: argv.index("--")] if "--" in argv else argv
    return "--json" in options


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    leading = 0
    while leading < len(args_list) and args_list[leading] in ("--json", "--debug"):
        leading += 1
    if args_list[leading : leading + 1] == ["simulate"]:
        # The simulator has its own options (and no JSON mode): it gets the rest whole.
        try:
            return _simulate(args_list[leading + 1 :])
        except BrokenPipeError:
            return _stdout_closed()
    as_json = _wants_json(args_list)
    try:
        args = build_parser().parse_args(args_list)
    except UsageError as exc:
        return _usage_failed(exc, as_json)
    debug: bool = args.debug
    if debug:
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        logging.getLogger("polygateway").setLevel(logging.DEBUG)
    handler: Handler = args.handler
    try:
        return handler(args)
    except UsageError as exc:
        return _usage_failed(exc, as_json)
    except BrokenPipeError:
        return _stdout_closed()
    except KeyboardInterrupt as exc:
        return _fail(exc, EXIT_INTERRUPTED, debug=False, as_json=as_json, message="interrupted")
    except ConfigError as exc:
        return _fail(exc, EXIT_CONFIG, debug=debug, as_json=as_json)
    except (GatewayError, CliError, OSError) as exc:
        return _fail(exc, EXIT_FAILURE, debug=debug, as_json=as_json)
    except Exception as exc:
        # The command line's outermost edge: a bug anywhere below must still end as one
        # line (with the traceback under --debug), never a raw traceback by default.
        message = f"{type(exc).__name__}: {exc} (run with --debug for the traceback)"
        return _fail(exc, EXIT_FAILURE, debug=debug, as_json=as_json, message=message)


def _usage_failed(exc: UsageError, as_json: bool) -> int:
    """A refused command line: argparse's usage and message, or its JSON document; exit 2."""
    if as_json:
        return _print_failure(exc, EXIT_CONFIG, as_json=True, message=f"{exc.prog}: {exc}")
    sys.stderr.write(exc.usage)
    sys.stderr.write(f"{exc.prog}: error: {exc}\n")
    return EXIT_CONFIG


def _fail(
    exc: BaseException, code: int, *, debug: bool, as_json: bool, message: str | None = None
) -> int:
    """Report ``exc`` (plus its traceback with ``--debug``) and return ``code``."""
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    return _print_failure(exc, code, as_json=as_json, message=message)


def _print_failure(exc: BaseException, code: int, *, as_json: bool, message: str | None) -> int:
    """The failure as one ``error:`` line on stderr, or as the run's one JSON document."""
    try:
        if as_json:
            error = error_json(exc)
            if message is not None:
                error["message"] = message
            dump_json({"ok": False, "error": error})
        else:
            print_error(message or str(exc) or type(exc).__name__)
    except BrokenPipeError:
        _stdout_closed()
    return code


def _stdout_closed() -> int:
    """stdout's reader is gone: say nothing more and keep Python's exit flush from failing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass  # stdout is not a file descriptor (a test's StringIO): nothing will flush it
    return EXIT_PIPE_CLOSED
