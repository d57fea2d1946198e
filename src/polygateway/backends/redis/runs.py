"""Acquires that go to Redis together: one ACQUIRE run for calls asking at the same time.

ACQUIRE decides several calls in one script run, reading each candidate's state
once (``scripts.py``; research-wiki/designs/script-cost.md, "Several calls per
script run"), which is where most of a governed call's Redis CPU goes. The calls
of one scope, candidate order and priority class that arrive while an ACQUIRE of
theirs is in flight wait for its reply and then go together, up to ``MAX_RUN``
a run: a process with one call at a time sends it at once, as before, and one
with many calls asking pays Redis about a fourth of a lone call's CPU for each.

Each call keeps its own ``Reply``: its caller's future, deadline and
cancellation, and its own action for a late grant. A call whose caller left
before its run was written is never sent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Final

from polygateway.backends.redis.bounded import Reply

__all__ = ["MAX_RUN", "Asked", "Runs"]

MAX_RUN: Final = 16
"""The most calls one ACQUIRE run carries. At 16 a call's share of a run's fixed cost is
small already (research-wiki/designs/script-cost.md, "Measured: the state read once,
each call decided"); longer runs would hold Redis longer for one script."""


@dataclass(slots=True)
class Asked:
    """One acquire, waiting for its run to be written, then for its reply."""

    lease_id: str
    ttl_s: float
    cost_tokens: int
    reply: Reply
    with_set: bool = False
    """The call must carry its scope's spec set whole (Redis said it holds none)."""
    counted: str | None = None
    """The class whose held permits a grant joins, as the run was written."""

    @property
    def left(self) -> bool:
        """Whether its caller stopped waiting (timed out, cancelled) before it was written."""
        waiter = self.reply.waiter
        return waiter is not None and waiter.done()


@dataclass(slots=True)
class _Key:
    in_flight: int = 0
    queue: deque[Asked] = field(default_factory=deque)


class Runs:
    """Per key (scope, candidates, class): the runs in flight and the calls for the next.

    ``send(key, calls)`` writes one run; whoever handles its reply (or its
    failure) calls ``answered(key)`` once, which writes every call that
    arrived meanwhile, in arrival order, in runs of ``MAX_RUN`` at most.
    """

    __slots__ = ("_keys", "_send")

    def __init__(self, send: Callable[[Hashable, list[Asked]], None]) -> None:
        self._send = send
        self._keys: dict[Hashable, _Key] = {}

    def ask(self, key: Hashable, asked: Asked) -> None:
        """Write ``asked`` now when nothing of ``key`` is in flight, else with the next run."""
        state = self._keys.get(key)
        if state is None:
            self._keys[key] = _Key(in_flight=1)
            self._send(key, [asked])
        else:
            state.queue.append(asked)

    def answered(self, key: Hashable) -> None:
        """A run of ``key`` got its reply: the calls that arrived meanwhile go now."""
        state = self._keys.get(key)
        if state is None:
            return
        state.in_flight -= 1
        queue = state.queue
        while queue:
            calls: list[Asked] = []
            while queue and len(calls) < MAX_RUN:
                asked = queue.popleft()
                if not asked.left:
                    calls.append(asked)
            if calls:
                state.in_flight += 1
                self._send(key, calls)  # its failure may be answered at once, in here
        if state.in_flight <= 0 and self._keys.get(key) is state:
            del self._keys[key]

    def __len__(self) -> int:
        """Keys with a run in flight."""
        return len(self._keys)
