"""A run of RELEASE leaves Redis, and replies, as its releases one after another do.

RELEASE frees several leases of one source in one script run (research-wiki/designs/
script-cost.md, "Several calls per script run"): ARGV[2 .. 7] are lists of one word per
lease, the source's state is read once, each outcome is decided on what the leases
before it left, each freed permit's wake-up runs in turn and what moved is written
once. Here twin scopes are brought to one state by the real ACQUIRE and RELEASE at
fixed clocks (grants, processes registered waiting, earlier releases that woke them and
held permits for them); then one scope releases N leases call by call, the other in one
run at the same ``now``, and the replies and every key of both scopes (its type, its
value, whether it expires and when) must be the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import pytest
import redis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from polygateway.backends.base import SourceSpec
from polygateway.backends.redis import codec, scripts
from polygateway.backends.redis.specset import SpecSet, limits_of
from polygateway.governance.aimd import AIMD_COOLOFF_S, AIMD_FACTOR

T0 = 1796212800.25
"""The grants and the registrations."""
T1 = T0 + 1.5
"""The releases before the run (they wake the registered processes)."""
STATE_TTL_S = "86400"
PROGRESS_TTL_S = "600"
COST = "100"
CLASSES = ("a", "b")
SHARES = ("1", "3")
RESERVED = (2, 0)
"""Class a reserves two permits, b none (the floors layout)."""
KINDS = (
    "success",
    "transient",
    "rate_limited",
    "source_misconfigured",
    "request_rejected",
    "cancelled",
)
ME = "me"
HEARD = "p1"
"""Subscribed on its wake-up channel: a wake-up that counts receivers reaches it."""
PROCESSES = (ME, HEARD, "p2")
TTL_SLACK_MS = 500
"""Lifetimes are set by the server's own clock, the twin's a few milliseconds apart."""

Lease = tuple[str, str, str, str, str, str]
"""A release's six words: lease id, kind, AIMD flag, pause, tokens used, reservation."""


@dataclass(frozen=True)
class Layout:
    """What a scope's calls carry besides the policy: the wake-up tail and its options."""

    tail: str | None  # ARGV[14] ("1": receivers counted), None: no wake-up tail
    handoff: str = "1.0"
    classes: bool = False
    floors: bool = False
    tenants: bool = False


@dataclass(frozen=True)
class Waiter:
    process: str
    priority_class: str
    tenant: str | None
    registration_ttl: str


@dataclass(frozen=True)
class Plan:
    layout: Layout
    spec: SourceSpec
    grants: tuple[tuple[str, float], ...]  # per lease of ME: its class and TTL
    waiters: tuple[Waiter, ...]
    before: tuple[tuple[int, Lease], ...]  # releases at T1: a grant's index, its words
    run_class: str
    run: tuple[Lease, ...]
    at: float
    skiplist: bool = True  # False: the lease zset lacks its skiplist member (an old one)
    expiring: bool = False  # the source's keys were set to expire long ago: RELEASE renews
    marked: bool = False  # a call of two candidates found the source full: its verdict
    state_lost: bool = False  # the source's state hash outlived by its leases (state TTL)


