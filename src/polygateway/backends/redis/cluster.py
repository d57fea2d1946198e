"""Redis Cluster: each scope's commands go to the node that owns its hash slot.

Every key of a scope carries the hash tag ``{scope}`` (``codec.key``), so a
scope lives in one slot, on one node, and each of its scripts runs there
whole: a call still costs two round trips (acquire, release), pipelined on
that node's ``Wire``. ``Cluster`` is the backend's ``Topology``: a ``Wire``
per node, made on first use, and a slot map (16384 slots to the primary
serving each), read with ``CLUSTER SHARDS`` (``CLUSTER SLOTS`` before Redis 7).

Redirections are followed the way Redis's cluster specification asks
(each node's ``Wire`` hands them here, with the command, instead of to the
command's callback):

- ``MOVED slot host:port``: the slot has a new owner. The map learns it at
  once, the command is sent there, and the whole map is read again in the
  background (a resharding seldom moves one slot alone).
- ``ASK slot host:port``: the slot is migrating and the node that answered
  lacks one of the keys; the command is sent once to the named node behind
  ``ASKING``, and the map is left alone. Answered ``NOSCRIPT`` there (its
  scripts flushed), it is loaded and sent once more to that node, behind
  ``ASKING`` again (``wire.ASKING_FIRST``): without it the node would answer
  ``MOVED`` back to the migrating one, which answers ``ASK`` again.
- ``TRYAGAIN``: the migrating node has some of the keys the script names
  but not all (Redis 7), or the importing node, after ``ASK``, lacks some
  (scripts name keys that may not exist yet, so during a migration of its
  slot a scope mostly sees this). The command is sent again to the slot's
  owner after a short pause that doubles each time: the scope waits until
  the migration of its keys ends (milliseconds for a scope's few keys).
- A script that makes keys itself (ACQUIRE: a scope's candidates after the
  first, ``scripts.py``) is never sent on after ``ASK``: on the importing
  node a key not migrated yet reads as absent, without an error, and the
  script would start that source anew there. Nor can it finish on the
  migrating node once it touches a key not stored there: Redis stops it with
  ``Script attempted to access a non local key`` (what it wrote before, the
  refusals of earlier candidates, stays: each candidate's reads come before
  its writes). Both are taken as ``TRYAGAIN``: the call waits until its
  slot's migration ends and ``MOVED`` names the new owner.

Each command follows at most ``_MAX_REDIRECTS`` redirections; then its last
reply is its answer (the backend fails closed with it). A redirected command
is sent on from the reply's callback, before anything else is written, so
the commands of one scope reach their new node in the order they were sent.

A node that cannot be reached, or whose connection is lost, makes the map be
read again from any node that answers (the seed node last), so a failover
inside the cluster is followed as soon as the cluster has promoted a replica.
A node that fails to answer in time, or answers what is not a slot map (a
shape Redis does not send, a port no socket takes), passes the reading to
the next; when none answers it is logged, and the commands, sent where the
map last said, fail on their own (``GovernanceBackendError``, fail closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Final

from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from polygateway.backends.redis import codec
from polygateway.backends.redis.endpoint import Endpoint
from polygateway.backends.redis.wire import (
    ASKING_FIRST,
    NON_LOCAL_KEY,
    OnReply,
    Script,
    Wire,
    command,
)

__all__ = ["SLOTS", "Cluster", "read_shards", "read_slots"]

logger = logging.getLogger("polygateway.backends.redis")

SLOTS: Final = 16384
_MAX_REDIRECTS: Final = 32
"""Redirections one command follows; TRYAGAIN pauses add up to about 6 s before that."""
_TRYAGAIN_FIRST_S: Final = 0.01
_TRYAGAIN_MAX_S: Final = 0.2
_SHARDS: Final = command("CLUSTER", "SHARDS")
_SLOTS: Final = command("CLUSTER", "SLOTS")
_MAX_SCOPES: Final = 4096
"""Scopes whose slot is kept computed; configs hold a few, so this only bounds misuse."""

Address = tuple[str, int]
Ranges = list[tuple[int, int, Address]]
"""``(first slot, last slot, primary's address)``, as a slot map is read."""


class _Hop:
    """A redirected command's callback: the original one, and how far the command has come."""

    __slots__ = ("hops", "on_reply", "slot")

    def __init__(self, on_reply: OnReply, slot: int, hops: int) -> None:
        self.on_reply = on_reply
        self.slot = slot
        self.hops = hops

    def __call__(self, reply: Any) -> None:
        self.on_reply(reply)


class _Paused:
    """A command waiting out a ``TRYAGAIN`` pause: sent again when its timer fires."""

    __slots__ = ("data", "handle", "hop", "replier", "script")

    def __init__(self, replier: Address, data: bytes, hop: _Hop, script: Script | None) -> None:
        self.replier = replier
        self.data = data
        self.hop = hop
        self.script = script
        self.handle: asyncio.TimerHandle | None = None


def _pairs(flat: Sequence[Any]) -> dict[str, Any]:
    """A RESP2 map (a flat list of names and values) as a dict keyed by name."""
    return {codec.text(flat[i]): flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def _host(endpoint: Any, ip: Any, replier: str) -> str | None:
    """The address to reach a node at: its endpoint, its IP, or the node that answered ("")."""
    for value in (endpoint, ip):
        if value is None:
            continue
        text = codec.text(value)
        if text == "?":
            continue
        return text or replier
    return None


def _port(value: Any) -> int:
    """A node's port as a slot map gives it.

    One no socket takes (past 65535) makes the whole reply malformed:
    ``ValueError``, so the map is read from the next node instead of routing
    slots to an address no connection can be made to.
    """
    port = int(value)
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range")
    return port


def read_shards(reply: Sequence[Any], replier: str, *, tls: bool) -> Ranges:
    """``CLUSTER SHARDS``'s reply as slot ranges of each shard's online primary."""
    ranges: Ranges = []
    for shard in reply:
        fields = _pairs(shard)
        slots = [int(slot) for slot in fields.get("slots", ())]
        for node in fields.get("nodes", ()):
            info = _pairs(node)
            if codec.text(info.get("role", "")) != "master":
                continue
            if codec.text(info.get("health", "online")) != "online":
                continue
            port = info.get("tls-port" if tls else "port") or info.get("port")
            host = _host(info.get("endpoint"), info.get("ip"), replier)
            if host is None or port is None:
                continue
            address = (host, _port(port))
            ranges += ((slots[i], slots[i + 1], address) for i in range(0, len(slots) - 1, 2))
            break
    return ranges


def read_slots(reply: Sequence[Any], replier: str) -> Ranges:
    """``CLUSTER SLOTS``'s reply (Redis before 7) as slot ranges of their primaries."""
    ranges: Ranges = []
    for row in reply:
        first, last, primary = int(row[0]), int(row[1]), row[2]
        host = _host(primary[0], None, replier)
        if host is not None:
            ranges.append((first, last, (host, _port(primary[1]))))
    return ranges


class Cluster:
    """A Redis Cluster as the backend's ``Topology``: a ``Wire`` per node, routed by slot.

    Args:
        seed: any node of the cluster; every other is made like it (TLS,
            credentials, timeouts), at the address the slot map gives.
        late_reply_s: each node's ``Wire`` silence bound.
        scripts: loaded on every new connection of every node.
        timeout_s: how long reading the slot map from one node may take.
    """

    __slots__ = (
        "_again",
        "_closed",
        "_late_reply_s",
        "_owners",
        "_paused",
        "_refreshing",
        "_scripts",
        "_seed",
        "_slots",
        "_timeout_s",
        "_unpaused",
        "_wires",
    )

    def __init__(
        self,
        seed: Endpoint,
        *,
        late_reply_s: float,
        scripts: Sequence[Script] = (),
        timeout_s: float,
    ) -> None:
        self._seed = seed
        self._late_reply_s = late_reply_s
        self._scripts = tuple(scripts)
        self._timeout_s = timeout_s
        self._wires: dict[Address, Wire] = {}
        self._owners: list[Wire | None] = [None] * SLOTS
        self._slots: dict[str, int] = {}
        self._refreshing: asyncio.Task[None] | None = None
        self._again = False
        self._closed = False
        self._paused: set[_Paused] = set()
        self._unpaused: asyncio.Event | None = None
        """Set when the last paused command was sent again (what ``drain`` waits for)."""

    def route(self, scope: str) -> Wire:
        """The wire of the node owning ``scope``'s slot (the seed's until the map is known)."""
        slot = self._slots.get(scope)
        if slot is None:
            slot = self.slot_of(scope)
        wire = self._owners[slot]
        if wire is None:
            self._closed = False  # used again after aclose, which forgot the map
            self.refresh()
            wire = self._wire((self._seed.host, self._seed.port))
        return wire

    def slot_of(self, scope: str) -> int:
        """The hash slot of every key of ``scope`` (computed once per scope)."""
        slot = key_slot(codec.key(scope, "sources").encode())
        if len(self._slots) >= _MAX_SCOPES:
            self._slots.clear()
        self._slots[scope] = slot
        return slot

    def nodes(self) -> list[str]:
        """The nodes owning slots now, as ``host:port``, in slot order."""
        seen: dict[str, None] = {}
        for wire in self._owners:
            if wire is not None:
                seen.setdefault(wire.endpoint.address)
        return list(seen)

    def _wire(self, address: Address) -> Wire:
        wire = self._wires.get(address)
        if wire is None:
            host, port = address
            wire = self._wires[address] = Wire(
                replace(self._seed, host=host, port=port),
                late_reply_s=self._late_reply_s,
                scripts=self._scripts,
                redirect=functools.partial(self._redirected, address),
                on_down=self.refresh,
            )
        return wire

    # -- redirections ------------------------------------------------------------------

    def _redirected(
        self, replier: Address, reply: ResponseError, data: bytes, on_reply: OnReply, script: Any
    ) -> None:
        """Send a command on where a ``MOVED``, ``ASK`` or ``TRYAGAIN`` reply says it belongs."""
        kind, _, rest = str(reply).partition(" ")
        hops = on_reply.hops + 1 if isinstance(on_reply, _Hop) else 1
        original = on_reply.on_reply if isinstance(on_reply, _Hop) else on_reply
        if kind == "READONLY" or hops > _MAX_REDIRECTS:
            original(reply)  # a replica in a cluster is never a redirection of ours
            return
        if (
            kind == "TRYAGAIN"
            or str(reply).startswith(NON_LOCAL_KEY)
            or (kind == "ASK" and script is not None and script.makes_keys)
        ):
            # From the migrating node (it has some of the keys) or, after ASK, the importing
            # one: either way the slot's owner is asked again, which the map (or, before any
            # redirection, the node that answered) says.
            slot = on_reply.slot if isinstance(on_reply, _Hop) else -1
            paused = _Paused(replier, data, _Hop(original, slot, hops), script)
            delay = min(_TRYAGAIN_FIRST_S * 2 ** (hops - 1), _TRYAGAIN_MAX_S)
            paused.handle = asyncio.get_running_loop().call_later(delay, self._resend, paused)
            self._paused.add(paused)
            return
        slot_text, _, address = rest.partition(" ")
        host, _, port = address.rpartition(":")
        try:
            slot, target = int(slot_text), self._wire((host or replier[0], int(port)))
        except ValueError:
            original(reply)
            return
        hop = _Hop(original, slot, hops)
        if kind == "MOVED":
            self._owners[slot] = target
            self.refresh()
            target.send(data, hop, script)
        else:
            target.send(data, hop, script, ASKING_FIRST)

    def _resend(self, paused: _Paused) -> None:
        """Send a command again to its slot's owner (after ``TRYAGAIN``)."""
        self._paused.discard(paused)
        hop = paused.hop
        wire = self._owners[hop.slot] if hop.slot >= 0 else None
        (wire or self._wire(paused.replier)).send(paused.data, hop, paused.script)
        if not self._paused and self._unpaused is not None:
            self._unpaused.set()

    # -- the slot map ------------------------------------------------------------------

    def refresh(self) -> None:
        """Read the slot map again in the background (once more after a reading under way)."""
        if self._closed:
            return
        if self._refreshing is not None:
            self._again = True  # what it reads may predate what asked for this one
            return
        with contextlib.suppress(RuntimeError):  # no running loop: at the next use
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh())

    async def _refresh(self) -> None:
        try:
            self._again = False
            await self._read_any()
        finally:
            self._refreshing = None
        if self._again:
            self.refresh()

    async def _read_any(self) -> None:
        """Read the map from the nodes owning slots, else the seed; the first answer wins."""
        seed = (self._seed.host, self._seed.port)
        owning = {id(wire) for wire in self._owners if wire is not None}
        tried = [a for a, w in self._wires.items() if a != seed and id(w) in owning]
        errors = []
        for address in [*tried, seed]:
            try:
                ranges = await self._read_map(self._wire(address), address[0])
            except (RedisError, OSError, ValueError, TypeError, IndexError) as exc:
                errors.append(f"{address[0]}:{address[1]}: {type(exc).__name__}")
                continue
            if ranges:
                self._apply(ranges)
                return
        logger.warning("cannot read the Redis Cluster's slot map (%s)", "; ".join(errors))

    async def _read_map(self, wire: Wire, host: str) -> Ranges:
        """The slot map as ``wire``'s node knows it: ``CLUSTER SHARDS``, else ``CLUSTER SLOTS``."""
        reply = await self._ask(wire, _SHARDS)
        if isinstance(reply, ResponseError):
            reply = await self._ask(wire, _SLOTS)
            if isinstance(reply, Exception):
                raise reply
            return read_slots(reply, host)
        if isinstance(reply, Exception):
            raise reply
        return read_shards(reply, host, tls=self._seed.tls is not None)

    async def _ask(self, wire: Wire, data: bytes) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def on_reply(reply: Any) -> None:
            if not future.done():
                future.set_result(reply)

        wire.send(data, on_reply)
        try:
            async with asyncio.timeout(self._timeout_s):
                return await future
        except TimeoutError as exc:
            raise RedisError(f"no reply within {self._timeout_s:g} s") from exc

    def _apply(self, ranges: Ranges) -> None:
        owners: list[Wire | None] = [None] * SLOTS
        for first, last, address in ranges:
            wire = self._wire(address)
            for slot in range(max(first, 0), min(last, SLOTS - 1) + 1):
                owners[slot] = wire
        self._owners = owners

    async def drain(self) -> None:
        """Return once no reply is due on any node, nor any command paused by ``TRYAGAIN``."""
        while True:
            if self._paused:
                self._unpaused = asyncio.Event()
                await self._unpaused.wait()
            for wire in list(self._wires.values()):
                await wire.drain()
            if not self._paused:
                return

    async def aclose(self) -> None:
        """Close every node's connection and forget the map (stop reading it).

        Used again, the cluster is read anew, as when it was made: the next
        ``route`` finds no owner, and reading the map is allowed again.
        Meanwhile the connections lost here do not read it.
        """
        self._closed = True
        self._owners = [None] * SLOTS
        paused, self._paused = self._paused, set()
        for waiting in paused:
            # Failed as every command pending at close is; sent later, it would reconnect.
            if waiting.handle is not None:
                waiting.handle.cancel()
            waiting.hop(RedisConnectionError("the backend closed while the command was paused"))
        if self._unpaused is not None:
            self._unpaused.set()
        refreshing, self._refreshing = self._refreshing, None
        if refreshing is not None:
            refreshing.cancel()
            with contextlib.suppress(BaseException):
                await refreshing
        for wire in list(self._wires.values()):
            await wire.aclose()
