"""The Redis backend's wire: scripts sent as pre-packed EVALSHA over a lean pool of connections.

Why not ``redis.asyncio.Redis.evalsha``: profiled on the governance loop
alone, redis-py 8 spent most of a round trip's client CPU around the round
trip rather than in it: ``pack_command`` encoding every argument anew (an
ACQUIRE carries about 25, nine per candidate, the same on every call), the
client's observability hooks and retry wrapper, ``BlockingConnectionPool``'s
condition, timeout and health probe per borrowed connection, and an
``asyncio.wait_for`` (a Task in Python 3.11) around every socket write. What
stays from redis-py is everything that is hard to get right: the connection
(URL parsing, TLS, unix sockets, AUTH / HELLO / SELECT on connect) and its
reply parser. What this module adds is small:

- Commands are RESP bytes built here. A candidate's ARGV and KEYS are packed
  once and cached by the limiter (``bulk``), so an ACQUIRE is one
  ``bytes.join`` of cached pieces; the Lua contract (``scripts.py``) is
  unchanged, so the differential suite guards it as before. Sending fewer
  arguments instead (one packed string per candidate, or specs stored once in
  Redis under a digest) would have changed that contract, and the second adds
  a failure mode (a spec missing after FLUSHALL or a restart, answered by a
  retry); once packing is a cached join, the argument count costs the client
  next to nothing.
- A LIFO of idle connections and a FIFO of waiters: a borrowed connection
  costs a list pop. At most ``size`` connections exist; past that an
  operation waits for one (its caller is bounded by the limiter).
- An EVALSHA answered ``NOSCRIPT`` (a ``SCRIPT FLUSH``, a restarted server)
  loads its script on the same connection and runs once more, as redis-py's
  ``Script`` does.
- A connection whose exchange failed or was interrupted is closed (redis-py
  does this on any error while writing or reading) and reconnects on its
  next use, so a reply never reaches the wrong operation.

Timeouts are not this module's: the limiter bounds callers and, for work
left behind, how long a late reply is still read (``limiter._bounded``).

Measured on the governance loop alone (the bench's ``loop`` scenario,
``pgw_redis_instant``, one run before and one after, medians of 3 rounds),
the client CPU of a call on Redis fell from 831 to 499 µs at concurrency 1
and from 687 to 406 µs at concurrency 64 (the memory backend: 64 µs). Most of
what is left is the event loop's and the socket's: each round trip blocks
the process once when nothing else is in flight. The ``redis`` extra brings
``hiredis``: redis-py then parses replies in C (its asyncio client packs
commands in Python either way, which no longer matters here), about 10 µs
less per call, at both concurrencies, measured interleaved. Not adopted:
coalescing the operations of one event-loop turn into one pipeline (a reply
shared by several callers would need its own late-reply and fail-closed
handling per operation).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio.connection import AbstractConnection
from redis.exceptions import NoScriptError, RedisError

__all__ = ["Script", "Wire", "bulk", "pack"]

_EVALSHA = b"$7\r\nEVALSHA\r\n$40\r\n"


def bulk(value: str) -> bytes:
    """One RESP bulk string: the packed form of one command argument."""
    data = value.encode()
    return b"$%d\r\n%b\r\n" % (len(data), data)


def pack(values: Sequence[str]) -> bytes:
    """Several arguments, packed one after another."""
    return b"".join(map(bulk, values))


async def _ready(conn: AbstractConnection) -> None:
    """Connect, or reconnect a connection the server closed (or with unread data) while idle.

    The same check as redis-py's pool on every borrow (``can_read`` only looks
    at buffers): after a server restart, idle connections reconnect instead of
    failing one operation each.
    """
    if conn.is_connected and await conn.can_read():
        await conn.disconnect()
    if not conn.is_connected:
        await conn.connect()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated


async def _discard(conn: AbstractConnection) -> None:
    """Close a connection whose exchange failed or was cut short: a reply may still be due on it.

    redis-py closes it itself on most such paths; this also covers the rest
    (a script error, a cancellation between two steps). It reconnects on its
    next use.
    """
    if conn.is_connected:
        with contextlib.suppress(RedisError, OSError):
            await conn.disconnect(nowait=True)


class Script:
    """A Lua script: its text (for ``SCRIPT LOAD``) and its SHA1, as EVALSHA sends it."""

    __slots__ = ("_head", "text")

    def __init__(self, text: str, sha: str) -> None:
        self.text = text
        self._head = _EVALSHA + sha.encode() + b"\r\n"

    def command(self, numkeys: int, count: int, packed: Sequence[bytes]) -> bytes:
        """``EVALSHA sha numkeys ...``: ``packed`` holds ``count`` packed KEYS then ARGV."""
        return b"".join((b"*%d\r\n" % (count + 3), self._head, bulk(str(numkeys)), *packed))


class Wire:
    """At most ``size`` connections made by ``connect``; one operation per connection at a time."""

    __slots__ = ("_idle", "_made", "_make", "_size", "_waiters")

    def __init__(self, make_connection: Callable[[], AbstractConnection], size: int) -> None:
        self._make = make_connection
        self._size = size
        self._made: list[AbstractConnection] = []
        self._idle: list[AbstractConnection] = []
        self._waiters: deque[asyncio.Future[AbstractConnection]] = deque()

    async def _borrow(self) -> AbstractConnection:
        if self._idle:
            return self._idle.pop()  # LIFO: the warmest connection, the others may idle out
        if len(self._made) < self._size:
            conn = self._make()
            self._made.append(conn)
            return conn
        waiter: asyncio.Future[AbstractConnection] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            # Handed a connection in the same turn as the cancellation: pass it on.
            if waiter.done() and not waiter.cancelled():
                self._give(waiter.result())
            raise

    def _give(self, conn: AbstractConnection) -> None:
        """Hand a connection to the oldest waiter still waiting, else back to the idle list."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():  # cancelled waiters are dropped here, lazily
                waiter.set_result(conn)
                return
        self._idle.append(conn)

    async def evalsha(self, script: Script, numkeys: int, count: int, packed: list[bytes]) -> Any:
        """Run a script: one round trip (two more after a ``NOSCRIPT``); errors are redis-py's."""
        command = script.command(numkeys, count, packed)
        conn = await self._borrow()
        try:
            await _ready(conn)
            await conn.send_packed_command(command, check_health=False)
            try:
                return await conn.read_response()
            except NoScriptError:
                # The reply was read whole: the connection is clean, load and run again.
                await conn.send_command("SCRIPT", "LOAD", script.text, check_health=False)
                await conn.read_response()
                await conn.send_packed_command(command, check_health=False)
                return await conn.read_response()
        except BaseException:
            await _discard(conn)
            raise
        finally:
            self._give(conn)

    async def execute(self, *args: str) -> Any:
        """One plain command (rare paths: the snapshot's ``ZRANGE``)."""
        conn = await self._borrow()
        try:
            await _ready(conn)
            await conn.send_command(*args, check_health=False)
            return await conn.read_response()
        except BaseException:
            await _discard(conn)
            raise
        finally:
            self._give(conn)

    async def aclose(self) -> None:
        """Close every connection made; waiters are not expected (the owner finished its work)."""
        made, self._made, self._idle = self._made, [], []
        for conn in made:
            await conn.disconnect()
