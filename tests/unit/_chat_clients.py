"""Chat clients on a fake clock for the chat unit tests, and the permits their scope holds.

``chat_on_clock`` builds the client the way every chat test file does (its
own settings, backend, transport and sleep; closed when the test ends);
``make_chat`` adds the usual settings, memory backend and scripted
transport, for the stream tests.
"""

from __future__ import annotations

import random
from typing import Any

from _closing import closing

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings
from polygateway.testing import BoundedSleep, FakeClock, FakeTransport, gateway_settings

__all__ = ["chat_on_clock", "in_flight", "make_chat"]


def chat_on_clock(
    settings: GatewaySettings,
    backend: Any,
    transport: Any,
    clock: FakeClock,
    *,
    seed: int,
    sleep: Any = None,
    max_sleeps: int = 1000,
    emitter: Any = None,
) -> ChatClient:
    """A ChatClient on ``clock`` (``random.Random(seed)`` for jitter), closed at test end.

    ``sleep`` defaults to a ``BoundedSleep`` on ``clock`` of at most ``max_sleeps`` calls,
    as most of these tests sleep.
    """
    return closing(
        ChatClient(
            settings,
            backend=backend,
            transport=transport,
            now=clock,
            sleep=sleep if sleep is not None else BoundedSleep(clock, max_calls=max_sleeps),
            rng=random.Random(seed),
            emitter=emitter,
        )
    )


def make_chat(
    clock: FakeClock,
    script: Any,
    *,
    sources: tuple[Any, ...] = ("primary",),
    backend: Any = None,
    sleep: Any = None,
    transport_sleep: Any = None,
    emitter: Any = None,
    seed: int = 5,
    max_sleeps: int = 1000,
    **gateway: Any,
) -> tuple[ChatClient, FakeTransport, Any]:
    """A chat client on a fake clock, a scripted transport and a memory backend."""
    settings = gateway_settings(*sources, **gateway)
    backend = backend if backend is not None else MemoryBackend(now=clock)
    transport = FakeTransport(script, clock=clock, sleep=transport_sleep)
    chat = chat_on_clock(
        settings,
        backend,
        transport,
        clock,
        seed=seed,
        sleep=sleep,
        max_sleeps=max_sleeps,
        emitter=emitter,
    )
    return chat, transport, backend


async def in_flight(backend: Any) -> int:
    """Permits held in the chat scope right now."""
    held: int = (await backend.snapshot("chat")).in_flight
    return held
