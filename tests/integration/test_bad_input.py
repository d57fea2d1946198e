"""Bad input never crashes with anything but a typed ``GatewayError``.

Hypothesis writes settings files (wrong types, huge and non-finite numbers,
unicode, empty values, unknown keys, broken TOML) and request payloads
(messages, parameters, texts, uploads of every shape), and each one goes
through the real code path: ``GatewaySettings.load`` then the three clients'
construction, or a call against the simulator on 127.0.0.1 with both
transports. Whatever happens, the only exceptions allowed out are
``GatewayError`` subclasses: ``ConfigError`` for settings, ``RequestRejected``
(or a served answer) for payloads. An oversize OCR upload is refused before
anything is sent.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.cli.demo import tiny_pdf, tiny_png
from polygateway.config import GatewaySettings
from polygateway.embedding import EmbeddingClient
from polygateway.errors import ConfigError, GatewayError, RequestRejected
from polygateway.ocr import OcrClient
from polygateway.simulator import FaultProfile, SimulatedUpstream
from polygateway.testing import gateway_settings

KEY_ENV = "PGW_BAD_INPUT_KEY"
# Bounds one example's call, never a timing under test.
CALL_BOUND_S = 10.0
EXAMPLES = 60

# -- values of every kind ----------------------------------------------------------------

huge_numbers = st.sampled_from(
    [0, -1, 1, 2**31, 2**63, 10**30, 1e308, -1e308, 1e-308, math.inf, -math.inf, math.nan, 0.5]
)
texts = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", " ", "\u0000", "日本語", "\U0001f600", "a" * 5000, "\ud7ff", "redis://"]),
)
scalars = st.one_of(huge_numbers, texts, st.booleans(), st.integers(), st.floats())
json_values = st.recursive(
    st.one_of(st.none(), scalars),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)

# -- settings files ----------------------------------------------------------------------

GATEWAY_KEYS = [
    "backend",
    "redis_url",
    "redis_socket_timeout_s",
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
    "no_such_key",
]
SOURCE_KEYS = [
    "max_concurrency",
    "rpm",
    "rpm_burst",
    "tpm",
    "tpm_burst",
    "timeout_s",
    "ttft_timeout_s",
    "stream_idle_timeout_s",
    "connect_timeout_s",
    "priority",
    "weight",
    "headers",
    "verify",
    "proxy",
    "max_batch_size",
    "max_batch_tokens",
    "max_upload_bytes",
    "api_key",
    "model",
    "unknown_source_key",
]


def toml_value(value: Any) -> str:
    """A value as TOML (inline tables and arrays); TOML strings take JSON's escapes."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        items = (
            f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items() if v is not None
        )
        return "{" + ", ".join(items) + "}"
    return '""'  # TOML has no null


def toml_document(doc: Mapping[str, Any]) -> str:
    """A settings document as TOML text: one ``key = inline value`` line per top-level key."""
    return "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in doc.items())


@st.composite
def sources(draw: st.DrawFn) -> dict[str, Any]:
    """One source table: mostly plausible, with a few fields replaced by anything."""
    source: dict[str, Any] = {
        "name": draw(st.one_of(st.sampled_from(["a", "b", "src-1"]), texts)),
        "protocol": draw(st.one_of(st.sampled_from(["openai", "monkey_ocr", "vision_ocr"]), texts)),
        "base_url": draw(st.one_of(st.just("http://127.0.0.1:9/v1"), texts, st.just("ftp://x"))),
        "api_key_env": draw(st.sampled_from([KEY_ENV, "PGW_UNSET_VARIABLE", "1bad", ""])),
    }
    for key in draw(st.lists(st.sampled_from(SOURCE_KEYS), max_size=5, unique=True)):
        source[key] = draw(json_values)
    return source


@st.composite
def settings_documents(draw: st.DrawFn) -> dict[str, Any]:
    """A settings document: a [gateway] table and scopes, each part possibly wrong."""
    gateway = {
        key: draw(json_values)
        for key in draw(st.lists(st.sampled_from(GATEWAY_KEYS), max_size=5, unique=True))
    }
    scopes = {
        draw(st.one_of(st.sampled_from(["chat", "embed", "ocr"]), texts)): {
            "kind": draw(st.one_of(st.sampled_from(["chat", "embed", "ocr"]), texts)),
            "sources": draw(st.lists(sources(), max_size=3)),
            **({"exempt_429": draw(json_values)} if draw(st.booleans()) else {}),
        }
        for _ in range(draw(st.integers(0, 2)))
    }
    doc: dict[str, Any] = {}
    if gateway or draw(st.booleans()):
        doc["gateway"] = gateway
    if scopes or draw(st.booleans()):
        doc["scopes"] = scopes
    if draw(st.booleans()):
        doc[draw(texts)] = draw(json_values)
    return doc