class Scope:
    """One scope's keys and the scripts' KEYS / ARGV for it, as ``limiter.py`` lays them out."""

    def __init__(self, name: str, plan: Plan) -> None:
        self.name, self.layout, self.spec = name, plan.layout, plan.spec
        self.classes = CLASSES if self.layout.classes else ("",)
        per_class = [(c,) if c else () for c in self.classes]
        self.registry = [
            self.key(part, *n) for n in per_class for part in ("waiting", "waiting_until")
        ]
        self.tenant_keys = [
            self.key(part, *n) for n in per_class for part in ("flows", "flows_of", "tenants")
        ]

    def key(self, *parts: str) -> str:
        return codec.key(self.name, *parts)

    def acquire(
        self,
        now: float,
        lease_id: str,
        ttl_s: float,
        process: str | None = None,
        priority_class: str = "",
        tenant: str | None = None,
        registration_ttl: str = "30",
    ) -> list[Any]:
        """ACQUIRE at the one source, with the waiting tail when the layout has one."""
        name = self.spec.name
        keys = [self.key("sources"), self.key("src", name), self.key("leases", name)]
        keys += [self.key("verdicts"), self.key("specs", "")]
        limits = limits_of(self.spec)
        argv = [repr(now), lease_id, repr(ttl_s), COST, STATE_TTL_S, name, *limits]
        argv += [" ".join(limits), "", "", ""]
        if self.layout.tail is not None and process is not None:
            flags = "".join("1" if c == priority_class else "0" for c in self.classes)
            keys += self.registry
            argv += [process, registration_ttl, flags]
            if self.layout.tenants:
                keys += self.tenant_keys
                lists = ""
                for c in self.classes:
                    inner = f"{len(tenant)}:{tenant}" if tenant and c == priority_class else ""
                    lists += f"{len(inner)}:{inner}"
                argv.append(lists)
            if self.layout.floors and RESERVED[CLASSES.index(priority_class)] > 0:
                keys.append(self.key("held", priority_class))
        return [len(keys), *keys, *argv]

    def marking(self, now: float) -> list[Any]:
        """ACQUIRE of two candidates, the source first: it is full, so it is marked (its
        verdict), and the lease goes to the other one (``RedisBackend.acquire``'s layout)."""
        other = SourceSpec("t", max_concurrency=1)
        specs = SpecSet(self.name, {s.name: s for s in (self.spec, other)})
        name = self.spec.name
        keys: list[str | bytes] = [self.key("sources"), self.key("src", name)]
        keys += [self.key("leases", name), self.key("verdicts"), _value(specs.key)]
        limits = limits_of(self.spec)
        argv: list[str | bytes] = [repr(now), "marking", "60.0", COST, STATE_TTL_S, name, *limits]
        argv += [" ".join(limits), _value(specs.digest), _value(specs.order([self.spec, other]))]
        argv.append(_value(specs.packed))
        return [len(keys), *keys, *argv]

    def release(self, now: float, leases: tuple[Lease, ...], priority_class: str) -> list[Any]:
        """RELEASE of the leases (one, or a run: each of ARGV[2 .. 7] their words joined)."""
        name = self.spec.name
        keys = [self.key("src", name), self.key("leases", name)]
        keys += [self.key("progress"), self.key("verdicts")]
        argv = [repr(now), *(" ".join(words) for words in zip(*leases, strict=True))]
        argv += [repr(AIMD_COOLOFF_S), repr(AIMD_FACTOR), PROGRESS_TTL_S, STATE_TTL_S]
        if self.layout.tail is not None:
            keys += self.registry
            if self.layout.classes:
                keys.append(self.key("classes"))
            if self.layout.tenants:
                keys += self.tenant_keys
            argv += [ME, self.name, self.layout.tail, self.layout.handoff]
            if self.layout.classes:
                argv += [x for pair in zip(CLASSES, SHARES, strict=True) for x in pair]
            if self.layout.floors:
                keys += [self.key("held", c) for c in CLASSES]
                index = CLASSES.index(priority_class) + 1
                if RESERVED[index - 1] == 0:
                    index = 0  # a class reserving nothing: its leases are in no count
                argv.append(" ".join(map(str, (index, *RESERVED))))
        return [len(keys), *keys, *argv]


def _value(arg: bytes) -> bytes:
    """A packed argument's value (``wire.bulk``: ``$<len>\\r\\n<value>\\r\\n``)."""
    return arg[arg.index(b"\r\n") + 2 : -2]


