"""Type-checked by `make lint` (mypy --strict): a stream's response(), response_model and choices.

The types a caller relies on: ``r.parsed`` is the ``response_model`` given
(``None`` without one), ``await stream.response()`` is a ``ChatResponse``,
``r.choices`` a tuple of ``Choice``.
"""

from __future__ import annotations

from typing import assert_type

from pydantic import BaseModel

from polygateway import (
    ChatClient,
    ChatResponse,
    Choice,
    GatewaySettings,
    ResponseParseError,
    ToolCall,
)

HI = [{"role": "user", "content": "hi"}]


class Answer(BaseModel):
    """A caller's model of the answer it wants."""

    city: str
    confidence: float


async def structured(chat: ChatClient) -> float:
    """``response_model=Answer`` makes ``r.parsed`` an ``Answer``; without it, ``None``."""
    r = await chat.complete(messages=HI, response_model=Answer, max_tokens=64)
    assert_type(r, ChatResponse[Answer])
    assert_type(r.parsed, Answer)
    city: str = r.parsed.city
    plain = await chat.complete(messages=HI)
    assert_type(plain.parsed, None)
    annotated: ChatResponse = plain  # a bare annotation still fits any response
    _ = (city, annotated)
    try:
        again = await chat.complete(messages=HI, response_model=Answer)
    except ResponseParseError as exc:
        text: str = exc.text
        where = [error["loc"] for error in exc.errors]
        whole: ChatResponse[None] | None = exc.response
        _ = (text, where, whole)
        raise
    return again.parsed.confidence


async def streamed(chat: ChatClient) -> str:
    """``await s.response()`` after iterating, or instead of it, is a whole ``ChatResponse``."""
    async with chat.stream(messages=HI) as s:
        async for chunk in s:
            print(chunk.text, end="")
        final = await s.response()
    assert_type(final, ChatResponse[None])
    calls: tuple[ToolCall, ...] = final.tool_calls
    _ = (calls, final.usage.total_tokens, final.attempts, final.raw)
    instead = await chat.stream(messages=HI).response()
    return instead.text


async def several(chat: ChatClient) -> list[str]:
    """``n=2``: ``r.choices`` holds both answers; ``r.text`` is the first one's."""
    r = await chat.complete(messages=HI, n=2)
    choices: tuple[Choice, ...] = r.choices
    index: int = choices[0].index
    finish: str | None = choices[0].finish_reason
    _ = (index, finish, choices[0].tool_calls)
    return [choice.text for choice in r.choices]


async def main(settings: GatewaySettings) -> None:
    """The three uses on one client."""
    async with ChatClient.from_settings(settings) as chat:
        await structured(chat)
        await streamed(chat)
        await several(chat)
