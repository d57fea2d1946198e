"""Type-checked by `make lint` (mypy --strict): the public API reads as DESIGN.md section 3 says."""

from __future__ import annotations

from polygateway import (
    AllSourcesExhausted,
    ChatClient,
    ChatResponse,
    EmbeddingClient,
    EmbeddingResponse,
    GatewaySettings,
    LayoutResult,
    OcrClient,
    TextResult,
)


async def use_the_clients(settings: GatewaySettings, png: bytes, pdf: bytes) -> None:
    """Every documented attribute exists with the documented type."""
    async with ChatClient.from_settings(settings, scope="chat") as chat:
        r: ChatResponse = await chat.complete(messages=[{"role": "user", "content": "hi"}])
        text: str = r.text
        source: str = r.source
        finish: str | None = r.finish_reason
        prompt_tokens: int = r.usage.prompt_tokens
        completion_tokens: int = r.usage.completion_tokens
        _ = (text, source, finish, prompt_tokens, completion_tokens, r.tool_calls, r.raw)
        async with chat.stream(messages=[{"role": "user", "content": "hi"}]) as s:
            async for chunk in s:
                _c: str = chunk.text
                _f: str | None = chunk.finish_reason
        try:
            await chat.complete(messages=[], fail_fast=True, deadline_s=1.0)
        except AllSourcesExhausted as exc:
            _r: str = exc.reason
            _ra: float | None = exc.retry_after_s
            _a = exc.attempts
    async with EmbeddingClient.from_settings(settings, scope="embed") as emb:
        e: EmbeddingResponse = await emb.embed(["a", "b"])
        vectors: list[list[float]] = e.vectors
        _ = vectors
    async with OcrClient.from_settings(settings, scope="ocr") as ocr:
        t: TextResult = await ocr.recognize_text(png)
        d: LayoutResult = await ocr.parse_layout(pdf)
        _ = (t.text, d.markdown, [(b.type, b.text, b.bbox, b.page) for b in d.blocks])
