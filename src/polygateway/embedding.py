"""The embedding client: ``embed()`` in batches, every batch governed by the one loop.

An embedding scope runs the loop of ``middleware/retry.py`` with
``exempt_429=False`` (its default for ``kind = "embed"``): every failure,
429 included, is charged to ``max_attempts``, there is no main-loop stall
check, and the stall rule inside ``_on_no_runnable`` is metered by the
call's ``StallClock`` (research-wiki/designs/stall-budget.md §3). This module only splits,
validates and reassembles; it has no loop of its own.

Inputs are split into batches no larger than ``max_batch_size`` texts and
``max_batch_tokens`` estimated tokens (the smallest limits among the
scope's sources, since any batch may go to any source). Batches run
concurrently as tasks of one ``TaskGroup``; the scope's permits bound how
many are really in flight, and at most ``2 x total_concurrency`` batch tasks
exist at once, so a million texts never become a million tasks.

A batch that fails after its retries does not stop its siblings: every
other batch runs to its end, so every vector that can be computed is. Then
``embed(..., partial=True)`` returns a ``PartialEmbeddingResponse`` (vectors
in input order, ``None`` where a batch failed, ``failed_spans`` naming those
batches); without it the first failure in input order is raised, its
``.batch = (start, stop)`` naming the batch and its ``.partial`` holding that
same result. Two things still stop every batch at once: the call's
cancellation, and a ``GovernanceBackendError`` (the shared state failed, so
nothing may run ungoverned); that error carries ``.partial`` too. A call
never returns misordered vectors, nor vectors of two sizes or of a size other
than the ``dimensions`` asked: such an answer is malformed (``_Dimensions``).

``on_progress`` is called once per finished batch, from the event loop and
never concurrently with itself; a callback that raises is logged and the
call carries on (research-wiki/ARCHITECTURE.md, section 2).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final, Literal, overload

from polygateway.errors import (
    AllSourcesExhausted,
    GatewayError,
    GovernanceBackendError,
    RequestRejected,
)
from polygateway.middleware.deadline import check_deadline_s
from polygateway.middleware.lifecycle import GovernedClient
from polygateway.models import (
    AttemptRecord,
    EmbeddingProgress,
    EmbeddingResponse,
    PartialEmbeddingResponse,
    Usage,
)
from polygateway.transport.openai import (
    embedding_request,
    estimate_embedding_tokens,
    parse_embedding_response,
)
from polygateway.transport.params import check_embedding_params
from polygateway.transport.wire import malformed_body, response_model

if TYPE_CHECKING:
    from polygateway.config import SourceConfig
    from polygateway.middleware.attempt import AttemptContext, Served

__all__ = ["EmbeddingClient", "plan_batches"]

_TASKS_PER_PERMIT: Final = 2
"""Batch tasks alive at once per permit of the scope: enough to keep every permit busy."""

_log = logging.getLogger("polygateway.embedding")

_SURROGATE: Final = re.compile("[\ud800-\udfff]")
"""A UTF-16 surrogate code point: never a character on its own."""

ProgressCallback = Callable[[EmbeddingProgress], None]
"""``on_progress``: a plain function; typed to return ``None`` so an ``async def`` is refused."""


@dataclass(frozen=True, slots=True)
class _Batch:
    """What one served batch came to."""

    vectors: list[list[float]]
    usage: Usage


class _Dimensions:
    """The one vector size every batch of a call must answer with.

    The caller's ``dimensions`` when asked (a server that ignores it answers
    full-size vectors, which must not pass for the asked ones); otherwise the
    size of the first batch answered, so batches served by sources of
    different models never mix sizes in one result. A batch of another size
    is a malformed answer: retried like one, then a failed span.
    """

    __slots__ = ("asked", "size")

    def __init__(self, asked: int | None) -> None:
        self.asked = asked
        self.size = asked

    def check(self, vectors: list[list[float]]) -> None:
        """Fix the call's size on its first answer, then refuse any other size."""
        got = len(vectors[0])
        if self.size is None:
            self.size = got
        elif got != self.size:
            wanted = (
                f"dimensions={self.asked} was asked (does the source ignore it?)"
                if self.asked is not None
                else f"this call's other batches have {self.size}"
            )
            raise malformed_body(f"vectors of {got} dimensions, where {wanted}")


