"""EmbeddingClient against answers real OpenAI-compatible servers give, over httpx's wire.

Each test pins one promise: vectors are never misaligned nor of mixed or
unasked dimensions ("no lost batch work" keeps what was computed, typed
errors name what went wrong), whatever order, count or encoding the
server answers with.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from _batch_clients import embed_settings as make_settings
from _batch_clients import embedding_source as source
from _batch_clients import mock_wire, on_clock

from polygateway.config import GatewaySettings
from polygateway.embedding import EmbeddingClient
from polygateway.errors import AllSourcesExhausted, RequestRejected
from polygateway.models import Usage
from polygateway.testing import FakeClock, FakeTransport, Hang, Outcome, embedding_body
from polygateway.transport.http import HttpRequest

SCOPE = "embed"

Handler = Callable[[httpx.Request], httpx.Response]


def client(settings: GatewaySettings, upstream: Handler) -> EmbeddingClient:
    """An EmbeddingClient whose real httpx transport sends through httpx.MockTransport."""
    return on_clock(
        EmbeddingClient, settings, SCOPE, mock_wire(settings, SCOPE, upstream), FakeClock(), seed=5
    )


def vector_of(text: str, dims: int = 2) -> list[float]:
    """The vector the fake server gives ``text`` (``t<i>``): its index, then ones."""
    return [float(text[1:])] + [1.0] * (dims - 1)


def answer(data: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    """An OpenAI embeddings answer carrying ``data`` as given."""
    body = {"object": "list", "model": "text-embedding-3-small", "data": data, **extra}
    return httpx.Response(200, json=body)


def items(inputs: list[str], dims: int = 2) -> list[dict[str, Any]]:
    """The ``data`` items of ``inputs``, in input order."""
    return [
        {"object": "embedding", "index": i, "embedding": vector_of(t, dims)}
        for i, t in enumerate(inputs)
    ]


def inputs_of(request: httpx.Request) -> list[str]:
    """The ``input`` array a request carries."""
    body = json.loads(request.content)
    sent: list[str] = body["input"]
    return sent


def texts(n: int) -> list[str]:
    """``t0`` .. ``t{n-1}``: each text names its own index."""
    return [f"t{i}" for i in range(n)]


USAGE = {"prompt_tokens": 4, "total_tokens": 4}


# --- Order and count ----------------------------------------------------------------


async def test_data_out_of_index_order_is_put_back_in_input_order() -> None:
    """A server answering ``data`` in any order still gives each text its own vector."""

    def shuffled(request: httpx.Request) -> httpx.Response:
        data = items(inputs_of(request))
        random.Random(11).shuffle(data)
        return answer(data, usage=USAGE)

    emb = client(make_settings(), shuffled)
    result = await emb.embed(texts(7))
    assert result.vectors == [vector_of(t) for t in texts(7)]


@pytest.mark.parametrize("extra", [1, -1])
async def test_more_or_fewer_vectors_than_texts_fail_typed_never_misaligned(extra: int) -> None:
    """An answer with one vector too many or too few is a named failure, not shifted vectors."""

    def wrong_count(request: httpx.Request) -> httpx.Response:
        sent = inputs_of(request)
        data = items([*sent, "t99"] if extra > 0 else sent[:-1])
        return answer(data, usage=USAGE)

    emb = client(make_settings(max_attempts=2), wrong_count)
    with pytest.raises(AllSourcesExhausted) as caught:
        await emb.embed(texts(3))
    assert caught.value.batch == (0, 3)
    assert "expected 3 vectors" in str(caught.value.attempts[-1].error)
    assert caught.value.partial is not None
    assert caught.value.partial.vectors == [None, None, None]


async def test_usage_absent_as_some_compatible_servers_answer_is_served() -> None:
    """No ``usage`` object (TEI, older Ollama) is a served answer with zero usage."""
    emb = client(make_settings(), lambda request: answer(items(inputs_of(request))))
    result = await emb.embed(texts(3))
    assert result.vectors == [vector_of(t) for t in texts(3)]
    assert result.usage == Usage()


# --- Vector contents ----------------------------------------------------------------


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
async def test_non_finite_number_in_a_vector_is_malformed(token: str) -> None:
    """Python's json reads NaN and Infinity; a vector holding one is refused, never returned."""

    def non_finite(request: httpx.Request) -> httpx.Response:
        data = items(inputs_of(request))
        text = json.dumps({"object": "list", "data": data, "usage": USAGE})
        text = text.replace("1.0", token, 1)
        return httpx.Response(200, content=text, headers={"content-type": "application/json"})

    emb = client(make_settings(max_attempts=1), non_finite)
    with pytest.raises(AllSourcesExhausted) as caught:
        await emb.embed(texts(2))
    assert "non-numeric" in str(caught.value.attempts[-1].error)


async def test_base64_string_where_a_float_array_was_asked_is_malformed() -> None:
    """A server answering base64 though float was asked gives a named failure, not bytes."""

    def base64_anyway(request: httpx.Request) -> httpx.Response:
        data = [
            {"object": "embedding", "index": i, "embedding": "AACAPwAAAEA="}
            for i in range(len(inputs_of(request)))
        ]
        return answer(data, usage=USAGE)

    emb = client(make_settings(max_attempts=1), base64_anyway)
    with pytest.raises(AllSourcesExhausted) as caught:
        await emb.embed(texts(2))
    assert "embedding" in str(caught.value.attempts[-1].error)


