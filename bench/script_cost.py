"""Redis CPU of a governed call's two scripts, and where it goes.

    python -m bench.script_cost [--pairs 500] [--walk-pairs 50] [--sources 200] [--rounds 8]

Starts a private redis-server (loopback, temporary directory, no
persistence; ``bench.services.private_redis``) and drives the backend's
ACQUIRE and RELEASE scripts (``polygateway.backends.redis.scripts``, as they
are) straight through redis-py, with the KEYS / ARGV layout ``limiter.py``
sends for a call that does not wait (the O(1) contract: the first candidate
whole, the others by their index in the scope's spec set, built with
``specset.SpecSet`` as ``RedisBackend.acquire`` builds it): ACQUIRE without
the waiting tail, RELEASE (``success``, tokens used reported) with its
wake-up tail, server time. Every source has rpm and tpm set. Cases:

- ``INCR + DECR``: the issue's baseline, one pair per governed call.
- ``1 source``: the issue's case (a single candidate: no digest, order or set).
- ``2 sources`` and ``N sources``: every source but the last is full (one
  long lease at ``max_concurrency = 1``, taken by the real ACQUIRE, one
  single-candidate call per source). Of two unmeasured calls per (case,
  variant) first, the first sends the spec set, examines each full source and
  marks it full (a verdict); every later call sends the digest and the order
  only and skips the marked sources unexamined. The verdicts are checked
  after those two calls and after the measured ones: every figure is the
  steady state, verdicts present (each RELEASE is at the last source, never
  marked, so it clears none). Replies are checked: granted at the last
  candidate, a ``c`` for each one before it.

Each (case, variant) is measured twice per round, rounds interleaved and the
best round shown (a busy machine only ever adds to a figure): split (a
pipeline of up to 50 ACQUIREs, then one of their RELEASEs; ``INFO
commandstats`` deltas, so ACQUIRE and RELEASE apart, and the commands the
scripts run inside) and interleaved (ACQUIRE, RELEASE, ACQUIRE, ...
pipelined; ``INFO cpu`` user + sys delta of the main thread over the run,
which counts what Redis spends on the scripts plus reading and answering
them).

The figures and the plan they feed: research-wiki/designs/script-cost.md.

Besides the ``current`` scripts, ``empty`` is a script that does nothing but
take the same KEYS and ARGV: the floor of EVALSHA itself, which no cut inside
the scripts can go below. ``calls`` (1 source only) runs the commands a
1-source grant and its success run, with constant arguments and no Lua
around them: the floor of the semantics' calls, so that the current scripts
minus it is what their own logic costs. Every variant's sources are first
seen by the real scripts, so each reads the state they keep. (The ``O(1)
call prototype`` once measured here shipped as the contract above.)

A last table (``LAYOUTS``) prices other ways ACQUIRE could take its
candidates, each with the empty script at 2 and at N candidates (``INFO
cpu`` per call, best round), and the Lua loop that walks a candidate order
against a verdict string: what a many-source ACQUIRE pays before any work,
against the current scripts' whole 2-source pair.

The batch table prices serving several calls in one script run, at 1, 4
and 16 calls a run (1 source, grants then successes, ``INFO cpu`` per pair,
best round), four ways: the real scripts' body looped (``looped``); the same
over a write-back cache of its commands (``cached``: each call still parses,
decides and formats, the commands are sent once a run); a run that reads the
state once, decides each call on it and writes once (``state_once``, the
measured path only, pinned to the real scripts' decisions by
``tests/integration/test_bench_state_once.py``); and that run's commands with
no logic (``shared_calls``).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis

from bench.machine import describe_machine
from bench.services import private_redis
from polygateway.backends.base import SourceSpec
from polygateway.backends.redis import codec, scripts
from polygateway.backends.redis.specset import SpecSet, limits_of
from polygateway.config import PROGRESS_TTL_S
from polygateway.governance.aimd import AIMD_COOLOFF_S, AIMD_FACTOR

__all__ = [
    "BATCH_COLUMNS",
    "BATCH_SIZES",
    "CASES",
    "LAYOUTS",
    "VARIANTS",
    "Layout",
    "Variant",
    "cached",
    "expected_rows",
    "looped",
    "main",
    "measure",
    "measure_batches",
    "measure_layouts",
    "state_once",
]

STATE_TTL_S = 86400
"""``limiter._STATE_TTL_S``, as the backend sends it."""
HANDOFF_TTL_S = 1.0
"""``limiter._HANDOFF_TTL_S`` (capped there by the socket timeout, 1 s by default)."""
LEASE_TTL_S = 60.0
COST_TOKENS = 100
TOKENS_USED = 80
BATCH = 50
"""ACQUIREs per pipeline in the split measurement; the granting source's ``max_concurrency``
(so its lease zset stays a listpack, as a real source's of a few dozen permits does)."""
FULL_LEASE_TTL_S = 3600.0
"""The lease that keeps a walked-past source full for the whole run."""


# -- the floor: a script that takes the same KEYS and ARGV and does nothing ------------------


_EMPTY = "-- EXPERIMENT: the same KEYS and ARGV, no work: EVALSHA's own floor\nreturn 1\n"


def _empty(a: str, r: str) -> tuple[str, str]:
    return _EMPTY, _EMPTY


# -- the commands alone: what a 1-source grant and its success run, with no Lua around -------

_CALLS_ACQUIRE = """-- EXPERIMENT: a 1-source grant's commands, constant arguments, no logic
redis.call('TIME')
redis.call('HMGET', KEYS[2], 'limit', 'breaker', 'not_before', 'rpm_tokens', 'rpm_at',
  'tpm_tokens', 'tpm_at', 'reopen_probe', 'spec', 'expires_at')
redis.call('ZCOUNT', KEYS[3], '(1796212800.1234567', '+inf')
redis.call('ZADD', KEYS[3], '1796212860.1234567', ARGV[2])
redis.call('HSET', KEYS[2], 'rpm_tokens', '999999.00000000012', 'rpm_at',
  '1796212800.1234567', 'tpm_tokens', '999999899.99999988', 'tpm_at', '1796212800.1234567')
return {1, 0, ''}
"""
_CALLS_RELEASE = """-- EXPERIMENT: a success's commands, constant arguments, no logic
redis.call('TIME')
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '1796212800.1234567')
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('HMGET', KEYS[1], 'max_concurrency', 'tpm', 'tpm_cap', 'cooldown_max_s',
  'breaker', 'failures', 'trips', 'probe_id', 'probe_until', 'limit', 'tpm_tokens',
  'reopen_probe', 'pprobe_id', 'expires_at', 'verdict')
redis.call('HSET', KEYS[1], 'tpm_tokens', '999999919.99999988')
redis.call('SET', KEYS[3], '1796212800.1234567', 'EX', ARGV[10])
redis.call('ZCARD', KEYS[5])
return 1
"""


def _calls(a: str, r: str) -> tuple[str, str]:
    return _CALLS_ACQUIRE, _CALLS_RELEASE


@dataclass(frozen=True, slots=True)
class Variant:
    """One pair of scripts to measure: ``current``, or the floor of EVALSHA."""

    key: str
    label: str
    make: Callable[[str, str], tuple[str, str]] | None
    cases: tuple[str, ...]
    checked: bool = True  # replies are the real contract's (grant, freed)


ONE, TWO, WALK = "one", "two", "walk"
CASES = ("baseline", ONE, TWO, WALK)
VARIANTS = (
    Variant("current", "current scripts", None, (ONE, TWO, WALK)),
    Variant("empty", "empty script, same KEYS/ARGV", _empty, (ONE, TWO, WALK), checked=False),
    Variant("calls", "its commands alone, no logic", _calls, (ONE,), checked=False),
)


def case_label(case: str, sources: int) -> str:
    """The table's name for a case."""
    return {
        "baseline": "INCR + DECR",
        ONE: "1 source",
        TWO: "2 sources, 1st full",
        WALK: f"{sources} sources, {sources - 1} full",
    }[case]


def expected_rows(sources: int) -> list[tuple[str, str]]:
    """Every (case, variant) row the main table has, in order."""
    rows = [(case_label("baseline", sources), "baseline")]
    for case in (ONE, TWO, WALK):
        rows += [(case_label(case, sources), v.label) for v in VARIANTS if case in v.cases]
    return rows


# -- the calls, as limiter.py lays them out ----------------------------------------------------


def _spec(name: str, max_concurrency: int) -> SourceSpec:
    """A measured source: rpm and tpm set, the breaker's defaults."""
    return SourceSpec(
        name,
        max_concurrency,
        rpm=6000000.0,
        rpm_burst=1000000.0,
        tpm=1000000000.0,
        tpm_burst=1000000000.0,
    )


def _spec_args(spec: SourceSpec) -> list[str]:
    """A candidate's ten ARGV (``RedisBackend._args_of``): its name, limits and spec string."""
    limits = limits_of(spec)
    return [spec.name, *limits, " ".join(limits)]


def _raw(arg: bytes) -> bytes:
    """The value of a packed argument (``wire.bulk``: ``$<len>\\r\\n<value>\\r\\n``)."""
    return arg[arg.index(b"\r\n") + 2 : -2]


@dataclass(slots=True)
class _Scope:
    """One measured scope: its candidates and the commands' fixed parts.

    Candidates are ``s000``, ``s001``, ... in that order; every one but the last
    has ``max_concurrency = 1`` (made full by ``_fill``), the last ``BATCH``.
    """

    name: str
    sources: int
    specs: list[SourceSpec] = field(default_factory=list)
    spec_set: SpecSet | None = None
    candidate_keys: list[str] = field(default_factory=list)
    candidate_args: list[str] = field(default_factory=list)
    release_keys: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        s = self.name
        last = self.sources - 1
        self.specs = [_spec(f"s{i:03d}", BATCH if i == last else 1) for i in range(self.sources)]
        for spec in self.specs:
            self.candidate_keys += [codec.key(s, p, spec.name) for p in ("src", "leases")]
            self.candidate_args += _spec_args(spec)
        if self.sources > 1:
            # ``RedisBackend._spec_set_of`` at a scope's first call: the candidates' specs.
            self.spec_set = SpecSet(s, {spec.name: spec for spec in self.specs})
        # RELEASE at the last (granting) source (``RedisBackend._release``, no classes).
        self.release_keys = [*self.candidate_keys[-2:], codec.key(s, "progress")]
        self.release_keys += [codec.key(s, p) for p in ("verdicts", "waiting", "waiting_until")]

    @property
    def sources_key(self) -> str:
        return codec.key(self.name, "sources")

    def single(self, index: int, lease_id: str, ttl_s: float) -> list[Any]:
        """ACQUIRE's call with candidate ``index`` alone: no spec set, digest or order."""
        keys = [
            self.sources_key,
            *self.candidate_keys[2 * index : 2 * index + 2],
            codec.key(self.name, "verdicts"),
            codec.key(self.name, "specs", ""),
        ]
        head = ["", lease_id, repr(ttl_s), str(COST_TOKENS), str(STATE_TTL_S)]
        args = self.candidate_args[10 * index : 10 * index + 10]
        return [len(keys), *keys, *head, *args, "", "", ""]

    def acquire(self, lease_id: str, ttl_s: float = LEASE_TTL_S) -> list[Any]:
        """ACQUIRE's call with every candidate, in order, as ``RedisBackend.acquire`` sends it.

        The spec set travels whole with the scope's first call only (then it is stored:
        ``SpecSet.stored``), the digest and the order with every call.
        """
        spec_set = self.spec_set
        if spec_set is None:
            return self.single(0, lease_id, ttl_s)
        keys = [
            self.sources_key,
            *self.candidate_keys[:2],
            codec.key(self.name, "verdicts"),
            _raw(spec_set.key),
        ]
        head = ["", lease_id, repr(ttl_s), str(COST_TOKENS), str(STATE_TTL_S)]
        packed = b"" if spec_set.stored else _raw(spec_set.packed)
        spec_set.stored = True
        tail = [_raw(spec_set.digest), _raw(spec_set.order(self.specs)), packed]
        return [len(keys), *keys, *head, *self.candidate_args[:10], *tail]

    def marked(self, client: redis.Redis) -> list[str]:
        """The sources whose verdict stands now (marked full, the mark not lapsed)."""
        if self.spec_set is None:
            return []
        raw = cast(bytes, client.get(codec.key(self.name, "verdicts")) or b"")
        digest = _raw(self.spec_set.digest)
        if not raw.startswith(digest):
            return []
        seconds, micros = client.time()
        now_ms = seconds * 1000 + micros // 1000
        body = raw[len(digest) :]
        names = sorted(spec.name for spec in self.specs)  # the set's indices
        return [
            names[k // 13]
            for k in range(0, len(body), 13)
            if body[k : k + 13].isdigit() and int(body[k : k + 13]) > now_ms
        ]

    def release(self, lease_id: str) -> list[Any]:
        keys = self.release_keys
        outcome = ["", lease_id, "success", "0", "", str(TOKENS_USED), str(COST_TOKENS)]
        return [
            len(keys),
            *keys,
            *outcome,
            repr(AIMD_COOLOFF_S),
            repr(AIMD_FACTOR),
            str(int(PROGRESS_TTL_S)),
            str(STATE_TTL_S),
            "bench-process-0001",
            self.name,
            "1",
            repr(HANDOFF_TTL_S),
        ]


def _fill(client: redis.Redis, scope: _Scope, sha: str) -> None:
    """Make every source but the last full: one long lease each, by the real ACQUIRE."""
    for i in range(scope.sources - 1):
        reply = client.evalsha(sha, *scope.single(i, f"full-{i}", FULL_LEASE_TTL_S))
        if list(reply[:3]) != [1, 0, b""]:
            raise RuntimeError(f"filling source {i} of {scope.name} was refused: {reply!r}")


# -- measuring ---------------------------------------------------------------------------------


def _stats(client: redis.Redis) -> dict[str, tuple[int, int]]:
    """(calls, usec) per command so far, from ``INFO commandstats``."""
    out = {}
    for key, value in client.info("commandstats").items():
        out[key.removeprefix("cmdstat_")] = (int(value["calls"]), int(value["usec"]))
    return out


def _delta(after: dict[str, tuple[int, int]], before: dict[str, tuple[int, int]]) -> dict[str, Any]:
    out: dict[str, list[int]] = {}
    for command, (calls, usec) in after.items():
        c0, u0 = before.get(command, (0, 0))
        if calls - c0 and command not in ("info", "ping", "config|resetstat"):
            out[command] = [calls - c0, usec - u0]
    return out


def _add(total: dict[str, list[int]], part: dict[str, list[int]]) -> None:
    for command, (calls, usec) in part.items():
        t = total.setdefault(command, [0, 0])
        t[0] += calls
        t[1] += usec


def _cpu_s(client: redis.Redis) -> float:
    """Redis's CPU seconds so far, its main thread's when the server tells them apart."""
    cpu = client.info("cpu")
    if "used_cpu_user_main_thread" in cpu:
        return float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


@dataclass(slots=True)
class _Run:
    """One (case, variant) measurement of one round."""

    acquire: dict[str, list[int]] = field(default_factory=dict)
    release: dict[str, list[int]] = field(default_factory=dict)
    split_pairs: int = 0
    cpu_s: float = 0.0
    cpu_pairs: int = 0


def _check(replies: Sequence[Any], granted: int | None, what: str) -> None:
    """ACQUIRE's replies: a grant at candidate ``granted``, no probe, a ``c`` for each before
    it (skipped or examined), no reopen time; RELEASE's (``granted`` None): 1, freed."""
    for reply in replies:
        if granted is None:
            ok = int(reply) == 1
        else:
            ok = list(reply) == [granted, 0, b"c" * (granted - 1)]
        if not ok:
            raise RuntimeError(f"{what}: unexpected reply {reply!r}")


def _check_verdicts(client: redis.Redis, scope: _Scope, what: str) -> None:
    """The steady state: every full source marked, the granting one not (with 2 or more)."""
    full = [spec.name for spec in scope.specs[:-1]]
    marked = scope.marked(client)
    if sorted(marked) != full:
        raise RuntimeError(f"{what}: verdicts stand for {marked!r}, expected {full!r}")


def _baseline(client: redis.Redis, pairs: int) -> _Run:
    run = _Run()
    for start in range(0, pairs, BATCH):
        n = min(BATCH, pairs - start)
        before = _stats(client)
        pipe = client.pipeline(transaction=False)
        for _ in range(n):
            pipe.execute_command("INCR", "bench:counter")  # type: ignore[no-untyped-call]
        pipe.execute()
        middle = _stats(client)
        pipe = client.pipeline(transaction=False)
        for _ in range(n):
            pipe.execute_command("DECR", "bench:counter")  # type: ignore[no-untyped-call]
        pipe.execute()
        _add(run.acquire, _delta(middle, before))
        _add(run.release, _delta(_stats(client), middle))
        run.split_pairs += n
    cpu = _cpu_s(client)
    for start in range(0, pairs, BATCH):
        pipe = client.pipeline(transaction=False)
        for _ in range(min(BATCH, pairs - start)):
            pipe.execute_command("INCR", "bench:counter")  # type: ignore[no-untyped-call]
            pipe.execute_command("DECR", "bench:counter")  # type: ignore[no-untyped-call]
        pipe.execute()
    run.cpu_s, run.cpu_pairs = _cpu_s(client) - cpu, pairs
    return run


def _scripts_run(
    client: redis.Redis,
    variant: Variant,
    sources: int,
    pairs: int,
    shas: tuple[str, str],
    real: tuple[str, str],
    tag: str,
) -> _Run:
    acquire_sha, release_sha = shas
    scope = _Scope(f"cost-{tag}", sources)
    _fill(client, scope, real[0])
    granted = sources if variant.checked else None
    serial = 0

    def ids(n: int) -> list[str]:
        nonlocal serial
        serial += n
        return [f"{i:012x}bench" for i in range(serial - n, serial)]

    acquire = scope.acquire

    def call(sha: str, commands: list[list[Any]], expect: int | None, what: str) -> None:
        pipe = client.pipeline(transaction=False)
        for args in commands:
            pipe.evalsha(sha, *args)
        replies = pipe.execute()
        if variant.checked:
            _check(replies, expect, what)

    # Warm-up, by the real scripts whatever the variant: first sight of every source (its
    # state as the real scripts keep it); with 2 sources or more the spec set stored and
    # every full source marked, so that what follows is the steady state: full sources
    # skipped by their verdict. Then the variant's own scripts once, compiled.
    for lease in ids(2):
        _check([client.evalsha(real[0], *acquire(lease))], sources, f"{tag} warm-up")
        _check([client.evalsha(real[1], *scope.release(lease))], None, f"{tag} warm-up")
    for lease in ids(1):
        call(acquire_sha, [acquire(lease)], granted, f"{tag} acquire")
        call(release_sha, [scope.release(lease)], None, f"{tag} release")
    if variant.checked:
        _check_verdicts(client, scope, f"{tag} after the warm-up")
    run = _Run()
    for start in range(0, pairs, BATCH):
        leases = ids(min(BATCH, pairs - start))
        before = _stats(client)
        call(acquire_sha, [acquire(x) for x in leases], granted, f"{tag} acquire")
        middle = _stats(client)
        call(release_sha, [scope.release(x) for x in leases], None, f"{tag} release")
        _add(run.acquire, _delta(middle, before))
        _add(run.release, _delta(_stats(client), middle))
        run.split_pairs += len(leases)
    cpu = _cpu_s(client)
    for start in range(0, pairs, BATCH):
        pipe = client.pipeline(transaction=False)
        for lease in ids(min(BATCH, pairs - start)):
            pipe.evalsha(acquire_sha, *acquire(lease))
            pipe.evalsha(release_sha, *scope.release(lease))
        replies = pipe.execute()
        if variant.checked:
            _check(replies[0::2], granted, f"{tag} acquire")
            _check(replies[1::2], None, f"{tag} release")
    run.cpu_s, run.cpu_pairs = _cpu_s(client) - cpu, pairs
    if variant.checked and not client.exists(codec.key(scope.name, "progress")):
        # RELEASE returns 1 on its short path too (a source without its spec): not measured.
        raise RuntimeError(f"{tag}: RELEASE never recorded an outcome, the call layout is wrong")
    if variant.checked:
        _check_verdicts(client, scope, f"{tag} after the measured calls")
    return run


def _script_usec(stats: dict[str, list[int]], baseline: bool) -> tuple[int, int]:
    """(calls, usec) of the measured top-level command of a phase."""
    name = ("incr" if "incr" in stats else "decr") if baseline else "evalsha"
    return tuple(stats.get(name, [0, 0]))  # type: ignore[return-value]


def _row(case: str, variant: str, runs: list[_Run], sources: int) -> dict[str, Any]:
    """The best round of one (case, variant): a busy machine only ever adds to a figure."""
    baseline = case == "baseline"
    acq, rel, cpu, commands = [], [], [], []
    for run in runs:
        a_calls, a_usec = _script_usec(run.acquire, baseline)
        r_calls, r_usec = _script_usec(run.release, baseline)
        acq.append(a_usec / a_calls)
        rel.append(r_usec / r_calls)
        cpu.append(run.cpu_s * 1e6 / run.cpu_pairs)
        every = sum(c for c, _ in run.acquire.values()) + sum(c for c, _ in run.release.values())
        # Commands per pair: the script calls themselves plus what they ran inside.
        commands.append(every / run.split_pairs)
    return {
        "case": case_label(case, sources),
        "variant": variant,
        "commands_per_pair": statistics.median(commands),
        "acquire_us": min(acq),
        "release_us": min(rel),
        "pair_us": min(a + r for a, r in zip(acq, rel, strict=True)),
        "pair_cpu_us": min(cpu),
    }


def measure(url: str, *, pairs: int, walk_pairs: int, sources: int, rounds: int) -> dict[str, Any]:
    """Every row of the tables, measured on the redis-server at ``url``."""
    client = redis.Redis.from_url(url)
    client.flushall()
    real = (client.script_load(scripts.ACQUIRE), client.script_load(scripts.RELEASE))
    plan: list[tuple[str, Variant | None, int, int]] = [("baseline", None, 1, pairs)]
    for case, n, size in ((ONE, 1, pairs), (TWO, 2, pairs), (WALK, sources, walk_pairs)):
        plan += [(case, v, n, size) for v in VARIANTS if case in v.cases]
    shas: dict[str, tuple[str, str]] = {}
    for each in VARIANTS:
        a, r = (scripts.ACQUIRE, scripts.RELEASE)
        if each.make is not None:
            a, r = each.make(a, r)
        shas[each.key] = (client.script_load(a), client.script_load(r))
    runs: dict[tuple[str, str], list[_Run]] = {}
    started = time.monotonic()
    for round_ in range(rounds):
        for case, variant, n, size in plan:
            if variant is None:
                # At least 1,000 pairs: fewer INCRs than that take a few microseconds in
                # all, which the server counts in whole microseconds (and divides by).
                run = _baseline(client, max(size, _BASELINE_PAIRS))
            else:
                tag = f"{case}-{variant.key}-{round_}"
                run = _scripts_run(client, variant, n, size, shas[variant.key], real, tag)
            runs.setdefault((case, variant.label if variant else "baseline"), []).append(run)
        client.flushall()
    rows = [_row(case, label, rs, sources) for (case, label), rs in runs.items()]
    base = rows[0]["pair_cpu_us"]
    for row in rows:
        row["x_baseline"] = row["pair_cpu_us"] / base

    # Where the current scripts' time goes, command by command (1 source, its best round).
    def script_usec(run: _Run) -> float:
        return (run.acquire["evalsha"][1] + run.release["evalsha"][1]) / run.split_pairs

    best = min(runs[(ONE, "current scripts")], key=script_usec)
    return {
        "rows": rows,
        "commands": _commands([best]),
        "seconds": time.monotonic() - started,
    }


def _commands(runs: list[_Run]) -> list[dict[str, Any]]:
    """Per command run by the current scripts on one source: calls and µs per pair."""
    pairs = sum(r.split_pairs for r in runs)
    total: dict[str, dict[str, int]] = {}
    for run in runs:
        for phase in ("acquire", "release"):
            for command, (calls, usec) in getattr(run, phase).items():
                t = total.setdefault(command, {"acquire": 0, "release": 0, "usec": 0})
                t[phase] += calls
                t["usec"] += usec
    out = []
    inner = 0.0
    for command, t in sorted(total.items(), key=lambda kv: -kv[1]["usec"]):
        if command == "evalsha":
            continue
        per_pair = t["usec"] / pairs
        inner += per_pair
        out.append(
            {
                "command": command.upper(),
                "in_acquire": t["acquire"] / pairs,
                "in_release": t["release"] / pairs,
                "us_per_call": t["usec"] / (t["acquire"] + t["release"]),
                "us_per_pair": per_pair,
            }
        )
    script = total["evalsha"]["usec"] / pairs
    out.append(
        {
            "command": "(Lua, arguments, redis.call: EVALSHA minus the above)",
            "in_acquire": 1.0,
            "in_release": 1.0,
            "us_per_call": None,
            "us_per_pair": script - inner,
        }
    )
    out.append(
        {
            "command": "EVALSHA in all (script time)",
            "in_acquire": 1.0,
            "in_release": 1.0,
            "us_per_call": script / 2,
            "us_per_pair": script,
        }
    )
    return out


# -- what a call layout costs before any work: ACQUIRE's floor by how candidates travel --------


@dataclass(frozen=True, slots=True)
class Layout:
    """A way ACQUIRE could take its n candidates, measured with a script that does nothing.

    ``keys`` and ``args`` are per candidate; ``packed`` sends every candidate's spec
    string in one argument, ``order`` only the candidates' indices, two bytes each (the
    specs then live in Redis; the shipped contract's way, but for its first candidate).
    The head (now, lease id, TTL, cost, state TTL) and ``KEYS[1]`` are sent as ACQUIRE
    takes them. Independent of the scripts: an experiment on EVALSHA's floor alone.
    """

    key: str
    label: str
    keys: int
    args: int
    packed: bool = False
    order: bool = False


LAYOUTS = (
    Layout("today", "2 keys + 10 arguments per candidate (before the O(1) contract)", 2, 10),
    Layout("spec", "2 keys + 1 argument (the spec string) per candidate", 2, 1),
    Layout("keys-packed", "2 keys per candidate, the specs packed in 1 argument", 2, 0, True),
    Layout("derived", "no keys per candidate, 1 argument each (keys made in the script)", 0, 1),
    Layout("derived-packed", "no keys per candidate, the specs packed in 1 argument", 0, 0, True),
    Layout(
        "order",
        "no keys per candidate, their order in 1 argument (specs in Redis)",
        0,
        0,
        False,
        True,
    ),
)

_WALK = """-- EXPERIMENT: walk the candidates' order (2 bytes each) against a verdict string
-- (a byte per source: "1" full), the Lua loop a verdict-skipping ACQUIRE cannot avoid.
local order, full = ARGV[1], ARGV[2]
for j = 1, #order / 2 do
  local hi, lo = string.byte(order, 2 * j - 1, 2 * j)
  if string.byte(full, hi * 256 + lo + 1) ~= 49 then
    return j
  end
end
return 0
"""
WALK_LABEL = "the order walked against a verdict string (a script doing only that)"


def _layout_args(layout: Layout, scope: _Scope, head: list[str]) -> list[Any]:
    n = scope.sources
    keys = [scope.sources_key]
    if layout.keys:
        keys += scope.candidate_keys
    specs = [
        f"{spec[0]} {spec[-1]}"
        for spec in (scope.candidate_args[i : i + 10] for i in range(0, 10 * n, 10))
    ]
    if layout.order:
        tail: list[Any] = [b"".join(i.to_bytes(2, "big") for i in range(n))]
    elif layout.packed:
        tail = ["\n".join(specs)]
    elif layout.args == 10:
        tail = scope.candidate_args
    else:
        tail = specs
    return [len(keys), *keys, *head, *tail]


def _cpu_per_call(client: redis.Redis, sha: str, args: list[Any], calls: int) -> float:
    """µs of Redis CPU per EVALSHA of ``args``, pipelined in batches."""
    cpu = _cpu_s(client)
    for start in range(0, calls, BATCH):
        pipe = client.pipeline(transaction=False)
        for _ in range(min(BATCH, calls - start)):
            pipe.evalsha(sha, *args)
        pipe.execute()
    return (_cpu_s(client) - cpu) * 1e6 / calls


def measure_layouts(url: str, *, calls: int, sources: int, rounds: int) -> list[dict[str, Any]]:
    """ACQUIRE's floor per layout at 2 and at ``sources`` candidates: the best round."""
    client = redis.Redis.from_url(url)
    empty, walk = client.script_load(_EMPTY), client.script_load(_WALK)
    head = ["", "0bench", repr(LEASE_TTL_S), str(COST_TOKENS), str(STATE_TTL_S)]
    best: dict[tuple[str, int], float] = {}
    for _ in range(rounds):
        for n in (2, sources):
            scope = _Scope(f"layout-{n}", n)
            for layout in LAYOUTS:
                us = _cpu_per_call(client, empty, _layout_args(layout, scope, head), calls)
                best[(layout.key, n)] = min(us, best.get((layout.key, n), us))
            order = b"".join(i.to_bytes(2, "big") for i in range(n))
            verdicts = b"1" * (n - 1) + b"0"
            us = _cpu_per_call(client, walk, [0, order, verdicts], calls)
            best[("walk", n)] = min(us, best.get(("walk", n), us))
    rows = [(layout.key, layout.label) for layout in LAYOUTS] + [("walk", WALK_LABEL)]
    return [
        {"layout": label, "at_two": best[(key, 2)], "at_n": best[(key, sources)]}
        for key, label in rows
    ]


# -- several calls per script run: what batching would amortize --------------------------------

BATCH_SIZES = (1, 4, 16)
"""Calls per script run in the batch table."""


def looped(source: str, calls: int) -> str:
    """EXPERIMENT: a script whose body runs ``calls`` times in one run, lease ``<id>:<i>`` each.

    The body is the real script, unchanged, so each call reads and writes the state as
    a script run of its own would: one run's floor (EVALSHA, the KEYS and ARGV tables,
    the reply) is shared and nothing else. The last call's reply is returned.
    """
    return (
        "-- EXPERIMENT: the real script's body looped, one lease id per call\n"
        f"local function body(ARGV)\n{source}\nend\n"
        "local reply\n"
        f"for i = 1, {calls} do\n"
        "  local args = {}\n"
        "  for k = 1, #ARGV do args[k] = ARGV[k] end\n"
        "  args[2] = ARGV[2] .. ':' .. i\n"
        "  reply = body(args)\n"
        "end\n"
        "return reply\n"
    )


_CACHED = """-- EXPERIMENT: the real script's body looped over a write-back cache of its commands
local real = redis.call
local ids = {}
for i = 1, @calls do
  ids[i] = ARGV[2] .. ':' .. i
end
local clock                                 -- TIME, read once a run
local hashes, dirty = {}, {}                -- key -> field -> value (false: absent) / moved
local counts, adds, added = {}, {}, {}      -- zset key -> live count / ZADD pairs / members
local swept, live, rems = {}, {}, {}        -- zset key -> swept / the run's live ids / ZREMs
local sets, cards = {}, {}                  -- SET arguments / ZCARD replies, a key
local cache = {}
function cache.call(cmd, key, ...)
  if cmd == 'TIME' then
    clock = clock or real('TIME')
    return clock
  elseif cmd == 'HMGET' then
    local h = hashes[key]
    if h == nil then
      h = {}
      hashes[key] = h
    end
    local fields, missing = {...}, {}
    for _, f in ipairs(fields) do
      if h[f] == nil then
        missing[#missing + 1] = f
      end
    end
    if #missing > 0 then
      local got = real('HMGET', key, unpack(missing))
      for k, f in ipairs(missing) do
        h[f] = got[k]
      end
    end
    local out = {}
    for k, f in ipairs(fields) do
      out[k] = h[f]
    end
    return out
  elseif cmd == 'HSET' then
    local h, d = hashes[key] or {}, dirty[key] or {}
    hashes[key], dirty[key] = h, d
    local a = {...}
    for k = 1, #a, 2 do
      h[a[k]] = a[k + 1]
      d[a[k]] = true
    end
    return 0
  elseif cmd == 'ZCOUNT' then
    if counts[key] == nil then
      counts[key] = real('ZCOUNT', key, ...)
    end
    return counts[key]
  elseif cmd == 'ZADD' then
    local a, p, m = {...}, adds[key] or {}, added[key] or {}
    adds[key], added[key] = p, m
    for k = 1, #a, 2 do
      if not m[a[k + 1]] then
        m[a[k + 1]] = true
        p[#p + 1] = a[k]
        p[#p + 1] = a[k + 1]
      end
    end
    if counts[key] then
      counts[key] = counts[key] + 1
    end
    return 1
  elseif cmd == 'ZREMRANGEBYSCORE' then
    if not swept[key] then
      swept[key] = true
      real('ZREMRANGEBYSCORE', key, ...)
    end
    return 0
  elseif cmd == 'ZREM' then
    local member, l = ..., live[key]
    if l == nil then
      l = {}
      local scores = real('ZMSCORE', key, unpack(ids))
      for k, id in ipairs(ids) do
        l[id] = scores[k] and true or nil
      end
      live[key] = l
    end
    if l[member] then
      l[member] = nil
      local r = rems[key] or {}
      rems[key] = r
      r[#r + 1] = member
      return 1
    end
    return 0
  elseif cmd == 'SET' then
    sets[key] = {...}
    return 'OK'
  elseif cmd == 'ZCARD' then
    if cards[key] == nil then
      cards[key] = real('ZCARD', key)
    end
    return cards[key]
  end
  return real(cmd, key, ...)
end
local function body(ARGV, redis)
@source
end
local reply
for i = 1, @calls do
  local args = {}
  for k = 1, #ARGV do
    args[k] = ARGV[k]
  end
  args[2] = ids[i]
  reply = body(args, cache)
end
-- What moved, written once a run.
for key, d in pairs(dirty) do
  local w = {}
  for f in pairs(d) do
    w[#w + 1] = f
    w[#w + 1] = hashes[key][f]
  end
  real('HSET', key, unpack(w))
end
for key, p in pairs(adds) do
  real('ZADD', key, unpack(p))
end
for key, r in pairs(rems) do
  real('ZREM', key, unpack(r))
end
for key, a in pairs(sets) do
  real('SET', key, unpack(a))
end
return reply
"""


def cached(source: str, calls: int) -> str:
    """EXPERIMENT: the real script's body run ``calls`` times in one run over a write-back
    cache of its commands: ``TIME`` once, a hash's fields read once and what moved written
    once (one ``HSET``), a lease zset counted once and its adds and removals sent as one
    ``ZADD`` and one ``ZREM`` (whether a lease is live: one ``ZMSCORE`` of the run's ids),
    the sweep, ``SET`` and ``ZCARD`` once. Right only on the measured path (grants with
    room, successes, nobody waiting; the zsets' keys already made): the ceiling of a run
    that reads and writes the state once while each call still parses, decides and formats
    as a script run of its own does."""
    return _CACHED.replace("@calls", str(calls)).replace("@source", source)


_RUN_ACQUIRE = """-- EXPERIMENT: @calls grants a run: state read once, each decided, written once
-- @clock
local n = @calls
local sk, lk = KEYS[2], KEYS[3]
local ttl, cost = num(ARGV[3]), num(ARGV[4])
local maxc, rpm, rpm_cap = num(ARGV[7]), num(ARGV[8]), num(ARGV[9])
local tpm, tpm_cap = num(ARGV[10]), num(ARGV[11])
local h = redis.call('HMGET', sk, 'limit', 'breaker', 'not_before', 'rpm_tokens', 'rpm_at',
  'tpm_tokens', 'tpm_at', 'reopen_probe', 'spec', 'expires_at')
local limit, not_before = num(h[1]), num(h[3])
local rpm_tokens, rpm_at, tpm_tokens, tpm_at = num(h[4]), num(h[5]), num(h[6]), num(h[7])
if limit == nil or h[2] ~= 'closed' or h[8] == '1' or h[9] ~= ARGV[15] or rpm_at == nil
    or tpm_at == nil then
  return redis.error_reply('EXPERIMENT: off the measured path')
end
local live = redis.call('ZCOUNT', lk, '(' .. now_s, '+inf')
local cap = math.max(1, math.min(maxc, math.floor(limit)))
local expiry = fmt(now + ttl)
local leases = {}
for i = 1, n do
  local reason
  repeat
    if now < not_before then
      reason = 'p'
      break
    end
    if live >= cap then
      reason = 'c'
      break
    end
    rpm_tokens = math.min(rpm_cap, rpm_tokens + (now - rpm_at) * rpm / 60)
    rpm_at = now
    if not (rpm_tokens >= 1) then
      reason = 'r'
      break
    end
    tpm_tokens = math.min(tpm_cap, tpm_tokens + (now - tpm_at) * tpm / 60)
    tpm_at = now
    if not (tpm_tokens >= math.min(cost, tpm_cap)) then
      reason = 't'
      break
    end
    rpm_tokens = rpm_tokens - 1
    tpm_tokens = tpm_tokens - cost
    live = live + 1
    leases[#leases + 1] = expiry
    leases[#leases + 1] = ARGV[2] .. ':' .. i
  until true
  if reason then
    return redis.error_reply('EXPERIMENT: refused (' .. reason .. ') off the measured path')
  end
end
redis.call('HSET', sk, 'rpm_tokens', fmt(rpm_tokens), 'rpm_at', now_s, 'tpm_tokens',
  fmt(tpm_tokens), 'tpm_at', now_s)
redis.call('ZADD', lk, unpack(leases))
local life = math.max(num(ARGV[5]), 2 * (math.max(math.ceil(ttl), math.ceil(num(ARGV[14]))) + 1))
if num(h[10]) - now < life / 2 then
  return redis.error_reply('EXPERIMENT: a renewal is off the measured path')
end
return {1, 0, ''}
"""
_RUN_RELEASE = """-- EXPERIMENT: @calls successes a run: state read once, each decided, written once
-- @clock
local n = @calls
local sk, lk = KEYS[1], KEYS[2]
redis.call('ZREMRANGEBYSCORE', lk, '(-inf', now_s)
local ids = {}
for i = 1, n do
  ids[i] = ARGV[2] .. ':' .. i
end
local scores = redis.call('ZMSCORE', lk, unpack(ids))
local freed = {}
for i = 1, n do
  if scores[i] then
    freed[#freed + 1] = ids[i]
  end
end
if #freed == 0 then
  return 0
end
redis.call('ZREM', lk, unpack(freed))
local h = redis.call('HMGET', sk, 'max_concurrency', 'tpm', 'tpm_cap', 'cooldown_max_s',
  'breaker', 'failures', 'trips', 'probe_id', 'probe_until', 'limit', 'tpm_tokens',
  'reopen_probe', 'pprobe_id', 'expires_at', 'verdict')
local maxc, tpm_cap, limit, tpm_tokens = num(h[1]), num(h[3]), num(h[10]), num(h[11])
if maxc == nil or h[5] ~= 'closed' or num(h[6]) ~= 0 or (h[15] and h[15] ~= '')
    or ARGV[5] ~= '' or tpm_tokens == nil then
  return redis.error_reply('EXPERIMENT: off the measured path')
end
local used, reserved = num(ARGV[6]), num(ARGV[7])
local read_limit = limit
for _ = 1, #freed do
  limit = math.min(maxc, limit + 1 / limit)
  tpm_tokens = math.min(tpm_cap, tpm_tokens + reserved - used)
end
local writes = {'tpm_tokens', fmt(tpm_tokens)}
if limit ~= read_limit then
  writes[3], writes[4] = 'limit', fmt(limit)
end
redis.call('HSET', sk, unpack(writes))
if num(h[14]) - now < math.ceil(num(h[4])) + 1 then
  return redis.error_reply('EXPERIMENT: a renewal is off the measured path')
end
redis.call('SET', KEYS[3], now_s, 'EX', ARGV[10])
if redis.call('ZCARD', KEYS[5]) > 0 then
  return redis.error_reply('EXPERIMENT: a wake-up is off the measured path')
end
return 1
"""


def state_once(calls: int) -> tuple[str, str]:
    """EXPERIMENT: the two scripts a run of ``calls`` calls would be if it read a source's
    state once, decided each call on it and wrote what moved once: grants with room and
    successes at one closed source with rpm and tpm (the measured path, the same decisions
    and arithmetic as the real scripts there; anything else stops the script with an
    error). One lease id a call, ``<id>:<i>``."""
    texts = (_RUN_ACQUIRE, _RUN_RELEASE)
    return cast(
        tuple[str, str],
        tuple(
            t.replace("@calls", str(calls)).replace("-- @clock\n", scripts._CLOCK, 1) for t in texts
        ),
    )


def shared_calls(calls: int) -> tuple[str, str]:
    """EXPERIMENT: the commands ``calls`` grants and successes at one source would need if
    one run read and wrote the state once for all of them (one ``ZADD`` and one ``ZREM``
    of every lease), with constant arguments and no logic: the floor of such a batch."""
    members = " ".join(f"'1796212860.1234567', ARGV[2] .. ':{i}'," for i in range(calls))
    leases = " ".join(f"ARGV[2] .. ':{i}'," for i in range(calls))
    acquire = _CALLS_ACQUIRE.replace(
        "redis.call('ZADD', KEYS[3], '1796212860.1234567', ARGV[2])",
        f"redis.call('ZADD', KEYS[3], {members.rstrip(',')})",
    )
    release = _CALLS_RELEASE.replace(
        "redis.call('ZREM', KEYS[2], ARGV[2])", f"redis.call('ZREM', KEYS[2], {leases.rstrip(',')})"
    )
    if acquire == _CALLS_ACQUIRE or release == _CALLS_RELEASE:
        raise RuntimeError("the commands-alone scripts changed: update shared_calls")
    return acquire, release


def in_runs(args: list[Any], ids: Sequence[str], per_call: Sequence[int]) -> list[Any]:
    """A lone call's EVALSHA arguments made a run of ``ids``: the ARGV at ``per_call``
    (1-based) hold a word per call, the lease id at the first, the others repeated."""
    at = args[0]  # numkeys, then the keys: ARGV[i] is args[at + i]
    out = list(args)
    for i in per_call:
        value = args[at + i]
        out[at + i] = " ".join(ids) if i == per_call[0] else " ".join([value] * len(ids))
    return out


BATCH_COLUMNS = (
    ("calls", "calls per script run"),
    ("looped", "body looped: pair CPU µs"),
    ("looped_x", "x INCR+DECR"),
    ("cached", "body looped over a write-back cache: pair CPU µs"),
    ("cached_x", "x INCR+DECR"),
    ("once", "state read once, decided per call: pair CPU µs"),
    ("once_x", "x INCR+DECR"),
    ("shared", "commands alone, state read once: pair CPU µs"),
    ("runs", "the scripts, ACQUIRE and RELEASE in runs: pair CPU µs"),
    ("runs_x", "x INCR+DECR"),
)


def _batch_run(
    client: redis.Redis, shas: tuple[str, str], calls: int, pairs: int, tag: str
) -> float:
    """µs of Redis CPU per pair (ACQUIRE, RELEASE, ... pipelined), ``calls`` per script run."""
    scope = _Scope(f"batch-{tag}", 1)
    runs = max(1, pairs // calls)
    per_pipe = max(1, BATCH // calls)
    serial = 0
    cpu = _cpu_s(client)
    for start in range(0, runs, per_pipe):
        pipe = client.pipeline(transaction=False)
        for _ in range(min(per_pipe, runs - start)):
            serial += 1
            pipe.evalsha(shas[0], *scope.acquire(f"{serial:012x}bench"))
            pipe.evalsha(shas[1], *scope.release(f"{serial:012x}bench"))
        pipe.execute()
    return (_cpu_s(client) - cpu) * 1e6 / (runs * calls)


def _script_runs(
    client: redis.Redis, shas: tuple[str, str], calls: int, pairs: int, tag: str
) -> float:
    """µs of Redis CPU per pair, the real scripts' ACQUIREs and RELEASEs ``calls`` a run (the
    run layout of ``backends/redis/runs.py``), pipelined; every reply checked."""
    scope = _Scope(f"batch-{tag}", 1)
    runs = max(1, pairs // calls)
    per_pipe = max(1, BATCH // calls)
    cpu = _cpu_s(client)
    for start in range(0, runs, per_pipe):
        pipe = client.pipeline(transaction=False)
        for serial in range(start, min(start + per_pipe, runs)):
            ids = [f"{serial:08x}{i:04x}bench" for i in range(calls)]
            pipe.evalsha(shas[0], *in_runs(scope.acquire(ids[0]), ids, (2, 3, 4)))
            pipe.evalsha(shas[1], *in_runs(scope.release(ids[0]), ids, (2, 3, 4, 5, 6, 7)))
        replies = pipe.execute()
        for k in range(0, len(replies), 2):
            _check(replies[k] if calls > 1 else [replies[k]], 1, tag)
            _check(replies[k + 1] if calls > 1 else [replies[k + 1]], None, tag)
    return (_cpu_s(client) - cpu) * 1e6 / (runs * calls)


def measure_batches(url: str, *, pairs: int, rounds: int) -> list[dict[str, Any]]:
    """Per pair, best round, at each of ``BATCH_SIZES``: the real scripts looped, and the
    commands a batch reading the state once would run. The looped replies are checked (a
    grant, then 1); every lease is gone after each run."""
    client = redis.Redis.from_url(url)
    real = (client.script_load(scripts.ACQUIRE), client.script_load(scripts.RELEASE))
    shas = {}
    for n in BATCH_SIZES:
        shas[("looped", n)] = tuple(
            client.script_load(looped(s, n)) for s in (scripts.ACQUIRE, scripts.RELEASE)
        )
        shas[("cached", n)] = tuple(
            client.script_load(cached(s, n)) for s in (scripts.ACQUIRE, scripts.RELEASE)
        )
        shas[("once", n)] = tuple(client.script_load(s) for s in state_once(n))
        shas[("shared", n)] = tuple(client.script_load(s) for s in shared_calls(n))
    best: dict[tuple[str, int], float] = {}
    for round_ in range(rounds):
        for n in BATCH_SIZES:
            for kind in ("looped", "cached", "once", "shared", "runs"):
                tag = f"{kind}-{n}-{round_}"
                scope = _Scope(f"batch-{tag}", 1)
                # First sight by the real scripts, then the variant once (compiled, checked).
                _check([client.evalsha(real[0], *scope.acquire("warm"))], 1, tag)
                _check([client.evalsha(real[1], *scope.release("warm"))], None, tag)
                if kind == "runs":
                    us = _script_runs(client, real, n, pairs, tag)
                    best[(kind, n)] = min(us, best.get((kind, n), us))
                    continue
                acquire, release = shas[(kind, n)]
                if kind != "shared":
                    _check([client.evalsha(acquire, *scope.acquire("check"))], 1, tag)
                    _check([client.evalsha(release, *scope.release("check"))], None, tag)
                us = _batch_run(client, (acquire, release), n, pairs, tag)
                best[(kind, n)] = min(us, best.get((kind, n), us))
                leases = client.zrangebyscore(codec.key(scope.name, "leases", "s000"), 0, "+inf")
                if kind != "shared" and leases:
                    raise RuntimeError(f"{tag}: leases left behind: {leases[:3]!r}")
        client.flushall()
    return [
        {
            "calls": n,
            "looped": best[("looped", n)],
            "cached": best[("cached", n)],
            "once": best[("once", n)],
            "shared": best[("shared", n)],
            "runs": best[("runs", n)],
        }
        for n in BATCH_SIZES
    ]


# -- reporting ---------------------------------------------------------------------------------

_BASELINE_PAIRS = 1000
"""The fewest INCR/DECR pairs the baseline is measured over, whatever ``--pairs`` says."""

ROW_COLUMNS = (
    ("case", "case"),
    ("variant", "variant"),
    ("commands_per_pair", "commands per pair"),
    ("acquire_us", "ACQUIRE µs"),
    ("release_us", "RELEASE µs"),
    ("pair_us", "pair µs (commandstats)"),
    ("pair_cpu_us", "pair CPU µs (INFO cpu)"),
    ("x_baseline", "x INCR+DECR"),
)
COMMAND_COLUMNS = (
    ("command", "command"),
    ("in_acquire", "per ACQUIRE"),
    ("in_release", "per RELEASE"),
    ("us_per_call", "µs per call"),
    ("us_per_pair", "µs per pair"),
)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def _table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(h for _, h in columns) + " |"]
    lines.append("|" + "---|" * len(columns))
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[k]) for k, _ in columns) + " |")
    return "\n".join(lines)


def _targets(
    rows: Sequence[dict[str, Any]], sources: int, batches: Sequence[dict[str, Any]] = ()
) -> str:
    """The issue's targets: a lone pair, a pair's share of runs (``backends/redis/runs.py``,
    the way a process with several calls in flight sends them), the walk's ratio."""
    by = {(r["case"], r["variant"]): r for r in rows}
    one = by[(case_label(ONE, sources), "current scripts")]["pair_cpu_us"]
    two = by[(case_label(TWO, sources), "current scripts")]["pair_cpu_us"]
    walk = by[(case_label(WALK, sources), "current scripts")]["pair_cpu_us"]
    ratio = walk / two
    return "\n".join(
        [
            "| target (issue 18) | measured | verdict |",
            "|---|---|---|",
            f"| ACQUIRE + RELEASE ≤ 25 µs of Redis CPU, 1 source | {one:,.1f} µs"
            f" | {'met' if one <= 25 else '**missed**'} |",
            *(
                f"| the same, {row['calls']} calls a run (ACQUIRE and RELEASE runs)"
                f" | {row['runs']:,.1f} µs | {'met' if row['runs'] <= 25 else '**missed**'} |"
                for row in batches
                if row["calls"] > 1
            ),
            f"| {sources} sources ≤ 2x 2 sources | {ratio:,.2f}x ({walk:,.1f} / {two:,.1f} µs)"
            f" | {'met' if ratio <= 2 else '**missed**'} |",
        ]
    )


def _layouts(layouts: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]], n: int) -> str:
    """ACQUIRE's floor per layout, against twice the current scripts' 2-source pair."""
    by = {(r["case"], r["variant"]): r for r in rows}
    two = by[(case_label(TWO, n), "current scripts")]["pair_cpu_us"]
    lines = [
        f"| call layout (empty script) | ACQUIRE floor µs, 2 candidates | ACQUIRE floor µs,"
        f" {n} candidates | {n}-candidate floor / 2-source pair |",
        "|---|---|---|---|",
    ]
    for row in layouts:
        lines.append(
            f"| {row['layout']} | {_cell(row['at_two'])} | {_cell(row['at_n'])}"
            f" | {row['at_n'] / two:.2f} |"
        )
    return "\n".join(lines)


