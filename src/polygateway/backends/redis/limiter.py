"""The Redis backend: one governance state for a whole fleet of processes.

Every operation is one Lua script (``scripts.py``), so it is atomic on the
server and costs one round trip: a call that does not wait costs exactly two
(acquire, release); a stream adds one per renewal. Scripts run by EVALSHA and
are reloaded on NOSCRIPT, so a ``SCRIPT FLUSH`` or a restarted server is
survived without a restart of the process. They are sent by ``wire.py``
(pre-packed commands pipelined on one connection of ours, made from an
``Endpoint`` read from the URL or an injected client), not through
``redis.asyncio.Redis``: that cut the client CPU of a governed call on Redis
by more than half, then by half again (its docstring says where the time
went).

Releases are written behind: ``release`` writes its script and returns
without waiting for the reply. Redis runs one connection's commands in the
order they were written, so everything this process sends afterwards (the
next acquire, a snapshot, a progress query) sees the permit freed; other
processes see it one round trip later, as they would anyway. Its reply is
still read: a freed permit wakes this process's waiting room, and a failure
is logged (operation, scope, no password) while the lease's expiry frees
the permit, which is what the governance loop does with a release that
fails (research-wiki/ARCHITECTURE.md §5: it never loses the answer). A release that cannot be
written at once (no connection yet, or reconnecting) waits for its reply
like any other operation, so a server that is down still fails it closed.

Time is the server's (``redis.call('TIME')``) unless a ``now`` is injected,
which only tests do, so the contract suite runs its time-dependent cases under
a ``FakeClock``. Every value handed back is relative, so the caller's
monotonic clock and the server's clock never mix.

Fail closed: any Redis error, socket timeout or script failure becomes
``GovernanceBackendError`` naming the operation and the scope (this module is
the one boundary where redis exceptions are translated); no request goes
upstream ungoverned. The password of the URL never appears in a message or
repr.

Topologies (``redis_mode``): one server (a ``Wire``), a Redis Cluster
(``cluster.py``: each scope's commands go to the node owning its slot,
redirections followed) or a primary found through Sentinel
(``sentinel.py``). In the last two a server silent while replies are due is
given up after one socket timeout rather than ``_LATE_REPLY_S``: another
server may be serving already. A release that fails for want of a server
(connection lost or refused, a cluster or primary in transition) is written
again, with a growing pause, until its lease would have expired anyway: a
lease id is released once, whoever runs it twice, so the permit is freed on
whichever primary serves next instead of being lost for a lease's TTL.

Replica acknowledgements (``replica_acks``, off by default): Redis
replicates asynchronously, so a replica promoted while behind has not seen
the leases its old primary granted last, and the fleet may then admit them
twice (research-wiki/guides/redis-fleet.md, "Replica lag"). With
``replica_acks = N`` every ACQUIRE is followed, in the same write, by
``WAIT N timeout``: one round trip still, as Redis runs the WAIT after the
script and answers both together. A grant acknowledged by fewer than N
replicas within the timeout is given back at once and the acquire fails
closed (``GovernanceBackendError``), so no call runs on a lease a promoted
replica would not know. A refusal's WAIT is ignored. The price: WAIT holds
this process's connection until the replicas answer, so its commands queue
behind each acquire for a replica round trip. Off, no WAIT is ever sent.

Late replies: an operation's caller waits for its reply at most
``socket_timeout_s`` (``_wait``, ``bounded.py``). A caller that stops waiting
(its timeout, or its own cancellation) leaves the operation behind: the
script may already be on the server, which runs it whenever it can (a frozen
server, on waking), so the reply is still read and acted on. An acquire
granted after its caller left is released at once; a release still frees its
permit and wakes this process's waiters. Nothing waits for a lease to expire
unless the server stays silent for ``_LATE_REPLY_S`` while replies are due:
then the wire closes the connection and reconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import logging
import os
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, NamedTuple, TypeVar, cast

try:
    import redis.asyncio as aioredis
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import RedisError, ResponseError
    from redis.exceptions import TimeoutError as RedisTimeoutError
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
    ReleaseListener,
    ReleaseListeners,
    ScopeSnapshot,
    SourceSnapshot,
    SourceSpec,
)
from polygateway.backends.redis import codec, scripts
from polygateway.backends.redis.bounded import TIMED_OUT, Deadlines, Failed, Late, Reply
from polygateway.backends.redis.cluster import Cluster
from polygateway.backends.redis.endpoint import Endpoint
from polygateway.backends.redis.runs import Asked, Key, Releasing, Runs
from polygateway.backends.redis.sentinel import SentinelPrimary
from polygateway.backends.redis.specset import SpecSet, limits_of
from polygateway.backends.redis.wakeups import CHANNEL_PREFIX, Wakeups
from polygateway.backends.redis.wire import (
    Arg,
    Script,
    Topology,
    Unanswered,
    Wire,
    bulk,
    bulks,
    command,
)
from polygateway.config import PROGRESS_TTL_S
from polygateway.config.masking import mask_url, scrub, url_secrets
from polygateway.config.settings import (
    RedisMode,
    redis_replica_acks_problem,
    redis_topology_problem,
    sentinel_address,
)
from polygateway.errors import ConfigError, GovernanceBackendError
from polygateway.governance.aimd import AIMD_COOLOFF_S, AIMD_FACTOR
from polygateway.governance.pacer import pause_for

__all__ = ["RedisBackend"]

logger = logging.getLogger("polygateway.backends.redis")

_PROGRESS_TTL_S = int(PROGRESS_TTL_S)
"""The progress key's lifetime in whole seconds (Redis's ``EX``), refreshed by every success.

It bounds ``stall_window_s`` (``config.PROGRESS_TTL_S``, the one figure): the
stall rule only asks whether the scope served within the window, and a
progress mark older than the longest window is as good as none, so an
abandoned scope's key may as well disappear.
"""

_STATE_TTL_S = 86400
"""Lifetime of a source's state after its last acquire or release.

A source nobody has touched for a day has no cool-down or pacing left worth
keeping (both are far shorter); dropping it keeps a fleet whose config
changed from accumulating keys. Lease keys empty themselves as leases end.
"""

_LATE_REPLY_S = 60.0
"""How long a connection may stay silent while replies are due before it is closed.

Callers are bounded by ``socket_timeout_s`` on their own side; what they left
behind is still read while the server may yet answer (a frozen server runs
what it received on waking: without this, a timed-out acquire would hold its
permit, unseen, until its lease expired). A server silent for this long (a
blackholed address after a failover) is given up: the wire closes the
connection, what was pending fails (a permit it holds frees itself at lease
expiry, as after a crash), and the next operation reconnects.
"""

_WAITING_TTL_S = 60
"""How long a process stays registered as waiting after its last refused acquire.

