"""The chat, embedding and OCR clients run one loop implementation: RetryMW, and no copy of it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from _closing import closing

import polygateway
from polygateway import chat, embedding, ocr
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings
from polygateway.embedding import EmbeddingClient
from polygateway.middleware import retry
from polygateway.middleware.lifecycle import GovernedClient
from polygateway.middleware.retry import RetryMW
from polygateway.ocr import OcrClient
from polygateway.testing import FakeTransport

PACKAGE = Path(polygateway.__file__).resolve().parent

# What only a governance loop does: lease permits, meter the stall budget, back off.
LOOP_MARKERS = {
    "acquires permits": re.compile(r"backend\.acquire\("),
    "builds a StallClock": re.compile(r"\bStallClock\("),
    "computes a back-off": re.compile(r"\bbackoff_delay\("),
    "waits in the scope's queue": re.compile(r"\broom\.wait\("),
}


def _settings() -> GatewaySettings:
    """One scope of each kind."""

    def src(name: str, protocol: str) -> dict[str, Any]:
        return {"name": name, "protocol": protocol, "base_url": f"http://127.0.0.1:9/{name}"}

    return GatewaySettings(
        _env_file=None,
        scopes={
            "chat": {"kind": "chat", "sources": [src("c", "openai")]},
            "embed": {"kind": "embed", "sources": [src("e", "openai")]},
            "ocr": {
                "kind": "ocr",
                "sources": [src("m", "monkey_ocr"), src("v", "vision_ocr")],
            },
        },
    )


def test_every_client_runs_the_one_retry_mw() -> None:
    """Each client is a GovernedClient whose loop is exactly RetryMW, with its scope's 429 rule."""
    settings = _settings()
    backend = MemoryBackend()
    clients = [
        closing(ChatClient(settings, "chat", backend=backend, transport=FakeTransport())),
        closing(EmbeddingClient(settings, "embed", backend=backend, transport=FakeTransport())),
        closing(OcrClient(settings, "ocr", backend=backend, transport=FakeTransport())),
    ]
    for client in clients:
        assert isinstance(client, GovernedClient)
        assert type(client._mw) is RetryMW
    assert [c._mw.policy.exempt_429 for c in clients] == [True, False, False]
    assert {id(c._mw.backend) for c in clients} == {id(backend)}


def test_ocr_subset_loops_are_the_same_retry_mw() -> None:
    """The OCR client's loop over fewer sources (a PDF skips vision) is RetryMW too, same policy."""
    settings = _settings()
    client = closing(OcrClient(settings, "ocr", backend=MemoryBackend(), transport=FakeTransport()))
    monkey_only = client._loop_for(settings.scope("ocr").sources[:1])
    assert type(monkey_only) is RetryMW
    assert monkey_only is not client._mw
    assert monkey_only.sources == ("m",)
    assert monkey_only.policy is client._mw.policy
    assert monkey_only.backend is client._mw.backend


@pytest.mark.parametrize("module", [chat, embedding, ocr], ids=lambda m: m.__name__)
def test_client_modules_hold_no_loop_of_their_own(module: Any) -> None:
    """No client module acquires permits, meters stalls, backs off or polls by itself."""
    source = inspect.getsource(module)
    found = [what for what, pattern in LOOP_MARKERS.items() if pattern.search(source)]
    assert found == [], f"{module.__name__} {', '.join(found)}: that is the loop's job"


def test_only_retry_py_holds_the_loop() -> None:
    """Across the whole package, only middleware/retry.py runs a loop."""
    retry_path = Path(retry.__file__).resolve()
    offenders: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.resolve() == retry_path:
            continue
        if "backends" in path.relative_to(PACKAGE).parts:
            continue  # backends implement acquire; they do not call it in a loop
        text = path.read_text(encoding="utf-8")
        hits = [what for what, pattern in LOOP_MARKERS.items() if pattern.search(text)]
        if hits:
            offenders[str(path.relative_to(PACKAGE))] = hits
    assert offenders == {}
    retry_text = retry_path.read_text(encoding="utf-8")
    # The loop itself (stall clock, back-off, the acquire, waiting) is in retry.py only.
    assert [w for w, p in LOOP_MARKERS.items() if p.search(retry_text)] == list(LOOP_MARKERS)
