"""The failure table of research-wiki/ARCHITECTURE.md §2b, row by row: first as the pure mapping
(middleware/classify.py), then end to end through the real HttpxTransport over
httpx.MockTransport, checking what each class does to the loop and to shared state."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from _chat_clients import chat_on_clock

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import AllSourcesExhausted, RequestRejected
from polygateway.middleware.classify import FAILURE_TABLE, verdict_for
from polygateway.testing import (
    FakeClock,
    TransientError,
    chat_completion,
    gateway_settings,
)
from polygateway.transport.httpx_client import HttpxTransport

MESSAGES = [{"role": "user", "content": "hi"}]


# --- the pure table ---------------------------------------------------------------------


class TestTable:
    """verdict_for: the release outcome and the loop's move for each class."""

    def test_every_failure_class_has_exactly_one_row(self) -> None:
        """The table covers the four classes of models.FailureClass."""
        assert set(FAILURE_TABLE) == {
            "rate_limited",
            "transient",
            "source_misconfigured",
            "request_rejected",
        }

    @pytest.mark.parametrize("exempt", [True, False])
    def test_429_is_paced_decreases_and_is_free_only_when_exempt(self, exempt: bool) -> None:
        """429: rate_limited, AIMD decrease, Retry-After to the pacer, charged unless exempt."""
        verdict = verdict_for(TransientError(status_code=429, retry_after_s=2.0), exempt_429=exempt)
        assert verdict.outcome.kind == "rate_limited"
        assert verdict.outcome.aimd_decrease is True
        assert verdict.outcome.retry_after_s == 2.0
        assert verdict.charged is (not exempt)
        assert verdict.raises is False

    @pytest.mark.parametrize(
        ("status", "decrease"),
        [(408, False), (500, False), (502, False), (503, True), (504, False), (529, True)],
    )
    def test_transient_statuses_are_charged_breaker_failures(
        self, status: int, decrease: bool
    ) -> None:
        """408/5xx: transient, charged; AIMD decreases on 503 and 529 only."""
        verdict = verdict_for(TransientError(status_code=status), exempt_429=True)
        assert verdict.outcome.kind == "transient"
        assert verdict.outcome.aimd_decrease is decrease
        assert verdict.outcome.retry_after_s is None
        assert verdict.charged is True
        assert verdict.raises is False

    @pytest.mark.parametrize(
        ("error", "decrease"),
        [
            (TransientError("connect error", failure="transient"), False),
            (TransientError("connection reset", failure="transient"), False),
            (TransientError("read timed out", failure="transient", timeout=True), True),
            (TransientError("malformed body", failure="transient"), False),
        ],
    )
    def test_failures_without_an_answer_are_transient(
        self, error: TransientError, decrease: bool
    ) -> None:
        """No answer at all: transient and charged; a timeout also shrinks the AIMD limit."""
        verdict = verdict_for(error, exempt_429=True)
        assert verdict.outcome.kind == "transient"
        assert verdict.outcome.aimd_decrease is decrease
        assert verdict.charged is True

    @pytest.mark.parametrize("status", [401, 402, 403, 404])
    def test_auth_and_not_found_mean_the_source_is_misconfigured(self, status: int) -> None:
        """401/403/404: source_misconfigured (breaker trips long), charged, no AIMD step."""
        verdict = verdict_for(TransientError(status_code=status), exempt_429=True)
        assert verdict.outcome.kind == "source_misconfigured"
        assert verdict.outcome.aimd_decrease is False
        assert verdict.charged is True
        assert verdict.raises is False

    @pytest.mark.parametrize("status", [400, 413, 422, 418])
    def test_the_request_itself_is_rejected(self, status: int) -> None:
        """400/413/422 (and other 4xx): request_rejected, raised at once."""
        verdict = verdict_for(TransientError(status_code=status), exempt_429=True)
        assert verdict.outcome.kind == "request_rejected"
        assert verdict.raises is True
        assert verdict.outcome.aimd_decrease is False


# --- end to end through HttpxTransport ------------------------------------------------


Handler = Callable[[httpx.Request], Any]


def make_chat(
    clock: FakeClock, misbehave: Handler, **source_a: Any
) -> tuple[ChatClient, MemoryBackend, list[str]]:
    """Sources a (tier 0, answering with ``misbehave``) and b (tier 1, answering 200)."""
    settings = gateway_settings({"name": "a", **source_a}, {"name": "b", "priority": 1})
    sources = settings.scope("chat").sources
    calls: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        source = request.url.path.split("/")[1]
        calls.append(source)
        if source == "a":
            result = misbehave(request)
            if asyncio.iscoroutine(result):
                result = await result
            assert isinstance(result, httpx.Response)
            return result
        return httpx.Response(200, json=chat_completion("from b"))

    transport = HttpxTransport(
        sources, max_connections=4, mock_transport=httpx.MockTransport(handler)
    )
    backend = MemoryBackend(now=clock)
    chat = chat_on_clock(settings, backend, transport, clock, seed=9)
    return chat, backend, calls


