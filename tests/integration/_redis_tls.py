"""A ``redis-server`` answering TLS with a CA of its own, for the ``rediss://`` tests.

Used through the ``tls_redis`` fixture (``conftest.py``) by the wire's tests
and the wake-ups'.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from _ports import free_port

TLS_PASSWORD = "tls-pw-FAKE-3b9d"


@dataclass(frozen=True)
class TLSRedis:
    """A redis-server answering TLS on ``tls_port`` (certificate for 127.0.0.1 signed by ``ca``).

    ``server`` is the ``RedisServer``: its plain port serves an admin client.
    """

    server: Any
    tls_port: int
    ca: Path
    password: str

    def url(self, db: int = 0, *, ca: Path | None = None) -> str:
        """A ``rediss://`` URL with the password; trusting ``ca`` (the server's by default)."""
        return (
            f"rediss://:{self.password}@127.0.0.1:{self.tls_port}/{db}?ssl_ca_certs={ca or self.ca}"
        )


def tls_files(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a certificate it signed for 127.0.0.1 with its key (``openssl``)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.fail("openssl is not installed (needed to make the TLS test's certificates)")
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    cert, key, csr = directory / "server.pem", directory / "server.key", directory / "server.csr"
    ext = directory / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    steps = (
        f"req -x509 -newkey rsa:2048 -nodes -keyout {ca_key} -out {ca} -days 1"
        " -subj /CN=polygateway-test-ca",
        f"req -newkey rsa:2048 -nodes -keyout {key} -out {csr} -subj /CN=127.0.0.1",
        f"x509 -req -in {csr} -CA {ca} -CAkey {ca_key} -CAcreateserial -out {cert} -days 1"
        f" -extfile {ext}",
    )
    for step in steps:  # pytest's tmp_path: no space in these paths
        subprocess.run([openssl, *step.split()], check=True, capture_output=True)
    return ca, cert, key


def start_tls_redis(make_redis_server: Callable[..., Any], directory: Path) -> TLSRedis:
    """Start a server with TLS besides TCP (``make_redis_server``), its files in ``directory``."""
    ca, cert, key = tls_files(directory)
    tls_port = free_port()
    server = make_redis_server(
        *("--tls-port", str(tls_port), "--tls-cert-file", str(cert)),
        *("--tls-key-file", str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"),
        password=TLS_PASSWORD,
    )
    return TLSRedis(server=server, tls_port=tls_port, ca=ca, password=TLS_PASSWORD)
