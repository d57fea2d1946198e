"""``backend_env``: every backend under one fake clock, for the one backend contract suite.

Each parameter builds a fresh backend that reads ``clock`` (a ``FakeClock``
the tests advance). A new backend is added here as a new parameter, never by
copying a test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from polygateway.backends.base import Backend
from polygateway.backends.memory import MemoryBackend
from polygateway.backends.redis import RedisBackend
from polygateway.testing import FakeClock


@dataclass
class BackendEnv:
    """A backend and the fake clock it reads."""

    name: str
    backend: Backend
    clock: FakeClock


@pytest.fixture(params=["memory", "redis"])
async def backend_env(request: pytest.FixtureRequest) -> AsyncIterator[BackendEnv]:
    """A fresh backend of each kind, on a fake clock, closed after the test."""
    clock = FakeClock()
    name: str = request.param
    backend: Backend
    if name == "redis":
        backend = RedisBackend(request.getfixturevalue("redis_url"), now=clock)
    else:
        backend = MemoryBackend(now=clock)
    try:
        yield BackendEnv(name=name, backend=backend, clock=clock)
    finally:
        await backend.aclose()