Each refused poll of a room's head extends it, so it must outlast the
longest ``poll_interval_s`` in use; it bounds how long a process that died
waiting can be sent wake-ups meant for the living (in a Cluster only: on one
server a wake-up nobody hears unregisters its process at once).
"""

_HANDOFF_TTL_S = 1.0
"""Longest time a released permit is held for the process its wake-up names.

RELEASE keeps the freed permit promised to the woken process (``scripts.py``,
research-wiki/designs/fleet-wakeups.md), so that a call elsewhere that asks at
once cannot take it before the woken head's acquire arrives. A live process
claims it within a pub/sub hop and one acquire, milliseconds; the hold is
only what a dead or stalled process may cost (one permit, this long). It is
capped by the socket timeout as well: a head whose acquire takes longer has
failed closed anyway, so holding the permit longer serves nobody. RELEASE
holds a permit 1 s at most whatever it is sent: ACQUIRE marks no source full
whose earliest live lease or placeholder lapses within a second.
"""

_RELEASE_RETRY_FIRST_S = 0.05
"""The first pause before a failed release is written again; it doubles up to the socket timeout."""

_IN_TRANSITION = ("LOADING", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "READONLY")
"""Error replies of a server that may serve the same command shortly (a release is retried)."""

_MAX_SPEC_CACHE = 1024
"""Specs (and sources' keys) kept packed; configs hold a few dozen, so this only bounds misuse."""

# Arguments that never change, packed once (see wire.py for why packing is ours).
_EMPTY = bulk("")
_AIMD_DECREASE = bulk("1")
_NO_AIMD_DECREASE = bulk("0")
_STATE_TTL_ARG = bulk(str(_STATE_TTL_S))
_NO_CLASS = ("",)
"""A scope without classes: one class, ``""``, for the registry and its flags."""
_WAITING_TTL_ARG = bulk(str(_WAITING_TTL_S))
_RELEASE_TAIL = bulks(
    (repr(AIMD_COOLOFF_S), repr(AIMD_FACTOR), str(_PROGRESS_TTL_S), str(_STATE_TTL_S))
)

T = TypeVar("T")
Operation = Literal["acquire", "release", "renew", "progress_age_s", "snapshot"]
BreakerState = Literal["closed", "open", "half_open"]
_BREAKER_STATES = ("closed", "open", "half_open")
_CANCELLED = AttemptOutcome("cancelled")


def _script(text: str, *, makes_keys: bool = False) -> Script:
    """A script as the wire sends it, its SHA1 computed here once."""
    sha = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
    return Script(text, sha, makes_keys=makes_keys)


class RedisBackend:
    """Governance state shared by every process that points at one Redis; implements ``Backend``.

    Cancellation-safe: a caller's cancellation never reaches its operation,
    which goes on without it, and a late grant of an abandoned acquire is given
    back (see "Late replies").

    Args:
        url: ``redis://[[user]:password@]host:port/db`` (or ``rediss://``,
            ``unix:///path?db=N``); the query options it may carry are
            ``Endpoint.from_url``'s, and any other is a ``ConfigError``.
        socket_timeout_s: longest wait of a caller for Redis (connect and reply);
            past it the operation fails closed, while its reply is still read in
            the background (see the module docstring).
        now: tests only: a clock passed to every script instead of the server's TIME.
        client: an existing ``redis.asyncio.Redis`` whose pool's settings the
            backend's own connection is made with (address, connect timeout, TLS,
            credentials, database; ``Endpoint.of_client``); the backend never
            uses the client itself, its
            owner closes it, and ``url`` then only names it in messages.
        mode: ``"standalone"``; ``"cluster"`` (``url`` names any node, the
            others are discovered); ``"sentinel"`` (``url`` carries only the
            password and database; the Sentinels name the primary).
        sentinels: ``host:port`` of each Sentinel (``mode="sentinel"`` only).
        sentinel_master: the name the Sentinels monitor the primary under.
        sentinel_password: the Sentinels' own password (their ``requirepass``),
            sent to each Sentinel, never to the primary; ``None`` or empty: none
            (``mode="sentinel"`` only).
        sentinel_username: the Sentinels' ACL user that password belongs to
            (``AUTH <user> <password>``); ``None`` or empty: ``requirepass``'s
            ``AUTH <password>``. Needs ``sentinel_password``; never shown.
        replica_acks: replicas that must acknowledge a grant (``WAIT``) before
            it is handed out; 0, the default, sends no ``WAIT`` (see the module
            docstring, "Replica acknowledgements"). Not with ``mode="cluster"``.
        replica_ack_timeout_s: how long the replicas may take; 0 means half of
            ``socket_timeout_s``, and it must stay below it.
    """

    __slots__ = (
        "__weakref__",
        "_ack_command",
        "_ack_timeout_s",
        "_acks",
        "_class_args",
        "_closes",
        "_deadlines",
        "_handoff_arg",
        "_listeners",
        "_listening",
        "_now",
        "_proc",
        "_proc_arg",
        "_release_runs",
        "_retries",
        "_runs",
        "_scope_keys",
        "_scripts",
        "_secrets",
        "_serial",
        "_spec_args",
        "_spec_keys",
        "_spec_sets",
        "_tenant_keys",
        "_timeout_s",
        "_url",
        "_wake_tail",
        "_wakeups",
        "_wire",
    )

    def __init__(
        self,
        url: str,
        *,
        socket_timeout_s: float = 1.0,
        now: Callable[[], float] | None = None,
        client: aioredis.Redis | None = None,
        mode: RedisMode = "standalone",
        sentinels: Sequence[str] = (),
        sentinel_master: str | None = None,
        sentinel_password: str | None = None,
        sentinel_username: str | None = None,
        replica_acks: int = 0,
        replica_ack_timeout_s: float = 0.0,
    ) -> None:
        self._url = mask_url(url)
        self._secrets = url_secrets(url)
        if sentinel_password or sentinel_username:
            # Longest first, as url_secrets orders them: a secret inside another is masked whole.
            spelled = {*self._secrets, *filter(None, (sentinel_password, sentinel_username))}
            self._secrets = tuple(sorted(spelled, key=len, reverse=True))
        if not socket_timeout_s > 0:
            raise ConfigError(
                f"socket_timeout_s must be positive, not {socket_timeout_s!r}",
                field="redis_socket_timeout_s",
            )
        problem = redis_topology_problem(
            mode, url, tuple(sentinels), sentinel_master, sentinel_password, sentinel_username
        )
        if problem is None and client is not None and mode != "standalone":
            problem = ("redis_mode", f"redis_mode = {mode!r} takes a URL, not a client")
        if problem is None:
            problem = redis_replica_acks_problem(
                mode, replica_acks, replica_ack_timeout_s, socket_timeout_s
            )
        if problem is not None:
            raise ConfigError(problem[1], field=problem[0])
        # socket_timeout_s (or an injected client's own connect timeout) bounds connecting:
        # the socket, TLS and the login. Afterwards callers wait socket_timeout_s (``_wait``),
        # and a late reply is still read and acted on until the connection has been silent
        # for _LATE_REPLY_S. No retry: one failed attempt fails closed at once, within the
        # timeout; the governance loop decides what comes next.
        try:
            if client is None:
                endpoint = Endpoint.from_url(url, connect_timeout_s=socket_timeout_s)
            else:
                endpoint = Endpoint.of_client(client, connect_timeout_s=socket_timeout_s)
        except ValueError as exc:
            what = "invalid redis url" if client is None else "unusable redis client for"
            raise ConfigError(
                f"{what} {self._url}: {self._scrub(str(exc))}", field="redis_url"
            ) from exc

        self._timeout_s = socket_timeout_s
        self._acks = replica_acks
        self._ack_timeout_s = replica_ack_timeout_s or socket_timeout_s / 2
        # WAIT's timeout is whole milliseconds, and 0 would mean "for ever".
        wait_ms = max(1, round(self._ack_timeout_s * 1000))
        self._ack_command = command("WAIT", str(replica_acks), str(wait_ms))
        self._deadlines = Deadlines(socket_timeout_s)
        self._now = now
        self._scripts = {
            "acquire": _script(scripts.ACQUIRE, makes_keys=True),
            "release": _script(scripts.RELEASE),
            "renew": _script(scripts.RENEW),
            "progress_age_s": _script(scripts.PROGRESS),
            "snapshot": _script(scripts.SNAPSHOT),
        }
        loaded = tuple(self._scripts.values())
        self._wire: Topology
        if mode == "cluster":
            self._wire = Cluster(
                endpoint, late_reply_s=socket_timeout_s, scripts=loaded, timeout_s=socket_timeout_s
            )
        elif mode == "sentinel":
            self._wire = SentinelPrimary(
                [sentinel_address(s) for s in sentinels],
                cast(str, sentinel_master),
                endpoint,
                late_reply_s=socket_timeout_s,
                scripts=loaded,
                timeout_s=socket_timeout_s,
                password=sentinel_password,
                username=sentinel_username,
            )
        else:
            self._wire = Wire(endpoint, late_reply_s=_LATE_REPLY_S, scripts=loaded)
        self._retries: set[asyncio.TimerHandle] = set()
        # aclose calls so far: a release written before the last one is not written again.
        self._closes = 0
        self._listeners = ReleaseListeners()
        # The waiting room of each scope this process waits in (its classes, who waits).
        self._listening: dict[str, ReleaseListener] = {}
        # Fleet-wide wake-ups (wakeups.py): this object's process id, its channel's listener.
        self._proc = os.urandom(8).hex()
        self._proc_arg = bulk(self._proc)
        # On one server a PUBLISH counts every subscriber; in a Cluster only the node's own.
        self._wake_tail = bulk("0" if mode == "cluster" else "1")
        self._handoff_arg = bulk(repr(min(_HANDOFF_TTL_S, socket_timeout_s)))
        self._wakeups = Wakeups(
            CHANNEL_PREFIX + self._proc,
            self._subscribe_on(endpoint),
            self._woken,
            timeout_s=socket_timeout_s,
        )
        self._spec_args: dict[SourceSpec, tuple[Arg, ...]] = {}
        self._spec_keys: dict[tuple[str, str], tuple[Arg, ...]] = {}
        self._spec_sets: dict[str, SpecSet] = {}  # per scope, the set ACQUIRE reads (specset.py)
        self._scope_keys: dict[str, _ScopeKeys] = {}
        self._class_args: dict[
            tuple[str, tuple[tuple[str, float], ...], tuple[int, ...]], _Classes
        ] = {}
        self._tenant_keys: dict[tuple[str, tuple[str, ...] | None], tuple[Arg, ...]] = {}
        self._serial = itertools.count(1)
        self._runs: Runs[Asked] = Runs(self._send_run)
        self._release_runs: Runs[Releasing] = Runs(self._send_releases)

    def __repr__(self) -> str:
        return f"RedisBackend(url={self._url!r})"

    def _subscribe_on(self, endpoint: Endpoint) -> Callable[[], Coroutine[Any, Any, Endpoint]]:
        """Where the wake-up subscription connects: the server written to, or any cluster node."""
        wire = self._wire
        if isinstance(wire, SentinelPrimary):
            return functools.partial(wire.locate, endpoint)
        if isinstance(wire, Cluster):
            cluster, turn = wire, itertools.count()

            async def any_node() -> Endpoint:
                # Each attempt the next node owning slots (the seed first): one gone is passed.
                nodes = [endpoint.address, *cluster.nodes()]
                host, _, port = nodes[next(turn) % len(nodes)].rpartition(":")
                return replace(endpoint, host=host, port=int(port))

            return any_node

        async def the_server() -> Endpoint:
            return endpoint

        return the_server

    # -- the one boundary where redis exceptions are translated ---------------------------

    def _scrub(self, text: str) -> str:
        return scrub(text, self._secrets)

    def _failure(
        self, operation: Operation, scope: str, detail: str, exc: BaseException
    ) -> GovernanceBackendError:
        message = f"redis {operation} failed at {self._url}: {detail}"
        if str(exc):
            message += f": {self._scrub(str(exc))}"
        return GovernanceBackendError(message, operation=operation, scope=scope)

    def _translate(self, operation: Operation, scope: str, exc: BaseException) -> BaseException:
        """Where redis exceptions become ``GovernanceBackendError``: fail closed, with context."""
        if isinstance(exc, (RedisError, OSError)):
            # OSError: socket errors redis-py does not wrap (e.g. during connection setup).
            return self._failure(operation, scope, type(exc).__name__, exc)
        if isinstance(exc, (ValueError, TypeError, IndexError)):
            # A reply our parser cannot read: a script out of step with this code.
            return self._failure(operation, scope, "unexpected script reply", exc)
        return exc

    def _late_failure(self, operation: str, scope: str, exc: BaseException) -> None:
        """Log the failure of an operation nobody waits for (left behind, or written behind)."""
        logger.warning(
            "%s (nobody waits for it: a permit it holds frees itself when its lease expires)",
            self._translate(cast(Operation, operation), scope, exc),
        )

    def _eval(
        self,
        operation: Operation,
        scope: str,
        keys: Sequence[Arg],
        argv: Sequence[Arg],
        parse: Callable[[Any], T],
        late: Late | None = None,
        failed: Failed | None = None,
    ) -> Coroutine[Any, Any, T]:
        """Run one script on ``keys`` and ``argv`` (its header's KEYS and ARGV, in order)."""
        script = self._scripts[operation]
        return self._call(operation, scope, script.command(keys, argv), parse, script, late, failed)

    def _call(
        self,
        operation: Operation,
        scope: str,
        data: bytes,
        parse: Callable[[Any], T],
        script: Script | None = None,
        late: Late | None = None,
        failed: Failed | None = None,
    ) -> Coroutine[Any, Any, T]:
        """Send one command (one round trip); the caller awaits its parsed reply (``_wait``)."""
        self._release_runs.flush(scope)  # what it finds must include every release before it
        reply = Reply(
            asyncio.get_running_loop().create_future(),
            late,
            operation,
            scope,
            failed or self._late_failure,
        )
        self._wire.route(scope).send(data, reply, script)
        return self._wait(operation, scope, reply, parse)

    async def _wait(
        self, operation: Operation, scope: str, reply: Reply, parse: Callable[[Any], T]
    ) -> T:
        """Wait ``socket_timeout_s`` at most for a reply, and parse it.

        A caller that stops waiting (the timeout, its own cancellation) leaves
        the operation going, since its script may run on the server anyway: its
        reply is still read and handed to ``reply.late`` (an acquire gives a late
        grant back), and its failure is logged.
        """
        waiter = cast(asyncio.Future[Any], reply.waiter)
        self._deadlines.add(asyncio.get_running_loop(), waiter)
        try:
            got = await waiter
        except asyncio.CancelledError:
            if not waiter.cancelled() and waiter.result() is not TIMED_OUT:
                reply.left_with(waiter.result())  # it came in the turn its caller was cancelled
            raise
        if got is TIMED_OUT:
            detail = f"TimeoutError: no reply within {self._timeout_s:g} s"
            timeout = TimeoutError(detail)
            raise self._failure(operation, scope, detail, timeout) from timeout
        if isinstance(got, Exception):
            # The wire's failure, whatever its class (a credential provider's own among
            # them): the backend failed, so the call fails closed.
            raise self._failure(operation, scope, type(got).__name__, got) from got
        try:
            return parse(got)
        except Exception as exc:
            translated = self._translate(operation, scope, exc)
            if translated is exc:
                raise
            raise translated from exc

    def _now_arg(self) -> Arg:
        return _EMPTY if self._now is None else bulk(repr(float(self._now())))

    def _args_of(self, spec: SourceSpec) -> tuple[Arg, ...]:
        """A candidate's ARGV slice (ACQUIRE's contract), packed once per spec."""
        cached = self._spec_args.get(spec)
        if cached is None:
            limits = limits_of(spec)
            # The limits, then the same as one string: the script writes them when it changed.
            cached = bulks((spec.name, *limits, " ".join(limits)))
            if len(self._spec_args) >= _MAX_SPEC_CACHE:
                self._spec_args.clear()
            self._spec_args[spec] = cached
        return cached

    def _keys_of(self, scope: str, source: str) -> tuple[Arg, ...]:
        """A source's two keys (state, leases), packed once per scope."""
        cached = self._spec_keys.get((scope, source))
        if cached is None:
            cached = bulks(
                (
                    codec.key(scope, "src", source),
                    codec.key(scope, "leases", source),
                )
            )
            if len(self._spec_keys) >= _MAX_SPEC_CACHE:
                self._spec_keys.clear()
            self._spec_keys[(scope, source)] = cached
        return cached

    def _keys_of_scope(self, scope: str) -> _ScopeKeys:
        """A scope's own keys (sources, progress mark, verdicts, waiting registry), packed once."""
        cached = self._scope_keys.get(scope)
        if cached is None:
            cached = _ScopeKeys(
                *bulks(
                    (
                        codec.key(scope, "sources"),
                        codec.key(scope, "progress"),
                        codec.key(scope, "verdicts"),
                        codec.key(scope, "waiting"),
                        codec.key(scope, "waiting_until"),
                        codec.key(scope, "specs", ""),
                    )
                )
            )
            if len(self._scope_keys) >= _MAX_SPEC_CACHE:
                self._scope_keys.clear()
            self._scope_keys[scope] = cached
        return cached

    def _spec_set_of(self, scope: str, candidates: Sequence[SourceSpec]) -> SpecSet:
        """The scope's spec set holding every candidate's spec: the last one, or its next."""
        found = self._spec_sets.get(scope)
        if found is None or not found.covers(candidates):
            if found is None:
                found = SpecSet(scope, {spec.name: spec for spec in candidates})
            else:
                found = found.with_specs(scope, candidates)
            if len(self._spec_sets) >= _MAX_SPEC_CACHE:
                self._spec_sets.clear()
            self._spec_sets[scope] = found
        return found

    def _classes_of(self, scope: str, room: ReleaseListener) -> _Classes | None:
        """The scope's priority classes packed for the scripts; ``None`` without classes."""
        shares = room.shares
        if not shares:
            return None
        declared = tuple(shares.items())
        floors = room.floors
        reserved = tuple(floors.get(name, 0) for name in shares) if floors else ()
        cached = self._class_args.get((scope, declared, reserved))
        if cached is None:
            names = tuple(shares)
            held = {name: bulk(codec.key(scope, "held", name)) for name in names if name in floors}
            cached = _Classes(
                names=names,
                registry=bulks(
                    [
                        key
                        for name in names
                        for key in (
                            codec.key(scope, "waiting", name),
                            codec.key(scope, "waiting_until", name),
                        )
                    ]
                ),
                hash_key=bulk(codec.key(scope, "classes")),
                shares=bulks(
                    [item for name, share in declared for item in (name, codec.num(share))]
                ),
                held=held,
                held_keys=(
                    bulks([codec.key(scope, "held", name) for name in names]) if held else ()
                ),
                reserved=reserved,
            )
            if len(self._class_args) >= _MAX_SPEC_CACHE:
                self._class_args.clear()
            self._class_args[(scope, declared, reserved)] = cached
        return cached

    def _tenant_keys_of(self, scope: str, names: tuple[str, ...] | None) -> tuple[Arg, ...]:
        """Per class (one without classes): its tenant keys, flows, flows_of and tenants."""
        cached = self._tenant_keys.get((scope, names))
        if cached is None:
            cached = bulks(
                [
                    codec.key(scope, part, *name)
                    for name in ([()] if names is None else [(n,) for n in names])
                    for part in ("flows", "flows_of", "tenants")
                ]
            )
            if len(self._tenant_keys) >= _MAX_SPEC_CACHE:
                self._tenant_keys.clear()
            self._tenant_keys[(scope, names)] = cached
        return cached

    def _woken(self, message: str) -> None:
        """A wake-up heard: the scope, then on lines of their own the class and the tenant.

        ``scripts.py``: the scope alone, the scope and the class, or the scope,
        the class (``""`` without classes) and the tenant.
        """
        scope, *rest = message.split("\n", 2)
        if len(rest) == 2:
            self._listeners.released(scope, rest[0], rest[1])
        else:
            self._listeners.released(scope, rest[0] if rest and rest[0] else None)

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
        priority_class: str = "",
    ) -> AcquireResult:
        """Lease the first admissible candidate, in order, in one ACQUIRE run (see ``_wait``).

        Calls of the same scope, candidates and class that arrive while one of
        theirs is in flight go to Redis together, in one run (``runs.py``); each
        is answered as if it had gone alone. A call of a class with reserved
        permits (its room's ``floors``) has its lease counted toward the class's
        permits held fleet-wide, and the lease names the class.
        """
        if not candidates:
            return AcquireResult(None)
        specs = tuple(candidates)
        # Unique fleet-wide (128 random bits, as many as a uuid4's 122 and cheaper to make),
        # and sorting in order of issue within this process (the counter in front), as the
        # memory backend's ids do: ordering leases by id is then stable from run to run, and
        # a lease zset reads chronologically.
        lease_id = f"{next(self._serial):012x}{os.urandom(16).hex()}"
        loop = asyncio.get_running_loop()
        now = self._now_arg()
        key = (scope, specs, priority_class, now)

        def result_of(answer: _Answer) -> AcquireResult:
            reply = answer.raw
            granted = int(reply[0])
            if granted == -1:
                if answer.sent_set:
                    raise ValueError("ACQUIRE found no spec set where it was just sent")
                return _SET_UNKNOWN
            rejections = _rejections(specs, codec.text(reply[2]), reply[3:])
            if granted == 0:
                return AcquireResult(None, rejections)
            lease = Lease(
                scope=scope,
                source=specs[granted - 1].name,
                lease_id=lease_id,
                ttl_s=ttl_s,
                tokens=cost_tokens,
                probe=int(reply[1]) == 1,
                priority_class=answer.counted,
            )
            return AcquireResult(lease, rejections)

        def parse(answer: _Answer) -> AcquireResult:
            result = result_of(answer)
            lease = result.lease
            acks = answer.acks
            if lease is None or acks is None or (isinstance(acks, int) and acks >= self._acks):
                return result  # a refusal wrote nothing worth waiting for
            # Module docstring, "Replica acknowledgements".
            self._release(lease, _CANCELLED, waited=False)
            heard = f"{acks} of {self._acks}" if isinstance(acks, int) else f"none ({acks})"
            raise GovernanceBackendError(
                f"redis acquire failed at {self._url}: granted, but acknowledged by {heard}"
                f" replicas within {self._ack_timeout_s:g} s, so given back"
                " (redis_replica_acks)",
                operation="acquire",
                scope=scope,
            )

        def give_back(answer: _Answer) -> None:
            # Granted a lease its caller never sees (timed out, cancelled): release it at once.
            lease = result_of(answer).lease
            if lease is not None:
                self._release(lease, _CANCELLED, waited=False)

        def unanswered(exc: BaseException | None) -> None:
            # Written, then its connection was lost before the reply: the script may have
            # run and granted ``lease_id`` on any candidate (a replica may keep it through a
            # failover). Released on each; an id that holds nothing is left as it is.
            if isinstance(exc, Unanswered):
                for spec in specs:
                    maybe = Lease(
                        scope=scope,
                        source=spec.name,
                        lease_id=lease_id,
                        ttl_s=ttl_s,
                        tokens=cost_tokens,
                        priority_class=asked.counted,
                    )
                    self._release(maybe, _CANCELLED, waited=False)

        def failed(operation: str, scope: str, exc: BaseException) -> None:
            unanswered(exc)
            self._late_failure(operation, scope, exc)

        reply = Reply(loop.create_future(), give_back, "acquire", scope, failed)
        asked = Asked(lease_id, ttl_s, int(cost_tokens), reply, now)
        try:
            while True:
                self._runs.ask(key, asked)
                result = await self._wait("acquire", scope, asked.reply, parse)
                if result is not _SET_UNKNOWN:
                    return result
                # Redis holds no set under its digest (it expired, or a new primary never
                # had it): sent whole, in the call's next run (specset.py).
                asked.with_set = True
                asked.reply = Reply(loop.create_future(), give_back, "acquire", scope, failed)
        except GovernanceBackendError as exc:
            unanswered(exc.__cause__)
            raise

    def _send_run(self, key: Key, calls: list[Asked]) -> None:
        """Write one ACQUIRE run of ``calls`` (one scope, candidates and class; ``runs.py``).

        Its reply goes to each call's own ``Reply``, as an ``_Answer``: the
        call's part of the reply, with what the run was written with. Calls the
        run left undecided (it stopped before one needing the spec set) get
        ``{-1}``, and ask again with the set.
        """
        scope, specs, priority_class, _ = cast(tuple[str, tuple[SourceSpec, ...], str, Arg], key)
        self._release_runs.flush(scope)  # what it finds must include every release before it
        keys, argv, counted, sent_set = self._acquire_args(scope, specs, priority_class, calls)
        for asked in calls:
            asked.counted = counted
        runs = self._runs
        acks_expected = self._acks > 0
        alone = len(calls) == 1

        def ran(reply: Any) -> None:
            try:
                if isinstance(reply, BaseException):
                    for asked in calls:
                        asked.reply(reply)
                    return
                acks = None
                if acks_expected:
                    reply, acks = reply
                each = [reply] if alone else reply if isinstance(reply[0], list) else ()
                for i, asked in enumerate(calls):
                    part = each[i] if i < len(each) else _UNDECIDED
                    asked.reply(_Answer(part, counted, sent_set, acks))
            finally:
                runs.answered(key)

        wire = self._wire.route(scope)
        script = self._scripts["acquire"]
        data = script.command(keys, argv)
        if acks_expected:
            # ACQUIRE and ``WAIT`` written together; a grant the replicas did not
            # acknowledge fails (module docstring, "Replica acknowledgements").
            both = _Acknowledged(ran, wire, self._ack_command)
            wire.send(data, both.ran, script)
            wire.send(self._ack_command, both.acknowledged)
        else:
            wire.send(data, ran, script)

    def _acquire_args(
        self,
        scope: str,
        specs: tuple[SourceSpec, ...],
        priority_class: str,
        calls: Sequence[Asked],
    ) -> tuple[list[Arg], list[Arg], str | None, bool]:
        """ACQUIRE's KEYS and ARGV for a run of ``calls``, the class its grants count in, and
        whether it carries the spec set whole."""
        scope_keys = self._keys_of_scope(scope)
        spec_set: SpecSet | None = None
        if len(specs) > 1:
            # The others by index into the scope's spec set, sent whole while not stored.
            spec_set = self._spec_set_of(scope, specs)
            keys = [scope_keys.sources, *self._keys_of(scope, specs[0].name)]
            keys += (scope_keys.verdicts, spec_set.key)
        else:
            keys = [scope_keys.sources, *self._keys_of(scope, specs[0].name)]
            keys += (scope_keys.verdicts, scope_keys.no_set)
        if len(calls) == 1:
            first = calls[0]
            words = (first.lease_id, codec.num(first.ttl_s), str(first.cost_tokens))
        else:
            # A run: its calls' lease ids, TTLs and costs, a word each (scripts.py).
            words = (
                " ".join(asked.lease_id for asked in calls),
                " ".join(codec.num(asked.ttl_s) for asked in calls),
                " ".join(str(asked.cost_tokens) for asked in calls),
            )
        argv = [calls[0].now, *bulks(words), _STATE_TTL_ARG, *self._args_of(specs[0])]
        whole = False
        if spec_set is None:
            argv += (_EMPTY, _EMPTY, _EMPTY)
        else:
            whole = not spec_set.stored or any(asked.with_set for asked in calls)
            argv += (
                spec_set.digest,
                spec_set.order(specs),
                spec_set.packed if whole else _EMPTY,
            )
            spec_set.stored = True
        wakeups = self._wakeups
        room = self._listening.get(scope)
        counted: str | None = None  # the class whose held permits the leases join
        if room is not None:
            # Someone here waits for this scope's releases: a refusal registers the process
            # (under each priority class it waits in, when the scope has classes).
            if not wakeups.started:
                wakeups.start()
            classes = self._classes_of(scope, room)
            flows = room.waiting_tenants()
            run = len(calls)
            if classes is None:
                keys += (scope_keys.waiting, scope_keys.waiting_until)
                argv += (self._proc_arg, _WAITING_TTL_ARG, _flags(_NO_CLASS, room, "", run))
                if flows is not None:
                    # Its tenants too (a call here named one): registered per tenant.
                    keys += self._tenant_keys_of(scope, None)
                    argv.append(_tenant_lists(_NO_CLASS, flows))
            else:
                keys += classes.registry
                argv += (
                    self._proc_arg,
                    _WAITING_TTL_ARG,
                    _flags(classes.names, room, priority_class, run),
                )
                if flows is not None:
                    keys += self._tenant_keys_of(scope, classes.names)
                    argv.append(_tenant_lists(classes.names, flows))
                held = classes.held.get(priority_class)
                if held is not None:
                    # Its class reserves permits: the leases count toward it fleet-wide.
                    keys.append(held)
                    counted = priority_class
        return keys, argv, counted, whole

    async def release(self, lease: Lease, outcome: AttemptOutcome) -> None:
        """Free the permit and record the outcome in one RELEASE run, written behind.

        Returns once the script is written (module docstring, "Releases are
        written behind"); without a connection up, once its reply came.
        """
        closes = self._closes
        reply = self._release(lease, outcome)
        if reply is not None and reply.late is not None:
            try:
                await self._wait("release", lease.scope, reply, reply.late)
            except GovernanceBackendError:
                # Its reply was a failure (a timeout leaves it to the reply's own ``failed``).
                if reply.waiter is not None and reply.waiter.done():
                    cause = reply.waiter.result()
                    if isinstance(cause, BaseException) and _worth_retrying(cause):
                        self._retry_release(lease, outcome, None, _RELEASE_RETRY_FIRST_S, closes)
                raise

    def _release(
        self,
        lease: Lease,
        outcome: AttemptOutcome,
        *,
        waited: bool = True,
        deadline: float | None = None,
        pause_s: float = _RELEASE_RETRY_FIRST_S,
    ) -> Reply | None:
        """Write a RELEASE; ``None``, or the ``Reply`` to wait for when it could only be queued.

        On an open connection nobody waits: it is written at once, or, while a
        release of its source and class is in flight, with the next run of them
        (``runs.py``; written before anything else this process sends for the
        scope). ``waited=False``: nobody will wait (a late grant given back, a
        retry), queued or not. A failure for want of a server writes it again
        (``_retry_release``) until ``deadline`` (the event loop's time; by default
        the lease's TTL from its first failure).
        """
        scope = lease.scope

        def freed(reply: Any) -> None:
            # 1: the permit is this process's turn (or nobody waits): its waiters hear of it.
            # [1, class]: this process's turn, for that priority class.
            # [1, class, tenant]: for that tenant of the class (class "": no classes).
            # 2: the fleet's turn went to another process, woken on its channel.
            if isinstance(reply, list):
                tenant = codec.text(reply[2]) if len(reply) > 2 else None
                self._listeners.released(scope, codec.text(reply[1]), tenant)
            elif codec.is_one(reply):
                self._listeners.released(scope)

        closes = self._closes

        def failed(operation: str, scope: str, exc: BaseException) -> None:
            if _worth_retrying(exc) and self._retry_release(
                lease, outcome, deadline, pause_s, closes
            ):
                if deadline is None:  # its first failure: said once, not at every retry
                    logger.warning(
                        "%s (written again until it succeeds or its lease expires)",
                        self._translate("release", scope, exc),
                    )
                return
            self._late_failure(operation, scope, exc)

        queued = waited and not self._wire.route(scope).writable
        waiter = asyncio.get_running_loop().create_future() if queued else None
        now = self._now_arg()
        releasing = Releasing(lease, outcome, Reply(waiter, freed, "release", scope, failed), now)
        key = (scope, lease.source, lease.priority_class or "", now)
        if queued:
            # No connection up: written alone, and its caller waits for the reply.
            self._send_releases(key, [releasing])
            return releasing.reply
        self._release_runs.ask(key, releasing)
        return None

    def _send_releases(self, key: Key, calls: list[Releasing]) -> None:
        """Write one RELEASE of ``calls`` (one source and class: a run when several).

        Its reply goes to each release's own ``Reply``: a run's, one part each.
        """
        lease = calls[0].lease
        scope, source, lease_class = lease.scope, lease.source, lease.priority_class
        room = self._listening.get(scope)
        classes = None if room is None else self._classes_of(scope, room)
        ours = self._keys_of_scope(scope)
        keys = (*self._keys_of(scope, source), ours.progress, ours.verdicts)
        if classes is None:
            keys += (ours.waiting, ours.waiting_until)
        else:
            keys += (*classes.registry, classes.hash_key)
        if room is not None and room.named_tenants:
            # A call here named a tenant: the wake-up takes the fleet's turn of tenants.
            keys += self._tenant_keys_of(scope, None if classes is None else classes.names)
        floors: tuple[Arg, ...] = ()
        if classes is not None and classes.held:
            # Reserved floors, fleet-wide: each class's held permits, the leases' leaving.
            keys += classes.held_keys
            floors = (classes.floors(lease_class),)
        argv = (
            calls[0].now,
            *_release_words(calls),
            *_RELEASE_TAIL,
            self._proc_arg,
            bulk(scope),
            self._wake_tail,
            self._handoff_arg,
            *(() if classes is None else classes.shares),
            *floors,
        )
        runs = self._release_runs
        alone = len(calls) == 1

        def ran(reply: Any) -> None:
            try:
                if alone or isinstance(reply, BaseException):
                    for releasing in calls:
                        releasing.reply(reply)
                else:
                    for releasing, part in zip(calls, reply, strict=True):
                        releasing.reply(part)
            finally:
                runs.answered(key)

        script = self._scripts["release"]
        self._wire.route(scope).send(script.command(keys, argv), ran, script)

    def _retry_release(
        self,
        lease: Lease,
        outcome: AttemptOutcome,
        deadline: float | None,
        pause_s: float,
        closes: int,
    ) -> bool:
        """Write a failed release again after ``pause_s``; ``False`` once its lease has expired.

        Also ``False`` for a release written before the last ``aclose`` (``closes``:
        the count of them then): closing gave it up, and many fail as the
        connection closes, which would otherwise connect the backend again.
        """
        if closes != self._closes:
            return False
        loop = asyncio.get_running_loop()
        if deadline is None:
            deadline = loop.time() + lease.ttl_s
        if loop.time() + pause_s >= deadline:
            return False

        def again() -> None:
            self._retries.discard(handle)
            self._release(
                lease,
                outcome,
                waited=False,
                deadline=deadline,
                pause_s=min(pause_s * 2, self._timeout_s),
            )

        handle = loop.call_later(pause_s, again)
        self._retries.add(handle)
        return True

    async def renew(self, lease: Lease) -> bool:
        """Extend a live lease by its TTL from now in one RENEW run."""
        scope = lease.scope
        argv = (self._now_arg(), bulk(lease.lease_id), bulk(codec.num(lease.ttl_s)), _STATE_TTL_ARG)
        keys = self._keys_of(scope, lease.source)
        if lease.priority_class is not None:
            # Counted toward its class's reserved floor fleet-wide: extended there too.
            keys = (*keys, bulk(codec.key(scope, "held", lease.priority_class)))
        return await self._eval("renew", scope, keys, argv, codec.is_one)

    async def progress_age_s(self, scope: str) -> float:
        """Seconds since the scope last served anywhere in the fleet; ``inf`` if never."""
        keys = (self._keys_of_scope(scope).progress,)
        return await self._eval("progress_age_s", scope, keys, (self._now_arg(),), codec.age)

    async def snapshot(self, scope: str) -> ScopeSnapshot:
        """Every source seen in the scope, in order of first sight (two round trips)."""
        now_arg = self._now_arg()
        listing = command("ZRANGE", codec.key(scope, "sources"), "0", "-1")
        names: list[str] = await self._call("snapshot", scope, listing, codec.texts)
        keys = [codec.key(scope, "progress")]
        for name in names:
            keys += (codec.key(scope, "src", name), codec.key(scope, "leases", name))

        def parse(reply: Any) -> ScopeSnapshot:
            sources = []
            for i, name in enumerate(names):
                row = reply[1 + 10 * i : 11 + 10 * i]
                if int(row[0]) == 0:
                    continue  # registered, but its state expired meanwhile
                breaker = codec.text(row[3])
                if breaker not in _BREAKER_STATES:
                    raise ValueError(f"unknown breaker state {breaker!r}")
                sources.append(
                    SourceSnapshot(
                        name=name,
                        in_flight=int(row[1]),
                        limit=float(codec.text(row[2])),
                        breaker=cast(BreakerState, breaker),
                        consecutive_failures=int(codec.text(row[4])),
                        trips=int(codec.text(row[5])),
                        reopen_in_s=codec.opt_float(row[6]),
                        paced_for_s=codec.opt_float(row[7]),
                        rpm_tokens=codec.opt_float(row[8]),
                        tpm_tokens=codec.opt_float(row[9]),
                    )
                )
            return ScopeSnapshot(
                scope=scope, progress_age_s=codec.age(reply[0]), sources=tuple(sources)
            )

        return await self._eval("snapshot", scope, bulks(keys), (now_arg,), parse)

    def on_release(self, scope: str, listener: ReleaseListener) -> None:
        """Call ``listener`` when a permit of ``scope`` is this process's turn.

        That is a permit this backend object frees while no other process of
        the fleet has waited longer for one, or a permit freed anywhere in the
        fleet whose wake-up names this process (``wakeups.py``): processes with
        waiters take the releases in turn, least recently woken first.
        """
        listener.fleet_floors = True  # reserved floors are the fleet's (RELEASE's wake-up)
        self._listeners.add(scope, listener)
        self._listening[scope] = listener
        with contextlib.suppress(RuntimeError):  # no running loop: at the first acquire
            self._wakeups.start()

    async def aclose(self) -> None:
        """Read the replies still due (releases written behind, work left behind), then close.

        They get one more socket timeout: a server still silent by then will not
        answer a closing backend, and what it runs later frees itself at lease
        expiry. An injected client stays its owner's to close. A release written
        before is not written again when it fails (``_retry_release``).
        """
        self._closes += 1
        for handle in self._retries:
            handle.cancel()  # a closing backend stops writing; the leases expire
        self._retries.clear()
        await self._wakeups.aclose()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._timeout_s):
                await self._wire.drain()
        await self._wire.aclose()