async def state_of_a(backend: MemoryBackend) -> Any:
    snap = (await backend.snapshot("chat")).source("a")
    assert snap is not None
    return snap


def status(code: int, **headers: str) -> Handler:
    """A handler answering ``code`` with a small JSON error body."""
    return lambda request: httpx.Response(code, headers=headers, json={"error": "nope"})


def raising(exc: Exception) -> Handler:
    """A handler whose exchange fails with an httpx exception."""

    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    return handler


class TestThroughHttpx:
    """Each row of the table, from a real HTTP exchange to the loop and the backend."""

    async def test_429_with_retry_after_paces_a_while_b_serves(self) -> None:
        """429 + Retry-After: 2 -> rate_limited; a paced ~2 s, breaker untouched; b serves."""
        clock = FakeClock()
        chat, backend, calls = make_chat(clock, status(429, **{"Retry-After": "2"}))
        async with chat:
            response = await chat.complete(MESSAGES)
            assert response.source == "b"
            assert response.attempts[0].outcome == "rate_limited"
            assert response.attempts[0].status_code == 429
            a = await state_of_a(backend)
            # Paced for 2 s from the 429; the back-off before b served has used some of it.
            assert a.paced_for_s is not None
            assert 1.0 < a.paced_for_s <= 2.0
            assert a.consecutive_failures == 0
            assert a.limit < 8
            assert calls == ["a", "b"]

    @pytest.mark.parametrize(
        ("code", "decrease"),
        [(408, False), (500, False), (502, False), (503, True), (504, False), (529, True)],
    )
    async def test_transient_statuses_fail_over_and_count_against_the_breaker(
        self, code: int, decrease: bool
    ) -> None:
        """408/5xx -> transient: a breaker failure, AIMD down on 503/529 only; b serves."""
        clock = FakeClock()
        chat, backend, _ = make_chat(clock, status(code))
        async with chat:
            response = await chat.complete(MESSAGES)
            assert response.source == "b"
            assert response.attempts[0].outcome == "transient"
            a = await state_of_a(backend)
            assert a.consecutive_failures == 1
            assert (a.limit < 8) is decrease

    @pytest.mark.parametrize(
        ("exc", "decrease"),
        [
            (httpx.ConnectError("refused"), False),
            (httpx.RemoteProtocolError("peer closed connection"), False),
            (httpx.ReadTimeout("read timed out"), True),
            # What httpx lets through when anyio's connect fails with a non-OSError.
            (ExceptionGroup("in a TaskGroup", [OverflowError("port must be 0-65535")]), False),
        ],
    )
    async def test_network_failures_are_transient(self, exc: Exception, decrease: bool) -> None:
        """Connect error (grouped too), reset, read timeout -> transient; a timeout shrinks AIMD."""
        clock = FakeClock()
        chat, backend, _ = make_chat(clock, raising(exc))
        async with chat:
            response = await chat.complete(MESSAGES)
            assert response.source == "b"
            assert response.attempts[0].outcome == "transient"
            assert response.attempts[0].status_code is None
            a = await state_of_a(backend)
            assert a.consecutive_failures == 1
            assert (a.limit < 8) is decrease

    async def test_exceeding_timeout_s_is_a_transient_timeout(self) -> None:
        """An answer slower than timeout_s -> transient timeout (AIMD down); b serves."""
        clock = FakeClock()
        never = asyncio.Event()

        async def slow(request: httpx.Request) -> httpx.Response:
            await never.wait()
            return httpx.Response(200, json=chat_completion())

        chat, backend, _ = make_chat(clock, slow, timeout_s=0.05)
        async with chat:
            response = await chat.complete(MESSAGES)
            assert response.source == "b"
            assert response.attempts[0].outcome == "transient"
            a = await state_of_a(backend)
            assert a.limit < 8

    @pytest.mark.parametrize(
        "answer",
        [
            lambda request: httpx.Response(200, text="<html>not json</html>"),
            lambda request: httpx.Response(200, json={"object": "something else"}),
        ],
        ids=["not-json", "wrong-shape"],
    )
    async def test_malformed_body_is_transient(self, answer: Handler) -> None:
        """A 200 that is not a chat completion -> transient, charged; b serves."""
        clock = FakeClock()
        chat, backend, _ = make_chat(clock, answer)
        async with chat:
            response = await chat.complete(MESSAGES)
            assert response.source == "b"
            assert response.attempts[0].outcome == "transient"
            assert (await state_of_a(backend)).consecutive_failures == 1

    @pytest.mark.parametrize("code", [401, 403, 404])
    async def test_misconfigured_source_trips_long(self, code: int) -> None:
        """401/403/404 -> source_misconfigured: a's breaker opens for cooldown_max_s; b serves."""
        clock = FakeClock()
        chat, backend, _ = make_chat(clock, status(code))
        async with chat:
            response = await chat.complete(MESSAGES)
            assert response.source == "b"
            assert response.attempts[0].outcome == "source_misconfigured"
            a = await state_of_a(backend)
            assert a.breaker == "open"
            assert a.reopen_in_s == pytest.approx(300, abs=1.0)  # minus the back-off before b

    async def test_429_insufficient_quota_means_the_source_is_misconfigured(self) -> None:
        """OpenAI's out-of-credit 429 is no pace: a trips long, b serves at once, AIMD untouched.

        Waiting does not help an account with no credit, so pacing it (and, with one
        source, waiting out the stall budget) would only delay the failure.
        """
        body = {
            "error": {
                "message": "You exceeded your current quota, please check your plan and "
                "billing details.",
                "type": "insufficient_quota",
                "param": None,
                "code": "insufficient_quota",
            }
        }
        clock = FakeClock()
        answer: Handler = lambda request: httpx.Response(429, json=body)  # noqa: E731
        chat, backend, calls = make_chat(clock, answer)
        async with chat:
            response = await chat.complete(MESSAGES)
            assert response.source == "b"
            assert response.attempts[0].outcome == "source_misconfigured"
            assert response.attempts[0].status_code == 429
            a = await state_of_a(backend)
            assert a.breaker == "open"
            assert a.paced_for_s is None
            assert a.limit == 8
            assert calls == ["a", "b"]

    async def test_a_lone_source_out_of_credit_ends_the_call_at_once(self) -> None:
        """One source, out of credit: retry_exhausted at once, not the stall budget's wait."""
        body = {"error": {"message": "quota", "type": "insufficient_quota", "code": None}}
        settings = gateway_settings({"name": "a"})
        transport = HttpxTransport(
            settings.scope("chat").sources,
            max_connections=1,
            mock_transport=httpx.MockTransport(lambda request: httpx.Response(429, json=body)),
        )
        clock = FakeClock()
        chat = chat_on_clock(settings, MemoryBackend(now=clock), transport, clock, seed=9)
        started = clock()
        async with chat:
            with pytest.raises(AllSourcesExhausted) as caught:
                await chat.complete(MESSAGES)
        assert caught.value.reason == "retry_exhausted"
        assert [a.outcome for a in caught.value.attempts] == ["source_misconfigured"]
        assert clock() - started < 1.0

    async def test_429_of_a_rate_limit_error_body_still_paces(self) -> None:
        """A 429 whose body names a rate limit (any other code) stays rate_limited."""
        body = {"error": {"message": "Rate limit reached", "type": "requests", "code": None}}
        clock = FakeClock()
        answer: Handler = lambda request: httpx.Response(  # noqa: E731
            429, headers={"Retry-After": "2"}, json=body
        )
        chat, backend, _ = make_chat(clock, answer)
        async with chat:
            response = await chat.complete(MESSAGES)
            assert response.attempts[0].outcome == "rate_limited"
            a = await state_of_a(backend)
            assert a.breaker == "closed"
            assert a.paced_for_s is not None

    async def test_402_payment_required_means_the_source_is_misconfigured(self) -> None:
        """402 (an account that cannot be billed): a trips long and b serves the call."""
        clock = FakeClock()
        chat, backend, calls = make_chat(clock, status(402))
        async with chat:
            response = await chat.complete(MESSAGES)
            assert response.source == "b"
            assert response.attempts[0].outcome == "source_misconfigured"
            assert (await state_of_a(backend)).breaker == "open"
            assert calls == ["a", "b"]

    @pytest.mark.parametrize("code", [400, 413, 422])
    async def test_rejected_request_raises_at_once(self, code: int) -> None:
        """400/413/422 -> RequestRejected after exactly one attempt; b is never asked."""
        clock = FakeClock()
        chat, backend, calls = make_chat(clock, status(code))
        async with chat:
            with pytest.raises(RequestRejected) as caught:
                await chat.complete(MESSAGES)
            assert caught.value.status_code == code
            assert calls == ["a"]
            a = await state_of_a(backend)
            assert a.breaker == "closed"
            assert a.consecutive_failures == 0
            assert a.in_flight == 0
