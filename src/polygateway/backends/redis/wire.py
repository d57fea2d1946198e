"""The Redis backend's wire: pre-packed EVALSHA over a few connections read by a protocol of ours.

Why not ``redis.asyncio.Redis.evalsha``: profiled on the governance loop
alone, redis-py 8 spent most of a round trip's client CPU around the round
trip rather than in it: ``pack_command`` encoding every argument anew (an
ACQUIRE carries about 25, nine per candidate, the same on every call), the
client's observability hooks and retry wrapper, ``BlockingConnectionPool``'s
condition, timeout and health probe per borrowed connection, and an
``asyncio.wait_for`` (a Task in Python 3.11) around every socket write.
What stays from redis-py is everything that is hard to get right about a
connection: URL parsing, TLS, unix sockets, AUTH / HELLO / SELECT on
connect. Once it is connected, its transport is taken over by ``Link``, an
``asyncio.Protocol`` of this module, and redis-py's connection object is
dropped. What this module does:

- Commands are RESP bytes built here. A candidate's ARGV and KEYS are packed
  once and cached by the limiter (``bulk``), so an ACQUIRE is one
  ``bytes.join`` of cached pieces; the Lua contract (``scripts.py``) is
  unchanged, so the differential suite guards it as before. Sending fewer
  arguments instead (one packed string per candidate, or specs stored once in
  Redis under a digest) would have changed that contract, and the second adds
  a failure mode (a spec missing after FLUSHALL or a restart, answered by a
  retry); once packing is a cached join, the argument count costs the client
  next to nothing.
- Replies are parsed by ``hiredis`` as bytes arrive (``Link.data_received``)
  and handed, in order, to the callback of the operation that asked: no
  Task, no stream reader and no coroutine per operation. An operation is an
  ``Exchange``: its caller hands it over and waits on a future of its own
  (the limiter's ``bounded.Reply``); a caller that stops waiting leaves the
  exchange going, and its reply is still read and acted on.
- At most ``size`` connections, one exchange on each at a time; past that an
  exchange queues (FIFO) and is sent on the first connection freed. An idle
  connection is a list pop away (LIFO: the warmest first, the others may
  idle out). A connection the server closed while idle is seen closed by the
  event loop (end of file) and replaced on the next use, so a restarted
  server fails no operation.
- An EVALSHA answered ``NOSCRIPT`` (a ``SCRIPT FLUSH``, a restarted server)
  loads its script on the same connection and runs once more, as redis-py's
  ``Script`` does.
- A connection whose exchange failed on the wire (lost, a reply out of step)
  is closed; what was pending on it fails with ``ConnectionError``.

Timeouts are not this module's: the limiter bounds callers and, for work
left behind, how long a late reply is still read (``Exchange.cut``).

Measured on the backend alone (an acquire then a release, in turn, on a quiet
machine): about 195 µs of client CPU per pair with redis-py's connections
and a Task per operation, 150 with this wire, against about 100 for the two
bare round trips (most of it the process sleeping and waking twice).
``hiredis`` (in the ``redis`` extra) is the parser.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final, cast

import hiredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

__all__ = ["Exchange", "Link", "OnReply", "Script", "Wire", "bulk", "pack"]

_EVALSHA = b"$7\r\nEVALSHA\r\n$40\r\n"
_INCOMPLETE: Final = object()
"""What ``hiredis.Reader.gets`` returns while a reply is still incomplete (never a reply)."""

OnReply = Callable[[Any], None]
"""Called once with an operation's reply: a value, or an exception (error reply, lost link)."""


def bulk(value: str) -> bytes:
    """One RESP bulk string: the packed form of one command argument."""
    data = value.encode()
    return b"$%d\r\n%b\r\n" % (len(data), data)


def pack(values: Sequence[str]) -> bytes:
    """Several arguments, packed one after another."""
    return b"".join(map(bulk, values))


def command(*args: str) -> bytes:
    """A whole command of plain arguments (rare paths: ``ZRANGE``, ``SCRIPT LOAD``)."""
    return b"*%d\r\n%b" % (len(args), pack(args))


