"""The configurations measured: raw clients, the openai SDK, LiteLLM's Router, PolyGateway.

Each configuration is a ``Client`` that makes one chat call, one stream, or
one embedding job the way a careful user of that library would: JSON parsed,
status checked, the answer's text read. Every configuration sends the same
request body with the same ``Authorization`` header to the same simulator.
Imports of the libraries measured happen in ``start`` only, so a process
loads nothing but the configuration it measures.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

__all__ = ["CONFIGS", "Client", "Target", "available", "missing_modules"]

API_KEY = "sk-bench-not-a-secret"
MODEL = "sim-model"
MESSAGES: list[dict[str, str]] = [{"role": "user", "content": "Say hello to the benchmark."}]
MAX_TOKENS = 64
_HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@dataclass(frozen=True, slots=True)
class Target:
    """Where and how a configuration talks: the simulator, its sources, the scope's limits.

    Attributes:
        sim_url: the simulator's root URL.
        sources: simulator sources to use; single-URL clients use the first.
        scenario: chat, stream, scale, embed or storm (some configurations adapt to it).
        max_concurrency: PolyGateway's per-source ``max_concurrency`` (raw clients: pool size).
        redis_url: the private redis-server of the run, for the Redis backend.
        batch_size: embedding ``max_batch_size``.
    """

    sim_url: str
    sources: tuple[str, ...]
    scenario: str
    max_concurrency: int
    redis_url: str | None = None
    batch_size: int = 128

    def base_url(self, name: str | None = None) -> str:
        """The OpenAI base URL of a source (default: the first)."""
        return f"{self.sim_url}/{name or self.sources[0]}/v1"


class Client:
    """One configuration; subclasses implement what they support."""

    name: ClassVar[str] = ""
    modules: ClassVar[tuple[str, ...]] = ()
    """Top-level modules this configuration imports (to tell whether this venv can run it)."""
    governed: ClassVar[bool] = False
    """True when the library bounds its own concurrency (the harness bounds raw clients)."""

    async def start(self, target: Target) -> None:
        """Build the client (import the library, open pools)."""
        raise NotImplementedError

    async def chat(self) -> None:
        """One non-streamed chat completion; raises on failure."""
        raise NotImplementedError

    async def stream(self, started: float) -> tuple[float, int]:
        """One streamed completion; returns (first content chunk time - ``started``, chunks)."""
        raise NotImplementedError

    async def embed(self, texts: list[str], concurrency: int) -> int:
        """Embed ``texts`` in batches of ``target.batch_size``; returns the vectors received."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Close pools."""


def _chat_body(stream: bool = False) -> dict[str, Any]:
    """The request body every configuration sends."""
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS}
    if stream:
        body["stream"] = True
    return body


def _batches(texts: list[str], size: int) -> list[list[str]]:
    """``texts`` cut into consecutive batches of at most ``size``."""
    return [texts[i : i + size] for i in range(0, len(texts), size)]


def _content_of(event: dict[str, Any]) -> str:
    """The content delta of a chat.completion.chunk (empty when it has none)."""
    choices = event.get("choices") or ()
    if not choices:
        return ""
    return str((choices[0].get("delta") or {}).get("content") or "")


