"""The chat client: ``complete()`` and ``stream()`` through the one governance loop.

A chat scope runs the loop with ``exempt_429=True``: a 429 does not burn
``max_attempts`` (the pacer and an exponential back-off absorb it) and the
main-loop stall rule bounds a saturated scope (DESIGN.md section 5).

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
``ChatResponse`` and ``ChatChunk`` whichever served.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from polygateway.errors import RequestRejected, StreamInterrupted
from polygateway.middleware.attempt import AttemptContext, Served
from polygateway.middleware.lifecycle import GovernedClient, InFlight
from polygateway.models import AttemptRecord, ChatChunk, ChatResponse, positional_builder
from polygateway.transport.anthropic import (
    MessagesStreamReader,
    messages_request,
    parse_messages_response,
)
from polygateway.transport.http import HintSink, HttpRequest, TransientError
from polygateway.transport.openai import (
    ParsedChat,
    chat_request,
    estimate_chat_tokens,
    parse_chat_chunk,
    parse_chat_response,
)

if TYPE_CHECKING:
    from polygateway.config import SourceConfig

__all__ = ["ChatClient", "ChatStream"]

Messages = Sequence[Mapping[str, Any]]

_new_response = positional_builder(ChatResponse)
"""``ChatResponse`` without the frozen dataclass's per-field ``__setattr__`` (one per call)."""


def _check_messages(messages: object, scope: str) -> list[Mapping[str, Any]]:
    """The caller's messages, or ``RequestRejected`` before any request is sent."""
    if type(messages) is list and messages:
        # The common case, checked without the ABCs' slower isinstance.
        for message in messages:
            if type(message) is not dict:
                break
            role = message.get("role")
            if type(role) is not str or not role:
                break
        else:
            return list(messages)
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise RequestRejected("messages must be a list of message dicts", scope=scope)
    if not messages:
        raise RequestRejected("messages must not be empty", scope=scope)
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RequestRejected(f"messages[{i}] is not a dict", scope=scope)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise RequestRejected(f"messages[{i}] has no role", scope=scope)
    return list(messages)


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
    ) -> HttpRequest: ...


@dataclass(frozen=True, slots=True)
class _ChatWire:
    """One protocol's chat wire: its request, its answer, and a chunk reader for each stream.

    ``chunk_reader`` is called once per stream: a stateless protocol hands
    back the same function every time, a stateful one a fresh reader.
    """

    request: _RequestBuilder
    parse_response: Callable[[Any], ParsedChat]
    chunk_reader: Callable[[], _ChunkParser]


def _openai_chunks() -> _ChunkParser:
    return parse_chat_chunk


def _anthropic_chunks() -> _ChunkParser:
    return MessagesStreamReader().read


_WIRES: dict[str, _ChatWire] = {
    "openai": _ChatWire(chat_request, parse_chat_response, _openai_chunks),
    "anthropic": _ChatWire(messages_request, parse_messages_response, _anthropic_chunks),
}
"""The wire of each chat protocol, looked up once per attempt (never per chunk)."""


def _cost(messages: Messages, params: Mapping[str, Any]) -> int:
    """The tpm reservation of one call (reconciled with real usage on release)."""
    limit = params.get("max_tokens", params.get("max_completion_tokens"))
    return estimate_chat_tokens(messages, limit if isinstance(limit, int) else None)