class Script:
    """A Lua script: its ``SCRIPT LOAD`` command and its SHA1, as EVALSHA sends it."""

    __slots__ = ("_head", "load")

    def __init__(self, text: str, sha: str) -> None:
        self.load = command("SCRIPT", "LOAD", text)
        self._head = _EVALSHA + sha.encode() + b"\r\n"

    def command(self, numkeys: int, count: int, packed: Sequence[bytes]) -> bytes:
        """``EVALSHA sha numkeys ...``: ``packed`` holds ``count`` packed KEYS then ARGV."""
        return b"".join((b"*%d\r\n" % (count + 3), self._head, bulk(str(numkeys)), *packed))


class Link(asyncio.Protocol):
    """One connection: commands written in order, each reply handed to its callback in order."""

    __slots__ = ("_pending", "_reader", "_transport", "_writer", "open")

    def __init__(self) -> None:
        # The stream writer redis-py connected with, kept alive: collected, it closes the transport.
        self._writer: asyncio.StreamWriter | None = None
        self._reader = hiredis.Reader(replyError=ResponseError, notEnoughData=_INCOMPLETE)
        self._pending: deque[OnReply] = deque()
        self._transport: asyncio.Transport | None = None
        self.open = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Take the connection (handed over by ``Wire`` once redis-py has set it up)."""
        self._transport = cast(asyncio.Transport, transport)
        self.open = True

    def data_received(self, data: bytes) -> None:
        """Parse what arrived; every whole reply goes to the oldest callback waiting."""
        reader, pending = self._reader, self._pending
        reader.feed(data)
        while True:
            try:
                reply = reader.gets()
            except hiredis.ProtocolError:
                self.close()  # the stream is garbage from here on
                return
            if reply is _INCOMPLETE:
                return
            if not pending:
                self.close()  # a reply nobody asked for: out of step
                return
            pending.popleft()(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        """Fail what was pending: its replies will never come."""
        self.open = False
        reason = "connection closed" if exc is None else f"connection lost: {exc}"
        pending, self._pending = self._pending, deque()
        for on_reply in pending:
            on_reply(RedisConnectionError(reason))

    def send(self, data: bytes, on_reply: OnReply) -> None:
        """Write a command; its reply (or the link's failure) goes to ``on_reply``."""
        self._pending.append(on_reply)
        cast(asyncio.Transport, self._transport).write(data)

    def close(self) -> None:
        """Close now; what is pending fails when the event loop reports the connection lost."""
        self.open = False
        if self._transport is not None:
            self._transport.close()


class Exchange:
    """One operation on the wire: a command, sent on a free connection or queued until one is."""

    __slots__ = ("_command", "_load_error", "_on_reply", "_script", "_wire", "link")

    def __init__(self, wire: Wire, data: bytes, on_reply: OnReply, script: Script | None) -> None:
        self._wire = wire
        self._command = data
        self._on_reply = on_reply
        self._script = script
        self._load_error: BaseException | None = None
        self.link: Link | None = None

    def start(self, link: Link) -> None:
        """Send on ``link``, which is this exchange's until its reply."""
        self.link = link
        link.send(self._command, self._replied)

    def fail(self, error: BaseException) -> None:
        """End before any reply (no connection could be made, or the wire closed)."""
        self._on_reply(error)

    def cut(self) -> None:
        """Give the reply up: close the connection it would come on, or leave the queue."""
        if self.link is not None:
            self.link.close()
        elif self._wire.unqueue(self):
            self._on_reply(RedisConnectionError("given up while waiting for a connection"))

    def _replied(self, reply: Any) -> None:
        script = self._script
        if (
            script is not None
            and type(reply) is ResponseError
            and str(reply).startswith("NOSCRIPT")
            and self.link is not None
            and self.link.open
        ):
            # The reply was read whole: the connection is in step, load and run once more.
            self._script = None
            self.link.send(script.load, self._loaded)
            self.link.send(self._command, self._replied)
            return
        if self._load_error is not None:
            reply = self._load_error
        link = self.link
        if link is not None:
            self._wire.give(link)
        self._on_reply(reply)

    def _loaded(self, reply: Any) -> None:
        if isinstance(reply, BaseException):
            self._load_error = reply


async def _taken_over(connection: AbstractConnection, link: Link) -> None:
    """Connect with redis-py (TLS, AUTH, SELECT...), then give the transport to ``link``."""
    await connection.connect()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated
    writer = connection._writer
    if writer is None:  # pragma: no cover - connect() returns connected or raises
        raise RedisConnectionError("connection not established")
    # redis-py must neither read nor close what is the link's now (its __del__ would close it).
    connection._reader = connection._writer = None
    link._writer = writer
    transport = writer.transport
    transport.set_protocol(link)
    link.connection_made(transport)


class Wire:
    """At most ``size`` connections made by ``make_connection``; one exchange on each at a time."""

    __slots__ = ("_connecting", "_idle", "_made", "_make", "_queue", "_size")

    def __init__(self, make_connection: Callable[[], AbstractConnection], size: int) -> None:
        self._make = make_connection
        self._size = size
        self._made: list[Link] = []
        self._idle: list[Link] = []
        self._queue: deque[Exchange] = deque()
        self._connecting: set[asyncio.Task[None]] = set()

    def send(self, data: bytes, on_reply: OnReply, script: Script | None = None) -> Exchange:
        """Send a command now if a connection is free (else queue it); ``on_reply`` gets its reply.

        With ``script``, a ``NOSCRIPT`` answer loads it and runs the command once more.
        """
        exchange = Exchange(self, data, on_reply, script)
        idle = self._idle
        while idle:
            link = idle.pop()
            if link.open:
                exchange.start(link)
                return exchange
            self._made.remove(link)  # closed while idle (a restarted server): replaced below
        if len(self._made) < self._size:
            self._open(exchange)
        else:
            self._queue.append(exchange)
        return exchange

    def give(self, link: Link) -> None:
        """A link's exchange is over: the next queued exchange takes it, else it idles."""
        if not link.open:
            with contextlib.suppress(ValueError):
                self._made.remove(link)
            if self._queue:
                self._open(self._queue.popleft())
            return
        if self._queue:
            self._queue.popleft().start(link)
        else:
            self._idle.append(link)

    def unqueue(self, exchange: Exchange) -> bool:
        """Take an exchange out of the queue; False if it was not there."""
        try:
            self._queue.remove(exchange)
        except ValueError:
            return False
        return True

    def _open(self, exchange: Exchange) -> None:
        """A new connection for ``exchange``, made in a task of its own (it is rare)."""
        link = Link()
        self._made.append(link)
        task = asyncio.get_running_loop().create_task(self._connect(link, exchange))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect(self, link: Link, exchange: Exchange) -> None:
        try:
            await _taken_over(self._make(), link)
        except BaseException as exc:
            with contextlib.suppress(ValueError):
                self._made.remove(link)
            link.close()
            error = exc
            if isinstance(exc, asyncio.CancelledError):
                error = RedisConnectionError("the backend closed while connecting")
            exchange.fail(error)
            if self._queue and not isinstance(exc, asyncio.CancelledError):
                self._open(self._queue.popleft())
            if not isinstance(exc, Exception):
                raise
            return
        exchange.start(link)

    async def aclose(self) -> None:
        """Close every connection; what is pending or queued fails with ``ConnectionError``."""
        for task in list(self._connecting):
            task.cancel()
        if self._connecting:
            await asyncio.gather(*self._connecting, return_exceptions=True)
        queue, self._queue = self._queue, deque()
        for exchange in queue:
            exchange.fail(RedisConnectionError("the backend closed"))
        made, self._made, self._idle = self._made, [], []
        for link in made:
            link.close()
        await asyncio.sleep(0)  # the transports report their connections lost
