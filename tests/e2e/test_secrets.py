"""Secrets: a recognisable fake key through every failure path, and it never shows.

An upstream that echoes the request's headers back (in error bodies, in
200s that say error, in broken JSON, in stream events) plays every way a
provider can fail while quoting the ``Authorization`` header; the simulator
plays the rest (resets, hangs, truncation, 5xx, 429). In process, everything
the library emits is captured: log records at DEBUG from every logger
(message, arguments, ``extra``, tracebacks), telemetry (``LoggingEmitter``,
``Recorder``, Prometheus exposition), and each error's message, repr,
notes, attempts and whole exception chain as ``--debug`` would print it.
Then the CLI, as a user runs it with ``--debug``, against the same
upstreams, and with a password-protected Redis. Neither the key, nor a
piece of it, nor the Redis password appears anywhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
import traceback
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cli_run import cli_command, cli_env
from prometheus_client import CollectorRegistry, generate_latest

from polygateway.backends.memory import MemoryBackend
from polygateway.backends.redis import RedisBackend
from polygateway.chat import ChatClient
from polygateway.cli.demo import tiny_png
from polygateway.config import GatewaySettings
from polygateway.embedding import EmbeddingClient
from polygateway.errors import GatewayError
from polygateway.middleware.telemetry import LoggingEmitter, PrometheusEmitter
from polygateway.ocr import OcrClient
from polygateway.simulator import FaultProfile, SimulatedUpstream
from polygateway.testing import Recorder

KEY = "sk-FAKE-pgw-e2e-7c1f3e9a0b2d4c6e"
KEY_ENV = "PGW_SECRETS_TEST_KEY"
# Pieces of the key a careless truncation or split could leave behind.
KEY_PIECES = (KEY, KEY[3:19], KEY[-16:], "7c1f3e9a0b2d")
REDIS_PASSWORD = "redis-pw-FAKE-91d3e7"
WRONG_PASSWORD = "wrong-pw-FAKE-5a0c2b"
BOUND_S = 20.0
CLI_BOUND_S = 60.0

# -- an upstream that quotes the request's headers back ---------------------------------

ECHO_MODES = (
    "s400",  # 400 quoting the Authorization header
    "s401",  # 401 quoting it
    "s429",  # 429 quoting it, Retry-After 0
    "s500",  # 500 quoting it
    "okbad",  # 200 whose body is not JSON and contains the key
    "okerr",  # 200 {"error": {"message": <key>}}
    "ocrfail",  # MonkeyOCR 200 {"success": false, "message": <key>}
    "streamerr",  # an event stream whose first event is an error quoting the key
    "reset",  # the connection dropped after the headers were read
)


def _head(status: int, content_type: str, length: int | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status} X", f"Content-Type: {content_type}", "Connection: close"]
    if status == 429:
        lines.append("Retry-After: 0")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@dataclass
class EchoUpstream:
    """A raw HTTP/1.1 server on 127.0.0.1 whose path says how it fails; one request a connection."""

    port: int = 0
    seen_keys: int = 0
    server: asyncio.Server | None = field(default=None, repr=False)

    async def __aenter__(self) -> EchoUpstream:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    def url(self, mode: str, openai: bool = True) -> str:
        """The base URL of a source failing as ``mode``."""
        return f"http://127.0.0.1:{self.port}/{mode}" + ("/v1" if openai else "")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            lines = head.split("\r\n")
            target = lines[0].split(" ")[1]
            headers = {k.lower(): v for k, _, v in (line.partition(": ") for line in lines[1:])}
            length = int(headers.get("content-length") or 0)
            if length:
                await reader.readexactly(length)
            auth = headers.get("authorization", "")
            if KEY in auth:
                self.seen_keys += 1
            await self._answer(writer, target.split("/")[1], auth, headers)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _answer(
        self, writer: asyncio.StreamWriter, mode: str, auth: str, headers: dict[str, str]
    ) -> None:
        quoted = f"invalid credentials {auth!r}; you sent {json.dumps(headers)}"
        if mode == "reset":
            writer.transport.abort()
            return
        if mode == "streamerr":
            writer.write(_head(200, "text/event-stream"))
            event = json.dumps({"error": {"message": quoted, "type": "server_error"}})
            writer.write(f"data: {event}\n\n".encode())
            await writer.drain()
            return
        status, body = {
            "s400": (400, {"error": {"message": quoted}}),
            "s401": (401, {"error": {"message": quoted}}),
            "s429": (429, {"error": {"message": quoted}}),
            "s500": (500, {"error": {"message": quoted}}),
            "okerr": (200, {"error": {"message": quoted}}),
            "ocrfail": (200, {"success": False, "message": quoted}),
        }.get(mode, (200, None))
        data = json.dumps(body).encode() if body is not None else b"{not json " + auth.encode()
        writer.write(_head(status, "application/json", len(data)) + data)
        await writer.drain()


# -- capturing everything ----------------------------------------------------------------


class Capture(logging.Handler):
    """Keeps every record whole: formatted text (traceback included) and its attributes."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
        self.texts: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(self.format(record))
        self.texts.append(repr(record.__dict__))


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Iterator[Capture]:
    """Every logger at DEBUG into one capture, for the duration of the test."""
    monkeypatch.setenv(KEY_ENV, KEY)
    handler = Capture()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def exception_texts(exc: BaseException) -> list[str]:
    """All an error shows: message, repr, notes, attempts, and the chain as --debug prints it."""
    texts = ["".join(traceback.format_exception(exc))]
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts += [str(current), repr(current), repr(current.args)]
        texts += list(getattr(current, "__notes__", []))
        texts += [repr(a) for a in getattr(current, "attempts", ())]
        current = current.__cause__ or current.__context__
    return texts


