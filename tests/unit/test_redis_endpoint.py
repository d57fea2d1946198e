"""Where the Redis backend connects and how it logs in, read from a URL or an injected client.

The backend makes its own connection (``backends/redis/endpoint.py``,
``wire.py``); these tests pin how a URL is read (as redis-py reads the same
URL), that an unknown option is refused rather than ignored, and that
credentials never show in a repr or a ``ConfigError``.
"""

from __future__ import annotations

import ssl

import pytest
import redis.asyncio as aioredis
from redis.credentials import UsernamePasswordCredentialProvider

from polygateway.backends.redis import RedisBackend
from polygateway.backends.redis.endpoint import Endpoint
from polygateway.errors import ConfigError

SECRET = "pa55-Secret-9"


def read(url: str) -> Endpoint:
    return Endpoint.from_url(url, connect_timeout_s=1.0)


def test_a_url_names_host_port_db_and_credentials() -> None:
    """``redis://user:password@host:port/db``, percent-encoding undone."""
    endpoint = read(f"redis://ops%40team:{SECRET}%2F@cache.internal:6380/3")
    assert (endpoint.host, endpoint.port, endpoint.db, endpoint.path) == (
        "cache.internal",
        6380,
        3,
        None,
    )
    assert (endpoint.username, endpoint.password) == ("ops@team", SECRET + "/")
    assert endpoint.tls is None
    assert endpoint.connect_timeout_s == 1.0
    assert endpoint.address == "cache.internal:6380"


def test_a_bare_url_means_localhost_6379_db_0() -> None:
    """No port, no path: redis-py's defaults."""
    endpoint = read("redis://")
    assert (endpoint.host, endpoint.port, endpoint.db) == ("localhost", 6379, 0)


def test_query_options_give_the_password_db_user_and_client_name() -> None:
    """``?password=``, ``?db=`` (over the path's), ``?username=``, ``?client_name=``."""
    endpoint = read(f"redis://h/1?password={SECRET}&db=4&username=gw&client_name=w1")
    assert (endpoint.password, endpoint.db, endpoint.username) == (SECRET, 4, "gw")
    assert endpoint.client_name == "w1"


def test_a_unix_url_names_the_socket_and_its_db() -> None:
    """``unix:///path?db=N``: the path, no host; the address in errors is the path."""
    endpoint = read(f"unix://:{SECRET}@/run/redis/redis.sock?db=2")
    assert (endpoint.path, endpoint.db, endpoint.password) == ("/run/redis/redis.sock", 2, SECRET)
    assert endpoint.address == "/run/redis/redis.sock"


def test_rediss_verifies_certificate_and_host_by_default() -> None:
    """``rediss://``: a TLS context that requires a valid certificate for the host."""
    tls = read("rediss://cache.internal:6380/0").tls
    assert tls is not None
    assert (tls.verify_mode, tls.check_hostname) == (ssl.CERT_REQUIRED, True)


def test_rediss_options_relax_verification_when_asked() -> None:
    """``ssl_cert_reqs=none`` and ``ssl_check_hostname=false``, as redis-py spells them."""
    unchecked = read("rediss://h/0?ssl_cert_reqs=none").tls
    assert unchecked is not None
    assert (unchecked.verify_mode, unchecked.check_hostname) == (ssl.CERT_NONE, False)
    any_host = read("rediss://h/0?ssl_check_hostname=false").tls
    assert any_host is not None
    assert (any_host.verify_mode, any_host.check_hostname) == (ssl.CERT_REQUIRED, False)


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("http://h/0", "schemes"),
        ("redis://h/0?socket_timeout=5", "unsupported option socket_timeout"),
        ("redis://h/0?ssl_cert_reqs=none", "unsupported option ssl_cert_reqs"),
        ("redis://h/zero", "db must be a whole number"),
        ("redis://h:port/0", "Port"),
        ("rediss://h/0?ssl_cert_reqs=sometimes", "invalid TLS settings"),
        ("rediss://h/0?ssl_ca_certs=/nonexistent/ca.pem", "invalid TLS settings"),
        ("unix://?db=1", "the socket's path"),
    ],
)
def test_an_unusable_url_is_refused_saying_why(url: str, complaint: str) -> None:
    """A URL the wire could not honour fails when read, not on the first call."""
    with pytest.raises(ValueError, match=complaint):
        read(url)


