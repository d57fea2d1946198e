"""The embedding client: ``embed()`` in batches, every batch governed by the one loop.

An embedding scope runs the loop of ``middleware/retry.py`` with
``exempt_429=False`` (its default for ``kind = "embed"``): every failure,
429 included, is charged to ``max_attempts``, there is no main-loop stall
check, and the stall rule inside ``_on_no_runnable`` is metered by the
call's ``StallClock`` (seed design section 5.4). This module only splits,
validates and reassembles; it has no loop of its own.

Inputs are split into batches no larger than ``max_batch_size`` texts and
``max_batch_tokens`` estimated tokens (the smallest limits among the
scope's sources, since any batch may go to any source). Batches run
concurrently as tasks of one ``TaskGroup``; the scope's permits bound how
many are really in flight, and at most ``2 x total_concurrency`` batch tasks
exist at once, so a million texts never become a million tasks. The first
batch that fails cancels its siblings and fails the whole call with its
error, ``.batch = (start, stop)`` naming its input indices: a call never
returns a partial or misordered result.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

from polygateway.errors import GatewayError, RequestRejected
from polygateway.middleware.lifecycle import GovernedClient
from polygateway.models import EmbeddingResponse, Usage
from polygateway.transport.openai import (
    embedding_request,
    estimate_embedding_tokens,
    parse_embedding_response,
)

if TYPE_CHECKING:
    from polygateway.config import SourceConfig
    from polygateway.middleware.attempt import AttemptContext, Served

__all__ = ["EmbeddingClient", "plan_batches"]

_TASKS_PER_PERMIT: Final = 2
"""Batch tasks alive at once per permit of the scope: enough to keep every permit busy."""


@dataclass(frozen=True, slots=True)
class _Batch:
    """What one served batch came to."""

    vectors: list[list[float]]
    usage: Usage


def plan_batches(
    texts: Sequence[str], *, max_batch_size: int, max_batch_tokens: int
) -> list[tuple[int, int]]:
    """Split ``texts`` into ``(start, stop)`` spans within both limits, in input order.

    Tokens are estimated as in ``estimate_embedding_tokens`` (chars / 4, at
    least 1 per text). A text alone over ``max_batch_tokens`` gets a batch of
    its own: splitting a text would change its embedding, so the upstream
    decides whether it fits.
    """
    spans: list[tuple[int, int]] = []
    start, tokens = 0, 0
    for index, text in enumerate(texts):
        cost = estimate_embedding_tokens((text,))
        if index > start and (index - start >= max_batch_size or tokens + cost > max_batch_tokens):
            spans.append((start, index))
            start, tokens = index, 0
        tokens += cost
    if start < len(texts):
        spans.append((start, len(texts)))
    return spans


def _check_texts(texts: object, scope: str) -> list[str]:
    """The caller's texts as a list, or ``RequestRejected`` before any request is sent."""
    if isinstance(texts, str | bytes | bytearray) or not isinstance(texts, Sequence):
        raise RequestRejected(
            f"texts must be a list of strings, not {type(texts).__name__}", scope=scope
        )
    items = list(texts)
    for index, text in enumerate(items):
        if not isinstance(text, str):
            raise RequestRejected(
                f"texts[{index}] is {type(text).__name__}, not a string", scope=scope
            )
        if not text:
            # Providers refuse empty input with a 400; no request is worth sending for it.
            raise RequestRejected(f"texts[{index}] is an empty string", scope=scope)
    return items


def _check_params(params: Mapping[str, Any], scope: str) -> None:
    """Refuse provider parameters whose answer this client could not read back."""
    fmt = params.get("encoding_format")
    # Not a set lookup: a caller's list or dict here must be refused, not crash on hashing.
    if fmt is not None and not (isinstance(fmt, str) and fmt == "float"):
        raise RequestRejected(
            f"encoding_format={fmt!r:.80} is not supported: vectors are read as float arrays",
            scope=scope,
        )


