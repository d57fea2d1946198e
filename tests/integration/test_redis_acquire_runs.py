"""An ACQUIRE run decides and leaves Redis exactly as its calls one by one would.

A run (research-wiki/designs/script-cost.md, "Several calls per script run") carries
several calls of one process, class and candidate order in one script run: their lease
ids, TTLs and costs as the words of ARGV[2], ARGV[3] and ARGV[4], and the class flags
as two words, those of the calls before the last, then those of the last. Each case
here builds one random history in two twin scopes, then sends the same calls to one
scope as a run and to the other one by one, and compares the replies and every key of
both scopes: values, and whether and how long each key lives.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend, codec, scripts
from polygateway.backends.redis.specset import SpecSet, limits_of

T0, T1 = 1796212800.25, 1796212830.5
PROC = "proc-a"
WAIT_TTL = "30"
CASES = 160


def _raw(arg: bytes) -> bytes:
    """The value of a packed argument (``wire.bulk``: ``$<len>\\r\\n<value>\\r\\n``)."""
    return arg[arg.index(b"\r\n") + 2 : -2]


def _part(name: str) -> tuple[str, ...]:
    """A class's key suffix: none without classes (the class named "")."""
    return (name,) if name else ()


@dataclass
class _Twin:
    """One scope of a case: its keys and how ACQUIRE and RELEASE are called there."""

    name: str
    specs: list[SourceSpec]
    classes: int  # 0: no process id; 1: one registry, no classes; 2: two classes
    own: int  # the calls' class, 0-based
    tenants: bool
    floors: bool
    state_ttl: str  # a day, or a minute: then lives follow the leases' TTLs
    spec_set: SpecSet | None = None
    stored: bool = False
    leases: dict[str, str] = field(default_factory=dict)  # lease id -> source

    def __post_init__(self) -> None:
        if len(self.specs) > 1:
            self.spec_set = SpecSet(self.name, {s.name: s for s in self.specs})

    def key(self, *parts: str) -> str:
        return codec.key(self.name, *parts)

    def acquire(
        self, ids: list[str], ttls: list[float], costs: list[int], flags: str, now: float
    ) -> list[Any]:
        first = self.specs[0]
        keys = [self.key("sources"), self.key("src", first.name), self.key("leases", first.name)]
        keys.append(self.key("verdicts"))
        limits = limits_of(first)
        argv: list[Any] = [
            repr(now),
            " ".join(ids),
            " ".join(map(repr, ttls)),
            " ".join(map(str, costs)),
            self.state_ttl,
            first.name,
            *limits,
            " ".join(limits),
        ]
        if self.spec_set is None:
            keys.append(self.key("specs", ""))
            argv += ["", "", ""]
        else:
            keys.append(_raw(self.spec_set.key))
            argv += [
                _raw(self.spec_set.digest),
                _raw(self.spec_set.order(self.specs)),
                "" if self.stored else _raw(self.spec_set.packed),
            ]
            self.stored = True
        if self.classes:
            names = [""] if self.classes == 1 else ["gold", "bulk"]
            for name in names:
                keys += [self.key("waiting", *_part(name))]
                keys += [self.key("waiting_until", *_part(name))]
            argv += [PROC, WAIT_TTL, flags]
            if self.tenants:
                lists = []
                for j, name in enumerate(names):
                    keys += [self.key(p, *_part(name)) for p in ("flows", "flows_of")]
                    keys.append(self.key("tenants", *_part(name)))
                    inner = "".join(f"{len(t)}:{t}" for t in (["t1", "t22"] if j == 0 else []))
                    lists.append(f"{len(inner)}:{inner}")
                argv.append("".join(lists))
            if self.floors:
                keys.append(self.key("held", names[self.own]))
        return [len(keys), *keys, *argv]

    def release(self, lease_id: str, kind: str, pause: str, used: str, now: float) -> list[Any]:
        source = self.leases[lease_id]
        keys = [self.key("src", source), self.key("leases", source), self.key("progress")]
        keys.append(self.key("verdicts"))
        aimd = "1" if kind == "transient" else "0"
        argv = [
            repr(now),
            lease_id,
            kind,
            aimd,
            pause,
            used,
            "40",
            "5",
            "0.5",
            "600",
            self.state_ttl,
        ]
        return [len(keys), *keys, *argv]


