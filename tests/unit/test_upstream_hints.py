"""What the loop does with the limits an upstream announces: fake clock, scripted transport.

A success announcing a spent window pauses its source until the reset (no
429 is ever provoked); a failure's back-off is clamped to the stall window;
the final error keeps the latest back-off. ``tests/integration`` shows the
same over real sockets against the simulator's provider wires.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from _closing import closing

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.embedding import EmbeddingClient
from polygateway.errors import AllSourcesExhausted
from polygateway.testing import (
    BoundedSleep,
    FakeClock,
    FakeTransport,
    StreamScript,
    TransientError,
    WithHeaders,
    chat_chunk_events,
    chat_completion,
    embedding_body,
    gateway_settings,
)

MESSAGES = [{"role": "user", "content": "hi"}]
SPENT = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "2s"}
"""A success announcing that its requests window is spent for 2 s."""


def _chat(
    clock: FakeClock, script: Any, *sources: Any, default: Any = None, **gateway: Any
) -> ChatClient:
    settings = gateway_settings(*(sources or ("primary",)), **gateway)
    return closing(
        ChatClient(
            settings,
            backend=MemoryBackend(now=clock),
            transport=FakeTransport(script, clock=clock, default=default),
            now=clock,
            sleep=BoundedSleep(clock, max_calls=2000),
            rng=random.Random(3),
        )
    )


async def _paced_for(chat: ChatClient, source: str) -> float | None:
    snap = (await chat.backend.snapshot(chat.scope)).source(source)
    assert snap is not None
    return snap.paced_for_s


async def test_success_announcing_spent_requests_pauses_until_the_reset() -> None:
    """0 requests remaining with a 2 s reset: the next call waits 2 s, and no 429 is met."""
    clock = FakeClock()
    chat = _chat(clock, [WithHeaders(SPENT, chat_completion()), chat_completion()])
    await chat.complete(MESSAGES)
    assert await _paced_for(chat, "primary") == pytest.approx(2.0)
    before = clock()
    second = await chat.complete(MESSAGES)
    assert clock() - before == pytest.approx(2.0, abs=0.01)
    assert [a.outcome for a in second.attempts] == ["success"]


async def test_success_announcing_spent_window_sends_calls_elsewhere() -> None:
    """While the first source's window is spent, the next calls go to the second at once."""
    clock = FakeClock()
    script = {
        "a": [WithHeaders(SPENT, chat_completion())],
        "b": [chat_completion(), chat_completion()],
    }
    chat = _chat(clock, script, {"name": "a"}, {"name": "b", "priority": 1})
    started = clock()
    assert (await chat.complete(MESSAGES)).source == "a"
    for _ in range(2):
        assert (await chat.complete(MESSAGES)).source == "b"
    assert clock() == started


async def test_success_with_too_few_tokens_left_pauses() -> None:
    """Fewer tokens remaining than the call cost: paused until the tokens window resets."""
    clock = FakeClock()
    few = {"x-ratelimit-remaining-tokens": "3", "x-ratelimit-reset-tokens": "1.5s"}
    chat = _chat(clock, [WithHeaders(few, chat_completion())])
    await chat.complete(MESSAGES, max_tokens=64)
    assert await _paced_for(chat, "primary") == pytest.approx(1.5)


async def test_success_with_room_left_pauses_nothing() -> None:
    """Requests and tokens left: no pause."""
    clock = FakeClock()
    room = {"x-ratelimit-remaining-requests": "5", "x-ratelimit-reset-requests": "2s"}
    chat = _chat(clock, [WithHeaders(room, chat_completion())])
    await chat.complete(MESSAGES)
    assert await _paced_for(chat, "primary") is None


async def test_stream_announcing_spent_window_pauses() -> None:
    """A stream's opening headers are read as a plain answer's."""
    clock = FakeClock()
    chat = _chat(clock, [WithHeaders(SPENT, StreamScript(chat_chunk_events("hello there")))])
    async with chat.stream(MESSAGES) as stream:
        text = "".join([chunk.text async for chunk in stream])
    assert text == "hello there"
    assert await _paced_for(chat, "primary") == pytest.approx(2.0)


async def test_embedding_batch_announcing_spent_window_pauses() -> None:
    """Embedding batches read the same headers."""
    clock = FakeClock()
    settings = gateway_settings("primary", scope="embed", kind="embed")
    emb = closing(
        EmbeddingClient(
            settings,
            backend=MemoryBackend(now=clock),
            transport=FakeTransport(
                [WithHeaders(SPENT, embedding_body([[0.1], [0.2]]))], clock=clock
            ),
            now=clock,
            sleep=BoundedSleep(clock, max_calls=100),
            rng=random.Random(3),
        )
    )
    await emb.embed(["a", "b"])
    snap = (await emb.backend.snapshot("embed")).source("primary")
    assert snap is not None
    assert snap.paced_for_s == pytest.approx(2.0)


async def test_announced_pause_longer_than_the_stall_window_is_clamped() -> None:
    """A reset an hour away pauses for the stall window only."""
    clock = FakeClock()
    far = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1h"}
    chat = _chat(clock, [WithHeaders(far, chat_completion())], stall_window_s=60.0)
    await chat.complete(MESSAGES)
    assert await _paced_for(chat, "primary") == pytest.approx(60.0)


async def test_failure_hint_longer_than_the_stall_window_is_clamped_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 429 asking for an hour pauses its source for the stall window, and says so."""
    clock = FakeClock()
    script = {
        "a": [TransientError(status_code=429, retry_after_s=3600.0)],
        "b": [chat_completion()],
    }
    chat = _chat(clock, script, {"name": "a"}, {"name": "b", "priority": 1}, stall_window_s=120.0)
    with caplog.at_level("WARNING", logger="polygateway.retry"):
        await chat.complete(MESSAGES)
    assert await _paced_for(chat, "a") == pytest.approx(120.0)
    assert any("3600" in r.getMessage() for r in caplog.records)


async def test_stalled_error_keeps_the_latest_hint() -> None:
    """After a 429 storm the stalled error names the upstream's back-off, not ``None``."""
    clock = FakeClock()
    limited = TransientError(status_code=429, retry_after_s=1.0)
    chat = _chat(clock, [], default=limited, stall_window_s=10.0, poll_interval_s=0.5)
    with pytest.raises(AllSourcesExhausted) as caught:
        await chat.complete(MESSAGES)
    assert caught.value.reason == "stalled"
    assert caught.value.retry_after_s is not None
    assert 0.0 < caught.value.retry_after_s <= 1.0
