"""Where the backend's Redis server is, and what a new connection to it sends first.

The wire makes its own connection (``wire.py``) from an ``Endpoint``: the
address (host and port, or a unix socket's path), a TLS context for
``rediss://``, the credentials and database a new connection starts with,
and how long connecting may take. An endpoint is read from a URL here, with
``urllib.parse``, or from an injected ``redis.asyncio.Redis`` through its
pool's public ``connection_class`` and ``connection_kwargs``. TLS contexts
are built by redis-py's ``RedisSSLContext``, as its own ``SSLConnection``
builds them, so a ``rediss://`` URL verifies what redis-py verifies.

A URL option this module does not know is refused (``ValueError``) rather
than ignored: an option that was meant to matter must not be dropped
silently. No message raised here quotes a credential; the backend masks the
URL it names (``urls.py``).
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.connection import (
    Connection,
    RedisSSLContext,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.credentials import CredentialProvider
from redis.exceptions import RedisError

__all__ = ["Endpoint"]

_SCHEMES = ("redis", "rediss", "unix")
_URL_OPTIONS = frozenset({"db", "username", "password", "client_name"})
_TLS_URL_OPTIONS = frozenset(
    {
        "ssl_cert_reqs",
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_check_hostname",
    }
)
_FALSE = ("0", "F", "FALSE", "N", "NO")
"""A URL flag's spellings of no, as redis-py reads them."""