def assert_no_secret(texts: list[str], *extra: str) -> None:
    """No text contains the key, a piece of it, or any of ``extra``."""
    for text in texts:
        for secret in (*KEY_PIECES, *extra):
            assert secret not in text, f"secret {secret[:6]}... leaked in: {text[:500]}"


# -- in process --------------------------------------------------------------------------


def scope(kind: str, url: str, protocol: str = "openai") -> dict[str, Any]:
    """A one-source scope whose key comes from the environment."""
    return {
        "kind": kind,
        "sources": [
            {
                "name": "src",
                "protocol": protocol,
                "base_url": url,
                "model": "m",
                "api_key_env": KEY_ENV,
                "timeout_s": 0.3,
                "ttft_timeout_s": 0.3,
                "stream_idle_timeout_s": 0.3,
            }
        ],
    }


@pytest.fixture
async def upstreams() -> AsyncIterator[tuple[EchoUpstream, SimulatedUpstream]]:
    """The echoing upstream and the simulator with one source per fault."""
    faults = {
        "reset": FaultProfile(rate_reset=1.0),
        "hang": FaultProfile(rate_hang=1.0),
        "malformed": FaultProfile(rate_malformed=1.0),
        "errbody": FaultProfile(rate_error_body=1.0),
        "truncate": FaultProfile(rate_truncate=1.0),
        "fivexx": FaultProfile(rate_5xx=1.0),
        "ratelimit": FaultProfile(rate_429=1.0, retry_after_s=0.1),
    }
    async with EchoUpstream() as echo, SimulatedUpstream(faults) as sim:
        yield echo, sim


def all_scopes(echo: EchoUpstream, sim: SimulatedUpstream) -> dict[str, dict[str, Any]]:
    """A chat scope per fault, embed scopes, OCR scopes, and one that refuses connections."""
    scopes = {f"chat-{m}": scope("chat", echo.url(m)) for m in ECHO_MODES if m != "ocrfail"}
    scopes |= {f"chat-sim-{n}": scope("chat", sim.base_url(n)) for n in sim.sources}
    scopes["chat-refused"] = scope("chat", "http://127.0.0.1:9/v1")
    scopes |= {f"embed-{m}": scope("embed", echo.url(m)) for m in ("s400", "s500", "okbad")}
    scopes["ocr-fail"] = scope("ocr", echo.url("ocrfail", openai=False), "monkey_ocr")
    scopes["ocr-s401"] = scope("ocr", echo.url("s401", openai=False), "monkey_ocr")
    scopes["ocr-vision"] = scope("ocr", echo.url("s500"), "vision_ocr")
    return scopes


class Fanout:
    """Hands each attempt record to several emitters."""

    def __init__(self, *emitters: Any) -> None:
        self.emitters = emitters

    def emit_attempt(self, record: Any) -> None:
        for emitter in self.emitters:
            emitter.emit_attempt(record)