def _specs(rng: random.Random) -> list[SourceSpec]:
    specs = []
    for i in range(rng.randint(1, 3)):
        rpm = rng.choice([None, rng.randint(2, 6) * 1.0])
        tpm = rng.choice([None, rng.randint(60, 300) * 1.0])
        specs.append(
            SourceSpec(
                f"s{i}",
                rng.randint(1, 3),
                rpm=rpm,
                tpm=tpm,
                breaker_failures=rng.randint(1, 3),
                cooldown_s=rng.choice([1.0, 4.0]),
                cooldown_max_s=rng.choice([8.0, 300.0]),
            )
        )
    if len(specs) > 1 and rng.random() < 0.3:
        specs.append(specs[0])  # a source listed twice: one state, walked twice
    return specs


def _dump(client: redis.Redis, twin: _Twin) -> dict[str, Any]:
    """Every key of the scope by its name less the scope: type, value, remaining life."""
    found: dict[str, Any] = {}
    for raw in client.scan_iter(match=f"pgw:{{{twin.name}}}:*", count=1000):
        name = raw.decode()
        kind = client.type(name).decode()
        value: Any
        if kind == "hash":
            value = client.hgetall(name)
        elif kind == "zset":
            value = client.zrange(name, 0, -1, withscores=True)
        else:
            value = client.get(name)
        found[name.replace(twin.name, "@", 1)] = (kind, value, client.ttl(name))
    return found


def _same(one: dict[str, Any], run: dict[str, Any]) -> None:
    assert one.keys() == run.keys()
    for name, (kind, value, ttl) in one.items():
        run_kind, run_value, run_ttl = run[name]
        assert (kind, value) == (run_kind, run_value), name
        # Lives set by the same EXPIREs a few ms apart: equal, or a second apart at most.
        assert (ttl < 0) == (run_ttl < 0), name
        assert abs(ttl - run_ttl) <= 1, name


