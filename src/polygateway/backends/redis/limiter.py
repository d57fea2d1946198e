"""The Redis backend: one governance state for a whole fleet of processes.

Every operation is one Lua script (``scripts.py``), so it is atomic on the
server and costs one round trip: a call that does not wait costs exactly two
(acquire, release); a stream adds one per renewal. Scripts run by EVALSHA and
are reloaded on NOSCRIPT, so a ``SCRIPT FLUSH`` or a restarted server is
survived without a restart of the process. They are sent by ``wire.py``
(pre-packed commands over a lean pool of redis-py connections), not through
``redis.asyncio.Redis``: that cut the client CPU of a governed call on Redis
by more than half (its docstring says where the time went).

Time is the server's (``redis.call('TIME')``) unless a ``now`` is injected,
which only tests do, so the contract suite runs its time-dependent cases under
a ``FakeClock``. Every value handed back is relative, so the caller's
monotonic clock and the server's clock never mix.

Fail closed: any Redis error, socket timeout or script failure becomes
``GovernanceBackendError`` naming the operation and the scope (this module is
the one boundary where redis exceptions are translated); no request goes
upstream ungoverned. The password of the URL never appears in a message or
repr.

Late replies: every operation runs as its own task, and its caller waits for
it at most ``socket_timeout_s`` (``_bounded``). A caller that stops waiting (its
timeout, or its own cancellation) leaves the task behind: the script may
already be on the server, which runs it whenever it can (a frozen server, on
waking), so the reply is still read, for up to ``_LATE_REPLY_S``. An acquire
granted after its caller left is released at once; a release still frees its
permit and wakes this process's waiters. Nothing waits for a lease to expire
unless the server stays silent longer than that.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import math
import os
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, Literal, TypeVar, cast

try:
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import RedisError
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "RedisBackend needs the redis client: pip install 'polygateway[redis]'"
    ) from exc

from polygateway.backends.base import (
    AcquireResult,
    AttemptOutcome,
    Lease,
    Rejection,
    RejectReason,
    ScopeSnapshot,
    SourceSnapshot,
    SourceSpec,
)
from polygateway.backends.redis import scripts
from polygateway.backends.redis.bounded import TIMED_OUT, Deadlines, relay
from polygateway.backends.redis.urls import REDACTED, mask_url, secrets_of
from polygateway.backends.redis.wire import Script, Wire, bulk, pack
from polygateway.backends.waiting import WaitingRoom
from polygateway.errors import ConfigError, GovernanceBackendError
from polygateway.governance.aimd import AIMD_COOLOFF_S, AIMD_FACTOR
from polygateway.governance.pacer import pace_for

__all__ = ["RedisBackend"]

logger = logging.getLogger("polygateway.backends.redis")

_PROGRESS_TTL_S = 3600
"""Lifetime of the fleet-wide progress key, refreshed by every success.

It bounds ``stall_window_s`` (config refuses more than 3600 s): the stall
rule only asks whether the scope served within the window, and a progress
mark older than the longest window is as good as none, so an abandoned
scope's key may as well disappear.
"""

_STATE_TTL_S = 86400
"""Lifetime of a source's state after its last acquire or release.

A source nobody has touched for a day has no cool-down or pacing left worth
keeping (both are far shorter); dropping it keeps a fleet whose config
changed from accumulating keys. Lease keys empty themselves as leases end.
"""

_LATE_REPLY_S = 60.0
"""How long a reply is still read after its caller stopped waiting for it.