@dataclass(frozen=True, slots=True)
class _Classes:
    """A scope's priority classes as ACQUIRE and RELEASE take them, packed once (``scripts.py``)."""

    names: tuple[str, ...]
    registry: tuple[Arg, ...]
    """Per class, in order: ``pgw:{scope}:waiting:<class>`` and ``...:waiting_until:<class>``."""
    hash_key: Arg
    """``pgw:{scope}:classes``: the classes' passes for the fleet's stride scheduling."""
    shares: tuple[Arg, ...]
    """Per class, in order: its name and its share (RELEASE's trailing arguments)."""
    held: Mapping[str, Arg]
    """Per class with reserved permits: ``pgw:{scope}:held:<class>`` (its permits fleet-wide)."""
    held_keys: tuple[Arg, ...]
    """Per class, in order, its ``held`` key (RELEASE's last keys); empty without floors."""
    reserved: tuple[int, ...]
    """Per class, in order, its reserved permits."""

    def floors(self, lease_class: str | None) -> Arg:
        """RELEASE's floors argument: the lease's class (1-based, 0: none), the reserved."""
        index = self.names.index(lease_class) + 1 if lease_class in self.held else 0
        return bulk(" ".join(map(str, (index, *self.reserved))))


def _release_words(calls: Sequence[Releasing]) -> tuple[Arg, ...]:
    """RELEASE's ARGV[2 .. 7] for ``calls``: lease id, outcome kind, AIMD decrease, pause,
    tokens used, reservation; for a run, a word per release in each, joined by spaces
    (``scripts.py``)."""
    rows = []
    for releasing in calls:
        lease, outcome = releasing.lease, releasing.outcome
        pause = pause_for(outcome.kind == "rate_limited", outcome.retry_after_s)
        rows.append(
            (
                lease.lease_id,
                outcome.kind,
                "1" if outcome.aimd_decrease else "0",
                "" if pause is None else repr(pause),
                "" if outcome.tokens_used is None else str(int(outcome.tokens_used)),
                str(int(lease.tokens)),
            )
        )
    if len(rows) == 1:
        return bulks(rows[0])
    return bulks([" ".join(column) for column in zip(*rows, strict=True)])


