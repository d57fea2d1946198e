"""make_transport picks the transport; aiohttp stays an optional extra loaded only on request."""

from __future__ import annotations

import subprocess
import sys

import pytest

from polygateway.chat import ChatClient
from polygateway.config import SourceConfig
from polygateway.errors import ConfigError
from polygateway.testing import gateway_settings
from polygateway.transport.aiohttp_client import AiohttpTransport
from polygateway.transport.factory import make_transport
from polygateway.transport.http import HttpRequest, Transport
from polygateway.transport.httpx_client import HttpxTransport

SOURCES = [SourceConfig(name="primary", protocol="openai", base_url="http://127.0.0.1:9/v1")]


async def test_httpx_is_built_by_name() -> None:
    """'httpx' builds an HttpxTransport that satisfies the Transport protocol."""
    transport = make_transport("httpx", SOURCES, max_connections=3)
    try:
        assert isinstance(transport, HttpxTransport)
        assert isinstance(transport, Transport)
    finally:
        await transport.aclose()


async def test_aiohttp_is_built_by_name() -> None:
    """'aiohttp' builds an AiohttpTransport that satisfies the Transport protocol."""
    transport = make_transport("aiohttp", SOURCES, max_connections=3)
    try:
        assert isinstance(transport, AiohttpTransport)
        assert isinstance(transport, Transport)
    finally:
        await transport.aclose()


def test_unknown_transport_is_refused() -> None:
    """A name that is neither httpx nor aiohttp is a ValueError naming both."""
    with pytest.raises(ValueError, match="'httpx' or 'aiohttp'"):
        make_transport("requests", SOURCES, max_connections=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["httpx", "aiohttp"])
def test_pool_size_must_be_positive(kind: str) -> None:
    """Both transports refuse a pool of zero connections."""
    with pytest.raises(ValueError, match="max_connections"):
        make_transport(kind, SOURCES, max_connections=0)  # type: ignore[arg-type]


async def test_closed_aiohttp_transport_refuses_requests() -> None:
    """After aclose, a send is a programming error, not a classified failure."""
    transport = make_transport("aiohttp", SOURCES, max_connections=1)
    await transport.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await transport.send(
            HttpRequest(source="primary", url="http://127.0.0.1:9/", timeout_s=1.0)
        )


def test_import_polygateway_and_httpx_transport_never_load_aiohttp() -> None:
    """The package, the factory and the httpx path import without touching aiohttp."""
    code = (
        "import sys\n"
        "import polygateway, polygateway.transport.factory, polygateway.transport.httpx_client\n"
        "import polygateway.transport.openai, polygateway.transport.monkey_ocr\n"
        "import polygateway.transport.vision_ocr\n"
        "assert 'aiohttp' not in sys.modules, 'aiohttp was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_missing_aiohttp_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without aiohttp, asking for it raises ImportError saying what to install."""
    monkeypatch.setitem(sys.modules, "aiohttp", None)
    monkeypatch.delitem(sys.modules, "polygateway.transport.aiohttp_client")
    with pytest.raises(ImportError, match=r"pip install polygateway\[aiohttp\]"):
        make_transport("aiohttp", SOURCES, max_connections=1)


SOCKS = [
    SourceConfig(
        name="primary",
        protocol="openai",
        base_url="http://127.0.0.1:9/v1",
        proxy="socks5://user:proxy-secret-pw@127.0.0.1:1080",
    )
]


def test_a_socks_proxy_without_socksio_is_refused_when_the_transport_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """httpx needs socksio for socks5://: a ConfigError naming the source and the extra.

    Without the check, httpx raised a bare ImportError out of the first call.
    """
    monkeypatch.setitem(sys.modules, "socksio", None)
    with pytest.raises(ConfigError, match=r"pip install 'polygateway\[socks\]'") as caught:
        make_transport("httpx", SOCKS, max_connections=1)
    assert "primary" in str(caught.value)
    assert "proxy-secret-pw" not in str(caught.value)


def test_a_socks_proxy_on_aiohttp_is_refused_when_the_transport_is_built() -> None:
    """aiohttp speaks to HTTP proxies only: a socks5:// proxy there is a ConfigError."""
    with pytest.raises(ConfigError, match="aiohttp") as caught:
        make_transport("aiohttp", SOCKS, max_connections=1)
    assert "primary" in str(caught.value)
    assert "proxy-secret-pw" not in str(caught.value)


def test_a_client_with_an_unusable_socks_proxy_fails_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The client's own transport is checked as it is built: before any call, not in one."""
    monkeypatch.setitem(sys.modules, "socksio", None)
    settings = gateway_settings({"name": "primary", "proxy": "socks5://127.0.0.1:1080"})
    with pytest.raises(ConfigError, match="socks"):
        ChatClient(settings)
