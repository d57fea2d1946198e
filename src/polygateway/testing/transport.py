"""``FakeTransport``: a scripted upstream that records what it was sent."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

from polygateway.testing.builders import chat_completion
from polygateway.testing.clock import FakeClock
from polygateway.transport.exchange import deadline_reached, deliver_hint
from polygateway.transport.http import HttpRequest, TransientError

__all__ = [
    "Delay",
    "FakeTransport",
    "Gate",
    "Hang",
    "Outcome",
    "ScriptExhausted",
    "StreamScript",
    "WithHeaders",
]


class Hang:
    """An upstream that never answers: time moves by exactly the attempt's timeout, then it fails.

    The timeout is the request's effective ``timeout_s`` (for a stream, its
    TTFT, or the stream's end, ``deadline_in_s``, when that comes first).
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return "Hang()"


@dataclass(frozen=True, slots=True)
class Delay:
    """Sleep ``seconds`` on the transport's fake sleep (other tasks run), then play ``outcome``.

    ``cut_at_timeout``: a delay longer than the request's effective timeout
    (for a stream, its TTFT or its end) is cut there and fails as a timeout,
    as a real transport would: a healthy source slower than a call's deadline.
    Off by default, so a script can also play an attempt of any length.
    """

    seconds: float
    outcome: Outcome
    cut_at_timeout: bool = False


@dataclass(frozen=True, slots=True)
class WithHeaders:
    """Play ``outcome`` and, if it is a success (a body or a stream), show ``headers`` first.

    The limits they announce reach the request's ``on_hint`` as a real
    transport hands them over: a source announcing its rate-limit window in a
    script. A failure carries its back-off in ``TransientError``.
    """

    headers: Mapping[str, str]
    outcome: Outcome


class Gate:
    """Hold requests until ``open()``, then play ``outcome``; ``entered`` counts arrivals.

    For tests that need an attempt in flight at a known moment (cancellation,
    FIFO order): ``await gate.wait_entered(n)`` returns once ``n`` requests wait.
    """

    __slots__ = ("_arrived", "_open", "entered", "outcome")

    def __init__(self, outcome: Outcome | None = None) -> None:
        self.outcome = outcome if outcome is not None else chat_completion()
        self.entered = 0
        self._open: asyncio.Event | None = None
        self._arrived: asyncio.Event | None = None

    def _events(self) -> tuple[asyncio.Event, asyncio.Event]:
        if self._open is None or self._arrived is None:
            self._open, self._arrived = asyncio.Event(), asyncio.Event()
        return self._open, self._arrived

    def open(self) -> None:
        """Let every held and future request through."""
        self._events()[0].set()

    async def wait_entered(self, count: int = 1) -> None:
        """Return once at least ``count`` requests have reached the gate."""
        _, arrived = self._events()
        while self.entered < count:
            arrived.clear()
            await arrived.wait()

    async def _pass(self) -> Outcome:
        opened, arrived = self._events()
        self.entered += 1
        arrived.set()
        await opened.wait()
        return self.outcome


@dataclass(frozen=True, slots=True)
class StreamScript:
    """A scripted SSE stream: ``events`` are the parsed ``data:`` payloads, in order.

    Args:
        done: end with ``[DONE]``; ``False`` ends like a cut connection
            (``TransientError(truncated=True)``).
        fail_after: after this many events, raise ``error`` (default: a reset).
        hang_before_first: time out waiting for the first event (TTFT).
        hang_after: after this many events, time out waiting for the next (idle).
        gap_s: fake time before each event after the first; a gap longer than
            the idle timeout fails as "stream idle" at that timeout.

    The TTFT rule of a real transport is played too: while no event the
    request's ``is_content`` accepts has been returned (a role-only chunk is
    not content), the wait for the next event, ``hang_after`` or ``gap_s``, is
    bounded by the TTFT counted from the stream's start (``timeout_s`` from
    the moment it was requested) and fails as "no first content" there; the
    idle timeout applies only after the first content. A request without
    ``is_content`` takes every event as content.

    A request with ``deadline_in_s`` is cut at that end as a real transport
    cuts it (the clock advanced to the end, then a timeout saying the call's
    deadline was reached), however well the script flows.
    """

    events: Sequence[Any]
    done: bool = True
    fail_after: int | None = None
    error: TransientError | None = None
    hang_before_first: bool = False
    hang_after: int | None = None
    gap_s: float = 0.0


