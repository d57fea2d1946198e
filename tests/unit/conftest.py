"""Unit-suite fixtures: the clients a test's helpers build are closed when it ends; the
settings tests' clean environment (``clean_environment``, asked for by their modules)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from _closing import close_all


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    """Close the clients handed to ``_closing.closing`` during the test."""
    yield
    await close_all()


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An empty directory (no stray .env), and no PolyGateway variable nor a key the
    settings tests name (``OPENAI_API_KEY``, ``EMBED_KEY``) set."""
    for name in list(os.environ):
        if name.upper().startswith("POLYGATEWAY_") or name in ("OPENAI_API_KEY", "EMBED_KEY"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
