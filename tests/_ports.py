"""A loopback port for a server a test starts: below the kernel's ephemeral range.

``bind(("127.0.0.1", 0))`` hands out a port from the ephemeral range, the same
range every outgoing connection of the suite takes its local port from: on two
busy workers, a port picked there was taken by a client socket before the
redis-server meant for it could bind it ("Address already in use", a Cluster
node's bus port). Ports below the range are never handed to client sockets,
so only another server can hold one, and the bind check below sees that.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]

_LOWEST = 10000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 unless configured)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 nobody listens on right now, outside the ephemeral range."""
    high = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(_LOWEST, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a crowded range
        sock.bind(("127.0.0.1", 0))
        found: int = sock.getsockname()[1]
        return found