class EmbeddingClient(GovernedClient):
    """Embeddings of many texts, batched and governed per DESIGN.md sections 5 and 8."""

    KIND: ClassVar[str] = "embed"
    DEFAULT_SCOPE: ClassVar[str] = "embed"

    def _setup(self) -> None:
        """Batch limits: any batch may be served by any source, so the smallest limits hold."""
        sources = self._config.sources
        self._max_batch_size = min(s.max_batch_size for s in sources)
        self._max_batch_tokens = min(s.max_batch_tokens for s in sources)
        self._max_batch_tasks = max(1, _TASKS_PER_PERMIT * self._config.total_concurrency)

    @property
    def max_batch_size(self) -> int:
        """Most texts in one request: the smallest ``max_batch_size`` of the scope's sources."""
        return self._max_batch_size

    @property
    def max_batch_tokens(self) -> int:
        """Most estimated tokens in one request: the smallest ``max_batch_tokens`` of sources."""
        return self._max_batch_tokens

    async def embed(
        self,
        texts: Sequence[str],
        *,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        **params: Any,
    ) -> EmbeddingResponse:
        """Vectors of ``texts`` in input order; ``params`` (dimensions, user, ...) go as given.

        ``deadline_s`` bounds the whole call, every batch included. ``fail_fast``
        applies to the call: the first batch asks without waiting and the call
        fails with ``no_runnable`` when the scope cannot take it at once; the
        other batches start once it holds a permit and then queue behind the
        call's own permits like any batch (waiting for oneself is not "no
        runnable source").

        Raises:
            RequestRejected: a non-list, an empty string or a non-string item
                (before any request), or a source answered 400/413/422;
                ``.batch`` names the batch in the latter case.
            AllSourcesExhausted: the loop gave up on a batch (``.reason``, ``.batch``).
            GovernanceBackendError: the shared state failed (fail closed).
            GatewayError: the client is closed.
        """
        items = _check_texts(texts, self._scope)
        _check_params(params, self._scope)
        self._life.check_open()
        if not items:
            return EmbeddingResponse(vectors=[], usage=Usage())
        spans = plan_batches(
            items, max_batch_size=self._max_batch_size, max_batch_tokens=self._max_batch_tokens
        )
        deadline_at = None if deadline_s is None else self._now() + deadline_s
        call = self._life.begin()
        try:
            async with call.running():
                served = await self._run_batches(items, spans, params, fail_fast, deadline_at)
        finally:
            self._life.end(call)
        vectors: list[list[float]] = []
        prompt = completion = total = 0
        for batch in served:
            vectors.extend(batch.value.vectors)
            usage = batch.value.usage
            prompt += usage.prompt_tokens
            completion += usage.completion_tokens
            total += usage.total_tokens
        return EmbeddingResponse(
            vectors=vectors,
            usage=Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=total),
            sources=tuple(batch.source for batch in served),
            batches=tuple(spans),
            attempts=tuple(record for batch in served for record in batch.attempts),
        )

    async def _run_batches(
        self,
        items: list[str],
        spans: list[tuple[int, int]],
        params: Mapping[str, Any],
        fail_fast: bool,
        deadline_at: float | None,
    ) -> list[Served[_Batch]]:
        """Every batch through the loop, concurrently; the first failure cancels the rest."""
        results: list[Served[_Batch] | None] = [None] * len(spans)
        failed: list[BaseException] = []
        slots = asyncio.Semaphore(self._max_batch_tasks)
        # fail_fast: only the first batch asks without waiting; the rest follow its admission.
        admitted = asyncio.Event()
        if not fail_fast:
            admitted.set()

        async def one(index: int, span: tuple[int, int]) -> None:
            try:
                if index > 0:
                    await admitted.wait()
                results[index] = await self._embed_batch(
                    items, span, params, fail_fast and index == 0, deadline_at, admitted.set
                )
            except BaseException as exc:
                # Not swallowed: the failure is noted (first one wins) and re-raised.
                if not isinstance(exc, asyncio.CancelledError):
                    if isinstance(exc, GatewayError):
                        exc.batch = span
                    failed.append(exc)
                raise
            finally:
                slots.release()

        try:
            async with asyncio.TaskGroup() as group:
                for index, span in enumerate(spans):
                    await slots.acquire()
                    if failed:
                        # The group is aborting: a task created now would be refused.
                        slots.release()
                        break
                    group.create_task(one(index, span))
        except BaseExceptionGroup as errors:
            first = failed[0] if failed else None
            _, others = errors.split(GatewayError)
            if isinstance(first, GatewayError) and others is None:
                raise first from None
            raise
        done = [r for r in results if r is not None]
        if len(done) != len(spans):  # unreachable: a batch without a result raised in the group
            raise RuntimeError("an embedding batch ended without a result or an error")
        return done

    async def _embed_batch(
        self,
        items: list[str],
        span: tuple[int, int],
        params: Mapping[str, Any],
        fail_fast: bool,
        deadline_at: float | None,
        on_admitted: Callable[[], None],
    ) -> Served[_Batch]:
        """One batch through the governance loop; a wrong vector count is a malformed answer."""
        start, stop = span
        texts = items[start:stop]
        transport = self._transport

        async def attempt(source: SourceConfig, ctx: AttemptContext) -> _Batch:
            on_admitted()
            request = embedding_request(
                source, texts, params, timeout_s=ctx.timeout_s, on_hint=ctx.see_hint
            )
            vectors, usage = parse_embedding_response(await transport.send(request), len(texts))
            ctx.usage = usage
            return _Batch(vectors, usage)

        left = None if deadline_at is None else max(0.0, deadline_at - self._now())
        return await self._mw.run(
            attempt,
            cost_tokens=estimate_embedding_tokens(texts),
            fail_fast=fail_fast,
            deadline_s=left,
            op_name="embed",
        )
