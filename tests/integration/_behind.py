"""Waiting for what a ``RedisBackend`` writes behind.

``release`` sends its RELEASE and returns without its reply (the backend's
module docstring, "written behind"), so a test that reads the server right
after may read it before the script ran. One round trip more on the same
backend is answered only after every command sent before it: PROGRESS, which
runs a GET and nothing a test counts or reads besides.
"""

from __future__ import annotations

from polygateway.backends.base import AttemptOutcome, Lease
from polygateway.backends.redis import RedisBackend


async def settled(backend: RedisBackend, scope: str) -> None:
    """Return once every command ``backend`` sent before this call has run."""
    await backend.progress_age_s(scope)


async def released(backend: RedisBackend, lease: Lease, outcome: AttemptOutcome) -> None:
    """Release ``lease`` and return once the RELEASE has run on the server."""
    await backend.release(lease, outcome)
    await settled(backend, lease.scope)