def test_an_unusable_url_is_a_config_error_without_its_password() -> None:
    """Through the backend: ConfigError on ``redis_url``, the password masked."""
    with pytest.raises(ConfigError) as caught:
        RedisBackend(f"redis://:{SECRET}@h/0?socket_timeout=5&password={SECRET}")
    assert caught.value.field == "redis_url"
    assert "socket_timeout" in str(caught.value)
    assert SECRET not in str(caught.value)


def test_the_repr_of_an_endpoint_shows_no_credential() -> None:
    """Username, password and credential provider are left out of the repr."""
    endpoint = read(f"redis://user-Secret:{SECRET}@h/0")
    assert "Secret" not in repr(endpoint)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://h/0", None),
        (f"redis://:{SECRET}@h/0", ("default", SECRET)),
        (f"redis://gw:{SECRET}@h/0", ("gw", SECRET)),
        ("redis://gw@h/0", ("gw", "")),
    ],
)
async def test_credentials_follow_redis_pys_rule(
    url: str, expected: tuple[str, str] | None
) -> None:
    """A password alone logs in as ``default``; a user name alone with an empty password."""
    assert await read(url).credentials() == expected


async def test_an_injected_clients_settings_are_read_from_its_pool() -> None:
    """Host, port, db, credentials, client name and connect timeout of the client's pool."""
    client = aioredis.Redis(
        host="cache.internal",
        port=6390,
        db=5,
        username="gw",
        password=SECRET,
        client_name="w2",
        socket_connect_timeout=2.5,
    )
    try:
        endpoint = Endpoint.of_client(client, connect_timeout_s=1.0)
    finally:
        await client.aclose()
    assert (endpoint.host, endpoint.port, endpoint.db, endpoint.client_name) == (
        "cache.internal",
        6390,
        5,
        "w2",
    )
    assert await endpoint.credentials() == ("gw", SECRET)
    assert endpoint.connect_timeout_s == 2.5


async def test_an_injected_clients_tls_unix_and_credential_provider_are_honoured() -> None:
    """A TLS pool gets a verifying context; a unix pool its path; a provider is asked."""
    tls_client = aioredis.Redis(host="h", ssl=True, ssl_cert_reqs="required")
    unix_client = aioredis.Redis(
        unix_socket_path="/run/redis.sock",
        credential_provider=UsernamePasswordCredentialProvider("gw", SECRET),
    )
    try:
        tls = Endpoint.of_client(tls_client, connect_timeout_s=1.0).tls
        unix = Endpoint.of_client(unix_client, connect_timeout_s=1.0)
    finally:
        await tls_client.aclose()
        await unix_client.aclose()
    assert tls is not None
    assert (tls.verify_mode, tls.check_hostname) == (ssl.CERT_REQUIRED, True)
    assert unix.path == "/run/redis.sock"
    assert await unix.credentials() == ("gw", SECRET)


async def test_an_injected_client_of_another_connection_class_is_refused() -> None:
    """A pool whose connections decide where to connect on their own: ConfigError, not a guess."""

    class Elsewhere(aioredis.Connection):
        """A connection subclass that might connect anywhere."""

    pool = aioredis.ConnectionPool(connection_class=Elsewhere, host="h")
    client = aioredis.Redis(connection_pool=pool)
    try:
        with pytest.raises(ConfigError, match="Elsewhere"):
            RedisBackend("redis://h/0", client=client)
    finally:
        await client.aclose()
        await pool.disconnect()
