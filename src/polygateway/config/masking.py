"""What of a setting may be printed: URLs and headers with their credentials masked.

Shared by the settings models (their dumps and reprs) and the file loader
(which refuses credential headers in a file); ``mask_url`` is public.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = [
    "SECRET_HEADER_PARTS",
    "SECRET_QUERY_PARTS",
    "is_secret_header",
    "looks_secret",
    "mask_headers",
    "mask_url",
]

# Header names that carry credentials: refused in files, masked whenever printed,
# scrubbed from every message (transport/http.py's secrets_in reads the same rule).
SECRET_HEADER_PARTS = ("auth", "key", "token", "secret", "cookie", "password")
# Query parameters of a URL that carry credentials, masked whenever printed.
SECRET_QUERY_PARTS = ("password", "passwd", "key", "token", "secret", "auth")
_MASK = "***"


def mask_url(url: str) -> str:
    """Return ``url`` with any password (and credential-looking query value) replaced by ``***``."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        # An unparseable URL may hide a secret anywhere in it: show nothing.
        return _MASK
    netloc = parts.netloc
    if "@" in netloc:
        # A lone user part is often a token (https://TOKEN@host): it is masked too.
        userinfo = f"{parts.username or ''}:{_MASK}" if parts.password is not None else _MASK
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{userinfo}@{host}" + (f":{port}" if port is not None else "")
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, _MASK if looks_secret(k, SECRET_QUERY_PARTS) else v) for k, v in pairs],
            safe="*",
        )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def looks_secret(name: str, parts: tuple[str, ...]) -> bool:
    """Whether a header or parameter name suggests its value is a credential."""
    lowered = name.lower()
    return any(part in lowered for part in parts)


def is_secret_header(name: str) -> bool:
    """Whether a header's value is a credential: the one rule of masking and scrubbing."""
    return looks_secret(name, SECRET_HEADER_PARTS)


def mask_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Headers as they may be printed: credential-looking values replaced by ``***``."""
    return {k: (_MASK if is_secret_header(k) else v) for k, v in headers.items()}