def _outcome(draw: st.DrawFn, lease_id: str) -> Lease:
    kind = draw(st.sampled_from(KINDS))
    aimd = "1" if kind == "transient" and draw(st.booleans()) else "0"
    if kind == "rate_limited":
        pause = draw(st.sampled_from(("0.5", "3.0")))
    elif kind in ("success", "transient"):
        pause = draw(st.sampled_from(("", "", "1.5")))
    else:
        pause = ""
    used = draw(st.sampled_from(("", "80", "150")))
    return (lease_id, kind, aimd, pause, used, COST)


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    tail = draw(st.sampled_from((None, "0", "1", "1")))
    layout = Layout(tail)
    if tail is not None:
        with_classes = draw(st.booleans())
        layout = Layout(
            tail,
            handoff=draw(st.sampled_from(("1.0", "0.25", "0"))),
            classes=with_classes,
            floors=with_classes and draw(st.booleans()),
            tenants=draw(st.booleans()),
        )
    tpm = draw(st.sampled_from((None, 600000.0)))
    spec = SourceSpec(
        "s",
        max_concurrency=draw(st.integers(3, 8)),
        tpm=tpm,
        tpm_burst=None if tpm is None else draw(st.sampled_from((None, 900.0))),
        breaker_failures=draw(st.integers(1, 3)),
        cooldown_s=1.0,
        cooldown_max_s=4.0,
    )
    classes = CLASSES if layout.classes else ("",)
    # The source is filled: every process's ask after that is refused and registers it.
    grants = tuple(
        (draw(st.sampled_from(classes)), draw(st.sampled_from((60.0, 60.0, 2.0))))
        for _ in range(spec.max_concurrency)
    )
    waiters: tuple[Waiter, ...] = ()
    if tail is not None:
        waiters = tuple(
            Waiter(
                p,
                draw(st.sampled_from(classes)),
                draw(st.sampled_from((None, "t1", "t2"))) if layout.tenants else None,
                draw(st.sampled_from(("30", "30", "1"))),  # "1": lapsed by T1
            )
            for p in draw(st.lists(st.sampled_from(PROCESSES), max_size=3, unique=True))
        )
    leases = list(range(len(grants)))
    early = draw(st.lists(st.sampled_from(leases), max_size=2, unique=True))
    before = tuple((i, _outcome(draw, f"lease-{i}")) for i in early)
    left = [f"lease-{i}" for i in leases if i not in early]
    n = draw(st.integers(1, 8))
    chosen = draw(st.lists(st.sampled_from([*left, "unknown"]), min_size=n, max_size=n))
    return Plan(
        layout,
        spec,
        grants,
        waiters,
        before,
        draw(st.sampled_from(classes)),
        tuple(_outcome(draw, lease_id) for lease_id in chosen),
        T1 + draw(st.sampled_from((0.0, 0.5, 3.0))),
        draw(st.sampled_from((True, True, False))),
        draw(st.sampled_from((False, False, True))),
        draw(st.booleans()),
        draw(st.sampled_from((False, False, False, True))),
    )


def _success(lease_id: str) -> Lease:
    return (lease_id, "success", "0", "", "", COST)


FLOORS = Plan(
    Layout("0", classes=True, floors=True),
    SourceSpec("s", max_concurrency=6),
    (("a", 60.0),) * 4 + (("b", 60.0),) * 2,
    (Waiter("p1", "a", None, "30"), Waiter("p2", "b", None, "30")),
    (),
    "a",
    tuple(_success(f"lease-{i}") for i in range(4)),
    T1,
)
"""Class a holds 4 permits, 2 reserved: below its floor only once the run's third lease of
it has left its count, not before (the wake-ups go to b, a, then a by its floor)."""

FLOORS_NOBODY_WAITING = Plan(
    Layout("1", classes=True, floors=True),
    SourceSpec("s", max_concurrency=3),
    (("a", 60.0), ("a", 60.0), ("b", 60.0)),
    (),
    (),
    "a",
    (_success("lease-1"), _success("lease-0")),
    T1,
)
"""Nobody waits: the run's leases leave the lease zset and their class's count together."""

FAILURES = Plan(
    Layout(None),
    SourceSpec("s", max_concurrency=3),
    (("", 60.0),) * 3,
    (),
    (),
    "",
    (
        _success("lease-0"),
        ("lease-1", "transient", "1", "", "", COST),
        ("lease-2", "rate_limited", "0", "0.5", "", COST),
    ),
    T1,
)
"""A success, then a failure that lowers the limit, then one that may not (the cool-off):
each decided on the state the one before left, the progress mark set by the first."""