@pytest.mark.parametrize(
    "params", [{"encoding_format": "base64"}, {"extra_body": {"encoding_format": "base64"}}]
)
async def test_base64_encoding_format_is_refused_before_any_request(params: Any) -> None:
    """base64 answers are not decoded here, so asking for them is refused up front."""
    sent: list[httpx.Request] = []

    def never(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return answer(items(inputs_of(request)))

    emb = client(make_settings(), never)
    with pytest.raises(RequestRejected, match="encoding_format"):
        await emb.embed(texts(2), **params)
    assert sent == []


@pytest.mark.parametrize("dimensions", [0, -3, 2.5, "256", True])
async def test_bad_dimensions_is_refused_before_any_request(dimensions: Any) -> None:
    """``dimensions`` must be a positive integer: anything else is named before sending."""
    sent: list[httpx.Request] = []

    def never(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        return answer(items(inputs_of(request)))

    emb = client(make_settings(), never)
    with pytest.raises(RequestRejected, match="dimensions"):
        await emb.embed(texts(2), dimensions=dimensions)
    assert sent == []


async def test_vectors_not_of_the_asked_dimensions_are_never_returned() -> None:
    """A server ignoring ``dimensions`` (full-size vectors) fails the batch, naming both sizes."""

    def ignores_dimensions(request: httpx.Request) -> httpx.Response:
        return answer(items(inputs_of(request), dims=4), usage=USAGE)

    emb = client(make_settings(max_attempts=2), ignores_dimensions)
    result = await emb.embed(texts(3), dimensions=2, partial=True)
    assert result.vectors == [None, None, None]
    assert result.failed_spans == ((0, 3),)
    with pytest.raises(AllSourcesExhausted) as caught:
        await emb.embed(texts(3), dimensions=2)
    error = str(caught.value.attempts[-1].error)
    assert "vectors of 4 dimensions, where dimensions=2 was asked" in error


async def test_vectors_of_the_asked_dimensions_are_served() -> None:
    """A server honouring ``dimensions`` is served, the parameter sent as asked."""
    seen: list[Any] = []

    def honours(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body["dimensions"])
        return answer(items(body["input"], dims=body["dimensions"]), usage=USAGE)

    emb = client(make_settings(), honours)
    result = await emb.embed(texts(2), dimensions=3)
    assert result.vectors == [vector_of(t, 3) for t in texts(2)]
    assert seen == [3]


async def test_batches_from_sources_of_different_dimensions_never_mix_in_one_result() -> None:
    """Two sources answering vectors of different sizes: one call's vectors all have one size."""

    def by_source(request: httpx.Request) -> httpx.Response:
        dims = 2 if "/small/" in request.url.path else 3
        return answer(items(inputs_of(request), dims=dims), usage=USAGE)

    settings = make_settings(
        source("small", max_batch_size=2),
        source("large", max_batch_size=2),
        max_attempts=4,
    )
    emb = client(settings, by_source)
    result = await emb.embed(texts(10), partial=True)
    sizes = {len(v) for v in result.vectors if v is not None}
    assert len(sizes) == 1
    served = [v for v in result.vectors if v is not None]
    assert served, "at least the first batch is served"


async def test_dimensions_in_extra_body_are_the_asked_ones() -> None:
    """``extra_body={"dimensions": n}`` is merged last, so vectors are checked against it."""

    def ignores_dimensions(request: httpx.Request) -> httpx.Response:
        return answer(items(inputs_of(request), dims=4), usage=USAGE)

    emb = client(make_settings(max_attempts=1), ignores_dimensions)
    result = await emb.embed(texts(2), extra_body={"dimensions": 2}, partial=True)
    assert result.failed_spans == ((0, 2),)
    served = await emb.embed(texts(2), extra_body={"dimensions": 4})
    assert {len(v) for v in served.vectors} == {4}


# --- A deadline keeps the work; a cancellation is the caller's ------------------------


def fake_client(transport: FakeTransport, clock: FakeClock, settings: GatewaySettings) -> Any:
    """An EmbeddingClient on a FakeTransport and a FakeClock."""
    return on_clock(EmbeddingClient, settings, SCOPE, transport, clock, seed=5)


def hang_on_t1(request: HttpRequest) -> Outcome:
    """Batch ``t0`` is served at once; batch ``t1`` never answers."""
    if request.json["input"] == ["t1"]:
        return Hang()
    return embedding_body([vector_of(t) for t in request.json["input"]])


async def test_deadline_mid_call_keeps_every_vector_already_computed() -> None:
    """``deadline_s`` running out while a batch hangs returns the served batch's vectors."""
    clock = FakeClock()
    transport = FakeTransport(default=hang_on_t1, clock=clock)
    settings = make_settings(source(max_batch_size=1, timeout_s=60))
    emb = fake_client(transport, clock, settings)
    result = await emb.embed(texts(2), deadline_s=5.0, partial=True)
    assert result.vectors == [vector_of("t0"), None]
    assert result.failed_spans == ((1, 2),)
    with pytest.raises(AllSourcesExhausted) as caught:
        await emb.embed(texts(2), deadline_s=5.0)
    assert caught.value.reason == "deadline"
    assert caught.value.partial is not None
    assert caught.value.partial.vectors == [vector_of("t0"), None]