def _flags(names: Sequence[str], room: ReleaseListener, priority_class: str, run: int) -> Arg:
    """ACQUIRE's class flags: per class in order, what the process's calls want there.

    "0": no call waits or asks; "1": some do, none once the ``run`` calls
    asking now are granted; "2": some are left even then. The calls asking
    count in their own class (``priority_class``) whether the room counts them
    or not: they ask there. A run of several sends two words: the flags of
    its calls before the last (its own class "2": the run's later calls are
    left), then those of its last (``scripts.py``).
    """
    wanting = room.wanting()
    last, before = [], []
    for name in names:
        n = wanting.get(name, 0)
        if name == priority_class:
            last.append("2" if n > run else "1")
            before.append("2")
        else:
            flag = "2" if n else "0"
            last.append(flag)
            before.append(flag)
    if run == 1:
        return bulk("".join(last))
    return bulk(f"{''.join(before)} {''.join(last)}")


def _tenant_lists(names: Sequence[str], flows: Mapping[str, Collection[str]]) -> Arg:
    """ACQUIRE's tenant argument: per class in order, "<len>:<list>" of "<len>:<tenant>"s.

    Lengths in bytes of the UTF-8 the argument is sent as (``scripts.py``).
    """
    lists = []
    for name in names:
        inner = "".join(f"{len(t.encode())}:{t}" for t in flows.get(name, ()))
        lists.append(f"{len(inner.encode())}:{inner}")
    return bulk("".join(lists))