NO_ROOM = Plan(
    Layout("0"),
    SourceSpec("s", max_concurrency=3),
    (("", 60.0),) * 3,
    (Waiter("p1", "", None, "30"), Waiter("p2", "", None, "30")),
    (),
    "",
    (("lease-0", "transient", "1", "", "", COST), _success("lease-1")),
    T1,
)
"""The first lease's failure lowers the limit to 2.1: two leases still live leave no room
to hold its permit for p1; after the second lease (one live), there is, for p2."""

WAKE_SETS_LIFETIME = Plan(
    Layout("0"),
    SourceSpec("s", max_concurrency=3),
    (("", 60.0),) * 3,
    (Waiter("p1", "", None, "30"),),
    (),
    "",
    (_success("lease-0"), _success("unknown"), _success("lease-1")),
    T1,
    skiplist=False,
    expiring=True,
)
"""The run's first lease sets the keys' lifetimes, then its wake-up holds the permit in a
lease zset that gains its skiplist member, which sets that zset's lifetime (2 s); the
third lease sets the keys' lifetimes again (a day), and its wake-up holds nothing."""


def _dump(client: redis.Redis, scope: str) -> tuple[dict[str, Any], dict[str, int]]:
    """Every key of the scope, its scope's name left out: type and value, and its PTTL."""
    values: dict[str, Any] = {}
    lifetimes: dict[str, int] = {}
    for raw in client.scan_iter(match=f"pgw:{{{scope}}}:*", count=1000):
        key = cast(bytes, raw).decode()
        kind = cast(bytes, client.type(key)).decode()
        value: Any
        if kind == "string":
            value = client.get(key)
        elif kind == "hash":
            value = client.hgetall(key)
        elif kind == "zset":
            value = client.zrange(key, 0, -1, withscores=True)
        else:
            raise AssertionError(f"a key of an unexpected type: {key} ({kind})")
        name = key.replace(f"{{{scope}}}", "{}", 1)
        values[name] = (kind, value)
        lifetimes[name] = int(client.pttl(key))
    return values, lifetimes


def _prepare(
    client: redis.Redis, acquire: str, release: str, plan: Plan, twins: tuple[Scope, ...]
) -> None:
    """The plan's state before its run, made alike in each scope, call after call."""
    for i, (priority_class, ttl_s) in enumerate(plan.grants):
        for s in twins:
            args = s.acquire(T0, f"lease-{i}", ttl_s, ME, priority_class)
            assert client.evalsha(acquire, *args)[0] == 1
    if not plan.skiplist:
        for s in twins:
            assert client.zremrangebyscore(s.key("leases", plan.spec.name), "-inf", "-inf")
    for w in plan.waiters:
        for s in twins:
            args = s.acquire(
                T0,
                f"ask-{w.process}",
                60.0,
                w.process,
                w.priority_class,
                w.tenant,
                w.registration_ttl,
            )
            assert client.evalsha(acquire, *args)[0] == 0, "the source is full"
    if plan.marked:
        for s in twins:
            assert client.evalsha(acquire, *s.marking(T0))[:3] == [2, 0, b"c"]
            assert client.hget(s.key("src", plan.spec.name), "verdict") not in (None, b"")
    if plan.expiring:
        for s in twins:
            client.hset(s.key("src", plan.spec.name), "expires_at", repr(plan.at + 2.0))
    if plan.state_lost:
        for s in twins:
            assert client.delete(s.key("src", plan.spec.name)) == 1
    for i, words in plan.before:
        for s in twins:
            client.evalsha(release, *s.release(T1, (words,), plan.grants[i][0]))


@pytest.fixture
def heard(redis_url: str) -> Iterator[None]:
    """HEARD listens on its channel; the others do not (a wake-up may find them gone)."""
    client = redis.Redis.from_url(redis_url)
    pubsub = client.pubsub()
    pubsub.subscribe(f"pgw:wake:{HEARD}")
    assert pubsub.get_message(timeout=5.0) is not None  # the subscription is in place
    yield
    pubsub.close()
    client.close()