Outcome = (
    Mapping[str, Any]
    | list[Any]
    | TransientError
    | Hang
    | Delay
    | Gate
    | WithHeaders
    | StreamScript
    | Callable[[HttpRequest], Any]
)


"""One scripted answer of ``FakeTransport``."""


class ScriptExhausted(AssertionError):
    """The test sent more requests than it scripted answers for."""


class FakeTransport:
    """A ``Transport`` that plays scripted outcomes and records every request.

    ``script`` is one sequence consumed by requests to any source, or a
    mapping of source name to its own sequence. Each outcome is: a dict (or
    list) returned as the JSON body; a ``TransientError`` raised; ``Hang()``;
    ``Delay(seconds, outcome)``; a ``Gate``; a callable taking the request
    (its result, awaited if need be, is played in turn); a ``StreamScript``
    for ``stream()``. When a script runs out, ``default`` is played, or
    ``ScriptExhausted`` raised.

    ``requests`` keeps each ``HttpRequest`` (whose repr hides headers and body);
    ``max_in_flight`` is the most requests and open streams at once.
    """

    def __init__(
        self,
        script: Sequence[Outcome] | Mapping[str, Sequence[Outcome]] = (),
        *,
        clock: FakeClock | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
        default: Outcome | None = None,
    ) -> None:
        self._shared: deque[Outcome] = deque()
        self._per_source: dict[str, deque[Outcome]] = {}
        if isinstance(script, Mapping):
            for name, outcomes in script.items():
                self._per_source[name] = deque(outcomes)
        else:
            self._shared.extend(script)
        self._clock = clock if clock is not None else FakeClock()
        self._sleep = sleep if sleep is not None else self._clock.sleep
        self.default = default
        self.requests: list[HttpRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.open_streams = 0
        self.closed = False

    def __repr__(self) -> str:
        return f"FakeTransport(requests={len(self.requests)}, in_flight={self.in_flight})"

    def add(self, *outcomes: Outcome, source: str | None = None) -> None:
        """Append outcomes to the shared script, or to one source's."""
        if source is None:
            self._shared.extend(outcomes)
        else:
            self._per_source.setdefault(source, deque()).extend(outcomes)

    def sources_called(self) -> list[str]:
        """Source name of each request, in order."""
        return [r.source for r in self.requests]

    def _next(self, request: HttpRequest) -> Outcome:
        queue = self._per_source.get(request.source)
        if queue is None or not queue:
            queue = self._shared
        if queue:
            return queue.popleft()
        if self.default is not None:
            return self.default
        raise ScriptExhausted(f"no scripted outcome left for a request to {request.source!r}")

    def _enter(self, request: HttpRequest) -> None:
        self.requests.append(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)

    async def _resolve(
        self, outcome: Outcome, request: HttpRequest, *, stream: bool, end: float
    ) -> Any:
        """Play an outcome up to the value it comes to: a body or a ``StreamScript``.

        ``end``: the fake clock's time when a stream is cut (``inf``: never).
        """
        spent = 0.0  # fake time this request's delays took so far
        headers: Mapping[str, str] | None = None
        while True:
            if isinstance(outcome, TransientError):
                raise outcome
            if isinstance(outcome, Hang):
                await self._time_out(request, request.timeout_s, end)
            if isinstance(outcome, Delay):
                if outcome.cut_at_timeout and outcome.seconds > min(
                    request.timeout_s - spent, end - self._clock()
                ):
                    await self._time_out(request, request.timeout_s - spent, end)
                await self._sleep(outcome.seconds)
                spent += outcome.seconds
                outcome = outcome.outcome
            elif isinstance(outcome, Gate):
                outcome = await outcome._pass()
            elif isinstance(outcome, WithHeaders):
                headers = outcome.headers
                outcome = outcome.outcome
            elif isinstance(outcome, StreamScript | Mapping | list):
                if isinstance(outcome, StreamScript) != stream:
                    kind = "StreamScript" if stream else "JSON body"
                    raise ScriptExhausted(f"expected a {kind} for {request.source!r}")
                if headers is not None:
                    deliver_hint(request, headers)
                return outcome
            else:
                result = outcome(request)
                outcome = await result if inspect.isawaitable(result) else result

    async def _time_out(self, request: HttpRequest, timeout_s: float, end: float) -> NoReturn:
        """Wait out ``timeout_s`` (or until ``end``, if sooner), then fail as that bound's."""
        left = end - self._clock()
        if left <= timeout_s:
            await self._sleep(max(0.0, left))
            raise deadline_reached(request)
        await self._sleep(timeout_s)
        raise TransientError(
            f"timed out at {request.source} after {request.timeout_s:g} s", timeout=True
        )

    def _end(self, request: HttpRequest) -> float:
        """When a stream starting now is cut: ``deadline_in_s`` from now on the fake clock."""
        left = request.deadline_in_s
        return math.inf if left is None else self._clock() + left

    async def send(self, request: HttpRequest) -> Any:
        """Play the next outcome for the request's source."""
        self._enter(request)
        try:
            # Only streams have an end: a request's timeout_s is already clipped to the deadline.
            return await self._resolve(self._next(request), request, stream=False, end=math.inf)
        finally:
            self.in_flight -= 1

    @asynccontextmanager
    async def stream(self, request: HttpRequest) -> AsyncIterator[AsyncIterator[Any]]:
        """Open a scripted stream; iterate its events until ``[DONE]``."""
        self._enter(request)
        self.open_streams += 1
        try:
            end = self._end(request)
            first = self._clock() + request.timeout_s
            script = await self._resolve(self._next(request), request, stream=True, end=end)
            yield _ScriptedEvents(script, request, self._sleep, self._clock, end, first)
        finally:
            self.open_streams -= 1
            self.in_flight -= 1

    async def aclose(self) -> None:
        """Mark the transport closed."""
        self.closed = True


class _ScriptedEvents:
    """The events of one ``StreamScript``, failing where it says, and cut at the stream's end."""

    __slots__ = ("_clock", "_content", "_end", "_first", "_i", "_request", "_script", "_sleep")

    def __init__(
        self,
        script: StreamScript,
        request: HttpRequest,
        sleep: Callable[[float], Awaitable[None]],
        clock: FakeClock,
        end: float,
        first: float,
    ) -> None:
        self._script = script
        self._request = request
        self._sleep = sleep
        self._clock = clock
        self._end = end
        self._first = first
        """The TTFT deadline on the fake clock: it bounds every wait until the first content."""
        self._content = request.is_content is None
        """An event with content was returned (always, for a request without ``is_content``)."""
        self._i = 0

    def __aiter__(self) -> _ScriptedEvents:
        return self

    async def _cut(self, timeout_s: float, what: str) -> NoReturn:
        """Wait out ``timeout_s`` (or until the end, if sooner), then fail as that bound's."""
        request = self._request
        left = self._end - self._clock()
        if left <= timeout_s:
            await self._sleep(max(0.0, left))
            raise deadline_reached(request)
        await self._sleep(timeout_s)
        raise TransientError(f"{what} at {request.source}", timeout=True)

    async def __anext__(self) -> Any:
        script, request, i = self._script, self._request, self._i
        if i == 0 and script.hang_before_first:
            await self._cut(request.timeout_s, "no first event")
        if script.fail_after is not None and i >= script.fail_after:
            raise script.error or TransientError(f"connection reset at {request.source}")
        if i > 0 and self._clock() >= self._end:
            # The end passed while the consumer held the last event.
            raise deadline_reached(request)
        if self._content:
            wait_s, what = request.idle_timeout_s or request.timeout_s, "stream idle"
        else:
            # No content yet: the TTFT, counted from the request, still bounds the wait.
            wait_s = max(0.0, self._first - self._clock())
            what = "no first content" if i else "no first event"
        if script.hang_after is not None and i >= script.hang_after:
            await self._cut(wait_s, what)
        if i >= len(script.events):
            if script.done:
                raise StopAsyncIteration
            raise TransientError(f"stream ended without [DONE] at {request.source}", truncated=True)
        if i > 0 and script.gap_s:
            if script.gap_s > min(wait_s, self._end - self._clock()):
                await self._cut(wait_s, what)
            await self._sleep(script.gap_s)
        self._i = i + 1
        event = script.events[i]
        if not self._content:
            is_content = request.is_content
            self._content = is_content is None or is_content(event)
        return event