def load_or_config_error(path: Path) -> GatewaySettings | None:
    """Load a file; ``None`` when it was refused with ``ConfigError``, the only error allowed."""
    try:
        return GatewaySettings.load(path, env_file=None)
    except ConfigError as exc:
        refused = exc
    assert str(refused), "a ConfigError says what is wrong"
    return None


async def build_every_client(loaded: GatewaySettings) -> None:
    """Build (then close) the client of each scope: only ``ConfigError`` may come out."""
    classes = {"chat": ChatClient, "embed": EmbeddingClient, "ocr": OcrClient}
    for name, scope in loaded.scopes.items():
        try:
            client = classes[scope.kind].from_settings(loaded, name, backend=MemoryBackend())
        except ConfigError:
            continue
        await client.aclose()


@pytest.fixture
def fuzz_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory for the generated files; the key variable some sources name is set."""
    monkeypatch.setenv(KEY_ENV, "sk-fuzz-not-a-real-key")
    return tmp_path


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(doc=settings_documents())
def test_generated_settings_files_load_or_raise_config_error(
    fuzz_dir: Path, doc: dict[str, Any]
) -> None:
    """Any settings file loads (and its clients build) or is refused with ConfigError."""
    path = fuzz_dir / "polygateway.toml"
    path.write_text(toml_document(doc), encoding="utf-8")
    loaded = load_or_config_error(path)
    if loaded is not None:
        asyncio.run(build_every_client(loaded))


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    raw=st.one_of(
        st.text(max_size=200),
        st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
        st.sampled_from(["[gateway", "[[scopes]]\n", "scopes = 1", "\ufeff[gateway]\n", "a = inf"]),
    )
)
def test_arbitrary_text_as_a_settings_file_is_a_config_error_or_settings(
    fuzz_dir: Path, raw: str
) -> None:
    """Text that is not even a settings document is refused with ConfigError, nothing else."""
    path = fuzz_dir / "polygateway.toml"
    path.write_bytes(raw.encode("utf-8", errors="surrogatepass"))
    loaded = load_or_config_error(path)
    assert loaded is None or isinstance(loaded, GatewaySettings)


# -- request payloads against a real server ----------------------------------------------


class NotJson:
    """An object no JSON encoder knows."""


weird_values = st.one_of(
    json_values,
    st.sampled_from([b"bytes", {1, 2}, NotJson(), math.nan, math.inf, "\ud800", 10**400]),
)
messages_like = st.one_of(
    weird_values,
    st.lists(
        st.one_of(
            weird_values,
            st.fixed_dictionaries(
                {"role": st.one_of(st.sampled_from(["user", "system", "assistant"]), weird_values)},
                optional={"content": weird_values, "name": weird_values},
            ),
        ),
        max_size=3,
    ),
)
chat_params = st.dictionaries(
    st.sampled_from(["max_tokens", "temperature", "stop", "tools", "stream_options", "n", "x"]),
    weird_values,
    max_size=3,
)


@dataclass
class Upstream:
    """The simulator and settings of chat, embed and OCR scopes on its one source ``a``."""

    sim: SimulatedUpstream
    settings: GatewaySettings


@pytest.fixture(params=["httpx", "aiohttp"])
async def upstream(request: pytest.FixtureRequest) -> AsyncIterator[Upstream]:
    """Chat, embed and OCR scopes on one simulator source, per transport."""
    async with SimulatedUpstream({"a": FaultProfile()}) as sim:
        common = {"name": "a", "timeout_s": 5.0, "max_upload_bytes": 4096}
        base = {
            "chat": sim.base_url("a"),
            "embed": sim.base_url("a"),
            "ocr": sim.base_url("a", "monkey_ocr"),
        }
        scopes = {
            kind: gateway_settings(
                {**common, "base_url": url},
                scope=kind,
                kind=kind,  # type: ignore[arg-type]
            ).scopes[kind]
            for kind, url in base.items()
        }
        yield Upstream(
            sim,
            GatewaySettings(
                _env_file=None,
                scopes=scopes,
                transport=request.param,
                max_attempts=2,
                backoff_base_s=0.01,
                backoff_cap_s=0.02,
            ),
        )


async def served_or_gateway_error(call: Any) -> Any:
    """Await ``call``: an answer, or ``None`` after a ``GatewayError``; anything else fails."""
    try:
        async with asyncio.timeout(CALL_BOUND_S):
            return await call
    except GatewayError as exc:
        failed = exc
    assert str(failed), "a GatewayError says what happened"
    assert repr(failed)
    return None


SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@SETTINGS
@given(messages=messages_like, params=chat_params)
async def test_chat_payloads_are_served_or_a_gateway_error(
    upstream: Upstream, messages: Any, params: dict[str, Any]
) -> None:
    """Any messages and parameters: an answer, or a GatewayError (plain and streamed)."""
    async with ChatClient(upstream.settings, "chat", backend=MemoryBackend()) as chat:
        await served_or_gateway_error(chat.complete(messages, **params))

        async def consume() -> list[Any]:
            async with chat.stream(messages, **params) as stream:
                return [chunk async for chunk in stream]

        await served_or_gateway_error(consume())


@SETTINGS
@given(
    texts=st.one_of(weird_values, st.lists(weird_values, max_size=4)),
    params=st.dictionaries(
        st.sampled_from(["encoding_format", "dimensions", "user"]), weird_values, max_size=2
    ),
)
async def test_embedding_payloads_are_served_or_a_gateway_error(
    upstream: Upstream, texts: Any, params: dict[str, Any]
) -> None:
    """Any texts and parameters: vectors, or a GatewayError."""
    async with EmbeddingClient(upstream.settings, "embed", backend=MemoryBackend()) as emb:
        result = await served_or_gateway_error(emb.embed(texts, **params))
    if result is not None:
        assert len(result.vectors) == len(texts)


@SETTINGS
@given(
    data=st.one_of(
        st.binary(max_size=64),
        st.binary(max_size=64).map(lambda b: tiny_png()[:16] + b),
        st.binary(max_size=64).map(lambda b: b"%PDF-1.4\n" + b),
        weird_values,
    ),
    filename=st.one_of(st.none(), texts, weird_values),
)
async def test_ocr_uploads_are_served_or_a_gateway_error(
    upstream: Upstream, data: Any, filename: Any
) -> None:
    """Any bytes (or not bytes) and file name: text, or a GatewayError."""
    async with OcrClient(upstream.settings, "ocr", backend=MemoryBackend()) as ocr:
        await served_or_gateway_error(ocr.recognize_text(data, filename))
        await served_or_gateway_error(ocr.parse_layout(data, filename))


# Values of a type the parameter checks refuse travel in extra_body, which is sent unchecked;
# both clients take extra_body and user.
NOT_JSON = [
    pytest.param({"extra_body": {"max_tokens": b"bytes"}}, id="bytes"),
    pytest.param({"extra_body": {"stop": {"a", "b"}}}, id="set"),
    pytest.param({"extra_body": {"temperature": math.nan}}, id="nan"),
    pytest.param({"extra_body": {"temperature": math.inf}}, id="inf"),
    pytest.param({"user": "\ud800"}, id="lone-surrogate"),
    pytest.param({"extra_body": {"metadata": NotJson()}}, id="object"),
]


@pytest.mark.parametrize("params", NOT_JSON)
async def test_a_body_json_cannot_carry_is_rejected_before_sending(
    upstream: Upstream, params: dict[str, Any]
) -> None:
    """Values JSON cannot carry are RequestRejected on both transports; nothing is sent."""
    async with ChatClient(upstream.settings, "chat", backend=MemoryBackend()) as chat:
        with pytest.raises(RequestRejected, match="not valid JSON"):
            await chat.complete([{"role": "user", "content": "hi"}], **params)
        with pytest.raises(RequestRejected, match="not valid JSON"):
            async with chat.stream([{"role": "user", "content": "hi"}], **params) as stream:
                [chunk async for chunk in stream]
        assert (await chat.backend.snapshot("chat")).in_flight == 0
    async with EmbeddingClient(upstream.settings, "embed", backend=MemoryBackend()) as emb:
        with pytest.raises(RequestRejected, match="not valid JSON"):
            await emb.embed(["hi"], **params)
    assert upstream.sim.stats("a").requests == 0


async def test_an_encoding_format_of_any_type_is_refused_not_a_crash(upstream: Upstream) -> None:
    """encoding_format as a list or dict is RequestRejected (it was a TypeError from hashing)."""
    async with EmbeddingClient(upstream.settings, "embed", backend=MemoryBackend()) as emb:
        for fmt in ([], {}, "base64", 1):
            with pytest.raises(RequestRejected, match="encoding_format"):
                await emb.embed(["hi"], encoding_format=fmt)
        assert (await emb.embed(["hi"], encoding_format="float")).vectors
    assert upstream.sim.stats("a").requests == 1


async def test_oversize_ocr_upload_is_refused_before_anything_is_sent() -> None:
    """An upload over every source's max_upload_bytes is RequestRejected; nothing is sent."""
    async with SimulatedUpstream({"a": FaultProfile()}) as sim:
        settings_ = gateway_settings(
            {"name": "a", "base_url": sim.base_url("a", "monkey_ocr"), "max_upload_bytes": 1024},
            scope="ocr",
            kind="ocr",
        )
        async with OcrClient(settings_, "ocr", backend=MemoryBackend()) as ocr:
            small = await ocr.recognize_text(tiny_png())
            assert small.text
            served = sim.stats("a").requests
            for upload in (tiny_png() + b"\0" * 2048, tiny_pdf() + b"\0" * 2048):
                with pytest.raises(RequestRejected, match="max_upload_bytes"):
                    await ocr.recognize_text(upload)
                with pytest.raises(RequestRejected, match="max_upload_bytes"):
                    await ocr.parse_layout(upload)
    assert sim.stats("a").requests == served
