"""The Python snippets of README.md and the guides run as written, over real HTTP and Redis.

Each snippet is taken from the document as it is committed and executed:
against the simulator (a real HTTP server on 127.0.0.1) for the clients,
against the suite's redis-server for ``RedisBackend``. The README's TOML
blocks are the settings file, with only their ``base_url`` pointed at the
simulator. A fragment (first line ``# Fragment: ...``) runs inside async code
with the names its first line says it needs, as a reader would paste it.
"""

from __future__ import annotations

import ast
import asyncio
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import prometheus_client
import pytest

import polygateway
from polygateway import ChatClient, GatewaySettings
from polygateway.simulator import FaultProfile, SimulatedUpstream

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
OBSERVABILITY = (REPO / "research-wiki/guides/observability.md").read_text(encoding="utf-8")
REDIS_FLEET = (REPO / "research-wiki/guides/redis-fleet.md").read_text(encoding="utf-8")
KEYS = {"OPENAI_API_KEY": "sk-docs-openai-0123456789", "ANTHROPIC_API_KEY": "sk-ant-docs-0123"}
EMBED_SCOPE = """
[scopes.embed]
kind = "embed"
[[scopes.embed.sources]]
name = "embedder"
protocol = "openai"
base_url = "BASE"
model = "text-embedding-3-small"
api_key_env = "OPENAI_API_KEY"
max_batch_size = 4
"""
"""The embedding scope the README's embedding snippet names (polygateway.example.toml's)."""
TEXTS = [f"text number {i}" for i in range(10)]
MESSAGES = [{"role": "user", "content": "hi"}]


def blocks(text: str, lang: str) -> list[str]:
    """Every fenced ``lang`` block of a document, in order."""
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.DOTALL)


async def run_fragment(source: str, names: dict[str, Any]) -> dict[str, Any]:
    """Run a snippet as async code with ``names`` defined; its namespace afterwards."""
    assert source.startswith("# Fragment: "), source.splitlines()[0]
    namespace = dict(names)
    code = compile(source, "<doc snippet>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, namespace)
    if result is not None:
        await result
    return namespace


@pytest.fixture
async def sim() -> AsyncIterator[SimulatedUpstream]:
    """The README's sources, each on its provider's wire."""
    sources = {
        "primary": FaultProfile(api_key=KEYS["OPENAI_API_KEY"]),
        "claude": FaultProfile(wire="anthropic", api_key=KEYS["ANTHROPIC_API_KEY"]),
        "embedder": FaultProfile(api_key=KEYS["OPENAI_API_KEY"]),
    }
    async with SimulatedUpstream(sources) as upstream:
        yield upstream


@pytest.fixture
def settings_file(sim: SimulatedUpstream, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """README's ``polygateway.toml`` in the current directory, its sources on the simulator.

    The first TOML block with the priority block's classes added to its chat
    scope, and the embedding scope the embedding snippet uses.
    """
    first, priority = blocks(README, "toml")[:2]
    text = first.replace("https://api.example.com/v1", sim.base_url("primary"))
    text = text.replace("https://api.anthropic.com/v1", sim.base_url("claude", "anthropic"))
    head, classes = priority.split('kind = "chat"\n', 1)
    assert head == "[scopes.chat]\n"
    text = text.replace('kind = "chat"\n', 'kind = "chat"\n' + classes, 1)
    text += EMBED_SCOPE.replace("BASE", sim.base_url("embedder"))
    monkeypatch.chdir(tmp_path)
    for name, key in KEYS.items():
        monkeypatch.setenv(name, key)
    for name in [n for n in os.environ if n.startswith("POLYGATEWAY_")]:
        monkeypatch.delenv(name)
    path = tmp_path / "polygateway.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> prometheus_client.CollectorRegistry:
    """A fresh registry standing in for prometheus_client's default one during the test."""
    fresh = prometheus_client.CollectorRegistry()
    monkeypatch.setattr(prometheus_client, "REGISTRY", fresh)
    return fresh


async def test_readme_first_example_runs_as_a_script(
    settings_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first example, run as a script, completes a call and a stream with no error."""
    example = blocks(README, "python")[0]
    assert "asyncio.run(main())" in example
    await asyncio.to_thread(exec, compile(example, "README.md", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert "requeue" not in out
    assert re.search(r" (primary|claude) \d+\n", out), out


async def test_readme_fragments_run_with_the_names_they_ask_for(
    settings_file: Path, registry: prometheus_client.CollectorRegistry
) -> None:
    """Priority classes, stream and structured answers, partial embeddings: each fragment runs."""
    priority, answers, embedding = blocks(README, "python")[1:]
    settings = GatewaySettings.load("polygateway.toml")
    await run_fragment(priority, {"settings": settings, "messages": MESSAGES})
    async with ChatClient.from_settings(settings, scope="chat") as chat:
        done = await run_fragment(answers, {"chat": chat})
    assert done["final"].text
    assert done["r"].parsed is not None
    done = await run_fragment(embedding, {"settings": settings, "texts": TEXTS})
    assert len(done["vectors"]) == len(TEXTS)
    assert None not in done["vectors"]
    assert (
        registry.get_sample_value(
            "polygateway_calls_total",
            {"scope": "chat", "operation": "chat.complete", "outcome": "served"},
        )
        == 1.0
    )


async def test_observability_fragments_run(
    settings_file: Path,
    registry: prometheus_client.CollectorRegistry,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The guide's logging, Prometheus, several-emitters and propagation fragments run."""
    served: list[tuple[Any, ...]] = []
    monkeypatch.setattr(prometheus_client, "start_http_server", lambda *a, **k: served.append(a))
    logging_, prometheus, several, otel, propagate = blocks(OBSERVABILITY, "python")
    settings = GatewaySettings.load("polygateway.toml")
    names = {"settings": settings, **{n: getattr(polygateway, n) for n in polygateway.__all__}}
    clients = []
    for fragment in (logging_, several, propagate):
        clients.append((await run_fragment(fragment, names))["chat"])
    for chat in clients:
        await chat.complete(MESSAGES)
        await chat.aclose()
    assert prometheus.endswith("as chat:\n    ...\n")
    await run_fragment(
        prometheus.replace("    ...", "    await chat.complete(MESSAGES)"),
        {**names, "MESSAGES": MESSAGES},
    )
    assert served == [(9464,)]
    compile(otel, "observability.md", "exec")


async def test_redis_fleet_backend_snippet_runs(redis_url: str) -> None:
    """The guide's ``RedisBackend`` line builds a backend that answers on a real server."""
    (snippet,) = blocks(REDIS_FLEET, "python")
    namespace: dict[str, Any] = {}
    exec(snippet.replace("redis://127.0.0.1:6379/0", redis_url), namespace)
    backend = namespace["backend"]
    try:
        assert await backend.progress_age_s("chat") == float("inf")
    finally:
        await backend.aclose()