Work left behind is cancelled after it (its connection has no socket timeout
of its own; an injected client's connections keep theirs); callers are
bounded by ``socket_timeout_s`` on their own side. Without it a timed-out acquire that a
frozen server runs on waking would hold its permit, unseen, until its lease
expired (``timeout_s + lease_grace_s``), for every connection that had one in
flight when the server froze.
"""

_MAX_CONNECTIONS = 64
"""Connections of the pool a backend opens; past it, operations wait for a free one.

Each operation holds a connection for one round trip, and the loop keeps a
process's concurrent acquires per scope bounded, so a few dozen serve any
number of permits; more would only load the server.
"""

_MAX_LEFT_BEHIND = _MAX_CONNECTIONS // 2
"""Operations left behind (their reply still read) at most; past it a timed-out one is abandoned.

(Half the pool: with an injected client, half of that client's pool size.)

Each holds a pool connection while it waits: half the pool stays for new
operations, so a server that never answers (a blackholed address after a
failover) cannot keep the pool busy for ``_LATE_REPLY_S``. The loop asks Redis
about once per socket timeout per scope while Redis is silent (only the head of
a waiting room asks), so this is rarely reached. An abandoned acquire that the
server runs later holds its permit until its lease expires, as a crash would.
"""

_MAX_SPEC_CACHE = 1024
"""Specs (and sources' keys) kept packed; configs hold a few dozen, so this only bounds misuse."""

# Arguments that never change, packed once (see wire.py for why packing is ours).
_EMPTY = bulk("")
_AIMD_DECREASE = bulk("1")
_NO_AIMD_DECREASE = bulk("0")
_STATE_TTL_ARG = bulk(str(_STATE_TTL_S))
_RELEASE_TAIL = pack(
    (repr(AIMD_COOLOFF_S), repr(AIMD_FACTOR), str(_PROGRESS_TTL_S), str(_STATE_TTL_S))
)

T = TypeVar("T")
Operation = Literal["acquire", "release", "renew", "progress_age_s", "snapshot"]
BreakerState = Literal["closed", "open", "half_open"]
_BREAKER_STATES = ("closed", "open", "half_open")
_CANCELLED = AttemptOutcome("cancelled")


def _key(scope: str, *parts: str) -> str:
    """``pgw:{scope}:...``: the hash tag keeps a scope in one Redis Cluster slot."""
    return ":".join(("pgw", "{" + scope + "}", *parts))


def _num(value: float | None) -> str:
    """A number as a Lua script reads it back exactly; ``""`` for none."""
    if value is None:
        return ""
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"a governance limit must be a finite number, not {value!r}")
    return repr(number)


def _text(value: Any) -> str:
    """A script's reply item as text (the client may or may not decode replies)."""
    if isinstance(value, bytes):
        return value.decode()
    return str(value)


def _opt_float(value: Any) -> float | None:
    text = _text(value)
    return None if text == "" else float(text)


def _is_one(reply: Any) -> bool:
    return int(reply) == 1


def _age(reply: Any) -> float:
    """A progress age from a script; ``""`` means never served."""
    age = _opt_float(reply)
    return math.inf if age is None else age


def _script(text: str) -> Script:
    """A script as the wire sends it, its SHA1 computed here once."""
    return Script(text, hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest())


def _pool_size(client: aioredis.Redis) -> int | None:
    """The connection pool's ``max_connections``, or ``None`` when the client does not say."""
    size = getattr(getattr(client, "connection_pool", None), "max_connections", None)
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    return None


class RedisBackend:
    """Governance state shared by every process that points at one Redis; implements ``Backend``.

    ``cancel_safe``: every operation runs in a task of its own that its caller's
    cancellation never reaches, and a late grant of an abandoned acquire is
    given back (see "Late replies").

    Args:
        url: ``redis://[[user]:password@]host:port/db`` (or ``rediss://``, ``unix://``).
        socket_timeout_s: longest wait of a caller for Redis (connect and reply);
            past it the operation fails closed, while its reply is still read in
            the background (see the module docstring).
        now: tests only: a clock passed to every script instead of the server's TIME.
        client: an existing ``redis.asyncio.Redis`` to use instead of opening a
            pool (its owner closes it; ``url`` then only names it in messages).
            Its pool makes the connections (its URL, timeouts, TLS, auth) and
            sizes the backend's own pool of them (``max_inflight_ops``).
    """

    __slots__ = (
        "_background",
        "_deadlines",
        "_max_inflight_ops",
        "_max_left_behind",
        "_now",
        "_rooms",
        "_scripts",
        "_secrets",
        "_serial",
        "_spec_args",
        "_spec_keys",
        "_timeout_s",
        "_url",
        "_wire",
    )

    cancel_safe = True

    def __init__(
        self,
        url: str,
        *,
        socket_timeout_s: float = 1.0,
        now: Callable[[], float] | None = None,
        client: aioredis.Redis | None = None,
    ) -> None:
        self._url = mask_url(url)
        self._secrets = secrets_of(url)
        if not socket_timeout_s > 0:
            raise ConfigError(
                f"socket_timeout_s must be positive, not {socket_timeout_s!r}",
                field="redis_socket_timeout_s",
            )
        if client is None:
            try:
                # Only a factory of connections (the URL parsed by redis-py): ``Wire`` pools them.
                factory = aioredis.ConnectionPool.from_url(
                    url,
                    # No socket timeout: callers wait socket_timeout_s (``_bounded``), and work
                    # left behind is cancelled after _LATE_REPLY_S, so a late reply is still
                    # read and acted on, not lost; a socket timeout would only add a Task to
                    # every write (redis-py's ``wait_for``).
                    socket_timeout=None,
                    socket_connect_timeout=socket_timeout_s,
                    # No client-side retry: one failed attempt fails closed at once,
                    # within the timeout; the governance loop decides what comes next.
                    retry=Retry(NoBackoff(), 0),
                )
            except ValueError as exc:
                raise ConfigError(
                    f"invalid redis url {self._url}: {self._scrub(str(exc))}", field="redis_url"
                ) from exc
            size = _MAX_CONNECTIONS
            self._max_inflight_ops: int | None = size
        else:
            # The injected client's settings (timeouts, TLS, auth), its pool size as ours.
            factory = client.connection_pool
            self._max_inflight_ops = _pool_size(client)
            size = self._max_inflight_ops or _MAX_CONNECTIONS
        self._wire = Wire(factory.make_connection, size)
        self._max_left_behind = max(1, size // 2)
        self._timeout_s = socket_timeout_s
        self._deadlines = Deadlines(socket_timeout_s)
        self._now = now
        self._scripts = {
            "acquire": _script(scripts.ACQUIRE),
            "release": _script(scripts.RELEASE),
            "renew": _script(scripts.RENEW),
            "progress_age_s": _script(scripts.PROGRESS),
            "snapshot": _script(scripts.SNAPSHOT),
        }
        self._rooms: dict[str, WaitingRoom] = {}
        self._spec_args: dict[SourceSpec, bytes] = {}
        self._spec_keys: dict[tuple[str, str], bytes] = {}
        # Work a caller stopped waiting for (timeout, cancellation); referenced until done.
        self._background: set[asyncio.Future[Any]] = set()
        self._serial = itertools.count(1)

    def __repr__(self) -> str:
        return f"RedisBackend(url={self._url!r})"

    @property
    def max_inflight_ops(self) -> int | None:
        """Operations this process runs at once before they queue for a pool connection.

        The loop bounds a scope's concurrent acquires by it, so a burst never
        waits inside the pool; ``None`` when an injected client's pool size is unknown.
        """
        return self._max_inflight_ops

    # -- the one boundary where redis exceptions are translated ---------------------------

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return text

    def _failure(
        self, operation: Operation, scope: str, detail: str, exc: BaseException
    ) -> GovernanceBackendError:
        message = f"redis {operation} failed at {self._url}: {detail}"
        if str(exc):
            message += f": {self._scrub(str(exc))}"
        return GovernanceBackendError(message, operation=operation, scope=scope)

    @contextlib.contextmanager
    def _boundary(self, operation: Operation, scope: str) -> Iterator[None]:
        """Where redis exceptions become ``GovernanceBackendError``: fail closed, with context."""
        try:
            yield
        except RedisError as exc:
            raise self._failure(operation, scope, type(exc).__name__, exc) from exc
        except OSError as exc:
            # Socket errors redis-py does not wrap (e.g. during connection setup).
            raise self._failure(operation, scope, type(exc).__name__, exc) from exc
        except (ValueError, TypeError, IndexError) as exc:
            # A reply our parser cannot read: a script out of step with this code.
            raise self._failure(operation, scope, "unexpected script reply", exc) from exc

    async def _run(
        self,
        operation: Operation,
        scope: str,
        numkeys: int,
        count: int,
        packed: list[bytes],
        parse: Callable[[Any], T],
    ) -> T:
        """Run one script (one round trip) and parse its reply, inside the boundary.

        ``packed`` holds ``count`` packed arguments: ``numkeys`` KEYS, then ARGV.
        """
        with self._boundary(operation, scope):
            reply = await self._wire.evalsha(self._scripts[operation], numkeys, count, packed)
            return parse(reply)

    async def _bounded(
        self,
        operation: Operation,
        scope: str,
        work: Coroutine[Any, Any, T],
        late: Callable[[asyncio.Future[T]], Awaitable[None]] | None = None,
    ) -> T:
        """Await ``work`` (its own task) for at most ``socket_timeout_s``.

        Past the timeout the caller fails closed; the task goes on, since its
        script may run on the server anyway, and is left behind with ``late``
        (when given) to act on its result: an acquire gives a late grant back.
        A cancelled caller leaves it behind the same way.

        One Task, one future and one entry in a deadline queue per operation
        (``bounded.py`` says why, and what it replaced).
        """
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Any] = loop.create_future()
        task = loop.create_task(relay(work, waiter))
        self._deadlines.add(loop, waiter)
        try:
            result = await waiter
        except asyncio.CancelledError:
            self._leave_behind(task, late)
            raise
        except Exception:
            # The work's own failure (already translated), relayed in the step that ended
            # the task: mark the task's copy retrieved, so asyncio does not log it again.
            if task.done():
                task.exception()
            raise
        if result is not TIMED_OUT:
            return cast(T, result)
        # Only our own timeout: inside the task every error is already translated.
        if len(self._background) >= self._max_left_behind:  # _MAX_LEFT_BEHIND
            task.cancel()  # closes its connection; see _MAX_LEFT_BEHIND
        self._leave_behind(task, late)
        detail = f"TimeoutError: no reply within {self._timeout_s:g} s"
        exc = TimeoutError(detail)
        raise self._failure(operation, scope, detail, exc) from exc

    def _leave_behind(
        self,
        task: asyncio.Task[T],
        late: Callable[[asyncio.Future[T]], Awaitable[None]] | None,
    ) -> None:
        """Keep a task its caller left referenced and acted on by ``late``; cut at _LATE_REPLY_S."""
        self._adopt(task if late is None else asyncio.ensure_future(late(task)))
        if not task.done():
            # The connection has no socket timeout of its own (see __init__): this is its bound.
            expire = asyncio.get_running_loop().call_later(_LATE_REPLY_S, task.cancel)
            task.add_done_callback(lambda _: expire.cancel())

    def _now_arg(self) -> bytes:
        return _EMPTY if self._now is None else bulk(repr(float(self._now())))

    def _args_of(self, spec: SourceSpec) -> bytes:
        """A candidate's ARGV slice (ACQUIRE's contract), packed once per spec."""
        cached = self._spec_args.get(spec)
        if cached is None:
            rpm = spec.rpm is not None
            tpm = spec.tpm is not None
            cached = pack(
                (
                    spec.name,
                    str(int(spec.max_concurrency)),
                    _num(spec.rpm),
                    _num(spec.rpm_capacity) if rpm else "",
                    _num(spec.tpm),
                    _num(spec.tpm_capacity) if tpm else "",
                    str(int(spec.breaker_failures)),
                    _num(spec.cooldown_s),
                    _num(spec.cooldown_max_s),
                )
            )
            if len(self._spec_args) >= _MAX_SPEC_CACHE:
                self._spec_args.clear()
            self._spec_args[spec] = cached
        return cached

    def _keys_of(self, scope: str, source: str) -> bytes:
        """A source's three keys (state, leases, lease metadata), packed once per scope."""
        cached = self._spec_keys.get((scope, source))
        if cached is None:
            cached = pack(
                (
                    _key(scope, "src", source),
                    _key(scope, "leases", source),
                    _key(scope, "lease_meta", source),
                )
            )
            if len(self._spec_keys) >= _MAX_SPEC_CACHE:
                self._spec_keys.clear()
            self._spec_keys[(scope, source)] = cached
        return cached

    # -- the Backend protocol ----------------------------------------------------------
    #
    # Each method reads the injected clock (if any) before its first await, as the
    # memory backend does: the operation happens at the moment it is called.

    async def acquire(
        self,
        scope: str,
        candidates: Sequence[SourceSpec],
        *,
        cost_tokens: int = 0,
        ttl_s: float,
    ) -> AcquireResult:
        """Lease the first admissible candidate, in order, in one ACQUIRE run (see ``_bounded``)."""
        if not candidates:
            return AcquireResult(None)
        specs = tuple(candidates)
        # Unique fleet-wide (128 random bits, as many as a uuid4's 122 and cheaper to make),
        # and sorting in order of issue within this process (the counter in front), as the
        # memory backend's ids do: ordering leases by id is then stable from run to run, and
        # a lease zset reads chronologically.
        lease_id = f"{next(self._serial):012x}{os.urandom(16).hex()}"
        packed = [bulk(_key(scope, "sources"))]
        packed += [self._keys_of(scope, spec.name) for spec in specs]
        packed += (
            self._now_arg(),
            bulk(lease_id),
            bulk(_num(ttl_s)),
            bulk(str(int(cost_tokens))),
            _STATE_TTL_ARG,
        )
        packed += map(self._args_of, specs)
        numkeys = 1 + 3 * len(specs)

        def parse(reply: Any) -> AcquireResult:
            granted = int(reply[0])
            rejections = tuple(
                Rejection(
                    specs[i].name,
                    cast(RejectReason, _text(reply[2 + 2 * i])),
                    _opt_float(reply[3 + 2 * i]),
                )
                for i in range((len(reply) - 2) // 2)
            )
            if granted == 0:
                return AcquireResult(None, rejections)
            lease = Lease(
                scope=scope,
                source=specs[granted - 1].name,
                lease_id=lease_id,
                ttl_s=ttl_s,
                tokens=cost_tokens,
                probe=int(reply[1]) == 1,
            )
            return AcquireResult(lease, rejections)

        # The script may grant a lease its caller never sees (timed out, cancelled): give it back.
        return await self._bounded(
            "acquire",
            scope,
            self._run("acquire", scope, numkeys, numkeys + 5 + 9 * len(specs), packed, parse),
            late=self._give_back,
        )

    async def _give_back(self, acquiring: asyncio.Future[AcquireResult]) -> None:
        """Release what an acquire whose caller stopped waiting is granted, as soon as it is."""
        lease = (await acquiring).lease
        if lease is not None:
            await self.release(lease, _CANCELLED)

    async def release(self, lease: Lease, outcome: AttemptOutcome) -> None:
        """Free the permit and record the outcome in one RELEASE run (left behind if need be)."""
        scope = lease.scope
        packed = [
            self._keys_of(scope, lease.source),
            bulk(_key(scope, "progress")),
            self._now_arg(),
            bulk(lease.lease_id),
            bulk(outcome.kind),
            _AIMD_DECREASE if outcome.aimd_decrease else _NO_AIMD_DECREASE,
            bulk(repr(pace_for(outcome.retry_after_s))),
            _EMPTY if outcome.tokens_used is None else bulk(str(int(outcome.tokens_used))),
            _RELEASE_TAIL,
        ]
        # A caller that stops waiting leaves the release running: it still frees the permit.
        await self._bounded("release", scope, self._release(scope, packed))

    async def _release(self, scope: str, packed: list[bytes]) -> None:
        freed = await self._run("release", scope, 4, 14, packed, _is_one)
        if freed:
            room = self._rooms.get(scope)
            if room is not None:
                room.notify()

    def _adopt(self, task: asyncio.Future[Any]) -> None:
        """Keep work a caller stopped waiting for referenced; log a failure nobody awaits."""
        self._background.add(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Future[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.warning(
                "work a caller stopped waiting for failed; any permit it holds frees "
                "itself when its lease expires: %s",
                exc,
            )

    async def renew(self, lease: Lease) -> bool:
        """Extend a live lease by its TTL from now in one RENEW run."""
        scope = lease.scope
        packed = [self._keys_of(scope, lease.source), self._now_arg(), bulk(lease.lease_id)]
        return await self._bounded("renew", scope, self._run("renew", scope, 3, 5, packed, _is_one))

    async def progress_age_s(self, scope: str) -> float:
        """Seconds since the scope last served anywhere in the fleet; ``inf`` if never."""
        packed = [bulk(_key(scope, "progress")), self._now_arg()]
        return await self._bounded(
            "progress_age_s", scope, self._run("progress_age_s", scope, 1, 2, packed, _age)
        )

    async def snapshot(self, scope: str) -> ScopeSnapshot:
        """Every source seen in the scope, in order of first sight (two round trips)."""
        return await self._bounded("snapshot", scope, self._snapshot(scope, self._now_arg()))

    async def _snapshot(self, scope: str, now_arg: bytes) -> ScopeSnapshot:
        with self._boundary("snapshot", scope):
            found = await self._wire.execute("ZRANGE", _key(scope, "sources"), "0", "-1")
            names = [_text(n) for n in found]
        keys = [_key(scope, "progress")]
        for name in names:
            keys += (_key(scope, "src", name), _key(scope, "leases", name))

        def parse(reply: Any) -> ScopeSnapshot:
            sources = []
            for i, name in enumerate(names):
                row = reply[1 + 10 * i : 11 + 10 * i]
                if int(row[0]) == 0:
                    continue  # registered, but its state expired meanwhile
                breaker = _text(row[3])
                if breaker not in _BREAKER_STATES:
                    raise ValueError(f"unknown breaker state {breaker!r}")
                sources.append(
                    SourceSnapshot(
                        name=name,
                        in_flight=int(row[1]),
                        limit=float(_text(row[2])),
                        breaker=cast(BreakerState, breaker),
                        consecutive_failures=int(_text(row[4])),
                        trips=int(_text(row[5])),
                        reopen_in_s=_opt_float(row[6]),
                        paced_for_s=_opt_float(row[7]),
                        rpm_tokens=_opt_float(row[8]),
                        tpm_tokens=_opt_float(row[9]),
                    )
                )
            return ScopeSnapshot(scope=scope, progress_age_s=_age(reply[0]), sources=tuple(sources))

        packed = [pack(keys), now_arg]
        return await self._run("snapshot", scope, len(keys), len(keys) + 1, packed, parse)

    def waiting_room(self, scope: str) -> WaitingRoom:
        """This process's FIFO of calls waiting for a permit of ``scope``, created on first use."""
        room = self._rooms.get(scope)
        if room is None:
            room = self._rooms[scope] = WaitingRoom()
        return room

    async def aclose(self) -> None:
        """Finish the work callers left behind, then close the pool (if ours).

        That work gets one more socket timeout: a server still silent by then
        will not answer a closing backend, and what it runs later frees itself
        at lease expiry.
        """
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._timeout_s):
                while self._background:
                    await asyncio.gather(*self._background, return_exceptions=True)
        if self._background:
            # The timeout cancelled them through gather; let them unwind.
            await asyncio.gather(*self._background, return_exceptions=True)
        await self._wire.aclose()