async def test_no_failure_path_shows_the_key_in_logs_telemetry_errors_or_reprs(
    captured: Capture, upstreams: tuple[EchoUpstream, SimulatedUpstream]
) -> None:
    """Every failure path, fully captured at DEBUG: the key is nowhere, though upstreams echo it."""
    echo, sim = upstreams
    settings = GatewaySettings(
        _env_file=None,
        scopes=all_scopes(echo, sim),  # type: ignore[arg-type]
        max_attempts=2,
        backoff_base_s=0.01,
        backoff_cap_s=0.02,
        stall_window_s=0.5,
        poll_interval_s=0.05,
    )
    recorder, registry = Recorder(), CollectorRegistry()
    emitter = Fanout(LoggingEmitter(), recorder, PrometheusEmitter(registry))
    texts: list[str] = [repr(settings), settings.model_dump_json(), str(settings.model_dump())]
    calls = 0
    errors: list[BaseException] = []
    classes = {"chat": ChatClient, "embed": EmbeddingClient, "ocr": OcrClient}
    for name, config in settings.scopes.items():
        backend = MemoryBackend()
        client = classes[config.kind](settings, name, backend=backend, emitter=emitter)
        texts += [repr(client), repr(client.backend)]
        async with client:
            calls += 1
            try:
                async with asyncio.timeout(BOUND_S):
                    if isinstance(client, ChatClient):
                        await client.complete([{"role": "user", "content": "hi"}])
                    elif isinstance(client, EmbeddingClient):
                        await client.embed(["a", "b"])
                    else:
                        await client.recognize_text(tiny_png())
            except GatewayError as exc:
                errors.append(exc)
            if isinstance(client, ChatClient):
                calls += 1
                try:
                    async with asyncio.timeout(BOUND_S):
                        async with client.stream([{"role": "user", "content": "hi"}]) as s:
                            texts.append(repr(s))
                            async for chunk in s:
                                texts.append(repr(chunk))
                except GatewayError as exc:
                    errors.append(exc)
        texts.append(repr(await backend.snapshot(name)))
    # Every path failed (but complete() at the truncating source: truncation cuts streams
    # only), and the key really went upstream to be echoed back.
    assert len(errors) == calls - 1
    assert echo.seen_keys >= 10
    for exc in errors:
        texts += exception_texts(exc)
    texts += [repr(r) for r in recorder.records]
    texts.append(generate_latest(registry).decode())
    texts += captured.texts
    assert any("invalid credentials" in t for t in texts), "the echoed bodies were quoted"
    assert_no_secret(texts)


async def test_redis_password_never_shows_in_backend_errors(
    captured: Capture, make_redis_server: Any
) -> None:
    """Wrong password, closed port: GovernanceBackendError says so without the password."""
    server = make_redis_server(password=REDIS_PASSWORD)
    texts: list[str] = []
    for url in (
        f"redis://:{WRONG_PASSWORD}@127.0.0.1:{server.port}/0",
        f"redis://user:{REDIS_PASSWORD}@127.0.0.1:9/0",
        f"redis://127.0.0.1:{server.port}/0?password={WRONG_PASSWORD}",
    ):
        backend = RedisBackend(url, socket_timeout_s=1.0)
        texts.append(repr(backend))
        try:
            with pytest.raises(GatewayError) as caught:
                await backend.progress_age_s("chat")
            texts += exception_texts(caught.value)
        finally:
            await backend.aclose()
    texts += captured.texts
    assert any("operation=progress_age_s" in t for t in texts)
    assert_no_secret(texts, REDIS_PASSWORD, WRONG_PASSWORD)


# -- the CLI as a user runs it -----------------------------------------------------------


