"""Client lifecycle: closing (refuse, wait within grace, then cancel), and one shared
backend per settings object or Redis URL."""

from __future__ import annotations

import asyncio
import gc
import sys
import warnings
from typing import Any

import pytest
from _chat_clients import chat_on_clock, in_flight
from _closing import closing

from polygateway.backends import factory
from polygateway.backends.factory import shared_backend
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.config import ScopeKind
from polygateway.embedding import EmbeddingClient
from polygateway.errors import ConfigError, GatewayError
from polygateway.middleware.lifecycle import GovernedClient
from polygateway.middleware.waiting import room_for
from polygateway.ocr import OcrClient
from polygateway.testing import (
    Delay,
    FakeClock,
    FakeTimers,
    FakeTransport,
    Gate,
    StreamScript,
    chat_chunk_events,
    chat_completion,
    gateway_settings,
    settle,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def make_chat(
    clock: FakeClock, timers: FakeTimers, script: Any = (), **source: Any
) -> tuple[ChatClient, FakeTransport, MemoryBackend]:
    """A chat client with close_grace_s=10 on virtual time."""
    settings = gateway_settings({"name": "primary", **source}, close_grace_s=10)
    backend = MemoryBackend(now=clock)
    transport = FakeTransport(script, clock=clock, sleep=timers.sleep)
    chat = chat_on_clock(settings, backend, transport, clock, sleep=timers.sleep, seed=4)
    return chat, transport, backend


class TestClose:
    """aclose(): no new calls, in-flight calls get close_grace_s, then are cancelled."""

    async def test_closed_client_refuses_new_calls(self) -> None:
        """After aclose(), complete() raises GatewayError("client closed") without a request."""
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, FakeTimers(clock), [chat_completion()])
        await chat.aclose()
        with pytest.raises(GatewayError, match="client closed"):
            await chat.complete(MESSAGES)
        assert transport.requests == []
        assert chat.closed

    async def test_context_exit_closes_the_transport(self) -> None:
        """Leaving ``async with`` closes the client and its transport, once."""
        clock = FakeClock()
        chat, transport, _ = make_chat(clock, FakeTimers(clock), [chat_completion()])
        async with chat as entered:
            assert entered is chat
            assert (await chat.complete(MESSAGES)).text == "ok"
        assert transport.closed
        await chat.aclose()  # idempotent
        assert chat.closed

    async def test_call_finishing_within_the_grace_completes(self) -> None:
        """A call in flight that ends within close_grace_s returns its answer."""
        clock = FakeClock()
        timers = FakeTimers(clock)
        chat, transport, backend = make_chat(clock, timers, [Delay(4.0, chat_completion("done"))])
        call = asyncio.create_task(chat.complete(MESSAGES))
        await settle()
        closing = asyncio.create_task(chat.aclose())
        await settle()
        assert not closing.done()
        assert not transport.closed
        await timers.advance(4.0)
        assert (await call).text == "done"
        await closing
        assert transport.closed
        assert await in_flight(backend) == 0

    async def test_call_outliving_the_grace_is_cancelled(self) -> None:
        """A call still in flight after close_grace_s fails with GatewayError, permit freed."""
        clock = FakeClock()
        timers = FakeTimers(clock)
        gate = Gate()
        chat, transport, backend = make_chat(clock, timers, [gate])
        caller_task: list[asyncio.Task[Any]] = []

        async def caller() -> str:
            task = asyncio.current_task()
            assert task is not None
            caller_task.append(task)
            try:
                await chat.complete(MESSAGES)
            except GatewayError as exc:
                return str(exc)
            return "served"

        call = asyncio.create_task(caller())
        await gate.wait_entered()
        closing = asyncio.create_task(chat.aclose())
        await settle()
        await timers.advance(9.0)
        assert not call.done()
        await timers.advance(1.0)
        await closing
        assert "client closed" in await call
        assert caller_task[0].cancelling() == 0  # the caller's task is not left cancelled
        assert await in_flight(backend) == 0
        assert transport.closed

    async def test_waiting_call_is_cancelled_after_the_grace(self) -> None:
        """A call queued for a permit when the grace runs out leaves the queue with GatewayError."""
        clock = FakeClock()
        timers = FakeTimers(clock)
        gate = Gate()
        chat, _, backend = make_chat(clock, timers, [gate], max_concurrency=1)
        first = asyncio.create_task(chat.complete(MESSAGES))
        await gate.wait_entered()
        waiting = asyncio.create_task(chat.complete(MESSAGES))
        await settle()
        assert len(room_for(backend, "chat")) == 1
        closing = asyncio.create_task(chat.aclose())
        await settle()
        await timers.advance(10.0)
        await closing
        for task in (first, waiting):
            with pytest.raises(GatewayError, match="client closed"):
                await task
        assert room_for(backend, "chat").empty
        assert await in_flight(backend) == 0

    async def test_stream_between_chunks_fails_on_its_next_read(self) -> None:
        """A stream whose consumer idles past the grace gets GatewayError on its next read."""
        clock = FakeClock()
        timers = FakeTimers(clock)
        events = chat_chunk_events(["a", "b", "c"], role_first=False)
        chat, _, backend = make_chat(clock, timers, [StreamScript(events)])
        async with chat.stream(MESSAGES) as stream:
            iterator = aiter(stream)
            first = await anext(iterator)
            assert first.text == "a"
            closing = asyncio.create_task(chat.aclose())
            await settle()
            await timers.advance(10.0)
            with pytest.raises(GatewayError, match="client closed"):
                await anext(iterator)
            assert await in_flight(backend) == 0
        await timers.advance(10.0)
        await closing