def _asked_dimensions(params: Mapping[str, Any]) -> int | None:
    """The ``dimensions`` the request carries: ``extra_body``'s wins, as it is merged last."""
    extra = params.get("extra_body")
    asked = extra.get("dimensions") if isinstance(extra, Mapping) else None
    if asked is None:
        asked = params.get("dimensions")
    if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0:
        return asked
    return None


def _total(usages: Iterable[Usage]) -> Usage:
    """The sum of the batches' usage."""
    prompt = completion = total = 0
    for usage in usages:
        prompt += usage.prompt_tokens
        completion += usage.completion_tokens
        total += usage.total_tokens
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=total)


class _Outcomes:
    """What the batches of one call came to, kept by batch index, and the progress they report.

    Only the event loop's thread touches it, and nothing here awaits: a batch's
    outcome, the counts and the report made of them change together, so
    reports never interleave and their counts only grow.
    """

    __slots__ = (
        "_batches_done",
        "_batches_failed",
        "_callback_errors",
        "_on_progress",
        "_scope",
        "_texts_done",
        "_texts_failed",
        "_texts_total",
        "errors",
        "served",
        "spans",
    )

    def __init__(
        self,
        spans: list[tuple[int, int]],
        texts_total: int,
        on_progress: ProgressCallback | None,
        scope: str,
    ) -> None:
        self.spans = spans
        self.served: list[Served[_Batch] | None] = [None] * len(spans)
        # None for a batch served, not yet finished, or given up with the fail_fast probe.
        self.errors: list[GatewayError | None] = [None] * len(spans)
        self._texts_total = texts_total
        self._on_progress = on_progress
        self._scope = scope
        self._texts_done = self._texts_failed = 0
        self._batches_done = self._batches_failed = 0
        self._callback_errors = 0

    def serve(self, index: int, served: Served[_Batch]) -> None:
        """Batch ``index`` was served."""
        self.served[index] = served
        self._finish(index, failed=False)

    def fail(self, index: int, error: GatewayError | None) -> None:
        """Batch ``index`` failed for good; ``None``: it was never sent (see ``_run_batches``)."""
        self.errors[index] = error
        self._finish(index, failed=True)

    def first_error(self) -> GatewayError | None:
        """The failure a call without ``partial=True`` raises: the first in input order."""
        return next((e for e in self.errors if e is not None), None)

    def complete(self) -> EmbeddingResponse:
        """The response of a call whose every batch was served."""
        served = [s for s in self.served if s is not None]
        if len(served) != len(self.spans):  # unreachable: embed() checks first_error() first
            raise RuntimeError("an embedding batch ended without vectors or an error")
        return EmbeddingResponse(
            vectors=[vector for s in served for vector in s.value.vectors],
            usage=_total(s.value.usage for s in served),
            sources=tuple(s.source for s in served),
            batches=tuple(self.spans),
            attempts=tuple(record for s in served for record in s.attempts),
        )

    def partial(self) -> PartialEmbeddingResponse:
        """Every vector computed so far at its input position; any other batch is a failed span."""
        vectors: list[list[float] | None] = []
        failed: list[tuple[int, int]] = []
        sources: list[str] = []
        attempts: list[AttemptRecord] = []
        for (start, stop), served, error in zip(self.spans, self.served, self.errors, strict=True):
            if served is not None:
                vectors.extend(served.value.vectors)
                sources.append(served.source)
                attempts.extend(served.attempts)
                continue
            vectors.extend([None] * (stop - start))
            failed.append((start, stop))
            sources.append("")
            if isinstance(error, AllSourcesExhausted):
                attempts.extend(error.attempts)
        return PartialEmbeddingResponse(
            vectors=vectors,
            usage=_total(s.value.usage for s in self.served if s is not None),
            failed_spans=tuple(failed),
            sources=tuple(sources),
            batches=tuple(self.spans),
            attempts=tuple(attempts),
        )

    def _finish(self, index: int, *, failed: bool) -> None:
        """Count a finished batch and report the call's progress."""
        start, stop = self.spans[index]
        self._texts_done += stop - start
        self._batches_done += 1
        if failed:
            self._texts_failed += stop - start
            self._batches_failed += 1
        if self._on_progress is None:
            return
        progress = EmbeddingProgress(
            texts_done=self._texts_done,
            texts_total=self._texts_total,
            texts_failed=self._texts_failed,
            batches_done=self._batches_done,
            batches_total=len(self.spans),
            batches_failed=self._batches_failed,
        )
        try:
            returned: object = self._on_progress(progress)
            if inspect.isawaitable(returned):
                # An async callback that looked plain (a lambda returning a coroutine): it
                # would never run. Closed, so no "never awaited" warning hides the fault.
                if inspect.iscoroutine(returned):
                    returned.close()
                raise TypeError(
                    "on_progress returned an awaitable: it must be a plain function "
                    "(hand async work to a task or a queue)"
                )
        except Exception:
            # The callback is the caller's code (a progress bar, a log line): its bug must
            # not throw away the vectors of a long job. Once with the traceback, then quietly.
            self._callback_errors += 1
            level = logging.WARNING if self._callback_errors == 1 else logging.DEBUG
            _log.log(
                level,
                "on_progress raised (%d time(s) in this call); the embedding call in scope %r "
                "carries on",
                self._callback_errors,
                self._scope,
                exc_info=True,
            )


