"""Unit-suite fixtures: the clients a test's helpers build are closed when it ends."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from _closing import close_all


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    """Close the clients handed to ``_closing.closing`` during the test."""
    yield
    await close_all()
