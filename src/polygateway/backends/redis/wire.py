"""The Redis backend's wire: pre-packed EVALSHA, pipelined on one connection read by our protocol.

Why not ``redis.asyncio.Redis.evalsha``: profiled on the governance loop
alone, redis-py 8 spent most of a round trip's client CPU around the round
trip rather than in it: ``pack_command`` encoding every argument anew (an
ACQUIRE carries about 25, nearly all the same on every call), the
client's observability hooks and retry wrapper, ``BlockingConnectionPool``'s
condition, timeout and health probe per borrowed connection, an
``asyncio.wait_for`` (a Task in Python 3.11) around every socket write, and
its stream reader. Without it the target "Redis backend, c1: CPU per call
<= 2x raw aiohttp" misses (research-wiki/designs/speed-tricks.md). So the
connection is ours from the socket up, made
through public interfaces only: ``loop.create_connection`` (with the
``Endpoint``'s TLS context for ``rediss://``) or ``create_unix_connection``,
with ``Link``, an ``asyncio.Protocol`` of this module, as its protocol.
redis-py provides the TLS context (``endpoint.py``) and the exception
classes, nothing else. What this module does:

- A new connection first sends ``HELLO 2`` (with ``AUTH user password`` when
  the endpoint has credentials, ``SETNAME`` when it names the client) and
  ``SELECT db`` unless the database is 0, pipelined, within the endpoint's
  connect timeout, and waits for their replies: a refusal fails the commands
  queued for the connection with the exception redis-py raises for it
  (``AuthenticationError`` for a wrong or missing password, ``ResponseError``
  for a database out of range), a connect error with redis-py's
  ``ConnectionError`` wording. The connection speaks RESP2; keep-alive
  probes find an idle connection to a server gone without a reset dead.
- Commands are RESP bytes built here from lists of ``Arg``, each one packed
  argument, and every count in the frame (the command's arguments, EVALSHA's
  ``numkeys``) is the length of the lists sent, never a figure a caller
  passes: a wrong count would corrupt the one connection every operation
  shares. A candidate's ARGV and KEYS are packed once and cached by the
  limiter (``bulks``), so an ACQUIRE is one ``bytes.join`` of cached pieces;
  the Lua contract (``scripts.py``) is unchanged, so the differential suite
  guards it as before. Sending fewer arguments instead (one packed string per
  candidate, or specs stored once in Redis under a digest) would have changed
  that contract, and the second adds a failure mode (a spec missing after
  FLUSHALL or a restart, answered by a retry); once packing is a cached join,
  the argument count costs the client next to nothing.
- One connection per backend, pipelined: every command is written at once and
  its reply, parsed by ``hiredis`` as bytes arrive (``Link.data_received``),
  goes to its callback in order. No Task, stream reader or coroutine per
  operation, and no pool to wait for. Redis runs the commands of one
  connection in the order they were written, so what this process does is
  seen by Redis in the order it did it: a release written before an acquire
  or a snapshot is run before it, whether or not its reply was read (the
  limiter's release relies on this).
- A caller that stops waiting leaves its command going: its reply is still
  read and handed to its callback (the limiter's ``bounded.Reply``).
- While the connection is being made (the first command, or after one was
  lost), commands queue and are written, in order, once it is up; if it
  cannot be made, they fail with its error and the next command tries again.
  A connection the server closed while idle is seen closed by the event loop
  (end of file) and replaced on the next use, so a restarted server fails no
  operation.
- Every new connection first loads the backend's scripts (``SCRIPT LOAD``,
  pipelined ahead of the commands queued meanwhile), so the first use of a
  script keeps its place in the order. An EVALSHA answered ``NOSCRIPT``
  anyway (a ``SCRIPT FLUSH`` mid-connection) loads its script and runs once
  more, as redis-py's ``Script`` does: after everything written before that
  answer came, which after a flush are mostly EVALSHAs answered ``NOSCRIPT``
  too and so run again in their order. It runs again as it was sent: behind
  ``ASKING`` when it followed a Cluster's ``ASK`` (``ASKING_FIRST``), and as
  its script's command, which ``cluster.py`` asks before following ``ASK``.
- A server silent for ``late_reply_s`` while replies are due (frozen, or
  gone without a reset) has its connection closed by a watchdog: what was
  pending fails with ``ConnectionError`` and the next command reconnects. So
  does a reply out of step or a byte stream ``hiredis`` cannot parse.
- A connection belongs to the event loop it was made in. A backend shared
  per URL outlives it (a program that calls ``asyncio.run`` more than once):
  used from another loop, the wire leaves that connection (what was pending
  there is ``Unanswered``; what was queued for a connection that loop was
  making is dropped with it) and makes a new one. A loop that is closed
  can no longer close its sockets, so the server is told (``shutdown``) and
  the socket is freed with its transport, which warns as asyncio does for
  any transport never closed: ``aclose`` a backend before its loop ends to
  spare that.
- Topologies (``Topology``): a ``Wire`` is the topology of one server. A
  Redis Cluster (``cluster.py``) holds a ``Wire`` per node and gives each a
  ``Redirect``: an error reply it names (``MOVED``, ``ASK``, ``TRYAGAIN``,
  ``READONLY``) goes to it with the command, instead of to the command's
  callback, to be sent again where it belongs. Behind Sentinel
  (``sentinel.py``) the wire asks where the primary is (``locate``) before
  each connection, and refuses a server that is not a primary (``ROLE``);
  once connected it asks again, and leaves a server no longer named.

Timeouts of callers are not this module's (``bounded.Deadlines``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, NewType, Protocol, cast

import hiredis
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from polygateway.backends.redis.endpoint import Endpoint

__all__ = [
    "ASKING",
    "ASKING_FIRST",
    "Arg",
    "Link",
    "Locate",
    "OnReply",
    "Redirect",
    "Script",
    "Topology",
    "Unanswered",
    "Wire",
    "bulk",
    "bulk_bytes",
    "bulks",
    "command",
    "handshake",
]

logger = logging.getLogger("polygateway.backends.redis")

_EVALSHA = b"$7\r\nEVALSHA\r\n$40\r\n"
_INCOMPLETE: Final = object()
"""What ``hiredis.Reader.gets`` returns while a reply is still incomplete (never a reply)."""

_GOODBYE_S: Final = 1.0
"""How long closing waits for a TLS connection's goodbye before cutting it (one round trip
to a live server; a frozen one never answers)."""
_KEEPALIVE: Final = (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))
"""Probes after 30 s idle, every 5 s, 3 unanswered: redis-py 8's defaults, about 45 s to notice."""

