"""A Redis Cluster's redirections and slot-map reads, each node's connection a fake.

Every node's ``Wire`` carries a ``Link`` over a transport that records what
is written and is fed the replies a node would send, so what the cluster
sends where, and in which order, is read back without a server.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from polygateway.backends.redis import cluster as cluster_module
from polygateway.backends.redis.cluster import SLOTS, Cluster
from polygateway.backends.redis.endpoint import Endpoint
from polygateway.backends.redis.wire import Link, Script, Wire, command

SEED = ("127.0.0.1", 7000)
OTHER = ("127.0.0.1", 7001)
ASKING = command("ASKING")
SCRIPT = Script("return 1", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db")
MAKES_KEYS = Script("return 2", "7f923f79fe76194c868d7e1d0820de36700eb649", makes_keys=True)
COMMAND = SCRIPT.command([], [])


class _Transport(asyncio.Transport):
    """Records every write; closing reports the connection lost, as the event loop does."""

    def __init__(self, link: Link) -> None:
        super().__init__()
        self.written: list[bytes] = []
        self._link = link
        self._closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if not self._closing:
            self._closing = True
            self._link.connection_lost(None)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def _node(cluster: Cluster, address: tuple[str, int]) -> tuple[Link, _Transport]:
    """The node's wire, connected over a fake transport."""
    wire = cluster._wire(address)
    link = Link(5.0, wire._redirect)  # no on_down: a lost fake must not make a real connection
    transport = _Transport(link)
    link.connection_made(transport)
    wire._link = link
    return link, transport


def _cluster() -> Cluster:
    return Cluster(Endpoint(host=SEED[0], port=SEED[1]), late_reply_s=5.0, timeout_s=1.0)


async def test_a_noscript_after_ask_loads_the_script_and_asks_again_on_the_ask_target() -> None:
    """NOSCRIPT from the importing node: SCRIPT LOAD, ASKING, the command, all on that node.

    Without ``ASKING`` the importing node answers ``MOVED`` to the migrating
    node, which answers ``ASK`` again: the command bounces, costing hops.
    """
    cluster = _cluster()
    seed, _ = _node(cluster, SEED)
    other, to_other = _node(cluster, OTHER)
    replies: list[Any] = []
    cluster._wire(SEED).send(COMMAND, replies.append, SCRIPT)
    seed.data_received(b"-ASK 5 127.0.0.1:7001\r\n")
    assert to_other.written == [ASKING, COMMAND]
    other.data_received(b"+OK\r\n-NOSCRIPT No matching script.\r\n")
    assert to_other.written[2:] == [SCRIPT.load, ASKING, COMMAND]  # before: no ASKING
    other.data_received(b"$40\r\n" + b"0" * 40 + b"\r\n+OK\r\n:1\r\n")
    assert replies == [1]
    await cluster.aclose()


