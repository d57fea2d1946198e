"""The simulator refuses an embeddings ``input`` of more than 2048 items as OpenAI and Azure do.

OpenAI answers such a request 400 "Invalid 'input': array length must be 2048
or less."; Azure OpenAI 400 "Too many inputs. The max number of inputs is
...". vLLM documents no such limit and takes any count. Plain httpx against
a real server on 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from polygateway.simulator import FaultProfile, SimulatedUpstream

AZURE_QUERY = {"api-version": "2024-10-21"}


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """A plain httpx client with a generous timeout."""
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


def texts(count: int) -> list[str]:
    """``count`` short distinct texts."""
    return [f"text {index}" for index in range(count)]


async def test_openai_wire_refuses_2049_inputs_in_openais_words(
    client: httpx.AsyncClient,
) -> None:
    """2049 inputs: 400 with OpenAI's error object; 2048: 200 with 2048 embeddings."""
    async with SimulatedUpstream({"a": FaultProfile(wire="openai")}) as sim:
        url = f"{sim.base_url('a')}/embeddings"
        over = await client.post(url, json={"model": "m", "input": texts(2049)})
        at = await client.post(url, json={"model": "m", "input": texts(2048)})
    assert over.status_code == 400
    assert over.json() == {
        "error": {
            "message": "Invalid 'input': array length must be 2048 or less.",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    assert at.status_code == 200
    assert len(at.json()["data"]) == 2048


async def test_azure_wire_refuses_2049_inputs_in_azures_words(
    client: httpx.AsyncClient,
) -> None:
    """2049 inputs to a deployment: 400 "Too many inputs"; 2048: 200."""
    async with SimulatedUpstream({"a": FaultProfile(wire="azure")}) as sim:
        url = f"{sim.base_url('a', 'azure')}/embeddings"
        over = await client.post(url, json={"input": texts(2049)}, params=AZURE_QUERY)
        at = await client.post(url, json={"input": texts(2048)}, params=AZURE_QUERY)
    assert over.status_code == 400
    error = over.json()["error"]
    assert error["message"] == "Too many inputs. The max number of inputs is 2048."
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, None)
    assert at.status_code == 200
    assert len(at.json()["data"]) == 2048


async def test_vllm_wire_takes_more_than_2048_inputs(client: httpx.AsyncClient) -> None:
    """vLLM documents no per-request input count: 2049 inputs are embedded."""
    async with SimulatedUpstream({"a": FaultProfile(wire="vllm")}) as sim:
        url = f"{sim.base_url('a')}/embeddings"
        r = await client.post(url, json={"model": "m", "input": texts(2049)})
    assert r.status_code == 200
    assert len(r.json()["data"]) == 2049
