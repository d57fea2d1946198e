"""Test kit, public so users can test their own code against PolyGateway without a network.

- ``FakeClock``: a monotonic clock advanced by hand or by its fake ``sleep``.
- ``BoundedSleep``: a fake sleep that fails the test after N calls instead of looping forever.
- ``FakeTimers``: virtual time for many concurrent sleepers, woken in deadline order;
  ``settle()`` lets the event loop run a few turns.
- ``FakeTransport``: a scripted upstream (bodies, ``TransientError``, ``Hang``,
  ``Delay``, ``Gate``, callables, ``StreamScript``) that records what it was sent.
- ``Recorder``: an emitter that keeps every attempt record.
- ``CountingBackend``: wraps a backend, counts its operations, can hold ``acquire``.
- ``TransientError``: re-exported, to script failures.
- Builders of provider bodies: ``chat_completion``, ``chat_chunk_events``, ``embedding_body``;
  and ``gateway_settings`` for a one-scope configuration in code.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import math
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, NoReturn

from pydantic import SecretStr

from polygateway.backends.base import (
    AcquireResult,
    AttemptOutcome,
    Backend,
    Lease,
    ScopeSnapshot,
    SourceSpec,
)
from polygateway.backends.waiting import WaitingRoom
from polygateway.config import GatewaySettings, ScopeConfig, ScopeKind, SourceConfig
from polygateway.models import AttemptRecord
from polygateway.transport.exchange import deadline_reached
from polygateway.transport.http import HttpRequest, TransientError

__all__ = [
    "BoundedSleep",
    "CountingBackend",
    "Delay",
    "FakeClock",
    "FakeTimers",
    "FakeTransport",
    "Gate",
    "Hang",
    "Outcome",
    "Recorder",
    "ScriptExhausted",
    "SleepBudgetExceeded",
    "StreamScript",
    "TransientError",
    "chat_chunk_events",
    "chat_completion",
    "embedding_body",
    "gateway_settings",
    "settle",
]


class FakeClock:
    """A monotonic clock that only moves when told to.

    Call it for the time (``now=clock``); ``await clock.sleep(d)`` advances it
    by ``d`` and yields to the event loop once, so other tasks run as they
    would during a real sleep.
    """

    __slots__ = ("_now", "sleeps")

    def __init__(self, start: float = 1000.0) -> None:
        self._now = float(start)
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward (never backward: the clock is monotonic)."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock cannot go back ({seconds} s)")
        self._now += seconds

    async def sleep(self, seconds: float) -> None:
        """A sleep that takes no real time."""
        self.sleeps.append(seconds)
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)

    def __repr__(self) -> str:
        return f"FakeClock(now={self._now})"


class SleepBudgetExceeded(AssertionError):
    """A loop slept more often than the test allowed: it would have spun forever."""


class BoundedSleep:
    """A fake sleep on a ``FakeClock`` that fails after ``max_calls`` sleeps."""

    __slots__ = ("calls", "clock", "max_calls")

    def __init__(self, clock: FakeClock, max_calls: int = 1000) -> None:
        self.clock = clock
        self.max_calls = max_calls
        self.calls = 0

    async def __call__(self, seconds: float) -> None:
        self.calls += 1
        if self.calls > self.max_calls:
            raise SleepBudgetExceeded(f"slept more than {self.max_calls} times")
        await self.clock.sleep(seconds)


class FakeTimers:
    """Virtual time for many concurrent sleepers on one ``FakeClock``.

    ``FakeClock.sleep`` moves time forward by itself, which is right for one
    task but adds up the sleeps of concurrent ones. Here ``sleep(d)`` waits
    until the clock reaches its deadline and only ``advance`` moves time,
    waking sleepers in deadline order with the clock set to each deadline.
    """

    __slots__ = ("_heap", "_seq", "clock")

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self._heap: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    @property
    def pending(self) -> int:
        """Sleepers still waiting (cancelled ones are not counted)."""
        return sum(1 for _, _, fut in self._heap if not fut.done())

    async def sleep(self, seconds: float) -> None:
        """Wait until the clock has been advanced by ``seconds``."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, (self.clock() + max(0.0, seconds), next(self._seq), fut))
        await fut

    async def advance(self, seconds: float, *, turns: int = 20) -> None:
        """Move time forward, waking each due sleeper at its own deadline, and let tasks run."""
        target = self.clock() + seconds
        while self._heap and self._heap[0][0] <= target:
            deadline, _, fut = heapq.heappop(self._heap)
            if fut.done():
                continue
            self.clock.advance(max(0.0, deadline - self.clock()))
            fut.set_result(None)
            await settle(turns)
        self.clock.advance(max(0.0, target - self.clock()))
        await settle(turns)


