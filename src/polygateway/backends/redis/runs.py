"""Calls that go to Redis together: one script run for the calls of a key meanwhile.

ACQUIRE decides several calls in one script run, reading each candidate's state
once, and RELEASE frees several leases of one source likewise (``scripts.py``;
research-wiki/designs/script-cost.md, "Several calls per script run"): that
state's reads, parses and writes are most of a governed call's Redis CPU. So the
calls of one key (an acquire's scope, candidates and priority class; a release's
scope, source and class) that arrive while a run of theirs is in flight wait for
its reply and then go together, up to ``MAX_RUN`` a run. A process with one call
at a time sends it at once, as before; one with many calls pays Redis a fraction
of a lone call's CPU for each.

Each call keeps its own ``Reply``: its caller's future, deadline and
cancellation, and its own action for a late grant. A call whose caller left
before its run was written is never sent. ``flush`` writes a scope's waiting
calls at once, for what must find them done (the limiter flushes releases
before anything else it writes for their scope).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Final, Generic, Protocol, TypeVar

from polygateway.backends.base import AttemptOutcome, Lease
from polygateway.backends.redis.bounded import Reply
from polygateway.backends.redis.wire import Arg

__all__ = ["MAX_RUN", "Asked", "Key", "Releasing", "Runs"]

Key = tuple[Hashable, ...]
"""What calls must share to go in one run; its first item is their scope. It holds their
``now`` too: a run has one, and an injected clock (tests) may move between two calls."""

MAX_RUN: Final = 16
"""The most calls one run carries. At 16 a call's share of a run's fixed cost is
small already (research-wiki/designs/script-cost.md, "Measured: the state read once,
each call decided"); longer runs would hold Redis longer for one script."""


@dataclass(slots=True)
class Asked:
    """One acquire, waiting for its run to be written, then for its reply."""

    lease_id: str
    ttl_s: float
    cost_tokens: int
    reply: Reply
    now: Arg
    """ARGV[1] as the call was made (the injected clock's time; "" for the server's)."""
    with_set: bool = False
    """The call must carry its scope's spec set whole (Redis said it holds none)."""
    counted: str | None = None
    """The class whose held permits a grant joins, as the run was written."""


@dataclass(slots=True)
class Releasing:
    """One release written behind, waiting for its run to be written (nobody waits for it,
    unless it was written alone for want of a connection)."""

    lease: Lease
    outcome: AttemptOutcome
    reply: Reply
    now: Arg
    """ARGV[1] as the release was made (the injected clock's time; "" for the server's)."""


class _Call(Protocol):
    """A call that goes in a run: its ``Reply`` (a waiter while its caller waits)."""

    @property
    def reply(self) -> Reply: ...


C = TypeVar("C", bound=_Call)


def _left(call: _Call) -> bool:
    """Whether its caller stopped waiting (timed out, cancelled) before it was written."""
    waiter = call.reply.waiter
    return waiter is not None and waiter.done()


@dataclass(slots=True)
class _Key(Generic[C]):
    in_flight: int = 0
    queue: deque[C] = field(default_factory=deque)


class Runs(Generic[C]):
    """Per key: the runs in flight and the calls for the next.

    ``send(key, calls)`` writes one run; whoever handles its reply (or its
    failure) calls ``answered(key)`` once, which writes every call that
    arrived meanwhile, in arrival order, in runs of ``MAX_RUN`` at most.
    """

    __slots__ = ("_keys", "_send")

    def __init__(self, send: Callable[[Key, list[C]], None]) -> None:
        self._send = send
        self._keys: dict[Key, _Key[C]] = {}

    def ask(self, key: Key, asked: C) -> None:
        """Write ``asked`` now when nothing of ``key`` is in flight, else with the next run."""
        state = self._keys.get(key)
        if state is None:
            self._keys[key] = _Key(in_flight=1)
            self._send(key, [asked])
        else:
            state.queue.append(asked)

    def answered(self, key: Key) -> None:
        """A run of ``key`` got its reply: the calls that arrived meanwhile go now."""
        state = self._keys.get(key)
        if state is None:
            return
        state.in_flight -= 1
        self._write(key, state)
        if state.in_flight <= 0 and self._keys.get(key) is state:
            del self._keys[key]

    def flush(self, scope: str) -> None:
        """Write now every call of ``scope`` waiting for a run in flight.

        What a process writes next for a scope must find these calls done, as
        it would have without runs (Redis runs one connection's commands in
        order): a release queued behind another must not be overtaken by the
        next acquire.
        """
        if self._keys:
            for key, state in list(self._keys.items()):
                if key[0] == scope and state.queue:
                    self._write(key, state)

    def _write(self, key: Key, state: _Key[C]) -> None:
        """Every queued call of ``key``, in arrival order, in runs of ``MAX_RUN`` at most."""
        queue = state.queue
        while queue:
            calls: list[C] = []
            while queue and len(calls) < MAX_RUN:
                asked = queue.popleft()
                if not _left(asked):
                    calls.append(asked)
            if calls:
                state.in_flight += 1
                self._send(key, calls)  # its failure may be answered at once, in here

    def __len__(self) -> int:
        """Keys with a run in flight."""
        return len(self._keys)
