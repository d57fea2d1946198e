"""Real Redis topologies for tests: a 3-master Cluster, a Sentinel setup, a replica made to lag.

Every process listens on a free loopback port with its own temporary
directory, and is stopped (thawed first when frozen) by the fixture that
started it. Startup waits are bounded; a topology that does not come up
fails the test with the servers' logs, never a skip.

A Cluster or a Sentinel setup can serve TLS only (``tls=``, certificates from
``_redis_tls.tls_files``): every process then listens on its ``tls-port``
with ``port 0`` and talks TLS to the others (``tls-replication yes``,
``tls-cluster yes``), as Redis's TLS documentation describes.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import pytest
import redis
from redis.crc import key_slot

from _ports import free_port
from polygateway.backends.base import AcquireResult, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.errors import GovernanceBackendError

TLSFiles = tuple[Path, Path, Path]
"""A CA, and a certificate for 127.0.0.1 it signed with its key (``_redis_tls.tls_files``)."""

_START_S = 15.0
_STOP_S = 10.0


def binary(name: str) -> str:
    """The path of ``name``, or a failure naming the Debian package `make test` installs."""
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; `make test` installs it (Debian)", pytrace=False)
    return found


class Process:
    """One redis-server (or redis-sentinel) on 127.0.0.1: started, frozen, killed, stopped."""

    def __init__(
        self,
        directory: Path,
        program: str,
        *args: str,
        config: str = "",
        password: str = "",
        username: str = "",
        tls: TLSFiles | None = None,
    ) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.port = free_port()
        self.program = program
        self.args = args
        self.config = config
        self.password = password
        """What ``client()`` logs in with (its ``requirepass``, written in ``config``)."""
        self.username = username
        """With ``password``: the ACL user ``client()`` logs in as (a ``user`` line)."""
        self.tls = tls
        """TLS only: ``port`` is the ``tls-port`` (``port 0``), replication and bus over TLS."""
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.log = directory / "log.txt"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        """A synchronous client for setup and inspection."""
        tls: dict[str, object] = {}
        if self.tls is not None:
            tls = {"ssl": True, "ssl_ca_certs": str(self.tls[0])}
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            username=self.username or None,
            password=self.password or None,
            socket_timeout=5.0,
            **tls,  # type: ignore[arg-type]
        )

    def start(self) -> None:
        """Start it and wait (bounded) until it answers PING."""
        argv = [binary(self.program)]
        if self.config:
            conf = self.directory / "redis.conf"
            conf.write_text(self.config)
            argv.append(str(conf))
        if self.tls is None:
            argv += ["--port", str(self.port)]
        else:
            ca, cert, key = self.tls
            argv += ["--port", "0", "--tls-port", str(self.port), "--tls-replication", "yes"]
            argv += ["--tls-cert-file", str(cert), "--tls-key-file", str(key)]
            argv += ["--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"]
        argv += ["--bind", "127.0.0.1", "--dir", str(self.directory)]
        argv += ["--save", "", "--appendonly", "no", "--daemonize", "no", *self.args]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        self.paused = False
        deadline = time.monotonic() + _START_S
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with self.client() as client:
                    if client.ping():
                        return
            except redis.RedisError:
                time.sleep(0.05)
        self.stop()
        pytest.fail(f"{self.program} on {self.address} did not start:\n{self.log.read_text()}")

    def pause(self) -> None:
        """Freeze it (SIGSTOP): its sockets stay open, nothing answers."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.process is not None and self.paused:
            os.kill(self.process.pid, signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        """Kill it at once (SIGKILL): connections reset."""
        if self.process is not None and self.process.poll() is None:
            self.resume()
            self.process.kill()
            self.process.wait(timeout=_STOP_S)
        self.process = None

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        if self.paused:
            os.kill(process.pid, signal.SIGCONT)
            self.paused = False
        process.terminate()
        try:
            process.wait(timeout=_STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=_STOP_S)


def wait_for(what: str, check: object, timeout_s: float = _START_S) -> None:
    """Poll ``check()`` until it is true, or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}", pytrace=False)


class Cluster:
    """Three masters, no replicas, created with ``redis-cli --cluster create``."""

    def __init__(self, directory: Path, masters: int = 3, *, tls: TLSFiles | None = None) -> None:
        self.tls = tls
        self.nodes = [
            Process(
                directory / f"node{i}",
                "redis-server",
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "3000",
                # The bus port is the client port + 10000 unless given: a free port may be too high.
                "--cluster-port",
                str(free_port()),
                *(("--tls-cluster", "yes") if tls else ()),
                tls=tls,
            )
            for i in range(masters)
        ]

    @property
    def seed_url(self) -> str:
        if self.tls is not None:
            return f"rediss://{self.nodes[0].address}/0?ssl_ca_certs={self.tls[0]}"
        return f"redis://{self.nodes[0].address}/0"

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        tls = ("--tls", "--cacert", str(self.tls[0])) if self.tls is not None else ()
        subprocess.run(
            [
                binary("redis-cli"),
                *tls,
                "--cluster",
                "create",
                *(node.address for node in self.nodes),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        wait_for("the cluster to be ok on every node", self._all_ok)

    def _all_ok(self) -> bool:
        for node in self.nodes:
            with node.client() as client:
                if client.execute_command("CLUSTER", "INFO").find(b"cluster_state:ok") < 0:
                    return False
                if len(client.execute_command("CLUSTER", "SLOTS")) < len(self.nodes):
                    return False
        return True

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def flush(self) -> None:
        for node in self.nodes:
            with node.client() as client:
                client.flushall()

    def node_id(self, node: Process) -> str:
        with node.client() as client:
            return str(client.execute_command("CLUSTER", "MYID").decode())

    def owner(self, slot: int) -> Process:
        """The master serving ``slot`` now, as the first node sees it."""
        with self.nodes[0].client() as client:
            for row in client.execute_command("CLUSTER", "SLOTS"):
                if int(row[0]) <= slot <= int(row[1]):
                    port = int(row[2][1])
                    return next(node for node in self.nodes if node.port == port)
        raise AssertionError(f"slot {slot} has no owner")

    def scopes_per_node(self, count: int = 1) -> dict[int, list[str]]:
        """``count`` scope names served by each node (node index -> names)."""
        found: dict[int, list[str]] = {i: [] for i in range(len(self.nodes))}
        for n in range(100000):
            scope = f"scope{n}"
            index = self.nodes.index(self.owner(slot_of(scope)))
            if len(found[index]) < count:
                found[index].append(scope)
            if all(len(names) == count for names in found.values()):
                return found
        raise AssertionError("no scopes found for every node")

    def begin_migration(self, slot: int, source: Process, target: Process) -> None:
        """Mark ``slot`` importing on ``target`` and migrating on ``source`` (keys stay)."""
        with target.client() as client:
            client.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
        with source.client() as client:
            client.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(target))

    def move_keys(
        self, slot: int, source: Process, target: Process, only: Sequence[str] = ()
    ) -> int:
        """MIGRATE the slot's keys (or ``only`` these) from ``source`` to ``target``; how many."""
        with source.client() as client:
            keys = list(only) or client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
            if keys:
                client.execute_command(
                    "MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys
                )
        return len(keys)

    def end_migration(self, slot: int, target: Process, others: Sequence[Process] = ()) -> None:
        """Give ``slot`` to ``target`` on every node (``CLUSTER SETSLOT ... NODE``)."""
        target_id = self.node_id(target)
        for node in [target, *[n for n in self.nodes if n is not target], *others]:
            with node.client() as client:
                client.execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)

    def migrate(self, slot: int, target: Process) -> None:
        """Move ``slot`` and its keys to ``target``, as ``redis-cli --cluster reshard`` does."""
        source = self.owner(slot)
        self.begin_migration(slot, source, target)
        while self.move_keys(slot, source, target):
            pass
        self.end_migration(slot, target)