class _ScopeKeys(NamedTuple):
    """A scope's own keys, packed (``scripts.py`` names what each holds)."""

    sources: Arg
    progress: Arg
    verdicts: Arg
    waiting: Arg
    waiting_until: Arg
    no_set: Arg  # a single candidate's spec-set key: no set, never read


_SET_UNKNOWN = AcquireResult(None)
"""ACQUIRE's ``{-1}``: no spec set under the digest sent; the call is sent again with it."""

_UNDECIDED = (-1,)
"""A call's part of a run that stopped before it (``{-1}``: it asks again with the spec set)."""


class _Answer(NamedTuple):
    """A call's part of an ACQUIRE run's reply, with what the run was written with."""

    raw: Any
    counted: str | None  # the class whose held permits a grant joins
    sent_set: bool  # the run carried the spec set whole
    acks: Any  # the WAIT's reply (replicas that acknowledged), None without WAIT


_REASONS: dict[str, RejectReason] = {
    "c": "concurrency",
    "b": "breaker_open",
    "i": "probe_in_flight",
    "p": "paced",
    "r": "rpm",
    "t": "tpm",
}
"""ACQUIRE's reason codes; ``c`` and ``i`` carry no reopen time, the others one each."""


def _rejections(
    specs: Sequence[SourceSpec], codes: str, reopens: Sequence[Any]
) -> tuple[Rejection, ...]:
    """ACQUIRE's codes and reopen times as the candidates' rejections, in order."""
    found = []
    at = 0
    for spec, code in zip(specs, codes, strict=False):
        reopen = None
        if code not in "ci":
            reopen = float(codec.text(reopens[at]))
            at += 1
        found.append(Rejection(spec.name, _REASONS[code], reopen))
    return tuple(found)