class TestSharedBackend:
    """Clients built from one settings object share one backend."""

    def test_from_settings_twice_shares_one_backend(self) -> None:
        """Two clients from one settings object use the same backend; other settings do not."""
        settings = gateway_settings("a")
        one = closing(ChatClient.from_settings(settings, transport=FakeTransport()))
        two = closing(ChatClient.from_settings(settings, "chat", transport=FakeTransport()))
        other = closing(ChatClient.from_settings(gateway_settings("a"), transport=FakeTransport()))
        assert one.backend is two.backend
        assert isinstance(one.backend, MemoryBackend)
        assert other.backend is not one.backend
        assert one.scope == "chat"

    def test_memory_backend_is_forgotten_with_its_settings(self) -> None:
        """The factory keeps no settings object alive."""
        settings = gateway_settings("a")
        shared_backend(settings)
        key = id(settings)
        assert key in factory._MEMORY
        del settings
        gc.collect()
        assert key not in factory._MEMORY

    def test_redis_backend_is_shared_per_url(self) -> None:
        """Settings pointing at the same Redis URL get the same backend (one pool)."""
        url = "redis://:hunter2-password@127.0.0.1:6399/0"
        one = shared_backend(gateway_settings("a", backend="redis", redis_url=url))
        two = shared_backend(gateway_settings("b", backend="redis", redis_url=url))
        three = shared_backend(
            gateway_settings("a", backend="redis", redis_url="redis://127.0.0.1:6399/1")
        )
        assert one is two
        assert three is not one
        assert "hunter2" not in repr(one)

    def test_settings_with_another_socket_timeout_get_a_backend_of_their_own(self) -> None:
        """A URL shared with another socket timeout would silently run on the first one's."""
        url = "redis://127.0.0.1:6396/0"
        short = shared_backend(
            gateway_settings("a", backend="redis", redis_url=url, redis_socket_timeout_s=1.0)
        )
        same = shared_backend(
            gateway_settings("b", backend="redis", redis_url=url, redis_socket_timeout_s=1.0)
        )
        long = shared_backend(
            gateway_settings("a", backend="redis", redis_url=url, redis_socket_timeout_s=5.0)
        )
        assert same is short
        assert long is not short
        assert long._timeout_s == 5.0  # type: ignore[attr-defined]
        assert short._timeout_s == 1.0  # type: ignore[attr-defined]

    def test_redis_without_the_extra_is_a_config_error(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """backend="redis" without redis installed says which extra to install."""
        monkeypatch.setitem(sys.modules, "polygateway.backends.redis", None)
        settings = gateway_settings("a", backend="redis", redis_url="redis://127.0.0.1:6398/0")
        with pytest.raises(ConfigError, match=r"polygateway\[redis\]"):
            shared_backend(settings)


class TestUnclosedClientWarns:
    """A client collected while open warns, as aiohttp's ClientSession does; a closed one not."""

    @pytest.mark.parametrize("kind", ["chat", "embed", "ocr"])
    def test_client_collected_open_emits_a_resource_warning(self, kind: ScopeKind) -> None:
        """Never closed (used or not): a ResourceWarning naming the client, when it is collected."""
        client_type: type[GovernedClient] = {
            "chat": ChatClient,
            "embed": EmbeddingClient,
            "ocr": OcrClient,
        }[kind]
        settings = gateway_settings("a", scope=kind, kind=kind)
        client = client_type(settings, kind, backend=MemoryBackend(), transport=FakeTransport())
        # Reachable only from a garbage cycle, so it goes at the collection below, as a
        # leaked client goes whenever the collector runs.
        cycle: list[Any] = [client]
        cycle.append(cycle)
        del client, cycle
        with pytest.warns(ResourceWarning, match=f"unclosed client {client_type.__name__}") as seen:
            gc.collect()
        assert isinstance(seen[0].source, client_type)

    async def test_closed_client_is_collected_silently(self) -> None:
        """After aclose() (or async with), collecting the client warns nothing."""
        client = ChatClient(
            gateway_settings("a"), backend=MemoryBackend(), transport=FakeTransport()
        )
        async with client:
            pass
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            del client
            gc.collect()

    def test_client_whose_construction_failed_warns_nothing(self) -> None:
        """A constructor that raised (ConfigError) left nothing open to warn about."""
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ConfigError):
                ChatClient(gateway_settings("a", scope="embed", kind="embed"), "embed")
            gc.collect()