def _history(client: redis.Redis, sha: dict[str, str], rng: random.Random, twin: _Twin) -> None:
    """Random calls before the run: grants, releases, a promised permit, a registration.

    The twins draw from the same random state, so they get the same history.
    """
    steps: list[tuple[str, Any]] = []
    for k in range(rng.randint(0, 10)):
        if rng.random() < 0.6:
            steps.append(("acquire", (f"h{k:03d}", rng.choice([5.0, 30.0]), rng.randint(0, 90))))
        else:
            kind = rng.choice(["success", "transient", "rate_limited", "request_rejected"])
            pause = repr(rng.choice([2.0, 40.0])) if kind == "rate_limited" else ""
            steps.append(("release", (rng.random(), kind, pause, str(rng.randint(0, 90)))))
    now = T0
    for what, data in steps:
        now += 0.125
        if what == "acquire":
            lease_id, ttl, cost = data
            reply = client.evalsha(
                sha["acquire"],
                *twin.acquire([lease_id], [ttl], [cost], "0" * twin.classes, now),
            )
            if reply[0] > 0:
                twin.leases[lease_id] = twin.specs[reply[0] - 1].name
        elif twin.leases:
            pick, kind, pause, used = data
            lease_id = sorted(twin.leases)[int(pick * len(twin.leases))]
            client.evalsha(sha["release"], *twin.release(lease_id, kind, pause, used, now))
            del twin.leases[lease_id]
    if twin.classes and rng.random() < 0.5:
        # A permit promised to the process at the first source, live or lapsed.
        lk = twin.key("leases", twin.specs[0].name)
        client.zadd(lk, {f"handoff:{PROC}": T1 + rng.choice([-0.5, 0.75])})
    if twin.classes and rng.random() < 0.5:
        # The process registered already, waiting in its class.
        name = "" if twin.classes == 1 else ["gold", "bulk"][twin.own]
        part = _part(name)
        client.zadd(twin.key("waiting", *part), {PROC: T0, "proc-b": T0 + 1})
        client.zadd(twin.key("waiting_until", *part), {PROC: T1 + 20, "proc-b": T1 + 20})


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.mark.parametrize("seed", range(CASES))
def test_a_run_leaves_what_its_calls_one_by_one_leave(client: redis.Redis, seed: int) -> None:
    rng = random.Random(seed)
    sha = {
        "acquire": client.script_load(scripts.ACQUIRE),
        "release": client.script_load(scripts.RELEASE),
    }
    specs = _specs(rng)
    classes = rng.choice([0, 1, 2])
    own = rng.randint(0, classes - 1) if classes else 0
    tenants = classes > 0 and rng.random() < 0.3
    floors = classes == 2 and rng.random() < 0.5
    state_ttl = rng.choice(["86400", "60"])
    twins = [
        _Twin(f"{label}-{seed}", specs, classes, own, tenants, floors, state_ttl)
        for label in ("one", "run")
    ]
    state = rng.getstate()
    for twin in twins:
        rng.setstate(state)
        _history(client, sha, rng, twin)
    one, run = twins

    n = rng.randint(1, 6)
    ids = [f"r{i:03d}-{seed}" for i in range(n)]
    ttls = [rng.choice([5.0, 30.0, 200.0]) for _ in range(n)]
    costs = [rng.randint(0, 120) for _ in range(n)]
    final = mid = ""
    for j in range(classes):
        if j == own:
            final += rng.choice("12")
            mid += "2"
        else:
            other = rng.choice("02")
            final += other
            mid += other
    flags = final if n == 1 else f"{mid} {final}"
    ran = client.evalsha(sha["acquire"], *run.acquire(ids, ttls, costs, flags, T1))
    replies = [ran] if n == 1 else ran
    assert len(replies) == n
    alone = []
    for i in range(n):
        each = final if i == n - 1 else mid
        alone.append(
            client.evalsha(sha["acquire"], *one.acquire([ids[i]], [ttls[i]], [costs[i]], each, T1))
        )
    assert alone == replies
    _same(_dump(client, one), _dump(client, run))


def test_a_run_stops_before_a_call_that_needs_a_spec_set_not_stored(client: redis.Redis) -> None:
    """The calls decided are answered; the one needing the lost set and those after wait."""
    sha = client.script_load(scripts.ACQUIRE)
    specs = [SourceSpec("s0", 1), SourceSpec("s1", 2)]
    twin = _Twin("unset", specs, 0, 0, tenants=False, floors=False, state_ttl="86400")
    assert twin.spec_set is not None
    client.delete(_raw(twin.spec_set.key))
    twin.stored = True  # believed stored, as after an eviction or a failover

    # The first call is granted at s0; the second finds s0 full and needs s1's spec.
    ran = client.evalsha(sha, *twin.acquire(["a", "b", "c"], [30.0] * 3, [0] * 3, "", T1))
    assert ran == [[1, 0, b""]]
    # Asked again, the call that needs the set gets {-1}: the client sends the set.
    assert client.evalsha(sha, *twin.acquire(["b", "c"], [30.0] * 2, [0] * 2, "", T1)) == [-1]
    twin.stored = False
    ran = client.evalsha(sha, *twin.acquire(["b", "c"], [30.0] * 2, [0] * 2, "", T1))
    assert ran == [[2, 0, b"c"], [2, 0, b"c"]]


# -- the backend's runs of acquires and releases (backends/redis/runs.py) -----------------


