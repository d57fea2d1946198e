"""A client's life: calls in flight, a graceful close, and the parts every client is built from.

``Lifecycle`` tracks the calls in flight (a request/response call, or an open
stream). ``aclose()`` stops new calls (``GatewayError("client closed")``),
waits for the calls in flight up to ``close_grace_s``, then cancels the ones
still running: a cancelled call releases its permit on the way out and its
caller gets ``GatewayError`` (the cancellation is converted, as
``asyncio.timeout`` converts its own, so the caller's task is not left
cancelled). A stream whose consumer is between two chunks is not interrupted
mid-air: its next read raises the same error.

``GovernedClient`` is the base of the chat, embedding and OCR clients:
settings to one ``RetryMW``, the shared backend, the transport, the
lifecycle, and the async context manager around them. A client collected
while still open emits a ``ResourceWarning`` (as aiohttp's ``ClientSession``
does): its transport's connections were never closed.
"""

from __future__ import annotations

import asyncio
import random
import time
import warnings
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Self, TypedDict, Unpack

from polygateway.backends.factory import shared_backend
from polygateway.errors import ConfigError, GatewayError
from polygateway.middleware.retry import LoopPolicy, RetryMW
from polygateway.middleware.telemetry import AttemptEmitter, ClientInfo, emitters_of
from polygateway.middleware.waiting import room_for
from polygateway.transport.factory import make_transport

if TYPE_CHECKING:
    from polygateway.backends.base import Backend
    from polygateway.config import GatewaySettings, ScopeConfig, SourceConfig
    from polygateway.transport.http import Transport

__all__ = [
    "ClientParts",
    "GovernedClient",
    "InFlight",
    "Lifecycle",
    "priority_shares",
    "reserved_permits",
]

Sleep = Callable[[float], Awaitable[None]]


class ClientParts(TypedDict, total=False):
    """The explicit parts of a client (keyword-only), typed once for ``from_settings``."""

    backend: Backend | None
    transport: Transport | None
    now: Callable[[], float] | None
    sleep: Sleep | None
    rng: random.Random | None
    emitter: AttemptEmitter | None
    emitters: Sequence[AttemptEmitter] | None


class InFlight:
    """One call in flight; ``running()`` marks the stretches when a task works on it.

    A close that runs out of grace cancels the task running the call (if one
    is) and marks the call closing, so its next stretch fails at once.
    """

    __slots__ = ("_baseline", "_task", "closing", "scope")

    def __init__(self, scope: str) -> None:
        self.scope = scope
        self.closing = False
        self._task: asyncio.Task[object] | None = None
        self._baseline = 0

    def cancel(self) -> None:
        """Stop the call: cancel its running stretch, fail the next one."""
        self.closing = True
        if self._task is not None:
            self._task.cancel()

    def running(self) -> InFlight:
        """Context of one stretch of work on the call, in the current task.

        The call is its own context manager (stretches of one call never
        overlap): a stream enters one stretch per chunk, so no object is made per stretch.
        """
        return self

    async def __aenter__(self) -> None:
        if self.closing:
            raise GatewayError("client closed", scope=self.scope)
        task = asyncio.current_task()
        if task is not None:
            self._task = task
            self._baseline = task.cancelling()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task, self._task = self._task, None
        if (
            exc_type is asyncio.CancelledError
            and self.closing
            and task is not None
            and task.uncancel() <= self._baseline
        ):
            # Our own cancellation (the close ran out of grace), not the caller's.
            raise GatewayError("client closed while the call was in flight", scope=self.scope)


