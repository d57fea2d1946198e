"""The state-once experiment of ``bench.script_cost`` decides as the real scripts do.

``state_once(n)`` prices a run of ``n`` calls that reads a source's state once,
decides each call on it and writes what moved once (research-wiki/designs/
script-cost.md, "Several calls per script run"). Its figure means something only if
it does the real work: here ``n`` grants and then ``n`` successes at one source, at
fixed clocks, leave the state hash, the lease zset and the progress key exactly as
``n`` calls of the real ACQUIRE and RELEASE one after another do.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is not installed
from bench.script_cost import _Scope, state_once

from polygateway.backends.redis import codec, scripts

CALLS = 4
T0, T1, T2 = 1796212800.25, 1796212801.5, 1796212802.75


def _at(args: list[Any], now: float) -> list[Any]:
    """A call's EVALSHA arguments with ``now`` in place of the server clock."""
    at = 1 + args[0]  # numkeys, the keys, then ARGV[1]
    assert args[at] == ""
    return [*args[:at], repr(now), *args[at + 1 :]]


def _state(client: redis.Redis, scope: str) -> dict[str, Any]:
    return {
        "source": client.hgetall(codec.key(scope, "src", "s000")),
        "leases": client.zrange(codec.key(scope, "leases", "s000"), 0, -1, withscores=True),
        "progress": client.get(codec.key(scope, "progress")),
    }


@pytest.mark.parametrize("calls", [1, CALLS])
def test_a_state_once_run_leaves_what_the_calls_one_by_one_leave(
    redis_url: str, calls: int
) -> None:
    client = redis.Redis.from_url(redis_url)
    acquire, release = (client.script_load(s) for s in (scripts.ACQUIRE, scripts.RELEASE))
    run_acquire, run_release = (client.script_load(s) for s in state_once(calls))
    one_by_one, in_runs = _Scope(f"one-by-one-{calls}", 1), _Scope(f"in-runs-{calls}", 1)
    for scope in (one_by_one, in_runs):  # first sight by the real scripts
        assert client.evalsha(acquire, *_at(scope.acquire("warm"), T0))[0] == 1
        assert client.evalsha(release, *_at(scope.release("warm"), T0)) == 1

    for i in range(1, calls + 1):
        reply = client.evalsha(acquire, *_at(one_by_one.acquire(f"x:{i}"), T1))
        assert reply[0] == 1
    assert client.evalsha(run_acquire, *_at(in_runs.acquire("x"), T1))[0] == 1
    granted = _state(client, one_by_one.name)
    assert len(granted["leases"]) == 1 + calls  # the skiplist member, then the leases
    assert _state(client, in_runs.name) == granted

    for i in range(1, calls + 1):
        assert client.evalsha(release, *_at(one_by_one.release(f"x:{i}"), T2)) == 1
    assert client.evalsha(run_release, *_at(in_runs.release("x"), T2)) == 1
    released = _state(client, one_by_one.name)
    assert released != granted
    assert _state(client, in_runs.name) == released
