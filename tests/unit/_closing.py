"""Clients a unit test builds are closed when the test ends, as ``async with`` would close them.

An open client warns when it is collected (``ResourceWarning``, an error in
this suite), so every test helper that builds a client hands it to
``closing``; the autouse fixture of ``tests/unit/conftest.py`` closes it after
the test.
"""

from __future__ import annotations

from typing import TypeVar

from polygateway.middleware.lifecycle import GovernedClient

__all__ = ["close_all", "closing"]

C = TypeVar("C", bound=GovernedClient)

_OPEN: list[GovernedClient] = []


def closing(client: C) -> C:
    """``client``, to be closed at the end of the current test."""
    _OPEN.append(client)
    return client


async def close_all() -> None:
    """Close every client handed to ``closing`` since the last call, newest first."""
    while _OPEN:
        await _OPEN.pop().aclose()