def _evalsha_calls(url: str) -> int:
    with redis.Redis.from_url(url) as admin:
        return int(admin.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


@pytest.fixture
async def own(make_redis_server: Callable[..., Any]) -> AsyncIterator[tuple[str, RedisBackend]]:
    """A redis-server of the test's own (its commands counted from zero) and a backend on it."""
    server = make_redis_server()
    backend = RedisBackend(server.url)
    try:
        yield server.url, backend
    finally:
        await backend.aclose()


async def test_calls_asking_together_go_in_runs_each_answered_alone(
    own: tuple[str, RedisBackend],
) -> None:
    """40 calls at once: the first alone, the 39 that arrived meanwhile in runs of 16 at most;
    every call gets its own lease, and the source never holds more than its limit."""
    url, backend = own
    spec = SourceSpec("s", 30)
    await backend.snapshot("warm")  # connected, so that only the calls below count
    before = _evalsha_calls(url)
    results = await asyncio.gather(
        *(backend.acquire("runs", [spec], cost_tokens=i, ttl_s=30.0) for i in range(40))
    )
    assert _evalsha_calls(url) - before == 1 + 3  # 1, then 16 + 16 + 7
    granted = [r.lease for r in results if r.lease is not None]
    assert len(granted) == 30
    assert len({lease.lease_id for lease in granted}) == 30
    assert [lease.tokens for lease in granted] == list(range(30))  # in arrival order
    assert all(r.rejections[0].reason == "concurrency" for r in results[30:])
    snapshot = await backend.snapshot("runs")
    assert snapshot.sources[0].in_flight == 30


async def test_a_call_cancelled_before_its_run_is_written_takes_no_permit(
    own: tuple[str, RedisBackend],
) -> None:
    url, backend = own
    spec = SourceSpec("s", 5)
    await backend.snapshot("warm")
    before = _evalsha_calls(url)
    tasks = [asyncio.create_task(backend.acquire("runs", [spec], ttl_s=30.0)) for _ in range(3)]
    await asyncio.sleep(0)  # each has asked: the first is in flight, two wait for it
    tasks[1].cancel()
    first, third = await tasks[0], await tasks[2]
    with pytest.raises(asyncio.CancelledError):
        await tasks[1]
    assert first.lease is not None
    assert third.lease is not None
    assert _evalsha_calls(url) - before == 2  # the first, then a run of one
    snapshot = await backend.snapshot("runs")
    assert snapshot.sources[0].in_flight == 2


async def test_releases_behind_one_in_flight_go_in_one_run_each_freeing_its_permit(
    own: tuple[str, RedisBackend],
) -> None:
    url, backend = own
    spec = SourceSpec("s", 20)
    results = await asyncio.gather(
        *(backend.acquire("runs", [spec], ttl_s=30.0) for _ in range(20))
    )
    before = _evalsha_calls(url)
    for result in results:
        assert result.lease is not None
        await backend.release(result.lease, AttemptOutcome("success", tokens_used=3))
    snapshot = await backend.snapshot("runs")  # written after every release before it
    assert snapshot.sources[0].in_flight == 0
    # The first release alone; the 19 written while it was in flight, in runs of 16 at
    # most, before the snapshot; then the snapshot's own script.
    assert _evalsha_calls(url) - before == 1 + 2 + 1


async def _one_release_waiting(backend: RedisBackend, spec: SourceSpec) -> Lease:
    """Two leases at ``spec`` released in a row: the first written and in flight, the
    second waiting for its run; returns the second."""
    one, two = await asyncio.gather(*(backend.acquire("runs", [spec], ttl_s=30.0) for _ in "ab"))
    assert one.lease is not None
    assert two.lease is not None
    await backend.release(one.lease, AttemptOutcome("success"))  # written, in flight
    await backend.release(two.lease, AttemptOutcome("success"))  # waits for a run
    return two.lease


async def test_a_release_waiting_for_its_run_is_written_before_the_next_acquire(
    own: tuple[str, RedisBackend],
) -> None:
    """Whatever the process sends next finds the permit free, as without runs."""
    _, backend = own
    spec = SourceSpec("s", 2)
    await _one_release_waiting(backend, spec)
    # Two acquires that go at once (two classes: two keys), right behind the first release.
    again = await asyncio.gather(
        *(backend.acquire("runs", [spec], ttl_s=30.0, priority_class=c) for c in "ab")
    )
    assert all(result.lease is not None for result in again)


async def test_a_release_waiting_for_its_run_is_written_before_a_renewal(
    own: tuple[str, RedisBackend],
) -> None:
    _, backend = own
    spec = SourceSpec("s", 2)
    waiting = await _one_release_waiting(backend, spec)
    assert await backend.renew(waiting) is False  # released already, as written before
