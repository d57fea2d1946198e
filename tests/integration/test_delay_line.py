"""The replica-lag relay of the topology fixtures cuts every connection, even one half made.

``DelayLine`` (``_redis_topologies.py``) stands between a primary and its
replica; ``cut()`` plays the primary's death, after which no byte may reach the
replica. A connection accepted before the cut but still connecting to the
primary when it came must be cut too, or the replica would go on replicating
through it. Real sockets on 127.0.0.1; the connection to the primary is held
open by the test, so the order is forced, not raced.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from _redis_topologies import DelayLine

BOUND_S = 5.0


def closed(peer: socket.socket) -> bool:
    """Whether the other end closed (or reset) the connection: no byte ever comes."""
    peer.settimeout(BOUND_S)
    try:
        return peer.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_connection_still_reaching_the_primary_when_the_line_is_cut_is_cut_too() -> None:
    primary = socket.create_server(("127.0.0.1", 0))
    primary.settimeout(BOUND_S)
    line = DelayLine(primary.getsockname()[1])
    entered = threading.Event()
    gate: list[asyncio.Future[None]] = []
    connect = line._upstream

    async def held_upstream() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        gate.append(asyncio.get_running_loop().create_future())
        entered.set()
        await gate[0]
        return await connect()

    line._upstream = held_upstream  # type: ignore[method-assign]
    line.start()
    replica = socket.create_connection(("127.0.0.1", line.port), timeout=BOUND_S)
    try:
        assert entered.wait(BOUND_S), "the line accepted the replica's connection"
        cutting = threading.Thread(target=line.cut)
        cutting.start()
        deadline = time.monotonic() + BOUND_S
        while not line._cut:
            assert time.monotonic() < deadline, "the cut began"
            time.sleep(0.001)  # edge: waiting for another thread
        line._loop.call_soon_threadsafe(gate[0].set_result, None)  # now it reaches the primary
        cutting.join(BOUND_S)
        assert not cutting.is_alive()

        upstream, _ = primary.accept()
        with upstream:
            assert closed(upstream), "the primary's side is cut"
        assert closed(replica), "the replica's side is cut"
    finally:
        replica.close()
        line.stop()
        primary.close()