def _check_progress(on_progress: object, scope: str) -> None:
    """Refuse an ``on_progress`` that is not a plain callable: an async one would never run."""
    if on_progress is None:
        return
    if (
        not callable(on_progress)
        or inspect.iscoroutinefunction(on_progress)
        # An object whose __call__ is async is as async as an async def (3.11 does not say so).
        or inspect.iscoroutinefunction(type(on_progress).__call__)
    ):
        raise RequestRejected(
            "on_progress must be a plain (not async) function taking an EmbeddingProgress",
            scope=scope,
        )


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
        if not text.isascii() and _SURROGATE.search(text) is not None:
            # Left by a decode with errors="surrogateescape": UTF-8 cannot encode it, so its
            # batch could never be sent. Refused here, before the other batches are paid for.
            raise RequestRejected(
                f"texts[{index}] holds a lone surrogate, which UTF-8 JSON cannot carry",
                scope=scope,
            )
    return items


def _check_format(fmt: object, where: str, scope: str) -> None:
    """Refuse an ``encoding_format`` other than float: any other answer is unreadable here."""
    # Not a set lookup: a caller's list or dict here must be refused, not crash on hashing.
    if fmt is not None and not (isinstance(fmt, str) and fmt == "float"):
        raise RequestRejected(
            f"{where}={fmt!r:.80} is not supported: vectors are read as float arrays",
            scope=scope,
        )


def _check_params(params: Mapping[str, Any], scope: str) -> None:
    """Refuse unknown or mistyped parameters, and those whose answer this client cannot read."""
    # The format first: the table's hint for a value it does not list is extra_body,
    # where the answer would be as unreadable (and every batch retried as malformed).
    _check_format(params.get("encoding_format"), "encoding_format", scope)
    check_embedding_params(params, scope)
    extra = params.get("extra_body")
    if extra:
        _check_format(extra.get("encoding_format"), "extra_body encoding_format", scope)