class RawHttpx(Client):
    """``httpx.AsyncClient`` POSTs with generous pool limits; JSON parsed by the caller."""

    name = "raw_httpx"
    modules = ("httpx",)

    async def start(self, target: Target) -> None:
        import httpx

        self._target = target
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        self._client = httpx.AsyncClient(
            limits=limits, timeout=httpx.Timeout(60.0), headers=_HEADERS
        )
        self._url = target.base_url() + "/chat/completions"
        self._emb_url = target.base_url() + "/embeddings"
        self._body = _chat_body()
        self._stream_body = _chat_body(stream=True)

    async def chat(self) -> None:
        response = await self._client.post(self._url, json=self._body)
        response.raise_for_status()
        data = response.json()
        if not data["choices"][0]["message"]["content"]:
            raise ValueError("empty answer")

    async def stream(self, started: float) -> tuple[float, int]:
        ttft = -1.0
        chunks = 0
        async with self._client.stream("POST", self._url, json=self._stream_body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                # Read on to the end of the body: a response left unread loses its connection.
                if payload == "[DONE]":
                    continue
                if _content_of(json.loads(payload)):
                    if ttft < 0:
                        ttft = time.perf_counter() - started
                    chunks += 1
        return ttft, chunks

    async def embed(self, texts: list[str], concurrency: int) -> int:
        gate = asyncio.Semaphore(concurrency)

        async def one(batch: list[str]) -> int:
            async with gate:
                response = await self._client.post(
                    self._emb_url, json={"model": MODEL, "input": batch}
                )
                response.raise_for_status()
                return len(response.json()["data"])

        done = await asyncio.gather(*(one(b) for b in _batches(texts, self._target.batch_size)))
        return sum(done)

    async def aclose(self) -> None:
        await self._client.aclose()


class RawAiohttp(Client):
    """``aiohttp.ClientSession`` POSTs, no connection limit: the floor."""

    name = "raw_aiohttp"
    modules = ("aiohttp",)

    async def start(self, target: Target) -> None:
        import aiohttp

        self._target = target
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=60.0),
            headers=_HEADERS,
        )
        self._url = target.base_url() + "/chat/completions"
        self._emb_url = target.base_url() + "/embeddings"
        self._body = _chat_body()
        self._stream_body = _chat_body(stream=True)

    async def chat(self) -> None:
        async with self._session.post(self._url, json=self._body) as response:
            response.raise_for_status()
            data = await response.json()
        if not data["choices"][0]["message"]["content"]:
            raise ValueError("empty answer")

    async def stream(self, started: float) -> tuple[float, int]:
        ttft = -1.0
        chunks = 0
        async with self._session.post(self._url, json=self._stream_body) as response:
            response.raise_for_status()
            async for raw in response.content:
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                # Read on to the end of the body: a response left unread loses its connection.
                if payload == "[DONE]":
                    continue
                if _content_of(json.loads(payload)):
                    if ttft < 0:
                        ttft = time.perf_counter() - started
                    chunks += 1
        return ttft, chunks

    async def embed(self, texts: list[str], concurrency: int) -> int:
        gate = asyncio.Semaphore(concurrency)

        async def one(batch: list[str]) -> int:
            async with (
                gate,
                self._session.post(self._emb_url, json={"model": MODEL, "input": batch}) as r,
            ):
                r.raise_for_status()
                return len((await r.json())["data"])

        done = await asyncio.gather(*(one(b) for b in _batches(texts, self._target.batch_size)))
        return sum(done)

    async def aclose(self) -> None:
        await self._session.close()


class OpenAISdk(Client):
    """``openai.AsyncOpenAI`` with its defaults (``max_retries=2``, its own httpx pool)."""

    name = "openai_sdk"
    modules = ("openai",)

    async def start(self, target: Target) -> None:
        import openai

        self._client = openai.AsyncOpenAI(base_url=target.base_url(), api_key=API_KEY)

    async def chat(self) -> None:
        completion = await self._client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
        )
        if not completion.choices[0].message.content:
            raise ValueError("empty answer")

    async def stream(self, started: float) -> tuple[float, int]:
        ttft = -1.0
        chunks = 0
        stream = await self._client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=MAX_TOKENS,
            stream=True,
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if ttft < 0:
                    ttft = time.perf_counter() - started
                chunks += 1
        return ttft, chunks

    async def aclose(self) -> None:
        await self._client.close()


class LiteLLMRouter(Client):
    """``litellm.Router``: one model name over two deployments, ``num_retries=2``."""

    name = "litellm_router"
    modules = ("litellm",)
    router_kwargs: ClassVar[dict[str, Any]] = {"num_retries": 2}

    async def start(self, target: Target) -> None:
        # Keep LiteLLM on this machine: the bundled cost map instead of a download.
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        os.environ.setdefault("LITELLM_LOG", "ERROR")
        import litellm

        litellm.telemetry = False
        litellm.suppress_debug_info = True
        model_list = [
            {
                "model_name": "bench",
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": target.base_url(name),
                    "api_key": API_KEY,
                },
            }
            for name in target.sources
        ]
        self._router = litellm.Router(model_list=model_list, **self.router_kwargs)

    async def chat(self) -> None:
        response = await self._router.acompletion(
            model="bench", messages=MESSAGES, max_tokens=MAX_TOKENS
        )
        if not response.choices[0].message.content:
            raise ValueError("empty answer")


class LiteLLMRouterDefault(LiteLLMRouter):
    """``litellm.Router`` over two deployments with its default settings."""

    name = "litellm_router_default"
    router_kwargs: ClassVar[dict[str, Any]] = {}


