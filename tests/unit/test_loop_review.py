"""Adversarial checks of the one governance loop: permits, deadlines, the stall budget, fairness.

Each test drives time with ``FakeClock`` (never a real sleep) and checks what
a caller relies on afterwards: no permit held, nobody left in the scope's
waiting room, and the reason the call ended with.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from _closing import closing

from polygateway.backends.base import AcquireResult, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import AllSourcesExhausted
from polygateway.middleware.waiting import room_for
from polygateway.testing import (
    BoundedSleep,
    FakeClock,
    FakeTransport,
    chat_completion,
    gateway_settings,
)
from polygateway.transport.http import HttpRequest

MESSAGES = [{"role": "user", "content": "hi"}]


def make_chat(
    clock: FakeClock,
    script: Any,
    *,
    backend: MemoryBackend,
    emitter: Any = None,
    sources: tuple[Any, ...] = ("primary",),
    **gateway: Any,
) -> tuple[ChatClient, FakeTransport]:
    """A chat client on a fake clock, a scripted transport and the given memory backend."""
    transport = FakeTransport(script, clock=clock)
    chat = closing(
        ChatClient(
            gateway_settings(*sources, **gateway),
            backend=backend,
            transport=transport,
            now=clock,
            sleep=BoundedSleep(clock, max_calls=2000),
            rng=random.Random(5),
            emitter=emitter,
        )
    )
    return chat, transport


class SlowAcquire(MemoryBackend):
    """A memory backend whose ``acquire`` takes ``delay_s`` of fake time (a slow shared store)."""

    __slots__ = ("clock", "delay_s")

    def __init__(self, clock: FakeClock, delay_s: float) -> None:
        super().__init__(now=clock)
        self.clock = clock
        self.delay_s = delay_s

    async def acquire(
        self,
        scope: str,
        candidates: Sequence[SourceSpec],
        *,
        cost_tokens: int = 0,
        ttl_s: float,
        priority_class: str = "",
    ) -> AcquireResult:
        await self.clock.sleep(self.delay_s)
        return await super().acquire(
            scope, candidates, cost_tokens=cost_tokens, ttl_s=ttl_s, priority_class=priority_class
        )


class TestDeadlineAroundAcquire:
    """``deadline_s`` is read again once a permit is granted: no attempt starts without time."""

    async def test_deadline_passed_during_acquire_sends_nothing_and_ends_deadline(self) -> None:
        """An acquire slower than the time left: no request, "deadline", the permit back."""
        clock = FakeClock()
        backend = SlowAcquire(clock, delay_s=2.0)
        sent: list[HttpRequest] = []

        def answer(request: HttpRequest) -> dict[str, Any]:
            sent.append(request)
            return chat_completion("late")

        chat, _ = make_chat(clock, [answer], backend=backend)
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES, deadline_s=1.0)
        assert caught.value.reason == "deadline"
        assert [r.timeout_s for r in sent] == []  # none sent, with no time left
        assert caught.value.attempts == ()
        assert (await backend.snapshot("chat")).in_flight == 0
        assert room_for(backend, "chat").empty