class ChatClient(GovernedClient):
    """Chat completions, plain and streamed, governed per DESIGN.md section 5."""

    KIND: ClassVar[str] = "chat"
    DEFAULT_SCOPE: ClassVar[str] = "chat"

    async def complete(
        self,
        messages: Messages,
        *,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        **params: Any,
    ) -> ChatResponse:
        """One chat completion; ``params`` (max_tokens, tools, ...) go to the provider as given.

        Raises:
            RequestRejected: invalid messages, or a source answered 400/413/422.
            AllSourcesExhausted: the loop gave up (``reason`` says why).
            GovernanceBackendError: the shared state failed (fail closed).
            GatewayError: the client is closed.
        """
        checked = _check_messages(messages, self._scope)
        call = self._life.begin()
        transport = self._transport

        async def attempt(source: SourceConfig, ctx: AttemptContext) -> ParsedChat:
            wire = _WIRES[source.protocol]
            request = wire.request(
                source, checked, params, stream=False, timeout_s=ctx.timeout_s, on_hint=ctx.see_hint
            )
            parsed = wire.parse_response(await transport.send(request))
            ctx.usage = parsed.usage
            return parsed

        try:
            # call.running() entered and left by hand: no two coroutines per call.
            call.enter()
            try:
                served = await self._mw.run(
                    attempt,
                    cost_tokens=_cost(checked, params),
                    fail_fast=fail_fast,
                    deadline_s=deadline_s,
                    op_name="chat.complete",
                )
            except BaseException as exc:
                call.leave(type(exc))
                raise
            call.leave(None)
        finally:
            self._life.end(call)
        parsed = served.value
        # ChatResponse's fields in order: text, source, finish_reason, tool_calls, usage,
        # attempts, raw.
        return _new_response(
            parsed.text,
            served.source,
            parsed.finish_reason,
            parsed.tool_calls,
            parsed.usage,
            served.attempts,
            parsed.raw,
        )

    def stream(
        self,
        messages: Messages,
        *,
        fail_fast: bool = False,
        deadline_s: float | None = None,
        **params: Any,
    ) -> ChatStream:
        """A streamed completion: iterate it, or ``async with`` it and iterate inside.

        Nothing is sent until iteration (or the ``async with``) begins; the
        loop's errors (``AllSourcesExhausted``, ``RequestRejected``, ...) surface
        there. After the first chunk, a failure raises ``StreamInterrupted``;
        a stream still flowing at ``deadline_s`` is cut there and raises
        ``AllSourcesExhausted(reason="deadline")``.

        Raises:
            RequestRejected: invalid messages, or ``stream_options`` that is not
                an object (at once, before anything is sent).
            GatewayError: the client is closed.
        """
        checked = _check_messages(messages, self._scope)
        options = params.get("stream_options")
        if options is not None and not isinstance(options, Mapping):
            # A stream's request adds include_usage to these options: they must be an object.
            raise RequestRejected(
                f"stream_options must be an object, not {type(options).__name__}",
                scope=self._scope,
            )
        self._life.check_open()
        return ChatStream(self, checked, params, fail_fast=fail_fast, deadline_s=deadline_s)


