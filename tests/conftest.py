"""Suite-wide fixtures: a real ``redis-server`` on a free loopback port; hypothesis defaults.

The Redis tests run against the real server (Debian package ``redis-server``,
installed by ``make test``), never a mock. When it is missing or cannot start
the fixture fails loudly: a suite that silently skips its Redis half would
report green while testing half the product.

Property tests must not depend on the machine's speed: the suite's hypothesis
profile has no per-example deadline and does not fail a test whose data is
slow to generate (``HealthCheck.too_slow``). A test's own ``@settings`` keep
these unless they name them (a ``suppress_health_check`` list replaces the
profile's: add ``too_slow`` to it).

An object left unclosed (a socket, a transport) warns when the garbage
collector frees it, and the warning fails whichever test is running then.
Each module ends with a full collection, so that what a module leaves behind
fails that module, not a later one.
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import HealthCheck, settings

from _ports import free_port

settings.register_profile(
    "polygateway", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("polygateway")

_START_DEADLINE_S = 10.0
_STOP_DEADLINE_S = 10.0


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1, restartable on the same port for fault tests."""

    def __init__(self, directory: Path, *extra_args: str, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed (needed by the Redis tests); "
                "`make test` installs it (Debian package redis-server)",
                pytrace=False,
            )
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self.password = password
        self.extra_args = extra_args
        self.process: subprocess.Popen[bytes] | None = None
        self._paused = False
        self.log_path = directory / "redis-server.log"

    @property
    def url(self) -> str:
        """The ``redis://`` URL of database 0, with the password when there is one."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A synchronous client for setup and inspection."""
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=2.0
        )

    def start(self) -> None:
        """Start the server (again, on the same port) and wait until it answers PING."""
        if self.process is not None and self.process.poll() is None:
            return
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        args += list(self.extra_args)
        log = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()
        self._paused = False
        deadline = time.monotonic() + _START_DEADLINE_S
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with self.client() as client:
                    if client.ping():
                        return
            except redis.RedisError as exc:
                last_error = exc
            time.sleep(0.02)
        self.stop()
        pytest.fail(
            f"redis-server did not answer PING on 127.0.0.1:{self.port} within "
            f"{_START_DEADLINE_S:.0f} s (last error: {last_error!r}); its output:\n"
            f"{self.log_path.read_text(errors='replace')}",
            pytrace=False,
        )

    def stop(self) -> None:
        """Stop the server; its data is gone (nothing is saved)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        if self._paused:
            # A stopped process only acts on SIGTERM once it runs again.
            process.send_signal(signal.SIGCONT)
            self._paused = False
        process.terminate()
        try:
            process.wait(timeout=_STOP_DEADLINE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=_STOP_DEADLINE_S)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections open but nothing answers."""
        assert self.process is not None, "the server is not running"
        os.kill(self.process.pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """Thaw a paused server (SIGCONT)."""
        if self.process is not None and self._paused:
            os.kill(self.process.pid, signal.SIGCONT)
        self._paused = False

    def ensure_running(self) -> None:
        """Undo whatever a fault test left behind: thaw or restart the server."""
        self.resume()
        self.start()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server for the whole session, stopped at the end."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session server's URL, running and emptied (FLUSHALL) for this test."""
    redis_server.ensure_running()
    with redis_server.client() as client:
        client.flushall()
    return redis_server.url


@pytest.fixture
def make_redis_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., RedisServer]]:
    """A factory of dedicated, started servers (e.g. with a password) stopped after the test."""
    servers: list[RedisServer] = []

    def make(*extra_args: str, password: str | None = None) -> RedisServer:
        server = RedisServer(tmp_path_factory.mktemp("redis"), *extra_args, password=password)
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(autouse=True, scope="module")
def _leaks_found_in_their_module() -> Iterator[None]:
    """A full collection as each module ends: its leaks warn (and fail) in it."""
    yield
    gc.collect()