def test_a_run_of_releases_leaves_what_its_releases_one_by_one_leave(
    redis_url: str, heard: None
) -> None:
    """Any N leases of one source (some expired, unknown or repeated), any outcomes, with
    or without processes waiting (classes, floors, tenants, hand-offs): one run leaves every
    key as the N releases one after another at the same ``now``, and replies theirs."""
    client = redis.Redis.from_url(redis_url)
    acquire, release = (client.script_load(s) for s in (scripts.ACQUIRE, scripts.RELEASE))
    names = itertools.count()
    seen: dict[str, int] = {}

    def note(what: str) -> None:
        seen[what] = seen.get(what, 0) + 1

    @settings(
        max_examples=250,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(plan=plans())
    @example(plan=FAILURES)
    @example(plan=FLOORS)
    @example(plan=FLOORS_NOBODY_WAITING)
    @example(plan=NO_ROOM)
    @example(plan=WAKE_SETS_LIFETIME)
    def check(plan: Plan) -> None:
        k = next(names)
        one, run = Scope(f"one-{k}", plan), Scope(f"run-{k}", plan)
        twins = (one, run)
        _prepare(client, acquire, release, plan, twins)

        one_by_one = [
            client.evalsha(release, *one.release(plan.at, (words,), plan.run_class))
            for words in plan.run
        ]
        in_run = client.evalsha(release, *run.release(plan.at, plan.run, plan.run_class))
        if len(plan.run) == 1:
            in_run = [in_run]  # no space in ARGV[2]: a lone release, its reply as ever
        assert in_run == one_by_one

        values, lifetimes = _dump(client, one.name)
        run_values, run_lifetimes = _dump(client, run.name)
        assert run_values == values
        assert run_lifetimes.keys() == lifetimes.keys()
        for key, ms in lifetimes.items():
            assert (ms < 0) == (run_lifetimes[key] < 0), key
            assert abs(run_lifetimes[key] - ms) <= TTL_SLACK_MS, key

        # What the examples reached (checked below): the paths a run must get right.
        for reply in one_by_one:
            note("reply [1, class, ...]" if isinstance(reply, list) else f"reply {reply}")
        if 0 in one_by_one[1:-1]:
            note("0 in the middle")
        if len(plan.run) > 1 and len({words[1] for words in plan.run}) > 1:
            note("mixed outcomes")
        state = values.get("pgw:{}:src:s", ("hash", {}))[1]
        if state.get(b"breaker") == b"open":
            note("tripped")
        if any(m.startswith(b"handoff:") for m, _ in values.get("pgw:{}:leases:s", ("", []))[1]):
            note("hand-off held")

    check()
    for what in (
        "reply 0",
        "reply 1",
        "reply 2",
        "reply [1, class, ...]",
        "0 in the middle",
        "mixed outcomes",
        "tripped",
        "hand-off held",
    ):
        assert seen.get(what, 0) > 0, (what, seen)


def test_a_lone_release_leaves_the_lease_zsets_lifetime_its_wake_up_set(redis_url: str) -> None:
    """A lone release sets the keys' lifetimes (a day: the state's were about to run out)
    before its wake-up, whose placeholder gives an old lease zset its skiplist member and
    the state's remaining life (2 s), which stands, as it did before runs existed."""
    client = redis.Redis.from_url(redis_url)
    acquire, release = (client.script_load(s) for s in (scripts.ACQUIRE, scripts.RELEASE))
    plan = WAKE_SETS_LIFETIME
    scope = Scope("lone", plan)
    _prepare(client, acquire, release, plan, (scope,))
    assert client.evalsha(release, *scope.release(plan.at, plan.run[:1], "")) == 2
    assert 0 < client.pttl(scope.key("leases", "s")) <= 2000
    assert client.ttl(scope.key("src", "s")) > 86000
