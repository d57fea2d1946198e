"""The chat client: ``complete()`` and ``stream()`` through the one governance loop.

A chat scope runs the loop with ``exempt_429=True``: a 429 does not burn
``max_attempts`` (the pacer and an exponential back-off absorb it) and the
main-loop stall rule bounds a saturated scope (research-wiki/designs/stall-budget.md).

A stream is one attempt from request to close: its permit is held, and
renewed every TTL/3 as chunks arrive, until iteration ends, the stream is
closed, or, for a bare ``async for`` that breaks early, the event loop
finalizes the iterator. Before the first chunk reaches the caller a failure
or a TTFT timeout fails over like any transient failure; after it, the
caller gets ``StreamInterrupted``. A stream that ends without ``[DONE]`` and
without a ``finish_reason`` is a failure. ``deadline_s`` is a hard bound for
a stream too: the transport cuts it at the call's deadline however well it
flows, and the caller gets ``AllSourcesExhausted(reason="deadline")``.

Each source speaks its own protocol's wire (``_ChatWire``: OpenAI chat
completions or Anthropic Messages), chosen per attempt from the source, so a
scope may mix both and fail over between them; the caller gets the same
``ChatResponse`` and ``ChatChunk`` whichever served. A ``response_model`` is
asked of each in its own way too (``transport/structured.py``), and
``ChatStream.response()`` puts a stream's chunks back together into the
``ChatResponse`` that ``complete()`` gives (``transport/assembly.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import warnings
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Coroutine,
    Mapping,
    Sequence,
)
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, overload

from polygateway.errors import StreamInterrupted
from polygateway.middleware.attempt import AttemptContext, Served
from polygateway.middleware.lifecycle import GovernedClient, InFlight
from polygateway.models import AttemptRecord, ChatChunk, ChatResponse
from polygateway.transport.anthropic import (
    MessagesStreamReader,
    answers_legacy_functions,
    event_model,
    messages_request,
    parse_messages_response,
    streamed_arguments,
)
from polygateway.transport.assembly import assemble_chat
from polygateway.transport.http import HintSink, HttpRequest, TransientError
from polygateway.transport.openai import (
    ChatChunkReader,
    ParsedChat,
    chat_request,
    estimate_chat_tokens,
    parse_chat_response,
)
from polygateway.transport.params import ChatCheck
from polygateway.transport.structured import AnswerFormat, answer_format
from polygateway.transport.wire import response_model

if TYPE_CHECKING:
    from pydantic import BaseModel

    from polygateway.config import SourceConfig
    from polygateway.middleware.retry import Call

__all__ = ["ChatClient", "ChatStream"]

Messages = Sequence[Mapping[str, Any]]

_M = TypeVar("_M", bound="BaseModel")


def _response(parsed: ParsedChat, served: Served[Any]) -> ChatResponse[Any]:
    """The answer of a served call, plain or assembled from a stream; ``parsed`` unset."""
    return ChatResponse(
        text=parsed.text,
        source=served.source,
        finish_reason=parsed.finish_reason,
        tool_calls=parsed.tool_calls,
        usage=parsed.usage,
        attempts=served.attempts,
        raw=parsed.raw,
        choices=parsed.choices,
        parsed=None,
        refusal=parsed.refusal,
    )


_ChunkParser = Callable[[Any, str], ChatChunk]
"""Reads one parsed stream event (and the source's name) into a chunk."""


class _RequestBuilder(Protocol):
    """Builds the ``HttpRequest`` of one chat attempt (``chat_request``, ``messages_request``)."""

    def __call__(
        self,
        source: SourceConfig,
        messages: Messages,
        params: Mapping[str, Any],
        *,
        stream: bool,
        timeout_s: float,
        ttft_timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
        on_hint: HintSink | None = None,
        extra_headers: Mapping[str, str] | None = None,
    ) -> HttpRequest: ...


@dataclass(frozen=True, slots=True)
class _ChatWire:
    """One protocol's chat wire: its request, its answer, and a chunk reader for each stream.

    ``chunk_reader`` is called once per stream: a stateless protocol hands
    back the same function every time, a stateful one a fresh reader.
    ``stream_arguments`` writes a streamed tool call's joined argument pieces
    as the protocol's completion writes them (``None``: as they came).
    ``event_model`` reads the model a stream event names, if it names one.
    ``parse_response`` and ``chunk_reader`` are given the call's parameters:
    an answer reads as what the call asked for (an Anthropic answer to legacy
    ``functions`` as OpenAI's ``function_call``).
    """

    request: _RequestBuilder
    parse_response: Callable[[Any, Mapping[str, Any]], ParsedChat]
    chunk_reader: Callable[[Mapping[str, Any]], _ChunkParser]
    stream_arguments: Callable[[str], str] | None = None
    event_model: Callable[[Any], str | None] = response_model


def _openai_response(body: Any, params: Mapping[str, Any]) -> ParsedChat:
    return parse_chat_response(body)


def _openai_chunks(params: Mapping[str, Any]) -> _ChunkParser:
    # A reader per stream: tool calls sent without index are numbered across its chunks.
    return ChatChunkReader().read


def _anthropic_response(body: Any, params: Mapping[str, Any]) -> ParsedChat:
    return parse_messages_response(body, legacy=answers_legacy_functions(params))


def _anthropic_chunks(params: Mapping[str, Any]) -> _ChunkParser:
    return MessagesStreamReader(legacy=answers_legacy_functions(params)).read


_WIRES: dict[str, _ChatWire] = {
    "openai": _ChatWire(chat_request, _openai_response, _openai_chunks),
    "anthropic": _ChatWire(
        messages_request,
        _anthropic_response,
        _anthropic_chunks,
        streamed_arguments,
        event_model,
    ),
}
"""The wire of each chat protocol, looked up once per attempt (never per chunk)."""


def _connection_ended(exc: TransientError) -> bool:
    """Whether a stream failed by its connection ending (closed, reset), not by a stall.

    After a ``finish_reason`` such an end loses nothing of the answer: a
    socket dropped without the body's last chunk (httpx's
    ``RemoteProtocolError``, aiohttp's ``ClientPayloadError``) ends it as
    surely as a clean close without ``[DONE]``. A timeout is not one: the
    source held the caller waiting.
    """
    return exc.truncated or (
        exc.status_code is None and not exc.timeout and exc.failure == "transient"
    )


def _cost(messages: Messages, params: Mapping[str, Any]) -> int:
    """The tpm reservation of one call (reconciled with real usage on release)."""
    limit = params.get("max_tokens", params.get("max_completion_tokens"))
    return estimate_chat_tokens(messages, limit if isinstance(limit, int) else None)


class ChatClient(GovernedClient):
    """Chat completions, plain and streamed, through the one governance loop."""

    KIND: ClassVar[str] = "chat"
    DEFAULT_SCOPE: ClassVar[str] = "chat"

    def _setup(self) -> None:
        """The checks of this scope's calls, from the protocols its sources speak."""
        self._check = ChatCheck(source.protocol for source in self._config.sources)

    @overload
    async def complete(
        self,
        messages: Messages,
        *,
        response_model: type[_M],
        fail_fast: bool = ...,
        deadline_s: float | None = ...,
        priority_class: str | None = ...,
        tenant: str | None = ...,
        **params: Any,
    ) -> ChatResponse[_M]: ...

    @overload
    async def complete(
        self,
        messages: Messages,
        *,
        response_model: None = ...,
        fail_fast: bool = ...,
        deadline_s: float | None = ...,
        priority_class: str | None = ...,
        tenant: str | None = ...,
        **params: Any,
    ) -> ChatResponse[None]: ...

    async def complete(
        self,
        messages: Messages,
        *,
        response_model: type[BaseModel] | None = None,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        priority_class: str | None = None,
        tenant: str | None = None,
        **params: Any,
    ) -> ChatResponse[Any]:
        """One chat completion; ``params`` (max_tokens, tools, ...) are checked, then sent.

        Messages and parameters are checked against the chat completions API
        before any permit is taken (``transport/params.py``): an unknown or
        mistyped parameter, ``model=``, ``stream=`` or a malformed message is
        refused. ``extra_body={...}`` carries provider fields unchecked.

        ``response_model=Model`` (a pydantic model class) asks each source for
        an answer of the model's JSON schema in its protocol's way and returns
        the validated instance as ``r.parsed`` (typed ``Model``); with
        ``n > 1``, the first choice is the one parsed. An answer that does not
        validate raises ``ResponseParseError`` after the source is released as
        a success and without trying another: the source served, and the
        model's answer to the same question elsewhere would cost as much and
        most likely fail alike (a refusal, an answer cut at ``max_tokens``);
        the error carries the text and the response for the caller to decide.
        A refusal (``r.refusal``: the model declined, as OpenAI reports it) is
        a served answer: without ``response_model`` it is returned; with one,
        the ``ResponseParseError`` says the model refused, its
        ``.response.refusal`` holding the refusal.

        Raises:
            RequestRejected: invalid messages or parameters (nothing sent;
                ``response_model`` together with ``response_format`` too), or a
                source answered 400/413/422.
            ResponseParseError: the answer is not a valid ``response_model``.
            AllSourcesExhausted: the loop gave up (``reason`` says why).
            GovernanceBackendError: the shared state failed (fail closed).
            GatewayError: the client is closed.
        """
        checked = self._check.complete(messages, params, self._scope)
        answer: AnswerFormat | None = None
        if response_model is not None:
            answer = answer_format(response_model, params, self._scope)
        call = self._life.begin()
        transport = self._transport

        async def attempt(source: SourceConfig, ctx: AttemptContext) -> ParsedChat:
            wire = _WIRES[source.protocol]
            sent = params if answer is None else answer.params(source.protocol, params)
            request = wire.request(
                source,
                checked,
                sent,
                stream=False,
                timeout_s=ctx.timeout_s,
                on_hint=ctx.see_hint,
                extra_headers=ctx.headers,
            )
            parsed = wire.parse_response(await transport.send(request), sent)
            if answer is not None:
                parsed = answer.read(source.protocol, parsed)
            ctx.usage = parsed.usage
            ctx.response_model = parsed.response_model()
            ctx.finish_reasons = parsed.finish_reasons()
            return parsed

        try:
            async with call.running():
                served = await self._mw.run(
                    attempt,
                    cost_tokens=_cost(checked, params),
                    fail_fast=fail_fast,
                    deadline_s=deadline_s,
                    op_name="chat.complete",
                    priority_class=priority_class,
                    tenant=tenant,
                )
        finally:
            self._life.end(call)
        response = _response(served.value, served)
        if answer is None:
            return response
        # Validated once the permit is back: whatever the answer, the source served.
        value = answer.validate(response, op_name="chat.complete", scope=self._scope)
        return dataclasses.replace(response, parsed=value)

    def stream(
        self,
        messages: Messages,
        *,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        priority_class: str | None = None,
        tenant: str | None = None,
        **params: Any,
    ) -> ChatStream:
        """A streamed completion: iterate it, or ``async with`` it and iterate inside.

        Nothing is sent until iteration (or the ``async with``) begins; the
        loop's errors (``AllSourcesExhausted``, ``RequestRejected``, ...) surface
        there. After the first chunk, a failure raises ``StreamInterrupted``;
        a stream still flowing at ``deadline_s`` is cut there and raises
        ``AllSourcesExhausted(reason="deadline")``.

        Raises:
            RequestRejected: invalid messages or parameters, checked as for
                ``complete()`` (at once, before anything is sent; ``stream=`` is
                refused here too).
            GatewayError: the client is closed.
        """
        checked = self._check.stream(messages, params, self._scope)
        self._mw.check_flow(priority_class, tenant, "chat.stream")
        self._life.check_open()
        return ChatStream(
            self,
            checked,
            params,
            fail_fast=fail_fast,
            deadline_s=deadline_s,
            flow=(priority_class, tenant),
        )


_CLEANUPS: set[asyncio.Task[None]] = set()
"""Streams' clean-ups running in tasks of their own: held here until done (the loop keeps
weak references)."""


def _cleanup(aw: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    """Run a clean-up in a task of its own, kept until done; its error is the awaiter's, if any."""
    task = asyncio.get_running_loop().create_task(aw)
    _CLEANUPS.add(task)
    task.add_done_callback(_cleanup_done)
    return task


def _cleanup_done(task: asyncio.Task[None]) -> None:
    _CLEANUPS.discard(task)
    if not task.cancelled():
        # Retrieved here too: an awaiter cancelled meanwhile is no longer there to see it.
        task.exception()


async def _close_connection(stack: AsyncExitStack) -> None:
    """Close a stream's connection (its transport context); a cancellation stops only the wait.

    The close runs in a task of its own, shielded: httpx awaits while it closes a
    response, and a second cancellation landing there would leave the socket open.
    """
    await asyncio.shield(_cleanup(stack.aclose()))


class _Opened:
    """A stream that reached its first chunk: the connection, the events, what was read."""

    __slots__ = ("buffered", "ended", "events", "finish_seen", "parse", "stack", "wire")

    def __init__(
        self,
        stack: AsyncExitStack,
        events: AsyncIterator[Any],
        parse: _ChunkParser,
        wire: _ChatWire,
    ) -> None:
        self.stack = stack
        self.events = events
        self.parse = parse
        """The source's protocol's chunk reader, this stream's own."""
        self.wire = wire
        self.buffered: deque[ChatChunk] = deque()
        self.ended = False
        self.finish_seen = False


class ChatStream:
    """A streamed chat answer: an async iterator of ``ChatChunk`` and an async context manager.

    ``async with chat.stream(...) as s: async for c in s`` releases the permit
    at context exit at the latest; a bare ``async for c in chat.stream(...)``
    releases it when iteration ends or, if the loop breaks early, when the
    event loop finalizes the iterator (a few loop turns later). A stream is
    consumed once. ``deadline_s`` bounds the whole call, stream included:
    the TTFT and idle timeouts of each attempt are clipped to the time left
    when it begins, and a stream still flowing when the deadline comes is cut
    there, after the chunks delivered before it, with
    ``AllSourcesExhausted(reason="deadline")`` (the attempt released as
    cancelled: the caller's deadline is not the source's failure).
    A consumer that stops early releases the permit as cancelled (only a
    clean end counts as a success); so does ``aclose()`` from another task,
    which ends the reading task's loop quietly, and so does the collection of
    a stream entered and never exited (with a ``ResourceWarning``).

    ``await s.response()`` is the whole answer as a ``ChatResponse``,
    assembled from the chunks: after iterating, or instead of it (it reads
    the stream to its end itself).
    """

    __slots__ = (
        "_chunks",
        "_client",
        "_deadline_s",
        "_delivered",
        "_ended",
        "_fail_fast",
        "_flow",
        "_in_flight",
        "_loop",
        "_loop_call",
        "_messages",
        "_params",
        "_reader",
        "_response",
        "_served",
        "_started",
        "_stopped",
    )

    def __init__(
        self,
        client: ChatClient,
        messages: list[Mapping[str, Any]],
        params: Mapping[str, Any],
        *,
        fail_fast: bool,
        deadline_s: float | None,
        flow: tuple[str | None, str | None] = (None, None),
    ) -> None:
        self._client = client
        self._flow = flow  # (priority_class, tenant)
        self._messages = messages
        self._params = params
        self._fail_fast = fail_fast
        self._deadline_s = deadline_s
        self._started = False
        self._delivered = 0
        self._chunks: list[ChatChunk] = []
        """Every chunk delivered, for ``response()``."""
        self._ended = False
        """Whether the stream reached its clean end."""
        self._response: ChatResponse[None] | None = None
        self._in_flight: InFlight | None = None
        self._loop_call: Call | None = None
        self._served: Served[_Opened] | None = None
        self._reader: asyncio.Task[Any] | None = None
        """The task inside a read right now (``None`` between reads)."""
        self._stopped: asyncio.Future[None] | None = None
        """Set when a close from another task stopped the reader; done once it has closed."""
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop of an ``async with`` entry: where a stream collected open is closed."""

    def __repr__(self) -> str:
        state = "open" if self._served is not None else "started" if self._started else "new"
        return f"ChatStream(scope={self._client.scope!r}, {state}, chunks={self._delivered})"

    @property
    def source(self) -> str | None:
        """The source serving the stream, once it has opened."""
        return self._served.source if self._served is not None else None

    @property
    def attempts(self) -> tuple[AttemptRecord, ...]:
        """The attempt records of this stream so far."""
        return self._served.attempts if self._served is not None else ()

    # --- opening and reading ----------------------------------------------------

    def _start(self) -> None:
        if self._started:
            raise RuntimeError("a ChatStream is consumed once")
        self._started = True

    async def _open_attempt(self, source: SourceConfig, ctx: AttemptContext) -> _Opened:
        """One attempt: open the stream and read up to its first deliverable chunk."""
        wire = _WIRES[source.protocol]
        request = wire.request(
            source,
            self._messages,
            self._params,
            stream=True,
            timeout_s=ctx.timeout_s,
            ttft_timeout_s=ctx.ttft_timeout_s,
            idle_timeout_s=ctx.idle_timeout_s,
            on_hint=ctx.see_hint,
            extra_headers=ctx.headers,
        )
        if ctx.deadline_in_s is not None:
            # The stream's end: the transport cuts it there, however well it flows.
            request = dataclasses.replace(request, deadline_in_s=ctx.deadline_in_s)
        stack = AsyncExitStack()
        try:
            events = await stack.enter_async_context(self._client._transport.stream(request))
            opened = _Opened(stack, aiter(events), wire.chunk_reader(self._params), wire)
            await self._fill(opened, ctx)
        except BaseException:
            # Clean-up only: the connection closes, the failure goes on to the loop.
            await _close_connection(stack)
            raise
        ctx.ttft_s = self._client._now() - ctx.started_at
        return opened

    async def _fill(self, opened: _Opened, ctx: AttemptContext) -> None:
        """Read events until one deliverable chunk is buffered or the stream has cleanly ended."""
        source = ctx.source
        while not opened.buffered and not opened.ended:
            try:
                event = await anext(opened.events)
            except StopAsyncIteration:
                opened.ended = True
                break
            except TransientError as exc:
                if opened.finish_seen and _connection_ended(exc):
                    # Closed without [DONE] but after a finish_reason (how every
                    # Anthropic stream ends, cleanly or by a dropped socket): the
                    # answer is whole.
                    opened.ended = True
                    break
                raise
            if not self._delivered and ctx.response_model is None:
                # Named by the events before the first chunk (every OpenAI chunk, Anthropic's
                # message_start): looked for no further, as it is per event.
                ctx.response_model = opened.wire.event_model(event)
            chunk = opened.parse(event, source)
            if chunk.usage is not None:
                ctx.usage = chunk.usage
            if chunk.finish_reason is not None:
                opened.finish_seen = True
                ctx.finish_reasons = (chunk.finish_reason,)
            # Worth handing to the caller: content (a refusal too), or usage once content has
            # begun. A bare role announcement is not, nor usage before any content (vLLM's
            # continuous usage stats): a source that stalls after it still fails over, as its
            # TTFT says.
            if (
                chunk.text
                or chunk.tool_calls
                or chunk.finish_reason
                or chunk.refusal
                or (chunk.usage and (self._delivered or opened.buffered))
            ):
                opened.buffered.append(chunk)

    async def _read(self, served: Served[_Opened]) -> ChatChunk | None:
        """The next chunk, or ``None`` after a clean end (which marks the attempt a success)."""
        opened = served.value
        if not opened.buffered and not opened.ended:
            await self._fill(opened, served.ctx)
            if served.renew_due():
                await served.renew_if_due()
        if opened.buffered:
            self._delivered += 1
            chunk = opened.buffered.popleft()
            self._chunks.append(chunk)
            return chunk
        served.complete()
        self._ended = True
        return None

    async def _enter(self) -> None:
        """Begin the call and run the loop until a source answers (the permit is then held)."""
        life = self._client._life
        in_flight = self._in_flight = life.begin()
        try:
            async with in_flight.running():
                loop_call = self._client._mw.begin(
                    cost_tokens=_cost(self._messages, self._params),
                    fail_fast=self._fail_fast,
                    deadline_s=self._deadline_s,
                    op_name="chat.stream",
                    streaming=True,
                    priority_class=self._flow[0],
                    tenant=self._flow[1],
                )
                self._served = await loop_call.serve(self._open_attempt)
                self._loop_call = loop_call
        except BaseException:
            self._in_flight = None
            life.end(in_flight)
            raise

    async def _close(self, exc: BaseException | None) -> None:
        """Close the connection, then release the permit with how the stream ended (``exc``).

        Runs once; later calls do nothing. A stream cut at the call's deadline
        raises ``AllSourcesExhausted(reason="deadline")`` from here.

        Called from another task while one waits inside a read (``aclose()``
        behind a "stop" button), it stops that read instead of closing the
        connection under it, and returns once the reader has closed the
        stream: the reader's iteration ends, quietly, as a closed stream's does.
        """
        reader = self._reader
        if reader is not None and reader is not asyncio.current_task():
            await self._stop(reader)
            return
        loop_call, self._loop_call = self._loop_call, None
        served = self._served
        try:
            if loop_call is not None and served is not None:
                try:
                    await _close_connection(served.value.stack)
                finally:
                    await loop_call.finish(served, exc)
        finally:
            in_flight, self._in_flight = self._in_flight, None
            if in_flight is not None:
                self._client._life.end(in_flight)
            stopped = self._stopped
            if stopped is not None and not stopped.done():
                stopped.set_result(None)

    async def _stop(self, reader: asyncio.Task[Any]) -> None:
        """Cancel ``reader``'s read, then wait (shielded) until it has closed the stream."""
        stopped = self._stopped
        if stopped is None:
            stopped = self._stopped = asyncio.get_running_loop().create_future()
            reader.cancel()
        await asyncio.shield(stopped)

    def _interrupted(self, exc: TransientError) -> StreamInterrupted:
        source = self._served.source if self._served is not None else ""
        return StreamInterrupted(
            f"chat.stream: the stream from {source} failed after {self._delivered} chunks: {exc}",
            scope=self._client.scope,
            sources=(source,) if source else (),
            chunks_delivered=self._delivered,
        )

    # --- iteration, bare or inside ``async with`` ----------------------------------

    def __aiter__(self) -> AsyncIterator[ChatChunk]:
        if self._loop_call is not None:
            return self._iterate(bare=False)
        self._start()
        # An async generator: if the consumer breaks early and drops it, the event
        # loop's asyncgen finalizer runs its clean-up, which releases the permit.
        return self._iterate(bare=True)

    async def _iterate(self, *, bare: bool) -> AsyncGenerator[ChatChunk, None]:
        """The chunks to the stream's end; a bare ``async for`` also opens and closes it.

        Inside ``async with`` a consumer that stops early leaves the stream
        open for the context's exit to close; a bare one closes it at once.
        """
        if bare:
            await self._enter()
        in_flight, served = self._in_flight, self._served
        if in_flight is None or served is None:
            return
        task = asyncio.current_task()
        while self._loop_call is not None:
            try:
                async with in_flight.running():
                    baseline = task.cancelling() if task is not None else 0
                    self._reader = task
                    try:
                        chunk = await self._read(served)
                    finally:
                        self._reader = None
            except TransientError as exc:
                await self._close(exc)
                raise self._interrupted(exc) from exc
            except asyncio.CancelledError as exc:
                # A close from another task (``_stop``) is not this task's cancellation:
                # withdrawn as asyncio.timeout withdraws its own, and the iteration ends.
                stopped = (
                    self._stopped is not None and task is not None and task.uncancel() <= baseline
                )
                await self._close(None if stopped else exc)
                if stopped:
                    return
                raise
            except BaseException as exc:
                # Clean-up only (cancelled, client closed): release, re-raise.
                await self._close(exc)
                raise
            if chunk is None:
                await self._close(None)
                return
            try:
                yield chunk
            except BaseException as exc:
                # The bare consumer is gone (GeneratorExit) or threw in: release as it ended.
                if bare:
                    await self._close(exc)
                raise

    # --- as a context manager ----------------------------------------------------

    async def __aenter__(self) -> ChatStream:
        self._start()
        self._loop = asyncio.get_running_loop()
        await self._enter()
        return self

    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        # Entered and never exited (a lost __aexit__): warn, as an unclosed client
        # does, and close it on its loop, as the loop closes a dropped async generator;
        # otherwise its permit would wait for the lease's expiry. A bare ``async for``
        # is closed by its generator's finalizer instead.
        loop = self._loop
        if loop is None or self._loop_call is None:
            return
        _warn(
            f"unclosed {self!r}: exit its async with or aclose() it", ResourceWarning, source=self
        )
        if not loop.is_closed():
            loop.call_soon_threadsafe(self._close_collected)

    def _close_collected(self) -> None:
        """Close a stream collected open (released as cancelled), in a task kept until done."""
        _cleanup(self._close(None))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close(exc)

    async def aclose(self) -> None:
        """Stop the stream and release its permit (as cancelled unless it had ended).

        Safe from another task than the one iterating: a read waiting there
        is stopped and that iteration ends without an error.
        """
        await self._close(None)

    # --- the whole answer ----------------------------------------------------------

    async def response(self) -> ChatResponse[None]:
        """The whole answer, as ``complete()`` would return it, assembled from the chunks.

        Called instead of iterating (``await chat.stream(...).response()``, or
        first thing inside ``async with``), it reads the stream to its end
        itself; called inside ``async with`` after some chunks, it reads the
        rest; after a stream iterated to its end, it only assembles. The same
        object is returned on every call. Text, tool calls (their pieces
        joined by ``ToolCallDelta.index``), finish reason, usage (``Usage()``
        when the provider sent none), source and attempts are as
        ``complete()`` gives them for the same answer; ``raw`` is a
        ``chat.completion`` object built from them (a stream has no one JSON
        answer); ``choices`` holds the one choice a stream follows.

        Raises:
            AllSourcesExhausted, RequestRejected, StreamInterrupted, ...: as
                iterating the stream raises them, when this call reads it.
            RuntimeError: the stream was closed, failed, or is being read by
                a bare ``async for`` (nothing to read the rest from).
        """
        if self._response is not None:
            return self._response
        if not self._ended and (not self._started or self._loop_call is not None):
            async for _ in self:
                pass
        if not self._ended or self._served is None:
            raise RuntimeError(
                "ChatStream.response(): the stream did not reach its end "
                "(closed, failed, or being read elsewhere)"
            )
        served = self._served
        parsed = assemble_chat(self._chunks, arguments=served.value.wire.stream_arguments)
        self._response = _response(parsed, served)
        return self._response
