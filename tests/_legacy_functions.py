"""The legacy ``functions`` a call offers in the legacy function-calling e2e tests.

Shared by ``tests/integration/test_legacy_functions_e2e.py`` (OpenAI and
Azure wires) and ``tests/integration/test_anthropic_legacy_functions_e2e.py``,
so that both ask the same question with the same functions.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ASK", "TIME", "WEATHER", "result_turn"]

ASK = [{"role": "user", "content": "weather in Paris"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME = {
    "name": "get_time",
    "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "string"}, "hours": {"type": "integer"}},
        "required": ["zone", "hours"],
    },
}


def result_turn(name: str, arguments: str, result: str = "sunny, 21 C") -> list[dict[str, Any]]:
    """``ASK``, the assistant's legacy call of ``name``, and the ``function`` message answering."""
    return [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": name, "arguments": arguments},
        },
        {"role": "function", "name": name, "content": result},
    ]