async def settle(turns: int = 20) -> None:
    """Let the event loop run ``turns`` times, so woken tasks reach their next await."""
    for _ in range(turns):
        await asyncio.sleep(0)


# --- A scripted upstream ------------------------------------------------------


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
            elif isinstance(outcome, StreamScript | Mapping | list):
                if isinstance(outcome, StreamScript) != stream:
                    kind = "StreamScript" if stream else "JSON body"
                    raise ScriptExhausted(f"expected a {kind} for {request.source!r}")
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
            script = await self._resolve(self._next(request), request, stream=True, end=end)
            yield _ScriptedEvents(script, request, self._sleep, self._clock, end)
        finally:
            self.open_streams -= 1
            self.in_flight -= 1

    async def aclose(self) -> None:
        """Mark the transport closed."""
        self.closed = True


class _ScriptedEvents:
    """The events of one ``StreamScript``, failing where it says, and cut at the stream's end."""

    __slots__ = ("_clock", "_end", "_i", "_request", "_script", "_sleep")

    def __init__(
        self,
        script: StreamScript,
        request: HttpRequest,
        sleep: Callable[[float], Awaitable[None]],
        clock: FakeClock,
        end: float,
    ) -> None:
        self._script = script
        self._request = request
        self._sleep = sleep
        self._clock = clock
        self._end = end
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
        idle_s = request.idle_timeout_s or request.timeout_s
        if script.hang_after is not None and i >= script.hang_after:
            await self._cut(idle_s, "stream idle")
        if i >= len(script.events):
            if script.done:
                raise StopAsyncIteration
            raise TransientError(f"stream ended without [DONE] at {request.source}", truncated=True)
        if i > 0 and script.gap_s:
            if script.gap_s > min(idle_s, self._end - self._clock()):
                await self._cut(idle_s, "stream idle")
            await self._sleep(script.gap_s)
        self._i = i + 1
        return script.events[i]


class Recorder:
    """An emitter that keeps every attempt record, for assertions."""

    __slots__ = ("records",)

    def __init__(self) -> None:
        self.records: list[AttemptRecord] = []

    def emit_attempt(self, record: AttemptRecord) -> None:
        """Keep the record."""
        self.records.append(record)

    def outcomes(self) -> list[str]:
        """The outcome of each record, in order."""
        return [r.outcome for r in self.records]


class CountingBackend:
    """A ``Backend`` wrapper that counts each operation and can hold ``acquire`` at a gate.

    ``calls["acquire"]`` etc. count backend operations (``waiting_room`` is
    local and not counted); ``ops`` is their total. While ``hold_acquire``
    (or ``hold_release``) is an event that is not set, every ``acquire``
    (``release``) waits for it before it runs.
    """

    __slots__ = ("calls", "hold_acquire", "hold_release", "inner")

    # A held gate suspends the operation without any shield of its own: the
    # loop must protect it, as it would any backend that is not cancel-safe.
    cancel_safe = False

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.calls: dict[str, int] = {}
        self.hold_acquire: asyncio.Event | None = None
        self.hold_release: asyncio.Event | None = None

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    @property
    def ops(self) -> int:
        """Backend operations so far."""
        return sum(self.calls.values())

    @property
    def max_inflight_ops(self) -> int | None:
        """The inner backend's figure: counting adds no pool of its own."""
        return self.inner.max_inflight_ops

    async def acquire(
        self,
        scope: str,
        candidates: Sequence[SourceSpec],
        *,
        cost_tokens: int = 0,
        ttl_s: float,
    ) -> AcquireResult:
        """Count, wait at the gate if one is closed, then delegate."""
        if self.hold_acquire is not None:
            await self.hold_acquire.wait()
        self._count("acquire")
        return await self.inner.acquire(scope, candidates, cost_tokens=cost_tokens, ttl_s=ttl_s)

    async def release(self, lease: Lease, outcome: AttemptOutcome) -> None:
        """Count, wait at the gate if one is closed, then delegate."""
        if self.hold_release is not None:
            await self.hold_release.wait()
        self._count("release")
        await self.inner.release(lease, outcome)

    async def renew(self, lease: Lease) -> bool:
        """Count and delegate."""
        self._count("renew")
        return await self.inner.renew(lease)

    async def progress_age_s(self, scope: str) -> float:
        """Count and delegate."""
        self._count("progress_age_s")
        return await self.inner.progress_age_s(scope)

    async def snapshot(self, scope: str) -> ScopeSnapshot:
        """Count and delegate."""
        self._count("snapshot")
        return await self.inner.snapshot(scope)

    def waiting_room(self, scope: str) -> WaitingRoom:
        """The inner backend's room (local state, not an operation)."""
        return self.inner.waiting_room(scope)

    async def aclose(self) -> None:
        """Delegate."""
        await self.inner.aclose()


