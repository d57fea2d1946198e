"""Write ``polygateway.example.toml`` from the settings model (``make example-config``).

Every key of ``[gateway]`` (``GatewaySettings``), of a scope (``ScopeConfig``)
and of a source (``SourceConfig``) comes from the model in its field order,
with the model's default; the text here only adds what a key is for and the
example values of the first chat source. A field of the model without a line
here stops the script: a new setting cannot go undocumented.
``tests/unit/test_example_config.py`` fails when the committed file differs.

Usage: ``python tools/example_config.py [PATH]`` (default: print on stdout);
``--check PATH`` exits 1 when PATH is not what would be written.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic_core import PydanticUndefined

from polygateway.config import GatewaySettings
from polygateway.config.models import ScopeConfig, SourceConfig

HEADER = """\
# PolyGateway settings: the full shape, every key with its default or an example value.
# Generated from the settings model by `make example-config` (tools/example_config.py);
# a test fails when a key is missing here or its default differs, so edit the generator.
# Copy to polygateway.toml, check it with `polygateway check-config --config polygateway.toml`
# and load it with `GatewaySettings.load("polygateway.toml")`.
# Precedence (highest first): keyword arguments > POLYGATEWAY_* environment > .env > this file.
# Secrets never go here: name the environment variable that holds a key with `api_key_env`.
"""

GATEWAY_NOTES: dict[str, str] = {
    "backend": '"memory" (one process) or "redis" (a fleet shares one budget)',
    "redis_url": "backend redis; a password in it is masked when printed",
    "redis_socket_timeout_s": "a slower Redis operation fails (and the call fails closed)",
    "redis_mode": '"standalone", "cluster" (redis_url: any node) or "sentinel"',
    "redis_sentinels": 'sentinel mode: ["host:26379", ...]; redis_url = "redis://:PW@/DB"',
    "redis_sentinel_master": "sentinel mode: the name the Sentinels monitor the primary under",
    "redis_sentinel_password": "sentinel mode: the Sentinels' requirepass; better in the env",
    "redis_sentinel_username": "sentinel mode: their ACL user (AUTH user pw); needs the password",
    "redis_replica_acks": "replicas that must WAIT-acknowledge a grant; 0: off (not cluster)",
    "redis_replica_ack_timeout_s": "their deadline; 0: half of redis_socket_timeout_s",
    "transport": '"httpx" or "aiohttp" (the aiohttp extra)',
    "stall_window_s": "non-productive waiting per call (<= 3600)",
    "max_attempts": "failed attempts (429 excepted in chat) before retry_exhausted",
    "poll_interval_s": "between polls for a free source while waiting",
    "backoff_base_s": "first back-off after a failure; doubles, with jitter",
    "backoff_cap_s": "longest back-off",
    "breaker_failures": "consecutive failures that open a source's breaker",
    "breaker_cooldown_s": "first open period; doubles per consecutive trip",
    "breaker_cooldown_max_s": "longest open period",
    "lease_grace_s": "lease TTL = attempt timeout + grace; streams renew",
    "close_grace_s": "how long close() waits for calls in flight",
}

SCOPE_NOTES: dict[str, str] = {
    "kind": "chat | embed | ocr",
    "exempt_429": "default: true for chat, false for embed and ocr",
    "sources": "one [[scopes.NAME.sources]] table per source, below",
    "priority_classes": "none: one queue, arrival order; else shares (+ reserved floors)",
    "default_priority_class": "a call's class when it names none",
}

SOURCE_NOTES: dict[str, str] = {
    "name": "unique in its scope; letters, digits, _ - .",
    "protocol": "openai | anthropic (chat) | monkey_ocr | vision_ocr",
    "base_url": "without /chat/completions: calls append it",
    "model": "sent with every request",
    "api_key_env": "the NAME of the variable holding the key",
    "api_key": "",  # refused in a file: see API_KEY_NOTE
    "api_key_header": "the key's header, sent bare (Azure)",
    "query": "query parameters on every request (Azure: api-version)",
    "max_concurrency": "attempts in flight at once, fleet-wide",
    "rpm": "requests per minute (a token bucket)",
    "rpm_burst": "one second's worth when unset, at least 1",
    "tpm": "tokens per minute (estimated, then reconciled)",
    "tpm_burst": "one second's worth of tpm when unset",
    "timeout_s": "one non-streamed attempt",
    "ttft_timeout_s": "streams: request to first content chunk",
    "stream_idle_timeout_s": "streams: longest gap between chunks",
    "connect_timeout_s": "opening a connection",
    "priority": "lower tier first; weight splits load inside a tier",
    "weight": "share of the calls inside its priority tier",
    "headers": "extra headers (not Authorization)",
    "verify": "TLS verification, or a CA bundle path",
    "proxy": "http://, https:// or socks5:// URL; empty: none",
    "max_batch_size": "embed: inputs per request (OpenAI, Azure: 2048 at most)",
    "max_batch_tokens": "embed: estimated tokens per request",
    "max_upload_bytes": "ocr: largest upload this source takes",
    "max_output_tokens": "vision_ocr: max_tokens per transcription; unset: the server's",
}

API_KEY_NOTE = "# api_key: refused in a file; the key comes from the variable named by api_key_env"

CHAT_EXAMPLE: dict[str, Any] = {
    "name": "primary",
    "protocol": "openai",
    "base_url": "http://127.0.0.1:8001/v1",
    "model": "gpt-4o-mini",
    "api_key_env": "OPENAI_API_KEY",
    "api_key_header": "api-key",
    "rpm": 600,
    "rpm_burst": 10,
    "tpm": 100000,
    "tpm_burst": 2000,
    "headers": {"X-Org": "acme"},
    "max_output_tokens": 4096,
}
"""Example values of the first chat source where the default is none or says little."""

COMMENTED_OUT = frozenset({"api_key_header", "tpm_burst", "max_output_tokens"})
"""Example keys shown commented out: setting them changes behaviour most users do not want
(``max_output_tokens`` is refused on this example's openai source: vision_ocr only)."""

TAIL = """
# The same shape serves embeddings and OCR. Every failure, 429 included, is charged
# to max_attempts there (exempt_429 defaults to false).

[scopes.embed]
kind = "embed"
[[scopes.embed.sources]]
name = "embedder"
protocol = "openai"
base_url = "http://127.0.0.1:8002/v1"
model = "text-embedding-3-small"
api_key_env = "OPENAI_API_KEY"
max_concurrency = 4
max_batch_size = 64               # inputs per request (OpenAI, Azure: 2048 at most)
max_batch_tokens = 8000           # estimated tokens per request

[scopes.ocr]
kind = "ocr"
[[scopes.ocr.sources]]
name = "monkey"
protocol = "monkey_ocr"           # POST /ocr/text and /parse; no key needed on a private server
base_url = "http://127.0.0.1:8003"
max_concurrency = 2
timeout_s = 120
max_upload_bytes = 20000000
"""

_COMMENT_AT = 34
"""Column where a key's comment starts (when the key is shorter)."""


def model_default(model: type[BaseModel], name: str) -> Any:
    """The default of ``model.name`` as a TOML file spells it; ``None`` when unset or required."""
    info = model.model_fields[name]
    if info.default is PydanticUndefined and info.default_factory is None:
        return None
    value = info.get_default(call_default_factory=True)
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    return value


def toml_value(value: Any) -> str:
    """One value in TOML (the few types settings hold)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        inner = ", ".join(f"{toml_value(str(k))} = {toml_value(v)}" for k, v in value.items())
        return "{ " + inner + " }"
    raise TypeError(f"no TOML spelling for {type(value).__name__}")


def _line(key_text: str, note: str) -> str:
    """``key = value`` with its comment aligned."""
    if not note:
        return key_text
    return f"{key_text.ljust(_COMMENT_AT - 1)} # {note}"


def _fields(model: type[BaseModel], notes: Mapping[str, str]) -> list[str]:
    """The model's field names in order; a field without a note is a generator bug."""
    names = list(model.model_fields)
    missing = [name for name in names if name not in notes]
    if missing:
        raise SystemExit(
            f"tools/example_config.py: {model.__name__} has undocumented fields {missing}: "
            "add a line for each to its notes"
        )
    return names


def render() -> str:
    """The whole example file."""
    lines = [HEADER, "[gateway]"]
    for name in _fields(GatewaySettings, {**GATEWAY_NOTES, "scopes": ""}):
        if name == "scopes":
            continue
        lines.append(
            _line(
                f"{name} = {toml_value(model_default(GatewaySettings, name))}", GATEWAY_NOTES[name]
            )
        )
    lines += ["", "[scopes.chat]"]
    for name in _fields(ScopeConfig, SCOPE_NOTES):
        if name == "kind":
            lines.append(_line('kind = "chat"', SCOPE_NOTES[name]))
        elif name == "exempt_429":
            lines.append(_line("# exempt_429 = true", SCOPE_NOTES[name]))
        elif name == "default_priority_class":
            lines.append(_line('# default_priority_class = "interactive"', SCOPE_NOTES[name]))
        elif name == "priority_classes":
            lines.append(_line("# priority_classes = {}", SCOPE_NOTES[name]))
            lines.append(
                "#   e.g. [scopes.chat.priority_classes.interactive] share = 9, reserved = 2"
            )
            lines.append("#        [scopes.chat.priority_classes.batch]       share = 1")
    lines.append(_line("[[scopes.chat.sources]]", SCOPE_NOTES["sources"]))
    for name in _fields(SourceConfig, SOURCE_NOTES):
        if name == "api_key":
            lines.append(API_KEY_NOTE)
            continue
        default = model_default(SourceConfig, name)
        note = SOURCE_NOTES[name]
        if name in CHAT_EXAMPLE:
            value = CHAT_EXAMPLE[name]
            shown = "none" if default is None else toml_value(default)
            if name not in ("name", "protocol", "base_url"):
                note = f"{note} (default: {shown})"
            prefix = "# " if name in COMMENTED_OUT else ""
            lines.append(_line(f"{prefix}{name} = {toml_value(value)}", note))
        else:
            lines.append(_line(f"{name} = {toml_value(default)}", note))
    return "\n".join(lines) + "\n" + TAIL


def main(argv: list[str] | None = None) -> int:
    """Print the file, write it to PATH, or ``--check`` PATH against it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", help="where to write (default: stdout)")
    parser.add_argument("--check", action="store_true", help="exit 1 when PATH differs")
    args = parser.parse_args(argv)
    text = render()
    if args.path is None:
        sys.stdout.write(text)
        return 0
    path = Path(args.path)
    if args.check:
        if path.read_text(encoding="utf-8") != text:
            print(f"{path} is stale: run `make example-config`", file=sys.stderr)
            return 1
        return 0
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