OnReply = Callable[[Any], None]
"""Called once with a command's reply: a value, or an exception (error reply, lost link)."""

Redirect = Callable[[ResponseError, bytes, "OnReply", "Script | None"], None]
"""Takes an error reply that says the command belongs elsewhere, with the command, to send it on."""

NON_LOCAL_KEY: Final = (
    "Script attempted to access a non local key",
    "ERR Script attempted to access a non local key",
)
"""A script's error on a Cluster node whose slot migrates, as the reply may spell it: it
touched a key it did not name in KEYS that is not stored there (moved, or not made yet);
what it wrote before stays."""

REDIRECTS: Final = ("MOVED ", "ASK ", "TRYAGAIN", "READONLY", *NON_LOCAL_KEY)
"""The error replies a ``Redirect`` is given (Cluster redirections, a demoted primary)."""

Locate = Callable[[], Awaitable[Endpoint]]
"""Where the server is now: asked before each new connection (Sentinel's current primary)."""

Arg = NewType("Arg", bytes)
"""One command argument, packed (a RESP bulk string): a command counts its ``Arg``s."""

ASKING_FIRST: Final = 1
"""A ``send`` flag: the command follows ``ASK`` (Redis Cluster), so ``ASKING`` goes right
before it, and again before it is sent once more after ``NOSCRIPT``: the importing node
serves the slot to the one command after ``ASKING``, and answers ``MOVED`` to any other."""
_RELOADED: Final = 2
"""A ``send`` flag: the command is sent once more after ``NOSCRIPT``; a second is its answer."""


