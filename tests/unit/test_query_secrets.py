"""A key carried in a source's query string is as secret as one in a header.

Google's and some proxies' OpenAI-compatible endpoints take the key as
``?key=...`` (``query = {key = ...}`` in the settings); an upstream that
echoes the URL it was asked in an error body must not carry it into an
attempt record, the raised error, a log line or a request's repr.
"""

from __future__ import annotations

import logging
import random

import httpx
import pytest
from _closing import closing

from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.errors import AllSourcesExhausted, RequestRejected
from polygateway.middleware.telemetry import LoggingEmitter
from polygateway.testing import BoundedSleep, FakeClock, FakeTransport, gateway_settings
from polygateway.transport.http import HttpRequest, TransientError
from polygateway.transport.httpx_client import HttpxTransport
from polygateway.transport.wire import endpoint

KEY = "AIzaSyQueryKey-0123456789abcdef"
MESSAGES = [{"role": "user", "content": "hi"}]


def _echoing(status: int) -> httpx.MockTransport:
    """An upstream whose error body quotes the URL it was asked, key and all."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"error": {"message": f"bad request to {request.url}"}})

    return httpx.MockTransport(handler)


def _chat(clock: FakeClock, status: int) -> ChatClient:
    settings = gateway_settings({"name": "g", "query": {"key": KEY}}, max_attempts=1)
    transport = HttpxTransport(
        settings.scope("chat").sources, max_connections=1, mock_transport=_echoing(status)
    )
    return closing(
        ChatClient(
            settings,
            backend=MemoryBackend(now=clock),
            transport=transport,
            emitter=LoggingEmitter(),
            now=clock,
            sleep=BoundedSleep(clock),
            rng=random.Random(1),
        )
    )


@pytest.mark.parametrize("status", [400, 500])
async def test_an_echoed_query_key_reaches_no_error_record_or_log(
    status: int, caplog: pytest.LogCaptureFixture
) -> None:
    """The key an upstream echoes is scrubbed from the error, its attempts and the log."""
    caplog.set_level(logging.DEBUG)
    chat = _chat(FakeClock(), status)
    async with chat:
        with pytest.raises((RequestRejected, AllSourcesExhausted)) as caught:
            await chat.complete(MESSAGES)
    error = caught.value
    assert "bad request to" in str(error)  # the echo is kept, the key is not
    assert KEY not in str(error)
    assert KEY not in repr(error)
    if isinstance(error, AllSourcesExhausted):
        assert error.attempts
        for attempt in error.attempts:
            assert KEY not in (attempt.error or "")
    # Ours, not httpx's: its own INFO line names every request's URL, as for any httpx user.
    ours = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("polygateway"))
    assert "bad request to" in ours
    assert KEY not in ours


def test_a_request_repr_masks_the_key_in_its_url() -> None:
    """An ``HttpRequest``'s repr shows its URL with a credential query value masked."""
    settings = gateway_settings({"name": "g", "query": {"key": KEY, "alt": "sse"}})
    source = settings.scope("chat").sources[0]
    request = HttpRequest(source="g", url=endpoint(source, "chat/completions"), timeout_s=1.0)
    assert KEY in request.url
    assert KEY not in repr(request)
    assert "alt=sse" in repr(request)


@pytest.mark.parametrize(
    ("fields", "secret"),
    [
        ({"query": {"key": KEY}}, KEY),
        ({"base_url": "https://gw:pw-Base-Url-SECRET@llm.example/v1"}, "pw-Base-Url-SECRET"),
    ],
    ids=["query", "userinfo"],
)
async def test_the_loop_scrubs_a_url_secret_a_transport_let_through(
    fields: dict[str, object], secret: str
) -> None:
    """Defence in depth: a failure message that still carries a credential of the source's URL
    (a transport of the application's own, say) is scrubbed by the loop itself."""
    clock = FakeClock()
    settings = gateway_settings({"name": "g", **fields}, max_attempts=1)
    failure = TransientError(f"upstream said: {secret} is not valid", status_code=500)
    async with ChatClient(
        settings,
        backend=MemoryBackend(now=clock),
        transport=FakeTransport([failure], clock=clock),
        now=clock,
        sleep=BoundedSleep(clock),
        rng=random.Random(1),
    ) as chat:
        with pytest.raises(AllSourcesExhausted) as caught:
            await chat.complete(MESSAGES)
    error = caught.value
    assert "upstream said" in str(error) or any(
        "upstream said" in (a.error or "") for a in error.attempts
    )
    assert secret not in str(error)
    assert secret not in repr(error)
    assert error.attempts
    for attempt in error.attempts:
        assert secret not in (attempt.error or "")