def cli_config(echo: EchoUpstream, sim: SimulatedUpstream) -> str:
    """A settings file with the scopes the CLI runs use; the key comes from the environment."""
    # A short stall window: a source that answers 401 trips for breaker_cooldown_max_s, and a
    # call with no other source then waits out the window (300 s by default) before "stalled".
    parts = [
        "[gateway]\nmax_attempts = 2\nbackoff_base_s = 0.01\nbackoff_cap_s = 0.02\n"
        "stall_window_s = 2\npoll_interval_s = 0.1\n"
    ]
    wanted = {
        "chat-s401": ("chat", "openai", echo.url("s401")),
        "chat-s400": ("chat", "openai", echo.url("s400")),
        "chat-okbad": ("chat", "openai", echo.url("okbad")),
        "chat-streamerr": ("chat", "openai", echo.url("streamerr")),
        "chat-sim": ("chat", "openai", sim.base_url("truncate")),
        "embed": ("embed", "openai", echo.url("s500")),
        "ocr": ("ocr", "monkey_ocr", echo.url("ocrfail", openai=False)),
    }
    for name, (kind, protocol, url) in wanted.items():
        parts.append(
            f'[scopes.{name}]\nkind = "{kind}"\n[[scopes.{name}.sources]]\nname = "src"\n'
            f'protocol = "{protocol}"\nbase_url = "{url}"\nmodel = "m"\n'
            f'api_key_env = "{KEY_ENV}"\ntimeout_s = 2\nttft_timeout_s = 2\n'
        )
    return "\n".join(parts)


async def run_cli(cwd: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``python -m polygateway ARGS`` in ``cwd``; the exit code and everything it printed."""
    proc = await asyncio.create_subprocess_exec(
        *cli_command(*args),
        cwd=cwd,
        env=cli_env({KEY_ENV: KEY, **(env or {})}),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(CLI_BOUND_S):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode() + err.decode()


@pytest.mark.timeout(CLI_BOUND_S * 2)
async def test_cli_with_debug_never_prints_the_key_or_the_redis_password(
    tmp_path: Path,
    upstreams: tuple[EchoUpstream, SimulatedUpstream],
    make_redis_server: Any,
) -> None:
    """--debug on every failing command (tracebacks, debug log): no key, no Redis password."""
    echo, sim = upstreams
    (tmp_path / "polygateway.toml").write_text(cli_config(echo, sim))
    (tmp_path / "page.png").write_bytes(tiny_png())
    server = make_redis_server(password=REDIS_PASSWORD)
    good_redis = {
        "POLYGATEWAY_BACKEND": "redis",
        "POLYGATEWAY_REDIS_URL": f"redis://:{REDIS_PASSWORD}@127.0.0.1:{server.port}/0",
    }
    bad_redis = {
        "POLYGATEWAY_BACKEND": "redis",
        "POLYGATEWAY_REDIS_URL": f"redis://:{WRONG_PASSWORD}@127.0.0.1:{server.port}/0",
    }
    runs = [
        ((), ("chat", "--debug", "--scope", "chat-s401", "hello")),
        ((), ("chat", "--debug", "--scope", "chat-s400", "hello")),
        ((), ("chat", "--debug", "--scope", "chat-okbad", "hello")),
        ((), ("chat", "--debug", "--stream", "--scope", "chat-streamerr", "hello")),
        ((), ("chat", "--debug", "--stream", "--scope", "chat-sim", "hello")),
        ((), ("embed", "--debug", "--json", "a", "b")),
        ((), ("ocr", "--debug", "page.png")),
        ((), ("check-config", "--debug")),
        ((), ("check-config", "--debug", "--json")),
        (("good",), ("status", "--debug")),
        (("good",), ("chat", "--debug", "--scope", "chat-s401", "hello")),
        (("bad",), ("status", "--debug")),
        (("bad",), ("chat", "--debug", "--scope", "chat-s400", "hello")),
    ]
    environments = {"good": good_redis, "bad": bad_redis}
    results = await asyncio.gather(
        *(run_cli(tmp_path, *args, env=environments[env[0]] if env else None) for env, args in runs)
    )
    outputs = []
    for (env, args), (code, output) in zip(runs, results, strict=True):
        outputs.append(f"$ {' '.join(args)} [{env}] -> {code}\n{output}")
        if args[0] != "check-config" and not (args[0] == "status" and env == ("good",)):
            assert code != 0, outputs[-1]
    text = "\n".join(outputs)
    # The failures were real: tracebacks were printed, the upstream quoted the key back.
    assert "Traceback" in text
    assert echo.seen_keys >= 5
    assert "invalid credentials" in text or "rejected the request" in text
    assert_no_secret([text], REDIS_PASSWORD, WRONG_PASSWORD)