class Unanswered(RedisConnectionError):
    """A command written, whose connection was lost before its reply: it may have run.

    Commands that failed before they were written (the connection could not be
    made) get the connect error instead: they certainly did not run.
    """


def bulk(value: str) -> Arg:
    """One argument, packed."""
    data = value.encode()
    return Arg(b"$%d\r\n%b\r\n" % (len(data), data))


def bulk_bytes(data: bytes) -> Arg:
    """One binary argument, packed."""
    return Arg(b"$%d\r\n%b\r\n" % (len(data), data))


def bulks(values: Sequence[str]) -> tuple[Arg, ...]:
    """Several arguments, each packed."""
    return tuple(map(bulk, values))


def command(*args: str) -> bytes:
    """A whole command of plain arguments (rare paths: ``ZRANGE``, ``SCRIPT LOAD``, connecting)."""
    return b"".join((b"*%d\r\n" % len(args), *map(bulk, args)))


ASKING: Final = command("ASKING")
"""Sent right before a command that follows a Cluster's ``ASK`` (``ASKING_FIRST``)."""


def handshake(
    credentials: tuple[str, str] | None,
    db: int,
    client_name: str | None,
    *,
    primary_only: bool = False,
) -> list[bytes]:
    """What a new connection sends first: ``HELLO 2 [AUTH user password] [SETNAME name]``, SELECT.

    ``HELLO`` rather than ``AUTH``: it logs in a ``default`` user that has no
    password whatever password is given (``AUTH`` would refuse one), and on a
    server that wants a password it fails at once, before any script runs.
    ``primary_only`` adds ``ROLE``, whose reply must say ``master``.
    """
    hello = ["HELLO", "2"]
    if credentials is not None:
        hello += ("AUTH", *credentials)
    if client_name:
        hello += ("SETNAME", client_name)
    commands = [command(*hello)]
    if db:
        commands.append(command("SELECT", str(db)))
    if primary_only:
        commands.append(command("ROLE"))
    return commands


class Script:
    """A Lua script: its ``SCRIPT LOAD`` command and its SHA1, as EVALSHA sends it.

    ``makes_keys``: the script also touches keys it makes itself (same hash tag,
    not in KEYS); in a Cluster it must not follow ``ASK`` (``cluster.py``).
    """

    __slots__ = ("_head", "load", "makes_keys")

    def __init__(self, text: str, sha: str, *, makes_keys: bool = False) -> None:
        self.makes_keys = makes_keys
        self.load = command("SCRIPT", "LOAD", text)
        self._head = _EVALSHA + sha.encode() + b"\r\n"

    def command(self, keys: Sequence[Arg], argv: Sequence[Arg]) -> bytes:
        """``EVALSHA sha numkeys KEYS... ARGV...``, every count taken from the lists."""
        numkeys = b"%d" % len(keys)
        head = b"*%d\r\n%b$%d\r\n%b\r\n" % (
            len(keys) + len(argv) + 3,
            self._head,
            len(numkeys),
            numkeys,
        )
        return b"".join((head, *keys, *argv))


def _ignore(reply: Any) -> None:
    """A ``SCRIPT LOAD``'s or an ``ASKING``'s reply: if it failed, the command after it says so."""


_Pending = tuple[OnReply, bytes, Script | None, int]
"""A command's callback, its bytes, its script, and its ``send`` flags."""