def slot_of(scope: str) -> int:
    """The hash slot of a scope's keys (``pgw:{scope}:...``)."""
    return int(key_slot(f"pgw:{{{scope}}}:sources".encode()))


async def end_and_give_back(
    cluster: Cluster,
    slot: int,
    source: Process,
    target: Process,
    pending: asyncio.Future[AcquireResult] | None = None,
) -> None:
    """A test's end, however it went: its keys dropped (a half-migrated key cannot block the
    cleanup), the migration ended at ``target`` and the slot moved back to ``source``."""
    if pending is not None and not pending.done():
        pending.cancel()
    await asyncio.to_thread(cluster.flush)
    await asyncio.to_thread(cluster.end_migration, slot, target)
    await asyncio.to_thread(cluster.migrate, slot, source)


class SentinelSetup:
    """A primary, its replica and one Sentinel watching them as ``mymaster``.

    With ``sentinel_password`` the Sentinel requires it: ``requirepass`` in its
    config, or, with ``sentinel_username`` too, an ACL user of that name (a
    ``user`` line, all commands, keys and channels) with the ``default`` user
    off, as redis.io's "Sentinel Access Control List authentication" sets one
    up. The primary and the replica take no password either way. With ``tls``
    all three serve TLS only and talk TLS to each other (``_redis_topologies``).
    """

    MASTER = "mymaster"
    DOWN_AFTER_MS = 2000
    """Sentinel's ``down-after-milliseconds``: twice its reconnection period, never equal to it.

    At ``+switch-master`` Sentinel resets the master's record (``sentinelResetMaster``
    in ``sentinel.c``): the new primary counts as unanswered from that moment
    (``act_ping_time = now``), yet its link is remade no sooner than
    ``SENTINEL_PING_PERIOD`` (1 s) after the last reconnection attempt, which, for
    a killed primary, Sentinel was making every second until the switch
    (``sentinelReconnectInstance``). With 1000 ms here the first PONG of a
    healthy new primary could come after ``down-after-milliseconds``:
    ``+sdown``, ``+odown`` (quorum 1) and, the reset having also cleared the
    failover timer ("We can failover again ASAP"), a second failover about a
    second after the first, which promoted the killed primary restarted a moment
    before as a replica, still in its full sync and holding the data of its
    previous life (the failover soak's "no replica acknowledges": Sentinel's log
    shows ``+switch-master`` to the new primary, ``+sdown`` of it 1.0 s later and
    ``-sdown`` 50 ms after that, too late). 2000 ms leaves that first PONG a
    second of margin; detection takes a second longer.
    """

    def __init__(
        self,
        directory: Path,
        *,
        down_after_ms: int = DOWN_AFTER_MS,
        sentinel_password: str = "",
        sentinel_username: str = "",
        tls: TLSFiles | None = None,
    ) -> None:
        self.primary = Process(directory / "primary", "redis-server", tls=tls)
        self.replica = Process(directory / "replica", "redis-server", tls=tls)
        self.down_after_ms = down_after_ms
        self.sentinel = Process(
            directory / "sentinel",
            "redis-sentinel",
            password=sentinel_password,
            username=sentinel_username,
            tls=tls,
        )

    @property
    def sentinels(self) -> list[str]:
        return [self.sentinel.address]

    def start(self) -> None:
        self.primary.start()
        self.replica.args = ("--replicaof", "127.0.0.1", str(self.primary.port))
        self.replica.start()
        wait_for("the replica to sync", self._replica_synced)
        self.sentinel.config = (
            f"sentinel monitor {self.MASTER} 127.0.0.1 {self.primary.port} 1\n"
            f"sentinel down-after-milliseconds {self.MASTER} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.MASTER} 10000\n"
            f"sentinel parallel-syncs {self.MASTER} 1\n"
        )
        if self.sentinel.username:
            self.sentinel.config += (
                f"user {self.sentinel.username} on >{self.sentinel.password} +@all ~* &*\n"
                "user default off\n"
            )
        elif self.sentinel.password:
            self.sentinel.config += f"requirepass {self.sentinel.password}\n"
        self.sentinel.start()
        wait_for("the Sentinel to see the replica", self._sentinel_sees_replica)

    def _replica_synced(self) -> bool:
        with self.replica.client() as client:
            info = client.info("replication")
            return bool(info.get("master_link_status") == "up")

    def _sentinel_sees_replica(self) -> bool:
        with self.sentinel.client() as client:
            replicas = client.execute_command("SENTINEL", "REPLICAS", self.MASTER)
            return len(replicas) >= 1

    def primary_port(self) -> int:
        """The primary's port as the Sentinel names it now."""
        with self.sentinel.client() as client:
            _, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.MASTER)
            return int(port)

    def config_epoch(self) -> int:
        """The Sentinel's configuration epoch of the master: one more at each failover it made."""
        with self.sentinel.client() as client:
            fields = client.execute_command("SENTINEL", "MASTER", self.MASTER)  # paired by redis-py
        return int(fields[b"config-epoch"])

    def wait_for_failover(self, old_port: int, timeout_s: float = 30.0) -> Process:
        """Wait until the Sentinel names another primary and it says so (ROLE); return it."""

        def switched() -> bool:
            port = self.primary_port()
            if port == old_port:
                return False
            node = self.replica if self.replica.port == port else self.primary
            with node.client() as client:
                return bool(client.execute_command("ROLE")[0] == b"master")

        wait_for("the Sentinel's failover", switched, timeout_s)
        return self.replica if self.replica.port == self.primary_port() else self.primary

    def stop(self) -> None:
        for process in (self.sentinel, self.replica, self.primary):
            process.stop()