def _batches(batches: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> str:
    """The batch table, the looped scripts against the INCR + DECR pair of the main table."""
    base = rows[0]["pair_cpu_us"]
    rows_x = [
        {**row, **{f"{k}_x": row[k] / base for k in ("looped", "cached", "once", "runs")}}
        for row in batches
    ]
    return _table(rows_x, BATCH_COLUMNS)


def _revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def render(result: dict[str, Any], args: argparse.Namespace) -> str:
    machine = describe_machine()
    head = [
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; commit {_revision()};"
        f" redis-server {machine['redis_server']}; {machine['cpus_usable']} CPUs"
        f" ({machine['cpu_model']}); Python {machine['python']}; run took"
        f" {result['seconds']:.0f} s.",
        f"Sizes: {args.pairs} pairs per round (1 and 2 sources), {args.walk_pairs} at"
        f" {args.sources} sources, {args.rounds} round(s), the best round shown.",
        "",
        _table(result["rows"], ROW_COLUMNS),
        "",
        _table(result["commands"], COMMAND_COLUMNS),
        "",
        _targets(result["rows"], args.sources, result.get("batches", ())),
        "",
        _layouts(result["layouts"], result["rows"], args.sources),
        "",
        _batches(result["batches"], result["rows"]),
    ]
    return "\n".join(head)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.script_cost", description=__doc__.split("\n")[0]
    )
    p.add_argument("--pairs", type=int, default=500, help="pairs per round, 1 and 2 sources")
    p.add_argument("--walk-pairs", type=int, default=50, help="pairs per round, many sources")
    p.add_argument("--sources", type=int, default=200, help="sources of the walk case")
    p.add_argument("--rounds", type=int, default=8)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.sources < 3 or min(args.pairs, args.walk_pairs, args.rounds) < 1:
        raise SystemExit("bench.script_cost: --sources ≥ 3, and every size ≥ 1")
    with private_redis() as url:
        result = measure(
            url,
            pairs=args.pairs,
            walk_pairs=args.walk_pairs,
            sources=args.sources,
            rounds=args.rounds,
        )
        result["layouts"] = measure_layouts(
            url, calls=args.pairs, sources=args.sources, rounds=args.rounds
        )
        result["batches"] = measure_batches(url, pairs=args.pairs, rounds=args.rounds)
    print(render(result, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