class Link(asyncio.Protocol):
    """One connection: commands written in order, each reply handed to its callback in order."""

    __slots__ = (
        "_clock",
        "_drained",
        "_heard",
        "_late_reply_s",
        "_lost",
        "_on_down",
        "_parser",
        "_pending",
        "_redirect",
        "_transport",
        "_watchdog",
        "loop",
        "open",
    )

    def __init__(
        self,
        late_reply_s: float,
        redirect: Redirect | None = None,
        on_down: Callable[[], None] | None = None,
    ) -> None:
        self._late_reply_s = late_reply_s
        self._redirect = redirect
        self._on_down = on_down
        self._parser = hiredis.Reader(replyError=ResponseError, notEnoughData=_INCOMPLETE)
        self._pending: deque[_Pending] = deque()
        self._transport: asyncio.Transport | None = None
        self._heard = 0.0  # when the server last answered, or last had nothing to answer
        self._clock: Callable[[], float] = time.monotonic  # edge: the event loop's once connected
        self._watchdog: asyncio.TimerHandle | None = None
        self._drained: asyncio.Future[None] | None = None
        self._lost: asyncio.Future[None] | None = None  # done once the socket is closed
        self.loop: asyncio.AbstractEventLoop | None = None
        """The event loop the connection was made in, which alone can read and close it."""
        self.open = False

    @property
    def pending(self) -> int:
        """Replies still due on this connection."""
        return len(self._pending)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Take the connection the event loop made (TLS, if any, already set up)."""
        self._transport = cast(asyncio.Transport, transport)
        self.open = True
        loop = self.loop = asyncio.get_running_loop()
        self._lost = loop.create_future()
        self._clock = loop.time
        self._heard = loop.time()
        self._watchdog = loop.call_later(self._late_reply_s / 2, self._watch)

    def data_received(self, data: bytes) -> None:
        """Parse what arrived; every whole reply goes to the oldest callback waiting."""
        parser, pending = self._parser, self._pending
        parser.feed(data)
        while True:
            try:
                reply = parser.gets()
            except hiredis.ProtocolError:
                self._fail("a reply Redis could not have sent")
                return
            if reply is _INCOMPLETE:
                break
            if not pending:
                self._fail("a reply nobody asked for")
                return
            on_reply, data_sent, script, flags = pending.popleft()
            if type(reply) is ResponseError:
                message = str(reply)
                if script is not None and not flags & _RELOADED and message.startswith("NOSCRIPT"):
                    # Flushed or restarted: load the script and run the command once more, as
                    # it was sent (behind ASKING after ASK) and still as the script's command
                    # (whether it may follow a later ASK: cluster.py).
                    self.send(script.load, _ignore)
                    self.send(data_sent, on_reply, script, flags | _RELOADED)
                    continue
                if self._redirect is not None and message.startswith(REDIRECTS):
                    self._redirect(reply, data_sent, on_reply, script)
                    continue
            on_reply(reply)
        if pending:
            self._heard = self._clock()  # the server speaks: silence counts from now
            return
        self._heard = 0.0  # nothing due: silence is not a fault
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        """Fail what was pending: its replies will never come."""
        self.open = False
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)
        if self._watchdog is not None:
            self._watchdog.cancel()
        reason = "connection closed" if exc is None else f"connection lost: {exc}"
        pending, self._pending = self._pending, deque()
        for on_reply, _, _, _ in pending:
            on_reply(Unanswered(reason))
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        if self._on_down is not None:
            self._on_down()

    def send(
        self, data: bytes, on_reply: OnReply, script: Script | None = None, flags: int = 0
    ) -> None:
        """Write a command; its reply (or the link's failure) goes to ``on_reply``.

        ``flags``: ``ASKING_FIRST`` writes ``ASKING`` right before it.
        """
        pending = self._pending
        if not pending and not self._heard:
            self._heard = self._clock()  # silence counts from now
        transport = cast(asyncio.Transport, self._transport)
        if flags & ASKING_FIRST:
            pending.append((_ignore, ASKING, None, 0))
            transport.write(ASKING)
        pending.append((on_reply, data, script, flags))
        transport.write(data)

    async def drained(self) -> None:
        """Return once no reply is due."""
        if self._pending and self.open:
            if self._drained is None or self._drained.done():
                self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def close(self) -> None:
        """Close now; what is pending fails when the event loop reports the connection lost."""
        self.open = False
        if self._transport is not None:
            self._transport.close()

    async def aclose(self, goodbye_s: float) -> None:
        """Close, and return once the socket is closed.

        A plain connection closes at the loop's next turn; TLS first exchanges
        its goodbye with the server, given ``goodbye_s`` before the connection
        is cut. Returning earlier would leave the socket to an event loop that
        may be closed next, which never closes it.
        """
        self.close()
        lost, transport = self._lost, self._transport
        if lost is None or transport is None:
            return  # never connected: no socket of ours
        try:
            async with asyncio.timeout(goodbye_s):
                await asyncio.shield(lost)
        except TimeoutError:
            transport.abort()
            await asyncio.shield(lost)

    def leave(self) -> None:
        """Give up a connection of an event loop that no longer runs, from the running one.

        Only that loop can close the transport: it is asked to, in case it runs
        again, and the socket is shut down so that the server drops the
        connection now. What was pending is ``Unanswered``: written, its reply
        never to be read (an acquire's late grant is given back from here).
        """
        self.open = False
        self._on_down = None
        if self._watchdog is not None:
            self._watchdog.cancel()
        transport, loop = self._transport, self.loop
        if transport is not None and loop is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            if not loop.is_closed():
                transport.abort()
        pending, self._pending = self._pending, deque()
        for on_reply, _, _, _ in pending:
            # A caller still waiting there has a future of that loop, which, closed, refuses
            # to wake it: nobody would read the outcome anyway.
            with contextlib.suppress(RuntimeError):
                on_reply(Unanswered("connection left with its event loop"))

    def _fail(self, why: str) -> None:
        logger.warning("closing a Redis connection: %s", why)
        self.close()

    def _watch(self) -> None:
        """Close the connection if replies are due and the server said nothing for too long."""
        loop = asyncio.get_running_loop()
        heard = self._heard
        if self._pending and heard and loop.time() - heard >= self._late_reply_s:
            self._fail(f"no reply for {self._late_reply_s:g} s while {len(self._pending)} were due")
            return
        self._watchdog = loop.call_later(self._late_reply_s / 2, self._watch)


async def _connect(endpoint: Endpoint, link: Link) -> None:
    """Open the socket (and TLS) with ``link`` as its protocol; errors worded as redis-py's."""
    loop = asyncio.get_running_loop()
    try:
        if endpoint.path is not None:
            await loop.create_unix_connection(lambda: link, endpoint.path)
            return
        transport, _ = await loop.create_connection(
            lambda: link, endpoint.host, endpoint.port, ssl=endpoint.tls
        )
    except OSError as exc:  # refused, unreachable, TLS refused (ssl.SSLError is an OSError)
        raise RedisConnectionError(_connect_error(endpoint.address, exc)) from exc
    except (ValueError, OverflowError) as exc:
        # An address no socket takes (a port past 65535, a host IDNA refuses), as a Cluster's
        # MOVED or slot map may name one: a connect error too, for the backend to translate.
        raise RedisConnectionError(f"Error connecting to {endpoint.address}. {exc}") from exc
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in _KEEPALIVE:
            option = getattr(socket, name, None)
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


def _connect_error(address: str, exc: OSError) -> str:
    """A socket error as redis-py words it: ``Error 111 connecting to host:port. Why.``"""
    args = exc.args
    if not args:
        return f"Error connecting to {address}."
    if len(args) == 1:
        return f"Error {args[0]} connecting to {address}."
    return f"Error {args[0]} connecting to {address}. {args[1]}."


def _refused(reply: ResponseError, credentials: tuple[str, str] | None) -> RedisError:
    """A first command's error reply as redis-py raises it: auth errors apart, ``ERR`` dropped.

    A refusal may quote the command, credentials and all: a server without
    ``HELLO`` (before Redis 6, or the command renamed away) answers ``unknown
    command 'HELLO', with args beginning with: ...``. The credentials sent
    are masked in it (the user name too, unless it is ``default``).
    """
    text = str(reply)
    if credentials is not None:
        user, password = credentials
        for secret in sorted({password, "" if user == "default" else user}, key=len, reverse=True):
            if secret:
                text = text.replace(secret, "***")
    code, _, detail = text.partition(" ")
    if code in ("WRONGPASS", "NOAUTH") or (code, detail) == ("ERR", "invalid password"):
        return AuthenticationError(detail)
    if code == "ERR":
        return ResponseError(detail)
    return ResponseError(text)


async def _greet(endpoint: Endpoint, link: Link) -> None:
    """Send the handshake's commands pipelined; raise the first refusal once all have replied."""
    credentials = await endpoint.credentials()
    commands = handshake(
        credentials,
        endpoint.db,
        endpoint.client_name,
        primary_only=endpoint.primary_only,
    )
    replies: list[Any] = []
    answered = asyncio.get_running_loop().create_future()

    def on_reply(reply: Any) -> None:
        replies.append(reply)
        if len(replies) == len(commands) and not answered.done():
            answered.set_result(None)

    for data in commands:
        link.send(data, on_reply)
    await answered
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise _refused(reply, credentials)
        if isinstance(reply, Exception):
            raise reply
    if endpoint.primary_only:
        role = replies[-1][0] if isinstance(replies[-1], list) and replies[-1] else b"?"
        if role != b"master":
            # A demoted primary that Sentinel still named, or a replica: never write to it.
            raise RedisConnectionError(
                f"{endpoint.address} is not the primary (its role is {role.decode()!r})"
            )


class Topology(Protocol):
    """Where a scope's commands go: one server's ``Wire``, or the Cluster node owning it."""

    def route(self, scope: str) -> Wire:
        """The wire that carries ``scope``'s commands now."""
        ...

    async def drain(self) -> None:
        """Return once no reply is due anywhere."""
        ...

    async def aclose(self) -> None:
        """Close every connection; what is pending or queued fails with ``ConnectionError``."""
        ...


class Wire:
    """One pipelined connection to ``endpoint``, remade when lost; the topology of one server.

    Args:
        locate: asked for the endpoint before each new connection (the current
            primary behind Sentinel), instead of ``endpoint``; its failure fails
            the commands queued, as a failed connect does.
        redirect: given the error replies of ``REDIRECTS`` (see the module docstring).
        on_down: told when a connection could not be made or was lost.
    """

    __slots__ = (
        "_abandoned",
        "_connecting",
        "_endpoint",
        "_late_reply_s",
        "_link",
        "_locate",
        "_on_down",
        "_queue",
        "_redirect",
        "_scripts",
    )

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        late_reply_s: float,
        scripts: Sequence[Script] = (),
        locate: Locate | None = None,
        redirect: Redirect | None = None,
        on_down: Callable[[], None] | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._late_reply_s = late_reply_s
        self._scripts = tuple(scripts)
        self._locate = locate
        self._redirect = redirect
        self._on_down = on_down
        self._link: Link | None = None
        self._queue: list[_Pending] = []
        self._connecting: asyncio.Task[None] | None = None
        self._abandoned = False

    @property
    def endpoint(self) -> Endpoint:
        """The server this wire connects to (behind Sentinel: the one it last connected to)."""
        return self._endpoint

    def route(self, scope: str) -> Wire:
        """One server carries every scope."""
        return self

    def abandon(self) -> None:
        """Close the connection (a demoted primary): what is pending fails; the next reconnects.

        A connection being made meanwhile is discarded once made and made again,
        located afresh: it may be going to the server just left (a frozen
        primary that Sentinel still named, which answers once it thaws).
        """
        link = self._link
        if link is not None:
            link.close()
        if self._connecting is not None:
            self._abandoned = True

    @property
    def writable(self) -> bool:
        """Whether a command sent now is written at once (the connection is up, in this loop)."""
        link = self._link
        return link is not None and link.open and link.loop is asyncio.get_running_loop()

    @property
    def pending(self) -> int:
        """Replies due, and commands waiting for the connection to be made."""
        return len(self._queue) + (self._link.pending if self._link is not None else 0)

    def send(
        self, data: bytes, on_reply: OnReply, script: Script | None = None, flags: int = 0
    ) -> None:
        """Write a command now, or once the connection is up; ``on_reply`` gets its reply.

        With ``script``, a ``NOSCRIPT`` answer loads it and runs the command once
        more. ``flags``: ``ASKING_FIRST`` sends ``ASKING`` right before it.
        """
        link = self._link
        if link is not None and link.open and link.loop is asyncio.get_running_loop():
            link.send(data, on_reply, script, flags)
            return
        self._settle()
        self._queue.append((on_reply, data, script, flags))
        if self._connecting is None:
            self._connecting = asyncio.get_running_loop().create_task(self._connect())

    async def _open(self, link: Link) -> None:
        """Connect and greet within the endpoint's connect timeout (after locating the server).

        With ``locate``, the server is located again once the connection is up,
        and a connection to a server no longer named is abandoned (made again
        where the answer points): connecting may have waited for a server that
        did not answer (a frozen primary), and the answer may have changed
        meanwhile without a word to ``abandon`` (Sentinel names a promoted
        replica before it announces ``+switch-master``). One more question to
        the Sentinels per connection, never per command.
        """
        if self._locate is not None:
            self._endpoint = await self._locate()
        endpoint = self._endpoint
        try:
            async with asyncio.timeout(endpoint.connect_timeout_s):
                await _connect(endpoint, link)
                await _greet(endpoint, link)
        except TimeoutError as exc:
            raise RedisTimeoutError("Timeout connecting to server") from exc
        if self._locate is not None and not self._abandoned:
            now = await self._locate()
            if (now.host, now.port, now.path) != (endpoint.host, endpoint.port, endpoint.path):
                self._abandoned = True

    async def _connect(self) -> None:
        while True:
            self._abandoned = False
            link = Link(self._late_reply_s, self._redirect, self._on_down)
            try:
                await self._open(link)
            except BaseException as exc:
                self._failed(link, exc)
                if not isinstance(exc, Exception):
                    raise
                return
            if not self._abandoned:
                break
            link.close()  # abandoned while it was being made: made again, located afresh
        if not link.open:
            # Lost after its login, while ``locate`` was asked again: a write now would be
            # dropped, its reply never come. What was queued fails as a failed connect does.
            self._failed(link, RedisConnectionError("connection lost while it was being made"))
            return
        self._link, self._connecting = link, None
        for loaded in self._scripts:
            link.send(loaded.load, _ignore)
        queue, self._queue = self._queue, []
        for on_reply, data, script, flags in queue:
            link.send(data, on_reply, script, flags)

    def _failed(self, link: Link, exc: BaseException) -> None:
        """A connection could not be made: the commands queued for it fail with its error."""
        link.close()
        if self._on_down is not None and isinstance(exc, Exception):
            self._on_down()
        error: BaseException = exc
        if isinstance(exc, asyncio.CancelledError):
            error = RedisConnectionError("the backend closed while connecting")
        self._connecting = None
        queue, self._queue = self._queue, []
        for on_reply, _, _, _ in queue:
            on_reply(error)

    def _settle(self) -> None:
        """Leave what an event loop other than the running one made: its connection, its queue.

        Such a loop ended (an earlier ``asyncio.run``): its connection is never
        read again, a connecting task of it never runs, and the callers queued
        for either were its own (module docstring).
        """
        loop = asyncio.get_running_loop()
        link, connecting = self._link, self._connecting
        if connecting is not None and connecting.get_loop() is not loop:
            self._connecting = None
            self._queue = []
        if link is not None and link.loop is not loop:
            self._link = None
            link.leave()  # last: what it calls back may send again (to a new connection)

    async def drain(self) -> None:
        """Return once no reply is due (the caller bounds how long it waits)."""
        self._settle()
        while self._connecting is not None:
            await asyncio.shield(self._connecting)
        if self._link is not None:
            await self._link.drained()

    async def aclose(self) -> None:
        """Close the connection; what is pending or queued fails with ``ConnectionError``."""
        self._settle()
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(BaseException):
                await self._connecting
        link, self._link = self._link, None
        if link is not None:
            await link.aclose(_GOODBYE_S)
