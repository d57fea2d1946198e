"""A task cancelled twice: once, then again ``turns`` loop turns later, while it unwinds.

Shared by the unit and socket stream tests (``tests/unit/test_stream_review.py``,
``tests/integration/test_stream_review_sockets.py``): the second cancellation
lands at a different point of the stream's close for each ``turns``, and
the caller must still get its ``CancelledError``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

__all__ = ["cancel_twice"]


async def cancel_twice(task: asyncio.Task[Any], turns: int) -> None:
    """Cancel ``task``, again after ``turns`` loop turns; it ends in CancelledError."""
    task.cancel()
    for _ in range(turns):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