class _Opened:
    """A stream that reached its first chunk: the connection, the events, what was read."""

    __slots__ = ("buffered", "ended", "events", "finish_seen", "parse", "stack")

    def __init__(
        self, stack: AsyncExitStack, events: AsyncIterator[Any], parse: _ChunkParser
    ) -> None:
        self.stack = stack
        self.events = events
        self.parse = parse
        """The source's protocol's chunk reader, this stream's own."""
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
    clean end counts as a success).
    """

    __slots__ = (
        "_call",
        "_client",
        "_cm",
        "_deadline_s",
        "_delivered",
        "_fail_fast",
        "_messages",
        "_params",
        "_served",
        "_started",
    )

    def __init__(
        self,
        client: ChatClient,
        messages: list[Mapping[str, Any]],
        params: Mapping[str, Any],
        *,
        fail_fast: bool,
        deadline_s: float | None,
    ) -> None:
        self._client = client
        self._messages = messages
        self._params = params
        self._fail_fast = fail_fast
        self._deadline_s = deadline_s
        self._started = False
        self._delivered = 0
        self._call: InFlight | None = None
        self._cm: AbstractAsyncContextManager[Served[_Opened]] | None = None
        self._served: Served[_Opened] | None = None

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
        )
        if ctx.deadline_in_s is not None:
            # The stream's end: the transport cuts it there, however well it flows.
            request = dataclasses.replace(request, deadline_in_s=ctx.deadline_in_s)
        stack = AsyncExitStack()
        try:
            events = await stack.enter_async_context(self._client._transport.stream(request))
            opened = _Opened(stack, aiter(events), wire.chunk_reader())
            await self._fill(opened, ctx)
        except BaseException:
            # Clean-up only: the connection closes, the failure goes on to the loop.
            await stack.aclose()
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
                if exc.truncated and opened.finish_seen:
                    # Closed without [DONE] but after a finish_reason (how every
                    # Anthropic stream ends): the answer is whole.
                    opened.ended = True
                    break
                raise
            chunk = opened.parse(event, source)
            if chunk.usage is not None:
                ctx.usage = chunk.usage
            if chunk.finish_reason is not None:
                opened.finish_seen = True
            # Worth handing to the caller: content, or usage once content has begun. A bare
            # role announcement is not, nor usage before any content (vLLM's continuous
            # usage stats): a source that stalls after it still fails over, as its TTFT says.
            if (
                chunk.text
                or chunk.tool_calls
                or chunk.finish_reason
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
            return opened.buffered.popleft()
        served.complete()
        return None

    @asynccontextmanager
    async def _session(self) -> AsyncIterator[Served[_Opened]]:
        """The loop's session for this stream, closing the connection before the release."""
        client = self._client
        async with client._mw.session(
            self._open_attempt,
            cost_tokens=_cost(self._messages, self._params),
            fail_fast=self._fail_fast,
            deadline_s=self._deadline_s,
            op_name="chat.stream",
            streaming=True,
        ) as served:
            try:
                yield served
            finally:
                await served.value.stack.aclose()

    def _interrupted(self, exc: TransientError) -> StreamInterrupted:
        source = self._served.source if self._served is not None else ""
        return StreamInterrupted(
            f"chat.stream: the stream from {source} failed after {self._delivered} chunks: {exc}",
            scope=self._client.scope,
            sources=(source,) if source else (),
            chunks_delivered=self._delivered,
        )

    # --- bare iteration ----------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[ChatChunk]:
        if self._cm is not None:
            return self._iterate_entered()
        self._start()
        # An async generator: if the consumer breaks early and drops it, the event
        # loop's asyncgen finalizer runs its finally, which releases the permit.
        return self._iterate_bare()

    async def _iterate_bare(self) -> AsyncGenerator[ChatChunk, None]:
        life = self._client._life
        call = self._call = life.begin()
        try:
            async with call.running():
                cm = self._session()
                served = await cm.__aenter__()
            try:
                self._served = served
                while True:
                    async with call.running():
                        chunk = await self._read(served)
                    if chunk is None:
                        break
                    yield chunk
            except TransientError as exc:
                await cm.__aexit__(type(exc), exc, exc.__traceback__)
                raise self._interrupted(exc) from exc
            except BaseException as exc:
                # Clean-up only (consumer gone, cancelled, client closed): release, re-raise.
                await cm.__aexit__(type(exc), exc, exc.__traceback__)
                raise
            await cm.__aexit__(None, None, None)
        finally:
            life.end(call)

    # --- as a context manager ----------------------------------------------------

    async def __aenter__(self) -> ChatStream:
        self._start()
        life = self._client._life
        call = self._call = life.begin()
        try:
            async with call.running():
                cm = self._session()
                self._served = await cm.__aenter__()
                self._cm = cm
        except BaseException:
            life.end(call)
            raise
        return self

    async def _iterate_entered(self) -> AsyncGenerator[ChatChunk, None]:
        served, call = self._served, self._call
        if served is None or call is None:
            return
        while self._cm is not None:
            try:
                async with call.running():
                    chunk = await self._read(served)
            except TransientError as exc:
                await self._exit(type(exc), exc, exc.__traceback__)
                raise self._interrupted(exc) from exc
            except BaseException as exc:
                await self._exit(type(exc), exc, exc.__traceback__)
                raise
            if chunk is None:
                await self._exit(None, None, None)
                return
            yield chunk

    async def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Leave the session once: release the permit with how the stream ended."""
        cm, self._cm = self._cm, None
        if cm is None:
            return
        try:
            await cm.__aexit__(exc_type, exc, tb)
        finally:
            if self._call is not None:
                self._client._life.end(self._call)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._exit(exc_type, exc, tb)

    async def aclose(self) -> None:
        """Stop the stream and release its permit (as cancelled unless it had ended)."""
        await self._exit(None, None, None)