_NOT_YET: Any = object()


class _Acknowledged:
    """An ACQUIRE's reply and its ``WAIT``'s, handed on together to one callback.

    Redis runs one connection's commands in order, so a ``WAIT`` answered
    after its script counts the replicas holding what the script wrote. One
    answered first acknowledged older writes: the script was sent again behind
    it (loaded again after ``NOSCRIPT``, or to a new primary after
    ``READONLY``), so another ``WAIT`` follows the script's reply, a second
    round trip in that rare case only.
    """

    __slots__ = ("_ack_command", "_early", "_ran", "_reply", "_wire")

    def __init__(self, reply: Callable[[Any], None], wire: Wire, ack_command: bytes) -> None:
        self._reply = reply
        self._wire = wire
        self._ack_command = ack_command
        self._ran: Any = _NOT_YET
        self._early = False

    def ran(self, reply: Any) -> None:
        """The script's reply (a value, or an exception)."""
        self._ran = reply
        if self._early:
            self._early = False
            if isinstance(reply, BaseException):
                self._reply(reply)
            else:
                self._wire.send(self._ack_command, self.acknowledged)

    def acknowledged(self, reply: Any) -> None:
        """The ``WAIT``'s reply: the replicas that acknowledged, or an exception."""
        ran = self._ran
        if ran is _NOT_YET:
            self._early = True
            return
        self._reply(ran if isinstance(ran, BaseException) else (ran, reply))


def _worth_retrying(exc: BaseException) -> bool:
    """Whether a release that failed so may succeed when written again (no server, for now)."""
    if isinstance(exc, ResponseError):
        return str(exc).startswith(_IN_TRANSITION)
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError, OSError))