# --- Provider bodies ------------------------------------------------------------


def chat_completion(
    text: str = "ok",
    *,
    finish_reason: str | None = "stop",
    tool_calls: Sequence[Mapping[str, str]] | None = None,
    prompt_tokens: int = 5,
    completion_tokens: int = 2,
    model: str = "fake-model",
) -> dict[str, Any]:
    """An OpenAI chat completion body; ``tool_calls`` items are ``{"id", "name", "arguments"}``."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = [
            {
                "id": call.get("id", f"call_{i}"),
                "type": "function",
                "function": {"name": call["name"], "arguments": call.get("arguments", "{}")},
            }
            for i, call in enumerate(tool_calls)
        ]
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def chat_chunk_events(
    texts: Sequence[str],
    finish_reason: str | None = "stop",
    *,
    usage: tuple[int, int] | None = None,
    role_first: bool = True,
) -> list[dict[str, Any]]:
    """The ``data:`` events of a streamed answer: a role chunk, one per text, a finish chunk.

    ``usage=(prompt, completion)`` adds the usage-only chunk ``include_usage``
    asks for; ``finish_reason=None`` leaves the finish chunk out.
    """
    events = [_chunk({"role": "assistant", "content": ""})] if role_first else []
    events += [_chunk({"content": t}) for t in texts]
    if finish_reason is not None:
        events.append(_chunk({}, finish_reason))
    if usage is not None:
        prompt, completion = usage
        events.append(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "choices": [],
                "usage": {
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                },
            }
        )
    return events


def embedding_body(
    vectors: Sequence[Sequence[float]], *, prompt_tokens: int | None = None
) -> dict[str, Any]:
    """An OpenAI embeddings body with ``vectors`` in input order."""
    tokens = prompt_tokens if prompt_tokens is not None else len(vectors)
    return {
        "object": "list",
        "model": "fake-embedding",
        "data": [
            {"object": "embedding", "index": i, "embedding": list(v)} for i, v in enumerate(vectors)
        ],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


_PROTOCOL_OF_KIND = {"chat": "openai", "embed": "openai", "ocr": "monkey_ocr"}


def gateway_settings(
    *sources: str | Mapping[str, Any],
    scope: str = "chat",
    kind: ScopeKind = "chat",
    **gateway: Any,
) -> GatewaySettings:
    """Settings with one scope, built in code; ``.env`` is not read.

    Each source is a name, or a mapping of ``SourceConfig`` fields with a
    ``name``. Defaults: protocol by kind, ``base_url http://127.0.0.1:9/<name>``,
    model ``fake-model`` and a fake API key (``sk-test-<name>-secret``), so a
    test can check that it never shows. ``gateway`` sets gateway fields.
    """
    built = []
    for spec in sources or ("primary",):
        fields: dict[str, Any] = {"name": spec} if isinstance(spec, str) else dict(spec)
        name = fields["name"]
        fields.setdefault("protocol", _PROTOCOL_OF_KIND[kind])
        fields.setdefault("base_url", f"http://127.0.0.1:9/{name}")
        fields.setdefault("model", "fake-model")
        if "api_key_env" not in fields:
            fields.setdefault("api_key", SecretStr(f"sk-test-{name}-secret"))
        elif isinstance(fields.get("api_key"), str):
            fields["api_key"] = SecretStr(fields["api_key"])
        built.append(SourceConfig(**fields))
    return GatewaySettings(
        _env_file=None, scopes={scope: ScopeConfig(kind=kind, sources=tuple(built))}, **gateway
    )
