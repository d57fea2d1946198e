"""EmbeddingClient and OcrClient as a user coming from the openai SDK calls them: found faults.

Each test pins a fault found in review: the call's own arguments are
checked up front with a typed error, as ``ChatClient`` checks them, and an
embedding answer the client cannot read is never asked for.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Coroutine
from typing import Any

import pytest
from _batch_clients import embed_settings, embedding_source, on_clock

from polygateway.embedding import EmbeddingClient
from polygateway.errors import RequestRejected
from polygateway.models import EmbeddingProgress
from polygateway.testing import FakeClock, FakeTransport, embedding_body
from polygateway.transport.http import HttpRequest
from polygateway.transport.params import ChatCheck

SCOPE = "embed"
MESSAGES = [{"role": "user", "content": "hi"}]


def echo(request: HttpRequest) -> dict[str, Any]:
    """An upstream that embeds each input as its position in the batch and a constant."""
    return embedding_body([[float(i), 1.0] for i, _ in enumerate(request.json["input"])])


def embedder(*, batch: int = 2) -> tuple[EmbeddingClient, FakeTransport]:
    """An EmbeddingClient of one OpenAI source on a FakeTransport, MemoryBackend and FakeClock."""
    clock = FakeClock()
    transport = FakeTransport(clock=clock, default=echo)
    settings = embed_settings(embedding_source(max_batch_size=batch))
    return on_clock(EmbeddingClient, settings, SCOPE, transport, clock, seed=7), transport


# --- deadline_s is checked up front, as the other clients check it ------------------


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("deadline_s", [-1.0, float("nan"), float("inf"), True, "5"])
async def test_bad_deadline_is_rejected_before_any_batch(deadline_s: Any, partial: bool) -> None:
    """A negative, NaN, infinite, bool or string deadline_s is a RequestRejected naming it.

    Not a deadline every batch has already missed, not a TypeError, and never a
    partial=True result with every vector None.
    """
    client, transport = embedder()
    with pytest.raises(RequestRejected, match="deadline_s must be a finite, non-negative"):
        await client.embed(["a", "b", "c"], deadline_s=deadline_s, partial=partial)
    assert transport.requests == []


async def test_zero_deadline_is_still_a_deadline() -> None:
    """deadline_s=0 stays valid (the loop takes it): the batches fail on the deadline, unsent."""
    client, transport = embedder()
    result = await client.embed(["a", "b", "c"], deadline_s=0, partial=True)
    assert result.failed_spans == ((0, 2), (2, 3))
    assert transport.requests == []


# --- Vectors are asked for as floats, however the format is set -----------------------


@pytest.mark.parametrize(
    "params",
    [
        {"extra_body": {"encoding_format": "base64"}},
        {"extra_body": {"encoding_format": ["float"]}},
        {"encoding_format": "b64"},
        {"encoding_format": "base64"},
    ],
)
async def test_non_float_encoding_format_anywhere_is_rejected_before_any_request(
    params: dict[str, Any],
) -> None:
    """encoding_format other than float, in extra_body too, is refused up front, naming it.

    A base64 answer cannot be read as floats: sent, every batch came back
    "malformed", was retried on every source and counted against its breaker.
    The refusal does not point at extra_body, which would not help either.
    """
    client, transport = embedder()
    with pytest.raises(RequestRejected, match="encoding_format") as caught:
        await client.embed(["a", "b", "c"], **params)
    assert "extra_body={" not in str(caught.value)
    assert transport.requests == []


async def test_float_encoding_format_in_extra_body_is_sent() -> None:
    """extra_body={"encoding_format": "float"} asks for what the client reads: it goes out."""
    client, transport = embedder()
    result = await client.embed(["a", "b", "c"], extra_body={"encoding_format": "float"})
    assert result.vectors == [[0.0, 1.0], [1.0, 1.0], [0.0, 1.0]]
    assert [r.json["encoding_format"] for r in transport.requests] == ["float", "float"]


# --- Integer parameters below the API's minimum are refused, not sent ----------------------


class TestIntegerMinimums:
    """A count the API bounds below (dimensions, n, max_tokens, ...) is checked up front."""

    @pytest.mark.parametrize("dimensions", [0, -3])
    async def test_non_positive_dimensions_is_rejected_before_any_request(
        self, dimensions: int
    ) -> None:
        """dimensions=0 or negative is a 400 at the provider: refused here, naming it."""
        client, transport = embedder()
        with pytest.raises(RequestRejected, match="dimensions must be an integer >= 1"):
            await client.embed(["a", "b", "c"], dimensions=dimensions, partial=True)
        assert transport.requests == []

    async def test_positive_dimensions_is_sent(self) -> None:
        """dimensions=1, the smallest the API takes, still goes out as given."""
        client, transport = embedder()
        transport.add(embedding_body([[0.5]]))  # a source honouring it: one float
        result = await client.embed(["a"], dimensions=1)
        assert [r.json["dimensions"] for r in transport.requests] == [1]
        assert result.vectors == [[0.5]]

    @pytest.mark.parametrize(
        ("params", "needle"),
        [
            ({"n": 0}, "n must be an integer >= 1"),
            ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
            ({"max_completion_tokens": -5}, "max_completion_tokens must be an integer >= 1"),
            ({"top_logprobs": -1}, "top_logprobs must be an integer >= 0"),
        ],
    )
    def test_chat_count_below_its_minimum_is_rejected(
        self, params: dict[str, Any], needle: str
    ) -> None:
        """A chat count the API refuses below its minimum is a RequestRejected naming it."""
        with pytest.raises(RequestRejected, match=needle):
            ChatCheck(["openai"]).complete(MESSAGES, params, "chat")

    def test_chat_counts_at_their_minimum_pass(self) -> None:
        """The smallest value each count takes is accepted: the bound is not off by one."""
        params = {"n": 1, "max_tokens": 1, "max_completion_tokens": 1, "top_logprobs": 0}
        assert ChatCheck(["openai"]).complete(MESSAGES, params, "chat") == MESSAGES


# --- An async on_progress is refused or caught, never silently dropped ----------------------


class TestAsyncProgressCallback:
    """on_progress must be a plain function; async ones that look plain are still caught."""

    async def test_object_with_async_call_is_rejected_before_any_request(self) -> None:
        """An instance whose __call__ is async is refused up front, like an async def."""

        class Bar:
            async def __call__(self, progress: EmbeddingProgress) -> None:
                """A progress bar written as a coroutine: it would never run."""

        client, transport = embedder()
        with pytest.raises(RequestRejected, match="on_progress must be a plain"):
            await client.embed(["a", "b", "c"], on_progress=Bar())  # type: ignore[arg-type]
        assert transport.requests == []

    async def test_coroutine_returned_by_on_progress_is_closed_and_logged(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A lambda handing back a coroutine: each is closed, one warning says so, vectors kept."""
        made: list[Coroutine[Any, Any, None]] = []

        async def report(progress: EmbeddingProgress) -> None:
            """Never awaited by the client."""

        def hand_back(progress: EmbeddingProgress) -> Coroutine[Any, Any, None]:
            made.append(report(progress))
            return made[-1]

        client, _ = embedder()
        with caplog.at_level(logging.WARNING, logger="polygateway.embedding"):
            result = await client.embed(["a", "b", "c"], on_progress=hand_back)  # type: ignore[arg-type]
        assert result.vectors == [[0.0, 1.0], [1.0, 1.0], [0.0, 1.0]]
        assert [inspect.getcoroutinestate(c) for c in made] == [inspect.CORO_CLOSED] * 2
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "on_progress" in warnings[0].getMessage()


# --- A text JSON cannot carry is refused up front, by its index ------------------------------


class TestUnencodableText:
    """A lone surrogate (a bad decode upstream of the caller) cannot go out as UTF-8 JSON."""

    @pytest.mark.parametrize("partial", [False, True])
    async def test_lone_surrogate_is_rejected_before_any_batch(self, partial: bool) -> None:
        """texts[2] with a lone surrogate: RequestRejected naming it, no batch sent at all.

        Not the other batches sent and paid for and then the call failed by one
        batch refused at the transport, naming only its span.
        """
        client, transport = embedder()
        with pytest.raises(RequestRejected, match=r"texts\[2\] holds a lone surrogate"):
            await client.embed(["a", "b", "c\udc80d"], partial=partial)
        assert transport.requests == []

    async def test_non_ascii_text_is_sent(self) -> None:
        """Any real character, astral ones included, is a text like any other."""
        client, transport = embedder()
        await client.embed(["é", "日本", "\U0001f600"])
        assert [r.json["input"] for r in transport.requests] == [["é", "日本"], ["\U0001f600"]]