class DelayLine:
    """A TCP relay on 127.0.0.1 that can hold what flows one way: a replica made to lag.

    A replica told to replicate from ``port`` receives its primary's stream
    through here. ``lag(seconds)`` delays every byte from the primary by that
    much from then on (the replica falls that far behind; its acknowledgements
    flow back at once); ``cut()`` drops what is held and closes every
    connection, as a primary's death loses the stream it had not delivered
    yet. It runs its own event loop in a thread, so the test's loop may block
    on a synchronous client meanwhile.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._lag_s = 0.0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._cut = False

    def start(self) -> None:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        future.result(timeout=_START_S)

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One replica connection: to the primary at once, from the primary after the lag."""
        try:
            up_reader, up_writer = await self._upstream()
        except OSError:
            writer.close()
            return
        if self._cut:
            # Accepted before the cut, connected after it: cut as well, or the stream
            # would flow on past it.
            writer.transport.abort()
            up_writer.transport.abort()
            return
        self._writers += (writer, up_writer)
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._tasks += (
            loop.create_task(self._pump(reader, up_writer)),
            loop.create_task(self._hold(up_reader, held)),
            loop.create_task(self._release(held, writer)),
        )

    async def _upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.target_port)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
        writer.close()

    async def _hold(
        self, reader: asyncio.StreamReader, held: asyncio.Queue[tuple[float, bytes]]
    ) -> None:
        loop = asyncio.get_running_loop()
        while data := await reader.read(65536):
            held.put_nowait((loop.time() + self._lag_s, data))

    async def _release(
        self, held: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        """Deliver in arrival order, each chunk once its time has come."""
        loop = asyncio.get_running_loop()
        while True:
            due, data = await held.get()
            await asyncio.sleep(max(0.0, due - loop.time()))  # edge: a real delay line
            writer.write(data)

    def lag(self, seconds: float) -> None:
        """Delay what the primary sends from now on by ``seconds``."""
        self._lag_s = seconds

    def cut(self) -> None:
        """Drop what is held, close every connection and stop accepting new ones."""
        asyncio.run_coroutine_threadsafe(self._cut_all(), self._loop).result(timeout=_STOP_S)

    async def _cut_all(self) -> None:
        self._cut = True  # a connection still being made to the primary is cut when it is
        if self._server is not None:
            self._server.close()  # first: nothing accepted while the rest is cut
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for writer in self._writers:
            writer.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()
        await asyncio.sleep(0)  # one turn: the aborted transports close their sockets

    def stop(self) -> None:
        if self._thread.is_alive():
            self.cut()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=_STOP_S)
        self._loop.close()


