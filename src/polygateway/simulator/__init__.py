"""A fault-injecting simulated upstream: a real HTTP server on 127.0.0.1.

See research-wiki/ARCHITECTURE.md §7.

It speaks chat (JSON and SSE) and embeddings as one of five provider wires
per source (``FaultProfile.wire``: ``openai``, ``azure``, ``anthropic``,
``litellm``, ``vllm``; see research-wiki/guides/providers.md), and MonkeyOCR's
``/ocr/text`` and ``/parse``, for several sources on one server
(``{sim.url}/{source}/...``), each with its own ``FaultProfile``; it records
what it saw for tests and reports. It plays the upstream, so it imports
nothing of the governance stack. Needs the ``sim`` extra (starlette, uvicorn).

    async with SimulatedUpstream({"a": PROFILES["flaky"]}) as sim:
        base_url = sim.base_url("a")          # http://127.0.0.1:PORT/a/v1
        ...
        sim.stats("a").max_concurrent
"""

from __future__ import annotations

from polygateway.simulator.command import main
from polygateway.simulator.payloads import embedding_vector
from polygateway.simulator.profiles import PROFILES, WIRES, FaultProfile, Wire, get_profile
from polygateway.simulator.server import SimulatedUpstream, SimulatorNotRunning
from polygateway.simulator.stats import OUTCOMES, SourceStats, format_stats

__all__ = [
    "OUTCOMES",
    "PROFILES",
    "WIRES",
    "FaultProfile",
    "SimulatedUpstream",
    "SimulatorNotRunning",
    "SourceStats",
    "Wire",
    "embedding_vector",
    "format_stats",
    "get_profile",
    "main",
]
