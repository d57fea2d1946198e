"""The two-source chat client the telemetry tests share: an OpenAI primary, an Anthropic backup.

One failure opens the primary's breaker, so a failed attempt on it moves the
call to the backup: the shape of a call that fails over once.
"""

from __future__ import annotations

import random
from typing import Any

from _closing import closing

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.testing import BoundedSleep, FakeClock, FakeTransport, gateway_settings

__all__ = ["failover_chat"]


def failover_chat(
    clock: FakeClock, transport: FakeTransport, *emitters: Any, **gateway: Any
) -> ChatClient:
    """A chat client on ``clock`` whose requests go to ``transport``, with ``emitters``."""
    return closing(
        ChatClient(
            gateway_settings(
                {"name": "primary", "base_url": "https://llm.example.com/v1", "model": "big-1"},
                {
                    "name": "backup",
                    "protocol": "anthropic",
                    "base_url": "http://backup.internal:8080",
                    "model": "claude-x",
                    "priority": 1,
                },
                breaker_failures=1,
                **gateway,
            ),
            backend=MemoryBackend(now=clock),
            transport=transport,
            now=clock,
            sleep=BoundedSleep(clock, max_calls=200),
            rng=random.Random(3),
            emitters=list(emitters),
        )
    )