async def test_a_script_that_makes_keys_still_does_not_follow_ask_after_a_noscript(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ACQUIRE answered NOSCRIPT, then ASK once loaded: it is sent again to the slot's owner,
    as after TRYAGAIN, never to the importing node, where keys not migrated yet would read
    as absent."""
    monkeypatch.setattr(cluster_module, "_TRYAGAIN_FIRST_S", 0.0)  # sent again at once
    cluster = _cluster()
    seed, to_seed = _node(cluster, SEED)
    _, to_other = _node(cluster, OTHER)
    acquire = MAKES_KEYS.command([], [])
    cluster._wire(SEED).send(acquire, lambda reply: None, MAKES_KEYS)
    seed.data_received(b"-NOSCRIPT No matching script.\r\n")
    assert to_seed.written == [acquire, MAKES_KEYS.load, acquire]
    seed.data_received(b"$40\r\n" + b"0" * 40 + b"\r\n-ASK 5 127.0.0.1:7001\r\n")
    assert to_other.written == []  # before: ASKING and the acquire, on the importing node
    for _ in range(3):
        await asyncio.sleep(0)
    assert to_seed.written[3:] == [acquire]
    await cluster.aclose()


async def test_a_second_noscript_for_one_command_on_one_node_is_its_answer() -> None:
    """A script that cannot be loaded is not loaded for ever: the second NOSCRIPT fails it."""
    cluster = _cluster()
    seed, to_seed = _node(cluster, SEED)
    replies: list[Any] = []
    cluster._wire(SEED).send(COMMAND, replies.append, SCRIPT)
    seed.data_received(b"-NOSCRIPT No matching script.\r\n")
    seed.data_received(b"-ERR denied\r\n-NOSCRIPT No matching script.\r\n")
    assert to_seed.written == [COMMAND, SCRIPT.load, COMMAND]
    assert [str(reply) for reply in replies] == ["NOSCRIPT No matching script."]
    await cluster.aclose()


def _shards(port: int) -> bytes:
    """``CLUSTER SHARDS`` (RESP2): one shard owning every slot, its primary at ``port``."""
    node = (
        b"*8\r\n$2\r\nip\r\n$9\r\n127.0.0.1\r\n$4\r\nport\r\n:%d\r\n"
        b"$4\r\nrole\r\n$6\r\nmaster\r\n$6\r\nhealth\r\n$6\r\nonline\r\n" % port
    )
    slots = b"*2\r\n:0\r\n:%d\r\n" % (SLOTS - 1)
    return b"*1\r\n*4\r\n$5\r\nslots\r\n" + slots + b"$5\r\nnodes\r\n*1\r\n" + node


def _owners(cluster: Cluster) -> set[tuple[str, int]]:
    return {(w.endpoint.host, w.endpoint.port) for w in cluster._owners if w is not None}


async def _read_map(cluster: Cluster, answers: dict[Link, list[bytes]]) -> None:
    """Read the map, each node answering its questions in turn with ``answers``'s bytes
    (``b""``: the connection is lost instead)."""
    reading = asyncio.ensure_future(cluster._read_any())
    while not reading.done():
        await asyncio.sleep(0)
        for link, replies in answers.items():
            if link.pending and replies:
                reply = replies.pop(0)
                if reply:
                    link.data_received(reply)
                else:
                    link.close()
    await reading


async def _owned_by_other(cluster: Cluster) -> tuple[Link, Link]:
    """Every slot owned by OTHER (its map read from the seed): OTHER is asked first next time."""
    seed, _ = _node(cluster, SEED)
    other, _ = _node(cluster, OTHER)
    await _read_map(cluster, {seed: [_shards(OTHER[1])]})
    assert _owners(cluster) == {OTHER}
    return seed, other


async def test_a_map_naming_a_port_out_of_range_is_refused_and_the_next_node_read() -> None:
    """A primary at port 70000 is a malformed reply: the next node's map is used instead.

    Applied, it made every command of those slots fail with ``OverflowError``
    (``connect(): port must be 0-65535``), which no boundary translates.
    """
    cluster = _cluster()
    seed, other = await _owned_by_other(cluster)
    await _read_map(cluster, {other: [_shards(70000)], seed: [_shards(SEED[1])]})
    assert _owners(cluster) == {SEED}  # before: 127.0.0.1:70000
    await cluster.aclose()


async def test_a_node_lost_or_answering_nonsense_while_the_map_is_read_passes_to_the_next() -> None:
    """A connection lost, an error, or replies of the wrong shape: the seed is read next."""
    nonsense = [b"", b"-ERR no\r\n", b":5\r\n", b"+OK\r\n", b"*1\r\n:1\r\n", b"*1\r\n*1\r\n:1\r\n"]
    for reply in nonsense:
        cluster = _cluster()
        seed, other = await _owned_by_other(cluster)
        # CLUSTER SHARDS refused: CLUSTER SLOTS is asked next, and refused too.
        mine = [reply, reply] if reply.startswith(b"-") else [reply]
        await _read_map(cluster, {other: mine, seed: [_shards(SEED[1])]})
        assert _owners(cluster) == {SEED}, reply
        await cluster.aclose()


async def test_a_node_at_a_port_out_of_range_fails_its_commands_as_a_connection_error() -> None:
    """A ``MOVED`` or a map naming port 70000: redis-py's ``ConnectionError``, which the
    backend translates, not the ``OverflowError`` the socket raises."""
    wire = Wire(Endpoint(host="127.0.0.1", port=70000, connect_timeout_s=1.0), late_reply_s=1.0)
    replied: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    wire.send(command("PING"), replied.set_result)
    got = await replied
    await wire.aclose()
    assert isinstance(got, RedisConnectionError), repr(got)  # before: OverflowError
    assert "127.0.0.1:70000" in str(got)


async def test_a_command_paused_by_tryagain_fails_at_aclose_instead_of_reconnecting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A TRYAGAIN pause that ends after ``aclose`` would reopen the node's connection.

    The command is failed as every command pending at ``aclose`` is: with
    ``ConnectionError``, once, and nothing is written after the close.
    """
    monkeypatch.setattr(cluster_module, "_TRYAGAIN_FIRST_S", 0.0)  # due at the next turn
    cluster = _cluster()
    seed, to_seed = _node(cluster, SEED)
    replies: list[Any] = []
    cluster._wire(SEED).send(COMMAND, replies.append, SCRIPT)
    seed.data_received(b"-TRYAGAIN Multiple keys request during rehashing of slot\r\n")
    assert replies == []
    await cluster.aclose()
    assert len(replies) == 1
    assert isinstance(replies[0], RedisConnectionError)
    written = list(to_seed.written)
    for _ in range(3):
        await asyncio.sleep(0)
    assert to_seed.written == written
    assert cluster._wires[SEED]._connecting is None  # no connection made again
    assert len(replies) == 1


async def test_drain_waits_for_a_command_paused_by_tryagain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A paused command's reply is due: ``drain`` returns only once it came."""
    monkeypatch.setattr(cluster_module, "_TRYAGAIN_FIRST_S", 0.0)  # sent again at the next turn
    cluster = _cluster()
    seed, to_seed = _node(cluster, SEED)
    replies: list[Any] = []
    cluster._wire(SEED).send(COMMAND, replies.append, SCRIPT)
    seed.data_received(b"-TRYAGAIN Multiple keys request during rehashing of slot\r\n")
    drained = asyncio.ensure_future(cluster.drain())
    for _ in range(3):
        await asyncio.sleep(0)
    assert to_seed.written == [COMMAND, COMMAND]  # sent again, its reply due
    assert not drained.done()
    seed.data_received(b":1\r\n")
    await asyncio.wait_for(drained, 1.0)
    assert replies == [1]
    await cluster.aclose()
