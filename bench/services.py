"""The processes a benchmark run talks to: the simulator and a private redis-server.

Both run on the first CPU the harness may use; every measured client runs
on another one, so neither the upstream's nor Redis's CPU is ever counted
against a client, and they do not steal the client's core.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Services", "cpu_layout", "private_redis", "running_services"]

_START_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Services:
    """Addresses of the running services and the CPU left for clients."""

    sim_url: str
    redis_url: str | None
    redis_missing: str | None
    client_cpu: int | None
    service_cpu: int | None


def cpu_layout() -> tuple[int | None, int | None]:
    """(CPU for the services, CPU for the clients); ``None`` when there is only one."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return cpus[0], cpus[1]


def _pin(cpu: int | None) -> None:
    """Pin the calling (child) process to ``cpu`` when there is one."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def _free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _stop(process: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    """SIGTERM, then SIGKILL after a grace period."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def _start_simulator(python: str, cpu: int | None) -> tuple[subprocess.Popen[str], str]:
    """Start ``bench.sim_server`` and wait for its ``READY <url>`` line."""
    process = subprocess.Popen(
        [python, "-m", "bench.sim_server", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: _pin(cpu),  # the harness runs no threads: safe
    )
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line.startswith("READY "):
        _stop(process)
        raise RuntimeError(f"the simulator did not start (said {line!r})")
    return process, line.removeprefix("READY ")


def _ping(port: int) -> bool:
    """Whether a Redis server answers PING on ``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _start_redis(directory: Path, cpu: int | None) -> tuple[subprocess.Popen[bytes], str]:
    """A throw-away redis-server on a free loopback port, no persistence."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise FileNotFoundError("redis-server is not installed (make redis-server installs it)")
    port = _free_port()
    process = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(directory),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: _pin(cpu),  # the harness runs no threads: safe
    )
    deadline = time.monotonic() + _START_TIMEOUT_S
    while not _ping(port):
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            raise RuntimeError("redis-server did not start")
        time.sleep(0.05)
    return process, f"redis://127.0.0.1:{port}/0"


@contextlib.contextmanager
def private_redis(cpu: int | None = None) -> Iterator[str]:
    """A throw-away redis-server (loopback, temporary directory) for the block; its URL.

    Raises:
        FileNotFoundError: redis-server is not installed.
    """
    with tempfile.TemporaryDirectory(prefix="bench-") as directory:
        process, url = _start_redis(Path(directory), cpu)
        try:
            yield url
        finally:
            _stop(process)


@contextlib.contextmanager
def running_services(python: str | None = None, *, redis: bool = True) -> Iterator[Services]:
    """Run the simulator (and redis-server unless ``redis`` is False) for the block's duration."""
    python = python or sys.executable
    service_cpu, client_cpu = cpu_layout()
    with contextlib.ExitStack() as stack:
        sim, sim_url = _start_simulator(python, service_cpu)
        stack.callback(_stop, sim)
        redis_url: str | None = None
        missing: str | None = None
        if redis:
            try:
                redis_url = stack.enter_context(private_redis(service_cpu))
            except FileNotFoundError as exc:
                missing = str(exc)
        else:
            missing = "not requested"
        yield Services(
            sim_url=sim_url,
            redis_url=redis_url,
            redis_missing=missing,
            client_cpu=client_cpu,
            service_cpu=service_cpu,
        )
