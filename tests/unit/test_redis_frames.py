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
import re
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from redis.asyncio.connection import Connection

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend, scripts, wire
from polygateway.errors import ConfigError
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


def spec_set(names: Sequence[str]) -> tuple[str, str]:
    """A spec set as ACQUIRE stores it (name order, "<len>:<name><len>:<spec>") and its digest."""
    text = "".join(
        f"{len(n.encode())}:{n}{len(CANDIDATE_ARGV[n][9].encode())}:{CANDIDATE_ARGV[n][9]}"
        for n in sorted(names)
    )
    return text, hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def lease_id_in(frame: bytes) -> str:
    """The lease id an ACQUIRE frame carries (12 + 32 hex digits)."""
    found = re.search(rb"\$44\r\n([0-9a-f]{44})\r\n", frame)
    assert found is not None
    return found.group(1).decode()


def acquire_frame(
    scope: str, specs: Sequence[SourceSpec], lease_id: str, head: Sequence[str], *, stored: bool
) -> bytes:
    """ACQUIRE as its header lays it out: 5 KEYS, the first candidate's 10 ARGV, the set's 3."""
    first = specs[0].name
    keys = [f"pgw:{{{scope}}}:sources", *source_keys(scope, first), f"pgw:{{{scope}}}:verdicts"]
    argv = [repr(NOW), lease_id, *head, "86400", *CANDIDATE_ARGV[first]]
    argv_set: list[Any]
    if len(specs) == 1:
        keys.append(f"pgw:{{{scope}}}:specs:")
        argv_set = ["", "", ""]
    else:
        text, digest = spec_set([s.name for s in specs])
        order = sorted(s.name for s in specs)
        keys.append(f"pgw:{{{scope}}}:specs:{digest}")
        indices = b"".join(order.index(s.name).to_bytes(2, "big") for s in specs)
        argv_set = [digest, indices, "" if stored else text]
    return encoded("EVALSHA", sha(scripts.ACQUIRE), len(keys), *keys, *argv, *argv_set)


@pytest.mark.parametrize("count", [1, 3])
async def test_acquire_writes_what_redis_py_encodes(count: int) -> None:
    """ACQUIRE with 1 and 3 candidates: 5 KEYS and 18 ARGV whatever the candidates, the spec
    set sent with the first call of its digest only, bytes as redis-py's."""
    specs = CANDIDATES[count - 1 :: -1]  # "c", "b", "a": the order is the call's, not the set's
    fake = FakeWire([1, 0, b""], [0, 0, b"c" * count])
    backend = backend_on(fake)
    result = await backend.acquire(SCOPE, specs, cost_tokens=10, ttl_s=30)
    refused = await backend.acquire(SCOPE, specs, cost_tokens=10, ttl_s=30)
    assert result.lease is not None
    assert [r.source for r in refused.rejections] == [s.name for s in specs]
    assert {r.reason for r in refused.rejections} == {"concurrency"}
    second = lease_id_in(fake.written[1])
    assert fake.written == [
        acquire_frame(SCOPE, specs, result.lease.lease_id, ["30.0", "10"], stored=False),
        acquire_frame(SCOPE, specs, second, ["30.0", "10"], stored=True),
    ]


async def test_a_script_without_the_set_gets_it_sent_again() -> None:
    """{-1}: no set under the digest (expired, a new primary): the call is sent again, with
    it; the reply's codes and reopen times become the candidates' rejections in order."""
    specs = CANDIDATES[:2]
    fake = FakeWire([1, 0, b""], [-1], [0, 0, b"rc", b"0.5"])
    backend = backend_on(fake)
    await backend.acquire(SCOPE, specs, ttl_s=30)
    result = await backend.acquire(SCOPE, specs, ttl_s=30)
    assert result.lease is None
    assert [(r.source, r.reason, r.reopen_in_s) for r in result.rejections] == [
        ("a", "rpm", 0.5),
        ("b", "concurrency", None),
    ]
    lease_id = lease_id_in(fake.written[1])
    assert fake.written[1:] == [
        acquire_frame(SCOPE, specs, lease_id, ["30.0", "0"], stored=True),
        acquire_frame(SCOPE, specs, lease_id, ["30.0", "0"], stored=False),
    ]


async def test_arguments_beyond_ascii_are_counted_in_bytes() -> None:
    """A scope and a source named in Cyrillic: every length counts UTF-8 bytes, as redis-py does."""
    scope, spec = "чат", SourceSpec(name="источник", max_concurrency=1)
    fake = FakeWire([1, 0, b""])
    result = await backend_on(fake).acquire(scope, [spec], ttl_s=30)
    assert result.lease is not None
    keys = [f"pgw:{{{scope}}}:sources", *source_keys(scope, spec.name)]
    keys += [f"pgw:{{{scope}}}:verdicts", f"pgw:{{{scope}}}:specs:"]
    argv = [repr(NOW), result.lease.lease_id, "30.0", "0", "86400", spec.name, "1"]
    argv += ["", "", "", "", "5", "30.0", "300.0", "1     5 30.0 300.0", "", "", ""]
    assert fake.written == [encoded("EVALSHA", sha(scripts.ACQUIRE), 5, *keys, *argv)]


async def test_release_writes_what_redis_py_encodes() -> None:
    """RELEASE: 6 KEYS (the source's two, progress, verdicts, the waiting registry), 15 ARGV."""
    lease = Lease(scope=SCOPE, source="a", lease_id="L1", ttl_s=30.0, tokens=5, probe=False)
    outcome = AttemptOutcome("transient", aimd_decrease=True, tokens_used=42)
    fake = FakeWire(1)
    backend = backend_on(fake)
    await backend.release(lease, outcome)
    keys = [*source_keys(SCOPE, "a"), "pgw:{chat}:progress", "pgw:{chat}:verdicts"]
    keys += ["pgw:{chat}:waiting", "pgw:{chat}:waiting_until"]
    argv = [repr(NOW), "L1", "transient", "1", "", "42", "5"]
    argv += [repr(AIMD_COOLOFF_S), repr(AIMD_FACTOR), "3600", "86400"]
    # This process, the wake-up's message, prune the gone, how long a handed-off permit is held.
    argv += [backend._proc, SCOPE, "1", "1.0"]
    assert fake.written == [encoded("EVALSHA", sha(scripts.RELEASE), 6, *keys, *argv)]


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


async def test_a_scope_beyond_what_two_bytes_index_is_refused_by_name() -> None:
    """65,537 sources cannot be indexed in two bytes: a ConfigError saying so, nothing sent."""
    fake = FakeWire()
    specs = [SourceSpec(name=f"s{i}", max_concurrency=1) for i in range(65_537)]
    with pytest.raises(ConfigError, match="at most 65536 sources, not 65537"):
        await backend_on(fake).acquire(SCOPE, specs, ttl_s=30)
    assert fake.written == []