class Lifecycle:
    """Open or closed, and the calls in flight; see the module docstring."""

    __slots__ = ("_calls", "_close_grace_s", "_closed", "_idle", "_scope", "_sleep")

    def __init__(self, *, scope: str, close_grace_s: float, sleep: Sleep) -> None:
        self._scope = scope
        self._close_grace_s = close_grace_s
        self._sleep = sleep
        self._closed = False
        self._calls: set[InFlight] = set()
        self._idle: asyncio.Event | None = None

    @property
    def closed(self) -> bool:
        """Whether ``aclose()`` has begun: no new call may start."""
        return self._closed

    @property
    def in_flight(self) -> int:
        """Calls started and not yet finished."""
        return len(self._calls)

    def check_open(self) -> None:
        """Raise ``GatewayError("client closed")`` once closing has begun."""
        if self._closed:
            raise GatewayError("client closed", scope=self._scope)

    def begin(self) -> InFlight:
        """Track a new call; ``end()`` must follow, whatever happens."""
        if self._closed:
            raise GatewayError("client closed", scope=self._scope)
        call = InFlight(self._scope)
        self._calls.add(call)
        return call

    def end(self, call: InFlight) -> None:
        """The call is over."""
        self._calls.discard(call)
        if not self._calls and self._idle is not None:
            self._idle.set()

    async def aclose(self) -> None:
        """Refuse new calls, give the running ones ``close_grace_s``, then cancel the rest."""
        self._closed = True
        if not await self._wait_idle():
            for call in list(self._calls):
                call.cancel()
            # Cancelled calls release their permits on the way out; wait for that too.
            await self._wait_idle()

    async def _wait_idle(self) -> bool:
        """Wait until no call is in flight or the grace has passed; ``True`` when idle."""
        if not self._calls:
            return True
        idle = self._idle = asyncio.Event()
        waiting = asyncio.ensure_future(idle.wait())
        timer = asyncio.ensure_future(self._sleep(self._close_grace_s))
        try:
            await asyncio.wait((waiting, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Cancel, never await: awaiting could swallow a cancellation of our caller.
            waiting.cancel()
            timer.cancel()
        return not self._calls


class GovernedClient:
    """What the chat, embedding and OCR clients share: one scope, its loop, backend and transport.

    Explicit parts (keyword-only) are for tests and embedding; without them
    the backend is the one shared per settings object (``shared_backend``),
    the transport is built from the settings, and time is the real clock.
    ``scope`` defaults to the subclass's ``DEFAULT_SCOPE``; a subclass with
    state of its own builds it in ``_setup()`` rather than repeating this
    constructor.
    """

    KIND: ClassVar[str] = ""
    """The scope kind a subclass serves (``chat``, ``embed`` or ``ocr``)."""
    DEFAULT_SCOPE: ClassVar[str] = ""
    """The scope a client binds to when none is named."""

    def __init__(
        self,
        settings: GatewaySettings,
        scope: str | None = None,
        *,
        backend: Backend | None = None,
        transport: Transport | None = None,
        now: Callable[[], float] | None = None,
        sleep: Sleep | None = None,
        rng: random.Random | None = None,
        emitter: AttemptEmitter | None = None,
        emitters: Sequence[AttemptEmitter] | None = None,
    ) -> None:
        scope = scope if scope is not None else self.DEFAULT_SCOPE
        config = settings.scope(scope)
        if config.kind != self.KIND:
            raise ConfigError(
                f"{type(self).__name__} serves scopes of kind {self.KIND!r}, "
                f"but scope {scope!r} is of kind {config.kind!r}",
                field=f"scopes.{scope}.kind",
                scope=scope,
            )
        self._config: ScopeConfig = config
        self._scope = scope
        self._now: Callable[[], float] = now if now is not None else time.monotonic  # edge
        self._sleep: Sleep = sleep if sleep is not None else asyncio.sleep  # edge
        # edge: selection and jitter need no cryptographic randomness.
        self._rng = rng if rng is not None else random.Random()  # noqa: S311
        self._backend = backend if backend is not None else shared_backend(settings)
        self._transport = (
            transport if transport is not None else _default_transport(settings, config.sources)
        )
        # ``emitter`` and ``emitters`` together: every record goes to each of them.
        telemetry = emitters_of(emitter, emitters)
        self._mw = RetryMW(
            scope=scope,
            sources=config.sources,
            policy=LoopPolicy.from_settings(settings, config),
            backend=self._backend,
            now=self._now,
            sleep=self._sleep,
            rng=self._rng,
            emitter=telemetry,
            priority_classes=priority_shares(config),
            default_priority_class=config.default_priority_class,
            reserved_permits=reserved_permits(config),
        )
        self._emitter = telemetry
        if telemetry is not None:
            room = room_for(self._backend, scope)
            telemetry.bind(
                ClientInfo(
                    self.KIND,
                    scope,
                    tuple(config.sources),
                    self._backend,
                    room.__len__,
                    room.by_class,
                )
            )
        self._life = Lifecycle(scope=scope, close_grace_s=settings.close_grace_s, sleep=self._sleep)
        self._setup()

    def _setup(self) -> None:
        """Build a subclass's own state, once every shared part above exists."""

    @classmethod
    def from_settings(
        cls, settings: GatewaySettings, scope: str | None = None, **parts: Unpack[ClientParts]
    ) -> Self:
        """A client of ``scope`` (default: the client's own kind of scope).

        Clients built from one settings object share one backend, so two
        clients of one scope in one process never double their limits.
        """
        return cls(settings, scope, **parts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scope={self._scope!r}, sources={list(self._mw.sources)!r})"

    @property
    def scope(self) -> str:
        """The scope this client is bound to."""
        return self._scope

    @property
    def backend(self) -> Backend:
        """The governance state this client shares with others."""
        return self._backend

    @property
    def closed(self) -> bool:
        """Whether the client is closing or closed."""
        return self._life.closed

    # Kept out of mutation testing: the collector runs a finalizer at any point, even inside
    # the mutation tool's own bookkeeping, which then crashes (research-wiki/MUTATION.md).
    def __del__(
        self, _warn: Callable[..., None] = warnings.warn
    ) -> None:  # pragma: no mutate block
        # Only a warning: a finalizer must not await, so it cannot close anything.
        # ``_warn`` is bound at definition, as aiohttp binds ``warnings``: at
        # interpreter exit the module's globals may be gone before this runs.
        life: Lifecycle | None = getattr(self, "_life", None)
        if life is not None and not life.closed:
            _warn(
                f"unclosed client {self!r}: use `async with` or `await client.aclose()`",
                ResourceWarning,
                source=self,
            )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop new calls, let calls in flight finish within ``close_grace_s``, close the transport.

        The shared backend stays open: other clients may use it.
        """
        if self._life.closed:
            return
        try:
            await self._life.aclose()
        finally:
            await self._transport.aclose()


def _default_transport(settings: GatewaySettings, sources: Sequence[SourceConfig]) -> Transport:
    """The transport the settings name, pooled to the scope's total concurrency.

    A missing extra (aiohttp) is a configuration error, like any other bad setting.
    """
    total = sum(s.max_concurrency for s in sources)
    try:
        return make_transport(settings.transport, sources, max_connections=total)
    except ImportError as exc:
        raise ConfigError(str(exc), field="transport") from exc


def priority_shares(config: ScopeConfig) -> dict[str, float]:
    """The scope's priority classes and their shares (empty: no classes)."""
    return {name: c.share for name, c in config.priority_classes.items()}


def reserved_permits(config: ScopeConfig) -> dict[str, int]:
    """The permits each class of the scope goes first for while below them (empty: none)."""
    return {name: c.reserved for name, c in config.priority_classes.items() if c.reserved}