class LaggingReplica:
    """A primary and a replica that replicates through a ``DelayLine``, promoted by hand."""

    def __init__(self, directory: Path) -> None:
        # The first full sync at once, not after the default 5 s wait for more replicas.
        self.primary = Process(
            directory / "primary", "redis-server", "--repl-diskless-sync-delay", "0"
        )
        self.replica = Process(directory / "replica", "redis-server")
        self.line: DelayLine | None = None

    def start(self) -> None:
        self.primary.start()
        self.line = DelayLine(self.primary.port)
        self.line.start()
        self.replica.args = ("--replicaof", "127.0.0.1", str(self.line.port))
        self.replica.start()
        wait_for("the replica to acknowledge", self._acknowledging)

    def _acknowledging(self) -> bool:
        """Whether the replica acknowledges writes: synced is not enough.

        After a sync the primary hears the replica's offset only at its first
        acknowledgement (one a second); until then a WAIT may count it at offset
        0. So: an offset heard, and a write acknowledged.
        """
        with self.primary.client() as client:
            client.set("replica-check", 1)
            acknowledged = client.execute_command("WAIT", 1, 100) == 1
            heard = client.info("replication").get("slave0", {}).get("offset")
            client.delete("replica-check")
            return bool(acknowledged and heard)

    def caught_up(self) -> None:
        """Wait until the replica acknowledged everything the primary wrote."""
        with self.primary.client() as client:
            assert client.execute_command("WAIT", 1, 5000) == 1

    def fail_over(self) -> None:
        """The primary dies with the stream it had not delivered; the replica is promoted."""
        assert self.line is not None
        self.line.cut()
        self.primary.kill()
        with self.replica.client() as client:
            client.execute_command("REPLICAOF", "NO", "ONE")

    def stop(self) -> None:
        if self.line is not None:
            self.line.stop()
        for process in (self.replica, self.primary):
            process.stop()


class _Topology(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


_T = TypeVar("_T", bound=_Topology)


def running(topology: _T) -> Iterator[_T]:
    """A fixture's body (``yield from``): start ``topology``, and stop it however the test
    ended."""
    try:
        topology.start()
        yield topology
    finally:
        topology.stop()


def sentinel_subscribers(setup: SentinelSetup) -> int:
    """How many clients of the Sentinel are subscribed to a channel (it has no PUBSUB)."""
    with setup.sentinel.client() as client:
        return sum(1 for entry in client.client_list() if int(entry.get("sub", 0)) > 0)


async def acquire_until_served(
    backend: RedisBackend, scope: str, spec: SourceSpec, ttl_s: float, bound_s: float
) -> Lease:
    """Acquire, retrying while the backend fails closed (a failover under way), within
    ``bound_s``."""
    deadline = time.monotonic() + bound_s
    while True:
        try:
            got = await backend.acquire(scope, [spec], ttl_s=ttl_s)
        except GovernanceBackendError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
            continue
        assert got.lease is not None, got.rejections
        return got.lease
