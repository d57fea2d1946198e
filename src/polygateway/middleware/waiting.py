"""The loop's queue of calls waiting for a permit (research-wiki/ARCHITECTURE.md §5).

The waiting room is the loop's: one per backend and scope in a process
(``room_for``), shared by every client of that scope. A backend only tells
it when a permit was freed (``Backend.on_release``); the room wakes its head.

Only the head of the queue asks the backend for a permit. A release wakes
the head only (O(1) per release, no thundering herd); the head's own jittered
poll notices releases the backend did not announce (other processes). Calls
behind the head sleep until they become head, or until a timer of their own
fires (their stall deadline), so waiting costs at most one backend poll per
scope per poll interval per process, whatever the number of waiters.

The stall rule's question, how long ago the scope last served
(``Backend.progress_age_s``, a round trip on Redis), has one answer for every
call of the scope, so the room asks it for them all (``progress_age``): calls
that ask while a read is in flight share it, and a past read, aged by the time
since, answers them for as long as it proves the scope fresh. A crowd waiting
past its stall window costs what one call costs.

Arrival order: a call takes a ticket when it starts looking for a permit,
and the queue is ordered by ticket. A call that asked at once (nobody was
waiting) and was refused takes its place by its ticket, ahead of calls that
arrived after it and queued while its acquire was in flight. A release
announced while such a call's acquire was in flight woke nobody, or woke a
call it now queues ahead of: it counts the room's releases (``releases``)
and, queued as head after one, asks again at once instead of waiting a poll
for a permit that is already free.

At most ``MAX_ASKING`` acquires of a scope are in flight at once in a
process: past that a new call queues, so a burst reaches a shared backend
as a stream of acquires through the head, not all at once.

A waiter's stall-deadline timer has two paths. With the real ``asyncio.sleep``
(the default) it is a ``loop.call_later`` handle that resolves the wake-up
future: no second Task per waiting call, which with thousands of calls queued
is memory and garbage-collector work. With any other ``sleep`` (a fake clock in
tests, an application's own) the timer must run that coroutine, so it is a Task
raced against the wake-up future; the handle path cannot serve it because a
fake clock does not drive the event loop's timers.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
import weakref
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

from polygateway.backends.base import Backend

__all__ = ["MAX_ASKING", "ClassState", "Waiter", "WaitingRoom", "room_for"]

Sleep = Callable[[float], Awaitable[None]]

MAX_ASKING: Final = 64
"""Acquires of one scope in flight at once per process before new calls queue instead.

The head of the queue asks whatever the count (nobody else would ask for
it), so the fast path stops one short of this bound.
"""

_COMPACT_ABOVE: Final = 16
"""Calls left in place a flow holds beyond its live ones before it is swept."""

_ROOMS: weakref.WeakKeyDictionary[Backend, dict[str, WaitingRoom]] = weakref.WeakKeyDictionary()
"""Every waiting room of the process, per backend object and scope; gone with the backend."""


def room_for(backend: Backend, scope: str) -> WaitingRoom:
    """The process's waiting room of ``scope`` on ``backend``, made and subscribed at first use."""
    rooms = _ROOMS.get(backend)
    if rooms is None:
        rooms = _ROOMS[backend] = {}
    room = rooms.get(scope)
    if room is None:
        room = rooms[scope] = WaitingRoom()
        backend.on_release(scope, room)
    return room


def _ticket_of(waiter: Waiter) -> int:
    return waiter.ticket


def _resolve(signal: asyncio.Future[None]) -> None:
    """The deadline passed: end the wait (unless a wake-up already did)."""
    if not signal.done():
        signal.set_result(None)


class Waiter:
    """One call's place in the queue: its priority class, its tenant, its ticket (arrival)."""

    __slots__ = ("_pending", "_signal", "failure", "left", "priority_class", "tenant", "ticket")

    def __init__(self, ticket: int, priority_class: str = "", tenant: str = "") -> None:
        self.ticket = ticket
        self.priority_class = priority_class
        self.tenant = tenant
        self._signal: asyncio.Future[None] | None = None
        self._pending = False
        self.left = False
        # Set when the backend failed for a call ahead: this one must fail closed too.
        self.failure: BaseException | None = None

    def _fire(self) -> None:
        if self._signal is not None and not self._signal.done():
            self._signal.set_result(None)
        else:
            # Not waiting right now (between a poll and the next wait): keep the
            # wake-up so the next wait returns at once instead of losing it.
            self._pending = True


