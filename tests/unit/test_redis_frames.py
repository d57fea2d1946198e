"""The bytes the Redis backend writes are the bytes redis-py's own encoder writes.

The backend packs its commands itself (``backends/redis/wire.py``), and every
count in a frame (the command's arguments, EVALSHA's ``numkeys``) comes from
the lists it sends: one wrong count would corrupt the one pipelined
connection every operation shares. Each command is built here without a
server, written to a fake wire, and compared with what
``redis.asyncio.connection.Connection.pack_command`` (redis-py's Python
encoder) makes of the arguments each script's header names
(``backends/redis/scripts.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from redis.asyncio.connection import Connection

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend, scripts, wire
from polygateway.governance.aimd import AIMD_COOLOFF_S, AIMD_FACTOR

NOW = 12.5
SCOPE = "chat"
CANDIDATES = (
    SourceSpec(name="a", max_concurrency=4, rpm=120.0),
    SourceSpec(
        name="b",
        max_concurrency=2,
        tpm=6000.0,
        tpm_burst=500.0,
        breaker_failures=3,
        cooldown_s=1.5,
        cooldown_max_s=60.0,
    ),
    SourceSpec(name="c", max_concurrency=1),
)
CANDIDATE_ARGV = {
    "a": ["a", "4", "120.0", "2.0", "", "", "5", "30.0", "300.0", "4 120.0 2.0   5 30.0 300.0"],
    "b": ["b", "2", "", "", "6000.0", "500.0", "3", "1.5", "60.0", "2   6000.0 500.0 3 1.5 60.0"],
    "c": ["c", "1", "", "", "", "", "5", "30.0", "300.0", "1     5 30.0 300.0"],
}


def encoded(*args: object) -> bytes:
    """What redis-py writes for a command of these arguments."""
    return b"".join(Connection().pack_command(*args))


def sha(text: str) -> str:
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()


def source_keys(scope: str, name: str) -> list[str]:
    """A source's state and leases keys, as the scripts' headers name them."""
    return [f"pgw:{{{scope}}}:{kind}:{name}" for kind in ("src", "leases")]


class FakeWire:
    """Keeps what the backend writes; answers each command with the next canned reply."""

    writable = True
    pending = 0

    def __init__(self, *replies: Any) -> None:
        self.written: list[bytes] = []
        self._replies = list(replies)

    def send(self, data: bytes, on_reply: Callable[[Any], None], script: Any = None) -> None:
        self.written.append(data)
        on_reply(self._replies.pop(0))

    def route(self, scope: str) -> FakeWire:
        """One server (the backend's ``Topology``)."""
        return self

    async def drain(self) -> None:
        """Nothing is ever due."""

    async def aclose(self) -> None:
        """Nothing to close."""


def backend_on(fake: FakeWire) -> RedisBackend:
    """A backend (never connected) whose commands go to ``fake``, on a fixed clock."""
    backend = RedisBackend("redis://127.0.0.1:1/0", now=lambda: NOW)
    backend._wire = fake  # type: ignore[assignment]  # the test's stand-in for the wire
    return backend


@pytest.mark.parametrize("count", [1, 3])
async def test_acquire_writes_what_redis_py_encodes(count: int) -> None:
    """ACQUIRE with 1 and 3 candidates: numkeys 1 + 2n, 5 + 10n ARGV, bytes as redis-py's."""
    specs = CANDIDATES[:count]
    fake = FakeWire([1, 0])
    result = await backend_on(fake).acquire(SCOPE, specs, cost_tokens=10, ttl_s=30)
    assert result.lease is not None
    keys = ["pgw:{chat}:sources"]
    argv = [repr(NOW), result.lease.lease_id, "30.0", "10", "86400"]
    for spec in specs:
        keys += source_keys(SCOPE, spec.name)
        argv += CANDIDATE_ARGV[spec.name]
    assert fake.written == [encoded("EVALSHA", sha(scripts.ACQUIRE), len(keys), *keys, *argv)]


async def test_arguments_beyond_ascii_are_counted_in_bytes() -> None:
    """A scope and a source named in Cyrillic: every length counts UTF-8 bytes, as redis-py does."""
    scope, spec = "чат", SourceSpec(name="источник", max_concurrency=1)
    fake = FakeWire([1, 0])
    result = await backend_on(fake).acquire(scope, [spec], ttl_s=30)
    assert result.lease is not None
    keys = [f"pgw:{{{scope}}}:sources", *source_keys(scope, spec.name)]
    argv = [repr(NOW), result.lease.lease_id, "30.0", "0", "86400", spec.name, "1"]
    argv += ["", "", "", "", "5", "30.0", "300.0", "1     5 30.0 300.0"]
    assert fake.written == [encoded("EVALSHA", sha(scripts.ACQUIRE), 3, *keys, *argv)]


async def test_release_writes_what_redis_py_encodes() -> None:
    """RELEASE: 5 KEYS (the source's two, the progress mark, the waiting registry), 15 ARGV."""
    lease = Lease(scope=SCOPE, source="a", lease_id="L1", ttl_s=30.0, tokens=5, probe=False)
    outcome = AttemptOutcome("transient", aimd_decrease=True, tokens_used=42)
    fake = FakeWire(1)
    backend = backend_on(fake)
    await backend.release(lease, outcome)
    keys = [*source_keys(SCOPE, "a"), "pgw:{chat}:progress"]
    keys += ["pgw:{chat}:waiting", "pgw:{chat}:waiting_until"]
    argv = [repr(NOW), "L1", "transient", "1", "", "42", "5"]
    argv += [repr(AIMD_COOLOFF_S), repr(AIMD_FACTOR), "3600", "86400"]
    # This process, the wake-up's message, prune the gone, how long a handed-off permit is held.
    argv += [backend._proc, SCOPE, "1", "1.0"]
    assert fake.written == [encoded("EVALSHA", sha(scripts.RELEASE), 5, *keys, *argv)]


async def test_renew_and_progress_write_what_redis_py_encodes() -> None:
    """RENEW: 2 KEYS, now, the lease id, its TTL, the state TTL; PROGRESS: the mark and now."""
    lease = Lease(scope=SCOPE, source="a", lease_id="L1", ttl_s=30.0, tokens=0, probe=False)
    fake = FakeWire(1, b"")
    backend = backend_on(fake)
    assert await backend.renew(lease) is True
    await backend.progress_age_s(SCOPE)
    assert fake.written == [
        encoded(
            "EVALSHA",
            sha(scripts.RENEW),
            2,
            *source_keys(SCOPE, "a"),
            repr(NOW),
            "L1",
            "30.0",
            "86400",
        ),
        encoded("EVALSHA", sha(scripts.PROGRESS), 1, "pgw:{chat}:progress", repr(NOW)),
    ]


async def test_snapshot_writes_what_redis_py_encodes() -> None:
    """SNAPSHOT: ZRANGE of the sources, then 1 + 2n KEYS and now."""
    fake = FakeWire([b"a", b"b"], [b""] + [0] + [b""] * 9 + [0] + [b""] * 9)
    snapshot = await backend_on(fake).snapshot(SCOPE)
    assert snapshot.sources == ()
    keys = ["pgw:{chat}:progress"]
    for name in ("a", "b"):
        keys += source_keys(SCOPE, name)
    assert fake.written == [
        encoded("ZRANGE", "pgw:{chat}:sources", 0, -1),
        encoded("EVALSHA", sha(scripts.SNAPSHOT), 5, *keys, repr(NOW)),
    ]


@pytest.mark.parametrize("name", ["ACQUIRE", "RELEASE", "RENEW", "PROGRESS", "SNAPSHOT"])
def test_script_load_writes_what_redis_py_encodes(name: str) -> None:
    """SCRIPT LOAD of each script (several KB, multi-line) as redis-py sends it."""
    text = getattr(scripts, name)
    assert wire.Script(text, sha(text)).load == encoded("SCRIPT", "LOAD", text)


@pytest.mark.parametrize(
    ("credentials", "db", "client_name", "expected"),
    [
        (None, 0, None, [("HELLO", 2)]),
        (("default", "pw"), 0, None, [("HELLO", 2, "AUTH", "default", "pw")]),
        (("u", "p@ss w"), 3, None, [("HELLO", 2, "AUTH", "u", "p@ss w"), ("SELECT", 3)]),
        (None, 15, "worker-1", [("HELLO", 2, "SETNAME", "worker-1"), ("SELECT", 15)]),
    ],
)
def test_the_handshake_writes_what_redis_py_encodes(
    credentials: tuple[str, str] | None,
    db: int,
    client_name: str | None,
    expected: Sequence[tuple[object, ...]],
) -> None:
    """HELLO 2 (with AUTH, SETNAME) and SELECT: a new connection's first commands."""
    assert wire.handshake(credentials, db, client_name) == [encoded(*c) for c in expected]


def test_a_frame_counts_what_it_carries_whatever_the_pieces() -> None:
    """Script.command takes KEYS and ARGV lists and counts them; no count is passed in."""
    script = wire.Script("return 1", sha("return 1"))
    keys = wire.bulks(["k1", "k2"])
    argv = (wire.bulk(""), *wire.bulks(["x" * 7000, "ü"]))
    assert script.command(keys, argv) == encoded(
        "EVALSHA", sha("return 1"), 2, "k1", "k2", "", "x" * 7000, "ü"
    )
    assert script.command((), ()) == encoded("EVALSHA", sha("return 1"), 0)