class _InstantTransport:
    """A transport that answers every request at once with a canned completion.

    With it, a PolyGateway call costs only the governance loop (and the
    backend's round trips): what PolyGateway adds on top of any HTTP client.
    """

    _ANSWER: ClassVar[dict[str, Any]] = {
        "id": "chatcmpl-instant",
        "object": "chat.completion",
        "created": 0,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello, benchmark."},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
    }

    async def send(self, request: Any) -> dict[str, Any]:
        """The canned answer, whatever was asked."""
        return self._ANSWER

    async def aclose(self) -> None:
        """Nothing to close."""


class PolyGateway(Client):
    """PolyGateway's ``ChatClient`` / ``EmbeddingClient`` on one backend and one transport."""

    name = ""
    modules: ClassVar[tuple[str, ...]] = ("polygateway",)
    governed = True
    backend: ClassVar[str] = "memory"
    transport: ClassVar[str] = "httpx"
    instant: ClassVar[bool] = False
    """Replace the HTTP transport by ``_InstantTransport`` (the governance loop alone)."""
    emitter: ClassVar[str] = ""
    """The telemetry emitter passed to the client (``_emitter``); none when empty."""

    async def start(self, target: Target) -> None:
        from pydantic import SecretStr

        from polygateway.config import GatewaySettings, ScopeConfig, SourceConfig

        self._target = target
        kind: Literal["chat", "embed"] = "embed" if target.scenario == "embed" else "chat"
        sources = tuple(
            SourceConfig(
                name=name,
                protocol="openai",
                base_url=target.base_url(name),
                model=MODEL,
                api_key=SecretStr(API_KEY),
                max_concurrency=target.max_concurrency,
                max_batch_size=target.batch_size,
                # Short texts: the token cap must not split batches below max_batch_size.
                max_batch_tokens=1_000_000,
            )
            for name in target.sources
        )
        extra: dict[str, Any] = {}
        if self.backend == "redis":
            if target.redis_url is None:
                raise ValueError("the Redis backend configurations need --redis-url")
            extra["redis_url"] = SecretStr(target.redis_url)
        settings = GatewaySettings(
            backend=self.backend,
            transport=self.transport,
            scopes={"bench": ScopeConfig(kind=kind, sources=sources)},
            _env_file=None,
            **extra,
        )
        if kind == "embed":
            from polygateway.embedding import EmbeddingClient

            self._emb = EmbeddingClient.from_settings(settings, "bench")
            self._client: Any = self._emb
        else:
            from polygateway.chat import ChatClient

            transport: Any = _InstantTransport() if self.instant else None
            emitters = [] if not self.emitter else [_emitter(self.emitter)]
            self._chat = ChatClient.from_settings(
                settings, "bench", transport=transport, emitters=emitters
            )
            self._client = self._chat

    async def chat(self) -> None:
        response = await self._chat.complete(MESSAGES, max_tokens=MAX_TOKENS)
        if not response.text:
            raise ValueError("empty answer")

    async def stream(self, started: float) -> tuple[float, int]:
        ttft = -1.0
        chunks = 0
        async with self._chat.stream(MESSAGES, max_tokens=MAX_TOKENS) as stream:
            async for chunk in stream:
                if chunk.text:
                    if ttft < 0:
                        ttft = time.perf_counter() - started
                    chunks += 1
        return ttft, chunks

    async def embed(self, texts: list[str], concurrency: int) -> int:
        # The client batches and bounds concurrency itself (max_concurrency per source).
        response = await self._emb.embed(texts)
        return len(response.vectors)

    async def aclose(self) -> None:
        backend = self._client.backend
        await self._client.aclose()
        # The shared backend outlives its clients by design; the benchmark owns it.
        await backend.aclose()


class PgwMemoryHttpx(PolyGateway):
    """PolyGateway, memory backend, httpx transport (the defaults)."""

    name = "pgw_memory_httpx"


class PgwMemoryAiohttp(PolyGateway):
    """PolyGateway, memory backend, aiohttp transport."""

    name = "pgw_memory_aiohttp"
    modules = ("polygateway", "aiohttp")
    transport = "aiohttp"


class PgwRedisHttpx(PolyGateway):
    """PolyGateway, Redis backend (a local redis-server), httpx transport."""

    name = "pgw_redis_httpx"
    modules = ("polygateway", "redis")
    backend = "redis"