_CONNECTIONS = (Connection, SSLConnection, UnixDomainSocketConnection)
"""The connection classes whose settings an injected client's pool may carry.

Any other class (a Sentinel-managed connection, a subclass) decides on
connect where and how to connect, which no setting says: refused.
"""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """How to reach and log in to one Redis server; the repr leaves credentials out."""

    host: str = "localhost"
    port: int = 6379
    path: str | None = None
    """A unix socket's path: then ``host`` and ``port`` are unused."""
    db: int = 0
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    credential_provider: CredentialProvider | None = field(default=None, repr=False)
    client_name: str | None = None
    tls: ssl.SSLContext | None = None
    connect_timeout_s: float | None = None
    """Bounds making a connection: the socket, TLS, and the first commands' replies."""
    primary_only: bool = False
    """Refuse a server whose ``ROLE`` is not ``master`` (behind Sentinel, a demoted primary)."""

    @property
    def address(self) -> str:
        """The server as connection errors name it (redis-py's wording): ``host:port`` or a path."""
        return self.path if self.path is not None else f"{self.host}:{self.port}"

    async def credentials(self) -> tuple[str, str] | None:
        """``(username, password)`` to log in with, or ``None`` when there is nothing to send.

        A password alone logs in as ``default``; a user name alone, with an empty
        password (redis-py's rule, so a URL logs in as it did through redis-py).
        """
        found: tuple[str, ...]
        if self.credential_provider is not None:
            found = tuple(await self.credential_provider.get_credentials_async())
        elif self.username:
            found = (self.username, self.password or "")
        elif self.password:
            found = (self.password,)
        else:
            return None
        if len(found) == 1:
            return ("default", found[0])
        return (found[0], found[1])

    @classmethod
    def from_url(cls, url: str, *, connect_timeout_s: float) -> Endpoint:
        """Read ``redis://[[user]:password@]host[:port][/db][?options]``, ``rediss://``, ``unix://``.

        Options: ``db``, ``username``, ``password``, ``client_name``; with
        ``rediss://`` also ``ssl_cert_reqs`` (``none`` / ``optional`` /
        ``required``, the default), ``ssl_ca_certs``, ``ssl_ca_path``,
        ``ssl_certfile``, ``ssl_keyfile``, ``ssl_check_hostname`` (default on).

        Raises:
            ValueError: an unknown scheme or option, or a value that is not one.
        """
        parts = urlsplit(url)
        scheme = parts.scheme
        if scheme not in _SCHEMES:
            raise ValueError(
                "Redis URL must specify one of the following schemes (redis://, rediss://, unix://)"
            )
        options = {name: values[0] for name, values in parse_qs(parts.query).items()}
        known = _URL_OPTIONS | _TLS_URL_OPTIONS if scheme == "rediss" else _URL_OPTIONS
        unknown = sorted(options.keys() - known)
        if unknown:
            raise ValueError(
                f"unsupported option {', '.join(unknown)} in a {scheme}:// URL"
                f" (supported: {', '.join(sorted(known))})"
            )
        username = unquote(parts.username) if parts.username else options.get("username")
        password = unquote(parts.password) if parts.password else options.get("password")
        db = options.get("db")
        if scheme == "unix":
            path = unquote(parts.path)
            if not path:
                raise ValueError("a unix:// URL names the socket's path")
            return cls(
                path=path,
                db=_number("db", db or "0"),
                username=username,
                password=password,
                client_name=options.get("client_name"),
                connect_timeout_s=connect_timeout_s,
            )
        if db is None:
            db = unquote(parts.path).replace("/", "") or "0"
        tls = None
        if scheme == "rediss":
            settings: dict[str, Any] = {
                name.removeprefix("ssl_"): value
                for name, value in options.items()
                if name in _TLS_URL_OPTIONS
            }
            if "check_hostname" in settings:
                settings["check_hostname"] = settings["check_hostname"].upper() not in _FALSE
            tls = _tls(settings)
        return cls(
            host=unquote(parts.hostname) if parts.hostname else "localhost",
            port=parts.port or 6379,
            db=_number("db", db),
            username=username,
            password=password,
            client_name=options.get("client_name"),
            tls=tls,
            connect_timeout_s=connect_timeout_s,
        )

    @classmethod
    def of_client(cls, client: aioredis.Redis, *, connect_timeout_s: float) -> Endpoint:
        """Read the settings an injected client's pool makes its connections with.

        Its connect timeout bounds connecting when it sets one, else
        ``connect_timeout_s``. What concerns only redis-py's own use of a
        connection (its socket timeout, decoding, protocol, retries) does not
        apply to the wire's.

        Raises:
            ValueError: connections of a class other than redis-py's three
                (TCP, TLS, unix socket), a connect callback of its own, or a
                client without a connection pool (``RedisCluster``).
        """
        pool = getattr(client, "connection_pool", None)
        if pool is None:
            raise ValueError(
                f"an injected {type(client).__name__} is not supported (a RedisCluster has no"
                ' connection pool of its own): pass its URL with redis_mode = "cluster" instead'
            )
        kind = pool.connection_class
        kwargs: Mapping[str, Any] = pool.connection_kwargs
        if kind not in _CONNECTIONS or kwargs.get("redis_connect_func") is not None:
            raise ValueError(
                f"an injected client whose pool makes {kind.__name__} objects"
                f"{' with a connect callback' if kind in _CONNECTIONS else ''} is not supported:"
                " pass its URL instead"
            )
        timeout = kwargs.get("socket_connect_timeout")
        tls = None
        if kind is SSLConnection:
            tls = _tls(
                {
                    name.removeprefix("ssl_"): v
                    for name, v in kwargs.items()
                    if name.startswith("ssl_")
                }
            )
        return cls(
            host=str(kwargs.get("host", "localhost")),
            port=int(kwargs.get("port", 6379)),
            path=str(kwargs.get("path", "")) if kind is UnixDomainSocketConnection else None,
            db=_number("db", kwargs.get("db", 0)),
            username=kwargs.get("username"),
            password=kwargs.get("password"),
            credential_provider=kwargs.get("credential_provider"),
            client_name=kwargs.get("client_name"),
            tls=tls,
            connect_timeout_s=timeout if timeout else connect_timeout_s,
        )


def _number(name: str, value: object) -> int:
    """A whole number setting, or ``ValueError`` naming the setting."""
    try:
        return int(str(value))
    except ValueError:
        raise ValueError(f"{name} must be a whole number, not {value!r}") from None


def _tls(settings: Mapping[str, Any]) -> ssl.SSLContext:
    """The TLS context redis-py's ``SSLConnection`` would use; a bad setting is a ``ValueError``.

    ``settings``: ``RedisSSLContext``'s arguments, only those given, so that
    one this redis-py does not know is refused rather than one it does not
    need; certificate and host name are verified unless they say otherwise
    (``SSLConnection``'s defaults).
    """
    settings = {"cert_reqs": "required", "check_hostname": True, **settings}
    try:
        return RedisSSLContext(**settings).get()
    except (RedisError, OSError, TypeError) as exc:
        # OSError: a certificate file missing or unreadable (ssl.SSLError is one too).
        raise ValueError(f"invalid TLS settings: {exc}") from exc
