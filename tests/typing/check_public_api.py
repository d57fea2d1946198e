"""Type-checked by `make lint` (mypy --strict): the public API reads as README.md shows it."""

from __future__ import annotations

from polygateway import (
    AllSourcesExhausted,
    ChatClient,
    ChatResponse,
    ConfigError,
    EmbeddingClient,
    EmbeddingProgress,
    EmbeddingResponse,
    GatewayError,
    GatewaySettings,
    LayoutResult,
    OcrClient,
    PartialEmbeddingResponse,
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
        vectors: list[list[float]] = e.vectors  # a complete call: no None to check for
        _ = vectors
        await resumable_job(emb, ["a", "b", "c"])
    async with OcrClient.from_settings(settings, scope="ocr") as ocr:
        t: TextResult = await ocr.recognize_text(png)
        d: LayoutResult = await ocr.parse_layout(pdf)
        _ = (t.text, d.markdown, [(b.type, b.text, b.bbox, b.page) for b in d.blocks])


def show(p: EmbeddingProgress) -> None:
    """A progress display: a plain function, called once per finished batch."""
    print(f"{p.texts_done}/{p.texts_total} texts, {p.batches_failed} batches failed")


async def resumable_job(emb: EmbeddingClient, texts: list[str]) -> list[list[float] | None]:
    """``partial=True`` keeps what was computed; only the failed spans are embedded again."""
    first: PartialEmbeddingResponse = await emb.embed(texts, partial=True, on_progress=show)
    merged: list[list[float] | None] = list(first.vectors)
    spans: tuple[tuple[int, int], ...] = first.failed_spans
    for start, stop in spans:
        try:
            merged[start:stop] = (await emb.embed(texts[start:stop])).vectors
        except GatewayError as exc:
            failing: tuple[int, int] | None = exc.batch
            kept: PartialEmbeddingResponse | None = exc.partial
            _ = (failing, kept)
    either = await emb.embed(texts, partial=bool(spans))  # a bool known only at run time
    _ = either.failed_spans

    async def async_show(p: EmbeddingProgress) -> None:
        """Refused: nothing would await it."""

    await emb.embed(texts, on_progress=async_show)  # type: ignore[arg-type]
    return merged


def settings_problem(path: str) -> str | None:
    """A ConfigError names the field and where the bad value came from: a file or a variable."""
    try:
        GatewaySettings.load(path)
    except ConfigError as exc:
        field: str | None = exc.field
        file: str | None = exc.path
        variable: str | None = exc.env
        return variable or file or field
    return None