class ClassState:
    """One priority class in a room: a queue per tenant, tenants served in turn, and its counts."""

    __slots__ = (
        "asking",
        "flows",
        "in_use",
        "live",
        "pass_",
        "reserved",
        "rotation",
        "share",
        "waiting",
    )

    def __init__(self, share: float, reserved: int = 0) -> None:
        self.share = share
        # Served before the stride choice while the class holds fewer permits than this.
        self.reserved = reserved
        # Per tenant, sorted by ticket. A deque: the head leaves in O(1) however many
        # wait (the target "10,000 waiting calls cost no more CPU per call than 1,000").
        # A call that leaves from behind the first stays in place, marked ``left``, until
        # the first reaches it or the dead outnumber the live: no walk of the queue per
        # call that leaves (``WaitingRoom.leave``). The first of a flow is never left.
        self.flows: dict[str, deque[Waiter]] = {}
        self.live: dict[str, int] = {}  # per tenant, the calls of its flow not left
        # Tenants with waiters, the next served first. Ordered, with O(1) removal from
        # anywhere: a tenant per call, cancelled in any order, costs no walk of the turn.
        self.rotation: OrderedDict[str, None] = OrderedDict()
        self.pass_ = 0.0  # the class's virtual time: 1/share more per permit it got
        self.waiting = 0
        self.in_use = 0  # permits its calls hold in this process (``hold``, ``unhold``)
        # Its calls asking from outside the queue (asked at once: not counted in ``waiting``);
        # the loop keeps it. A call that is head asks too, counted in ``waiting`` alone.
        self.asking = 0