class EmbeddingClient(GovernedClient):
    """Embeddings of many texts, batched and through the one governance loop."""

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

    @overload
    async def embed(
        self,
        texts: Sequence[str],
        *,
        partial: Literal[False] = False,
        on_progress: ProgressCallback | None = None,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        priority_class: str | None = None,
        tenant: str | None = None,
        **params: Any,
    ) -> EmbeddingResponse: ...

    @overload
    async def embed(
        self,
        texts: Sequence[str],
        *,
        partial: Literal[True],
        on_progress: ProgressCallback | None = None,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        priority_class: str | None = None,
        tenant: str | None = None,
        **params: Any,
    ) -> PartialEmbeddingResponse: ...

    @overload
    async def embed(
        self,
        texts: Sequence[str],
        *,
        partial: bool,
        on_progress: ProgressCallback | None = None,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        priority_class: str | None = None,
        tenant: str | None = None,
        **params: Any,
    ) -> EmbeddingResponse | PartialEmbeddingResponse: ...

    async def embed(
        self,
        texts: Sequence[str],
        *,
        partial: bool = False,
        on_progress: ProgressCallback | None = None,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        priority_class: str | None = None,
        tenant: str | None = None,
        **params: Any,
    ) -> EmbeddingResponse | PartialEmbeddingResponse:
        """Vectors of ``texts`` in input order; ``params`` (dimensions, user, ...) checked, sent.

        ``params`` are those of the embeddings API, checked before any permit
        is taken (an unknown or mistyped one, or ``model=``, is refused);
        ``extra_body={...}`` carries provider fields unchecked.

        Every batch runs to its end, whatever its siblings do, before the call
        returns or raises. With ``partial=True`` batches that failed after their
        retries do not fail the call: it returns a ``PartialEmbeddingResponse``
        with ``None`` vectors and ``failed_spans`` where they were, and embedding
        those spans again completes the set. Without it the first failure in
        input order is raised, its ``.partial`` holding that same result.

        ``on_progress`` is called with an ``EmbeddingProgress`` once per finished
        batch (served or failed), on the event loop, never concurrently with
        itself, counts growing to the totals; it must be a plain function (hand
        async work to a task or a queue) and quick, since batches wait for it. An
        exception it raises is logged (logger ``polygateway.embedding``) and the
        call carries on: a progress display's bug does not cost the job.

        ``deadline_s`` bounds the whole call, every batch included. ``fail_fast``
        applies to the call: the first batch asks without waiting and the call
        fails with ``no_runnable`` when the scope cannot take it at once (its
        other batches are then not sent, and count as failed); the other batches
        start once it holds a permit and then queue behind the call's own
        permits like any batch (waiting for oneself is not "no runnable source").

        Raises:
            RequestRejected: a non-list, an empty string, a non-string item, a
                text with a lone surrogate, a bad parameter, a non-bool ``partial``,
                an async ``on_progress`` or a ``deadline_s`` that is not a finite,
                non-negative number (before any request), or a source answered
                400/413/422 to a batch (``.batch``, ``.partial``; not raised with
                ``partial=True``).
            AllSourcesExhausted: the loop gave up on a batch (``.reason``,
                ``.batch``, ``.partial``; not raised with ``partial=True``).
            GovernanceBackendError: the shared state failed (fail closed): every
                batch stops at once, even with ``partial=True``; ``.partial``
                holds what was computed before.
            GatewayError: the client is closed (``.partial`` when it closed
                during the call).
        """
        items = _check_texts(texts, self._scope)
        _check_params(params, self._scope)
        if not isinstance(partial, bool):
            raise RequestRejected(
                f"partial must be True or False, not {type(partial).__name__}", scope=self._scope
            )
        _check_progress(on_progress, self._scope)
        if deadline_s is not None and not check_deadline_s(deadline_s):
            # The loop checks it too, but only per batch: by then a negative deadline
            # would be every batch's deadline already passed, a string a TypeError.
            raise RequestRejected(
                "embed: deadline_s must be a finite, non-negative number of seconds, "
                f"not {deadline_s!r:.60}",
                scope=self._scope,
                sources=self._mw.sources,
            )
        flow = self._mw.check_flow(priority_class, tenant, "embed")
        self._life.check_open()
        spans = plan_batches(
            items, max_batch_size=self._max_batch_size, max_batch_tokens=self._max_batch_tokens
        )
        outcomes = _Outcomes(spans, len(items), on_progress, self._scope)
        dimensions = _Dimensions(_asked_dimensions(params))
        if spans:
            deadline_at = None if deadline_s is None else self._now() + deadline_s
            call = self._life.begin()
            try:
                async with call.running():
                    await self._run_batches(
                        items, outcomes, params, fail_fast, deadline_at, flow, dimensions
                    )
            except GatewayError as exc:
                # Fail closed, or closed under the call: what was computed still goes back.
                exc.partial = outcomes.partial()
                raise
            finally:
                self._life.end(call)
        failure = outcomes.first_error()
        if failure is None and not partial:
            return outcomes.complete()
        result = outcomes.partial()
        if partial:
            return result
        if failure is None:  # unreachable: a failed batch without an error has a failed probe
            raise RuntimeError("an embedding batch failed without an error")
        failure.partial = result
        raise failure

    async def _run_batches(
        self,
        items: list[str],
        outcomes: _Outcomes,
        params: Mapping[str, Any],
        fail_fast: bool,
        deadline_at: float | None,
        flow: tuple[str, str],
        dimensions: _Dimensions,
    ) -> None:
        """Every batch through the loop, concurrently, each to its end; a backend failure stops all.

        A batch's ``GatewayError`` is its outcome, kept in ``outcomes``; only a
        ``GovernanceBackendError`` (or a bug) leaves a batch task and makes the
        ``TaskGroup`` cancel the rest.
        """
        aborted: list[GovernanceBackendError] = []
        slots = asyncio.Semaphore(self._max_batch_tasks)
        # fail_fast: only the first batch asks without waiting; the rest follow its admission.
        gate = asyncio.Event()
        admitted = not fail_fast
        if admitted:
            gate.set()

        def admit() -> None:
            nonlocal admitted
            admitted = True
            gate.set()

        async def one(index: int, span: tuple[int, int]) -> None:
            try:
                if index > 0:
                    await gate.wait()
                    if not admitted:
                        # The first batch found the scope unable to take it: no_runnable is
                        # the call's answer, and asking again for each batch would change it.
                        outcomes.fail(index, None)
                        return
                try:
                    served = await self._embed_batch(
                        items,
                        span,
                        params,
                        fail_fast and index == 0,
                        deadline_at,
                        admit,
                        flow,
                        dimensions,
                    )
                except GovernanceBackendError as exc:
                    exc.batch = span
                    aborted.append(exc)
                    raise
                except GatewayError as exc:
                    exc.batch = span
                    outcomes.fail(index, exc)
                else:
                    outcomes.serve(index, served)
            finally:
                if index == 0:
                    gate.set()  # wakes the others even when the probe failed unadmitted
                slots.release()

        try:
            async with asyncio.TaskGroup() as group:
                for index, span in enumerate(outcomes.spans):
                    await slots.acquire()
                    if aborted:
                        # The group is aborting: a task created now would be refused.
                        slots.release()
                        break
                    group.create_task(one(index, span))
        except BaseExceptionGroup as errors:
            _, others = errors.split(GovernanceBackendError)
            if aborted and others is None:
                raise aborted[0] from None
            raise

    async def _embed_batch(
        self,
        items: list[str],
        span: tuple[int, int],
        params: Mapping[str, Any],
        fail_fast: bool,
        deadline_at: float | None,
        on_admitted: Callable[[], None],
        flow: tuple[str, str],
        dimensions: _Dimensions,
    ) -> Served[_Batch]:
        """One batch through the governance loop; a wrong vector count or size is malformed."""
        start, stop = span
        texts = items[start:stop]
        transport = self._transport

        async def attempt(source: SourceConfig, ctx: AttemptContext) -> _Batch:
            on_admitted()
            request = embedding_request(
                source,
                texts,
                params,
                timeout_s=ctx.timeout_s,
                on_hint=ctx.see_hint,
                extra_headers=ctx.headers,
            )
            body = await transport.send(request)
            vectors, usage = parse_embedding_response(body, len(texts))
            dimensions.check(vectors)
            ctx.usage = usage
            ctx.response_model = response_model(body)
            return _Batch(vectors, usage)

        left = None if deadline_at is None else max(0.0, deadline_at - self._now())
        return await self._mw.run(
            attempt,
            cost_tokens=estimate_embedding_tokens(texts),
            fail_fast=fail_fast,
            deadline_s=left,
            op_name="embed",
            priority_class=flow[0],
            tenant=flow[1],
        )