class PgwRedisAiohttp(PolyGateway):
    """PolyGateway, Redis backend (a local redis-server), aiohttp transport."""

    name = "pgw_redis_aiohttp"
    modules = ("polygateway", "redis", "aiohttp")
    backend = "redis"
    transport = "aiohttp"


class PgwMemoryInstant(PolyGateway):
    """PolyGateway, memory backend, no network: the governance loop's own cost."""

    name = "pgw_memory_instant"
    instant = True


class PgwRedisInstant(PolyGateway):
    """PolyGateway, Redis backend, no upstream: the loop plus its two Redis round trips."""

    name = "pgw_redis_instant"
    modules = ("polygateway", "redis")
    backend = "redis"
    instant = True


class _BareEmitter:
    """An emitter that does nothing but is not ``NullEmitter``: what having any emitter costs."""

    def emit_attempt(self, record: Any) -> None:
        """Drop the record."""

    def emit_call(self, record: Any) -> None:
        """Drop the record."""


def _emitter(kind: str) -> Any:
    """A telemetry emitter as a user would turn it on, with nothing reading its output."""
    if kind == "null":
        from polygateway.middleware.telemetry import NullEmitter

        return NullEmitter()
    if kind == "bare":
        return _BareEmitter()
    if kind == "logging":
        import logging

        from polygateway import LoggingEmitter

        # The level off: served calls log at DEBUG, the logger's level is WARNING.
        logging.getLogger("polygateway.attempts").setLevel(logging.WARNING)
        return LoggingEmitter()
    if kind == "prometheus":
        from prometheus_client import CollectorRegistry

        from polygateway import PrometheusEmitter

        return PrometheusEmitter(CollectorRegistry())
    if kind == "otel_noop":
        from polygateway import OpenTelemetryEmitter

        return OpenTelemetryEmitter()  # the global providers: the API's no-ops, no SDK
    if kind == "otel_sdk":
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from polygateway import OpenTelemetryEmitter

        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
        meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
        return OpenTelemetryEmitter(tracer_provider, meter_provider)
    raise ValueError(f"unknown emitter {kind!r}")


class PgwInstantNull(PgwMemoryInstant):
    """The governance loop alone with ``NullEmitter`` passed explicitly."""

    name = "pgw_instant_null"
    emitter = "null"


class PgwInstantBare(PgwMemoryInstant):
    """The governance loop alone with an emitter that does nothing: the loop's cost of one."""

    name = "pgw_instant_bare"
    emitter = "bare"


class PgwInstantLogging(PgwMemoryInstant):
    """The governance loop alone with ``LoggingEmitter``, its level off."""

    name = "pgw_instant_logging"
    emitter = "logging"


class PgwInstantPrometheus(PgwMemoryInstant):
    """The governance loop alone with ``PrometheusEmitter`` on a registry of its own."""

    name = "pgw_instant_prometheus"
    modules = ("polygateway", "prometheus_client")
    emitter = "prometheus"


class PgwInstantOtelNoop(PgwMemoryInstant):
    """The governance loop alone with ``OpenTelemetryEmitter`` on the API's no-op providers."""

    name = "pgw_instant_otel_noop"
    modules = ("polygateway", "opentelemetry")
    emitter = "otel_noop"


class PgwInstantOtelSdk(PgwMemoryInstant):
    """The governance loop alone with ``OpenTelemetryEmitter`` on the SDK, in-memory exporters."""

    name = "pgw_instant_otel_sdk"
    modules = ("polygateway", "opentelemetry", "opentelemetry.sdk")
    emitter = "otel_sdk"


CONFIGS: dict[str, type[Client]] = {
    c.name: c
    for c in (
        RawHttpx,
        RawAiohttp,
        OpenAISdk,
        LiteLLMRouter,
        LiteLLMRouterDefault,
        PgwMemoryHttpx,
        PgwMemoryAiohttp,
        PgwRedisHttpx,
        PgwRedisAiohttp,
        PgwMemoryInstant,
        PgwRedisInstant,
        PgwInstantNull,
        PgwInstantBare,
        PgwInstantLogging,
        PgwInstantPrometheus,
        PgwInstantOtelNoop,
        PgwInstantOtelSdk,
    )
}
"""Every configuration, by name."""


def missing_modules(name: str) -> list[str]:
    """Modules configuration ``name`` needs that this interpreter cannot import."""
    return [m for m in CONFIGS[name].modules if importlib.util.find_spec(m) is None]


def available(name: str) -> bool:
    """Whether this interpreter can run configuration ``name``."""
    return not missing_modules(name)