class WaitingRoom:
    """The queue of waiting calls for one scope in this process.

    Without priority classes (the default) it is one FIFO in arrival order.
    With them (``shares``), the next call to ask is chosen by stride
    scheduling over the classes that have waiters: each permit a class gets
    moves its virtual time on by ``1 / share``, and the class furthest behind
    goes next, so classes get permits in proportion to their shares while
    they wait; a class with nobody waiting takes no part (its share is lent
    to the others) and comes back at the current virtual time, with no
    credit saved up. Inside a class, tenants are served in turn (round robin),
    each tenant's calls in arrival order. On a fleet the backend may name the
    class and the tenant whose turn a freed permit is (``notify``): their
    first call is the head until the room's next grant.

    A class with ``reserved`` permits that holds fewer than that (in this
    process) while its calls wait goes before the stride choice, and such a
    grant does not move its virtual time: the floor comes on top of the
    share. It only orders who asks next, so no permit is set aside: with
    nobody of that class waiting, the others take every permit. Permits in
    use are counted per class (``hold``, ``unhold``: the loop calls them for
    every permit its calls get, queued or not).

    On a backend that keeps the floors fleet-wide (``fleet_floors``, set by
    the Redis backend), the room applies no floor of its own: its counts are
    this process's, and a class at its floor fleet-wide would still go first
    here, against the fleet's choice. The fleet's wake-ups give a class below
    its floor the turn (``notify``), and every grant moves the class's
    virtual time (research-wiki/designs/priority-fairness.md, "On Redis").
    """

    __slots__ = (
        "_age",
        "_age_at",
        "_age_clock",
        "_age_read",
        "_classes",
        "_count",
        "_head",
        "_stale",
        "_tickets",
        "_turn",
        "_turn_tenant",
        "_vtime",
        "asking",
        "fleet_floors",
        "floors",
        "named_tenants",
        "releases",
        "shares",
        "wakeups",
    )

    def __init__(
        self, shares: Mapping[str, float] | None = None, reserved: Mapping[str, int] | None = None
    ) -> None:
        self.shares: dict[str, float] = {}
        # The declared classes with reserved permits (a fleet's backend counts theirs).
        self.floors: dict[str, int] = {}
        # Set by a backend that keeps the floors fleet-wide: no per-process floor here.
        self.fleet_floors = False
        self._classes: dict[str, ClassState] = {}
        self.declare(shares or {}, reserved or {})
        self._count = 0
        self._vtime = 0.0
        self._head: Waiter | None = None
        self._stale = False
        self._turn: str | None = None
        self._turn_tenant: str | None = None
        # Whether a call naming a tenant ever entered (or a fleet's wake-up named one): from
        # then on a fleet's backend registers the process per tenant too (``waiting_tenants``).
        self.named_tenants = False
        self._tickets = itertools.count()
        self.wakeups = 0  # releases that found a head to wake; for tests and telemetry
        # Releases announced (``notify``). A call that asked from outside the queue and was
        # refused while one came was not there to be woken: ``Call.wait`` asks again.
        self.releases = 0
        # Acquires in flight for this scope in this process (kept by the loop): past
        # MAX_ASKING a new call queues instead of asking too.
        self.asking = 0
        # The scope's last progress age read, when that read began and on which clock
        # (``progress_age``), and the read in flight, if any: its age, or ``None`` if its
        # reader was cancelled.
        self._age = math.inf
        self._age_at = -math.inf
        self._age_clock: Callable[[], float] | None = None
        self._age_read: asyncio.Future[float | None] | None = None

    def __len__(self) -> int:
        return self._count

    @property
    def empty(self) -> bool:
        """No call is waiting."""
        return not self._count

    @property
    def may_ask_at_once(self) -> bool:
        """Whether a new call may ask the backend without queueing: nobody waits, room to ask."""
        return not self._count and self.asking < MAX_ASKING - 1

    def wanting(self) -> dict[str, int]:
        """Per class with calls waiting or asking, how many (each call once).

        A fleet's backend registers the process under these classes, and a
        grant keeps it registered where calls are left besides the one granted.
        """
        return {
            name: c.waiting + c.asking for name, c in self._classes.items() if c.waiting or c.asking
        }

    def waiting_tenants(self) -> dict[str, list[str]] | None:
        """Per class with calls waiting, its tenants with calls waiting, in turn order.

        ``None`` while no call naming a tenant has entered the room and no
        wake-up named one: a fleet's backend then registers the process per
        class only, as without tenants (research-wiki/designs/priority-fairness.md,
        "On Redis").
        """
        if not self.named_tenants:
            return None
        return {name: list(c.rotation) for name, c in self._classes.items() if c.rotation}

    def waiting_by_class(self) -> dict[str, int]:
        """How many calls wait, per priority class (``""``: a scope without classes)."""
        return {name: c.waiting for name, c in self._classes.items() if c.waiting}

    def by_class(self) -> dict[str, tuple[int, int]]:
        """(calls waiting, permits in use) in this process, per class the room knows.

        Every declared class, idle ones too (a gauge keeps its series), and
        ``""`` for a scope without classes.
        """
        return {name: (c.waiting, c.in_use) for name, c in self._classes.items()}

    def declare(self, shares: Mapping[str, float], reserved: Mapping[str, int]) -> None:
        """The scope's classes, their shares and reserved permits (as a client of it is built)."""
        self.shares.update(shares)
        for name, share in shares.items():
            klass = self.slot(name)
            klass.share = share
            klass.reserved = reserved.get(name, 0)
            if klass.reserved > 0:
                self.floors[name] = klass.reserved
            else:
                self.floors.pop(name, None)
        self._stale = True

    def slot(self, priority_class: str) -> ClassState:
        """The record of ``priority_class`` (its queue and counts), made at first use."""
        klass = self._classes.get(priority_class)
        if klass is None:
            klass = self._classes[priority_class] = ClassState(self.shares.get(priority_class, 1.0))
        return klass

    def hold(self, klass: ClassState) -> None:
        """A call of ``klass`` got a permit, queued or not (``slot`` gives ``klass``).

        A scope without reserved permits pays one integer update for it.
        """
        klass.in_use += 1
        if klass.reserved and not self.fleet_floors:
            self._reschedule()

    def unhold(self, klass: ClassState) -> None:
        """A permit ``hold`` counted is being released: once per permit, before the release."""
        klass.in_use -= 1
        if klass.reserved and not self.fleet_floors:
            self._reschedule()

    def _reschedule(self) -> None:
        """A reserved class crossed its floor, perhaps: if the head changed, wake the new one.

        Nobody else would: the old head, when it wakes, finds it is not head
        and sleeps to its stall timer.
        """
        before = self.head()
        self._stale = True
        head = self.head()
        if head is not None and head is not before:
            head._fire()

    def ticket(self) -> int:
        """A place in the arrival order, taken when a call starts looking for a permit."""
        return next(self._tickets)

    def enter(
        self, ticket: int | None = None, *, priority_class: str = "", tenant: str = ""
    ) -> Waiter:
        """Join the queue of ``priority_class`` and ``tenant`` at the place of ``ticket``.

        Behind every call of that tenant that arrived earlier; without a
        ticket, at its tail with a ticket taken now.
        """
        waiter = Waiter(self.ticket() if ticket is None else ticket, priority_class, tenant)
        klass = self.slot(priority_class)
        if not klass.waiting:
            # Back from idle: no credit for the time it did not wait. It starts level
            # with the classes waiting now, or where the last one served left off.
            active = [c.pass_ for c in self._classes.values() if c.waiting]
            klass.pass_ = max(klass.pass_, min(active) if active else self._vtime)
        flow = klass.flows.get(tenant)
        if flow is None:
            flow = klass.flows[tenant] = deque()
            klass.live[tenant] = 0
            klass.rotation[tenant] = None
            if tenant:
                self.named_tenants = True
        ticket = waiter.ticket
        if not flow or flow[-1].ticket < ticket:
            flow.append(waiter)
        else:
            flow.insert(bisect.bisect(flow, ticket, key=_ticket_of), waiter)
        klass.live[tenant] += 1
        klass.waiting += 1
        self._count += 1
        self._stale = True
        return waiter

    def head(self) -> Waiter | None:
        """The call that asks next, or ``None`` when nobody waits.

        A class below its reserved floor first; among equals (all below, or
        none), the class furthest behind in virtual time, the larger share on a
        tie, then the class declared first.
        """
        if self._stale:
            self._stale = False
            best: ClassState | None = None
            floor = False
            turn = None if self._turn is None else self._classes.get(self._turn)
            if turn is not None and turn.waiting:
                # The fleet gave this permit to that class (``notify``): its head asks.
                return self._set_head(turn, self._turn_tenant)
            for klass in self._classes.values():
                if not klass.waiting:
                    continue
                below = klass.in_use < klass.reserved and not self.fleet_floors
                if (
                    best is None
                    or below > floor
                    or (
                        below == floor
                        and (
                            klass.pass_ < best.pass_
                            or (klass.pass_ == best.pass_ and klass.share > best.share)
                        )
                    )
                ):
                    best, floor = klass, below
            return self._set_head(best)
        return self._head

    def _set_head(self, klass: ClassState | None, tenant: str | None = None) -> Waiter | None:
        if klass is None:
            self._head = None
        else:
            # ``tenant``: the fleet's tenant turn (``notify``), if it waits here; else the
            # class's own turn of tenants.
            flow = None if tenant is None else klass.flows.get(tenant)
            self._head = (flow or klass.flows[next(iter(klass.rotation))])[0]
        return self._head

    def is_head(self, waiter: Waiter) -> bool:
        """Only the head asks the backend for a permit."""
        return waiter is self.head()

    def leave(self, waiter: Waiter, *, granted: bool = False) -> None:
        """Leave the queue (``granted``: with a permit; else failed or cancelled).

        A permit granted moves its class's virtual time on (unless the class
        was below its reserved floor: call this before ``hold``) and sends its
        tenant to the back of the class's turn. Whoever is head next is woken:
        the permit that served the old head may not have been the last free.
        """
        if waiter.left:
            return
        waiter.left = True
        was_head = waiter is self.head()
        klass = self._classes[waiter.priority_class]
        tenant = waiter.tenant
        flow = klass.flows[tenant]
        live = klass.live[tenant] - 1
        klass.waiting -= 1
        self._count -= 1
        if granted:
            self._turn = None  # the fleet's turn, if any, was this grant's
            self._turn_tenant = None
        if granted and (klass.in_use >= klass.reserved or self.fleet_floors):
            self._vtime = klass.pass_
            klass.pass_ += 1.0 / klass.share
        if not live:
            del klass.flows[tenant]
            del klass.live[tenant]
            del klass.rotation[tenant]
        else:
            klass.live[tenant] = live
            if flow[0] is waiter:
                # The calls behind it that left meanwhile go too, each once: the first
                # of a flow is always one still waiting.
                flow.popleft()
                while flow[0].left:
                    flow.popleft()
            elif len(flow) > 2 * live + _COMPACT_ABOVE:
                # Left in place (no walk per call that leaves); swept once they outnumber
                # the live, so a long-lived first call cannot pile them up without bound.
                klass.flows[tenant] = deque(w for w in flow if not w.left)
        if live and granted and len(klass.rotation) > 1:
            klass.rotation.move_to_end(tenant)
        self._stale = True
        if (was_head or granted) and self._count:
            head = self.head()
            if head is not None:
                head._fire()

    def _waiters(self) -> list[Waiter]:
        return [
            w
            for klass in self._classes.values()
            for f in klass.flows.values()
            for w in f
            if not w.left
        ]

    def fail_all(self, failure: BaseException, *, but: Waiter | None = None) -> None:
        """The backend failed: wake every waiter (but ``but``) to fail closed at once.

        Without this, each queued call would become head in turn and wait out
        the backend's timeout on its own: the last of N would fail N timeouts late.
        """
        for waiter in self._waiters():
            if waiter is not but:
                waiter.failure = failure
                waiter._fire()

    def notify(self, priority_class: str | None = None, tenant: str | None = None) -> None:
        """A permit was released: wake the head only.

        ``priority_class``: a fleet's backend gave the permit to that class
        (stride scheduling across the fleet): its head is the head until the
        room's next grant, if the class has calls waiting here; otherwise
        the room's own order stands. ``tenant``: the fleet gave it to that
        tenant of the class (round robin over the fleet's tenants): the
        tenant's first call is the head, if it waits here in that class;
        otherwise the class's own turn of tenants stands.
        """
        if tenant is not None:
            # The fleet takes turns of tenants in this scope: so does this process from now
            # on (its calls of no tenant are then the tenant "", its releases take the turn).
            self.named_tenants = True
        if (
            priority_class is not None
            or tenant is not None
            or self._turn is not None
            or self._turn_tenant is not None
        ):
            self._turn = priority_class
            self._turn_tenant = tenant
            self._stale = True
        self.releases += 1
        head = self.head()
        if head is not None:
            self.wakeups += 1
            head._fire()

    async def progress_age(
        self, backend: Backend, scope: str, now: Callable[[], float], *, known_below: float
    ) -> float:
        """The scope's progress age for the stall rule: one backend read for every call asking.

        The last read, aged by the time since it began, is an upper bound of
        the age now (progress only ever lowers it); while that bound is at most
        ``known_below`` it is the answer, and ``age > known_below`` comes out as
        a fresh read would have it. Otherwise the answer is a fresh read: the
        one in flight if any, else one this call makes and the calls that ask
        meanwhile share. A read that fails fails every call waiting on it
        (research-wiki/designs/stall-budget.md, "Reading the progress age") and
        is not kept; a reader cancelled mid-read leaves the others to read anew.
        A read timed on another clock (another client's ``now``) is never aged on
        this one.
        """
        since = now() - self._age_at
        if since >= 0.0 and now == self._age_clock:
            bound = self._age + since
            if bound <= known_below:
                return bound
        while (reading := self._age_read) is not None:
            # Shielded: this call's cancellation must not cancel the read the others await.
            shared = await asyncio.shield(reading)
            if shared is not None:
                return shared
        began = now()
        reading = self._age_read = asyncio.get_running_loop().create_future()
        try:
            age = await backend.progress_age_s(scope)
        except Exception as exc:
            reading.set_exception(exc)
            reading.exception()  # delivered to the calls waiting on it, if any; not logged
            raise
        except BaseException:
            reading.set_result(None)
            raise
        finally:
            self._age_read = None
        self._age, self._age_at, self._age_clock = age, began, now
        reading.set_result(age)
        return age

    async def wait(self, waiter: Waiter, timeout_s: float, sleep: Sleep) -> None:
        """Sleep until woken (release, or promotion to head) or until ``timeout_s`` passes.

        Cancellation passes through; the caller still owns ``leave``.
        """
        if waiter._pending:
            waiter._pending = False
            return
        loop = asyncio.get_running_loop()
        signal: asyncio.Future[None] = loop.create_future()
        waiter._signal = signal
        delay = max(0.0, timeout_s)
        if sleep is asyncio.sleep:
            # The real clock: a timer handle on the loop, no Task (see the module doc).
            handle = loop.call_later(delay, _resolve, signal)
            try:
                await signal
            finally:
                waiter._signal = None
                waiter._pending = False
                handle.cancel()
            return
        timer = asyncio.ensure_future(sleep(delay))
        try:
            await asyncio.wait((signal, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter._signal = None
            waiter._pending = False
            # Cancel, never await: awaiting here could swallow a cancellation of the caller.
            timer.cancel()
