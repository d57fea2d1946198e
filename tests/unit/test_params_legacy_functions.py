"""OpenAI's rules for its deprecated function calling, checked before any permit or byte.

OpenAI answers 400 to ``functions`` beside ``tools`` ("'functions' and
'tools' cannot both be provided"), to ``function_call`` without
``functions`` ("'function_call' is only allowed when 'functions' are
specified") and to an empty list; so would any source, so every scope
refuses them up front, whatever its protocols.
"""

from __future__ import annotations

from typing import Any

import pytest

from polygateway.errors import RequestRejected
from polygateway.transport.params import ChatCheck

ASK = [{"role": "user", "content": "weather?"}]
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}
TOOL = {"type": "function", "function": {"name": "get_time"}}

REFUSED = [
    ({"functions": [WEATHER], "tools": [TOOL]}, "functions and tools cannot both be given"),
    (
        {"functions": [WEATHER], "function_call": "auto", "tool_choice": "auto"},
        "function_call and tool_choice cannot both be given",
    ),
    ({"function_call": "auto"}, "function_call is only allowed when functions are given"),
    ({"functions": []}, "functions is empty"),
]


@pytest.mark.parametrize("protocols", [["openai"], ["anthropic"], ["anthropic", "openai"]])
@pytest.mark.parametrize(("params", "fragment"), REFUSED)
@pytest.mark.parametrize("how", ["complete", "stream"])
def test_what_openai_refuses_is_refused_before_anything_is_sent(
    protocols: list[str], params: dict[str, Any], fragment: str, how: str
) -> None:
    check = getattr(ChatCheck(protocols), how)
    with pytest.raises(RequestRejected) as caught:
        check(ASK, params, "chat")
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    "params",
    [
        {"functions": [WEATHER]},
        {"functions": [WEATHER], "function_call": "none"},
        {"functions": [WEATHER], "function_call": {"name": "get_weather"}},
        {"tools": [TOOL], "tool_choice": "auto"},
        {"functions": None, "tools": [TOOL]},
    ],
)
def test_either_generation_alone_passes(params: dict[str, Any]) -> None:
    assert ChatCheck(["openai"]).complete(ASK, params, "chat") == ASK
