"""Pieces every wire format shares: endpoint URLs, request headers, strict JSON readers.

The readers raise ``TransientError("malformed body: ...")`` for anything that
is not the promised shape, so a provider's odd answer is a failed attempt (the
loop tries another source), never a ``KeyError`` or ``TypeError`` escaping a
client.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from polygateway.transport.http import TransientError

if TYPE_CHECKING:
    from polygateway.config import SourceConfig

__all__ = [
    "add_headers",
    "endpoint",
    "json_target",
    "key_header",
    "malformed_body",
    "opt_int",
    "opt_str",
    "req_list",
    "req_obj",
    "req_str",
    "response_model",
    "source_headers",
]


def endpoint(source: SourceConfig, path: str) -> str:
    """``base_url`` joined with ``path`` by exactly one slash, then the source's ``query``."""
    url = source.base_url.rstrip("/") + "/" + path.lstrip("/")
    if source.query:
        url += "?" + urlencode(source.query)
    return url


def key_header(source: SourceConfig, default: str = "Authorization") -> tuple[str, str] | None:
    """The header carrying the source's key, or ``None`` without a key.

    The name is the source's ``api_key_header``, else the protocol's
    ``default``; an ``Authorization`` header carries the key as a bearer
    token, any other (Azure's ``api-key``, Anthropic's ``x-api-key``) bare.
    """
    if source.api_key is None:
        return None
    key = source.api_key.get_secret_value()
    if not key:
        return None
    name = source.api_key_header or default
    return name, (f"Bearer {key}" if name.lower() == "authorization" else key)


def source_headers(source: SourceConfig, *, content_type: str | None = None) -> dict[str, str]:
    """The headers of a request to ``source``: its key, content type, then its own extras.

    The source's configured ``headers`` come last and win.
    """
    headers: dict[str, str] = {}
    if content_type is not None:
        headers["Content-Type"] = content_type
    key = key_header(source)
    if key is not None:
        headers[key[0]] = key[1]
    headers.update(source.headers)
    return headers


_NEVER_ADDED = frozenset(
    {
        "authorization",
        "proxy-authorization",
        "x-api-key",
        "api-key",
        "cookie",
        "content-type",
        "content-length",
        "transfer-encoding",
        "host",
    }
)
"""Names ``add_headers`` never takes: credentials, and what the transport writes itself."""


def add_headers(headers: dict[str, str], extra: Mapping[str, str] | None) -> dict[str, str]:
    """``headers`` with ``extra`` added where the request has no header of the name (any case).

    For what telemetry adds to an attempt (trace context): it never replaces
    the source's key or a header the source configured, and never adds a
    credential or framing header (``_NEVER_ADDED``: a multipart upload's
    content type is the transport's, with its boundary).
    """
    if extra:
        have = {name.lower() for name in headers}
        for name, value in extra.items():
            lower = name.lower()
            if lower not in have and lower not in _NEVER_ADDED:
                headers[name] = value
    return headers


def response_model(body: Any) -> str | None:
    """The ``model`` an answer (or a stream's chunk) names, when it names one as a string."""
    if type(body) is dict:
        model = body.get("model")
        if type(model) is str and model:
            return model
    return None


_JSON = "application/json"

_TARGETS_MAX = 256
"""Sources whose JSON target ``json_target`` keeps; past it the table starts afresh."""

_targets: dict[tuple[int, str], tuple[SourceConfig, str, dict[str, str]]] = {}


def json_target(source: SourceConfig, path: str) -> tuple[str, dict[str, str]]:
    """``endpoint(source, path)`` and a fresh copy of the source's JSON request headers.

    Computed once per source and path: a ``SourceConfig`` is frozen, and
    building the URL and the headers would cost on every request. The table holds
    the source itself, so its ``id`` cannot be reused while its entry lives.
    """
    key = (id(source), path)
    entry = _targets.get(key)
    if entry is None or entry[0] is not source:
        if len(_targets) >= _TARGETS_MAX:
            _targets.clear()
        entry = (source, endpoint(source, path), source_headers(source, content_type=_JSON))
        _targets[key] = entry
    return entry[1], dict(entry[2])


def malformed_body(detail: str) -> TransientError:
    """The failure of a 2xx answer whose JSON is not the protocol's shape."""
    return TransientError(f"malformed body: {detail}", failure="transient")


def req_obj(value: Any, what: str) -> dict[str, Any]:
    """``value`` if it is a JSON object, else a malformed-body failure naming ``what``."""
    if not isinstance(value, dict):
        raise malformed_body(f"{what} is not an object")
    return value


def req_list(value: Any, what: str) -> list[Any]:
    """``value`` if it is a JSON array, else a malformed-body failure naming ``what``."""
    if not isinstance(value, list):
        raise malformed_body(f"{what} is not an array")
    return value


def req_str(value: Any, what: str) -> str:
    """``value`` if it is a string, else a malformed-body failure naming ``what``."""
    if not isinstance(value, str):
        raise malformed_body(f"{what} is not a string")
    return value


def opt_str(value: Any, what: str) -> str | None:
    """``value`` if it is a string or null/absent (``None``)."""
    return None if value is None else req_str(value, what)


def opt_int(value: Any, what: str) -> int:
    """A non-negative count (``0`` when null/absent); integral floats are accepted."""
    if value is None:
        return 0
    # bool is an int subclass, and True tokens is nonsense.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise malformed_body(f"{what} is not a number")
    if isinstance(value, float) and (not math.isfinite(value) or not value.is_integer()):
        raise malformed_body(f"{what} is not an integer")
    if value < 0:
        raise malformed_body(f"{what} is negative")
    return int(value)
