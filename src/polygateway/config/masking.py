"""The one home of secrets: what is a credential, how it is masked, how it is scrubbed.

One rule for every place a secret could show: the settings (their dumps and
reprs, and the file loader, which refuses credential headers in a file), the
transports and the loop (scrubbing upstream messages), the Redis backend (its
repr and errors) and the CLI. ``mask_url`` is public.

- A header whose name contains ``auth``, ``key``, ``token``, ``secret``,
  ``cookie`` or ``password`` carries a credential (``Authorization``,
  ``X-Api-Key``, ``api-key``, ``X-Auth-Token``, ...).
- In a URL: the userinfo (a lone user part too: ``redis://TOKEN@host``) and
  query parameters named like ``password``, ``key``, ``token``, ``secret``,
  ``auth``.
- Masking replaces a credential with ``***`` where a value is shown;
  scrubbing replaces every known spelling of one in foreign text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

__all__ = [
    "REDACTED",
    "SECRET_HEADER_PARTS",
    "SECRET_QUERY_PARTS",
    "is_secret_header",
    "looks_secret",
    "mask_headers",
    "mask_query",
    "mask_url",
    "scrub",
    "secrets_in",
    "url_secrets",
]

# Header names that carry credentials: refused in files, masked whenever printed,
# scrubbed from every message.
SECRET_HEADER_PARTS = ("auth", "key", "token", "secret", "cookie", "password")
# Query parameters of a URL that carry credentials, masked whenever printed.
SECRET_QUERY_PARTS = ("password", "passwd", "key", "token", "secret", "auth")
REDACTED = "***"
_MASK = REDACTED
# Shorter values are not scrubbed: replacing every "a" in a message would hide everything.
_MIN_SECRET_CHARS = 4


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


def mask_query(params: Mapping[str, str]) -> dict[str, str]:
    """Query parameters as they may be printed: credential-looking values replaced by ``***``.

    The same rule as a query in a URL (``mask_url``): ``query = {key = ...}``
    is as secret as ``?key=...`` written in ``base_url``.
    """
    return {k: (_MASK if looks_secret(k, SECRET_QUERY_PARTS) else v) for k, v in params.items()}


def secrets_in(headers: Mapping[str, str]) -> tuple[str, ...]:
    """The credential values a request carries in its headers, longest first, to scrub.

    Both a whole ``Authorization`` value and its token after the scheme are
    returned, so an upstream that echoes only the bare key is scrubbed too.
    """
    found: set[str] = set()
    for name, value in headers.items():
        if not is_secret_header(name):
            continue
        for candidate in (value, value.partition(" ")[2]):
            candidate = candidate.strip()
            if len(candidate) >= _MIN_SECRET_CHARS:
                found.add(candidate)
    # Longest first: the whole "Bearer sk-..." goes before its token is looked for.
    return tuple(sorted(found, key=len, reverse=True))


def url_secrets(url: str) -> tuple[str, ...]:
    """Every spelling of a URL's credentials that a foreign message could contain."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return ()
    # A user part alone is as often a token (redis://TOKEN@host) as a name: scrubbed too.
    found = [parts.password or ("" if parts.password is not None else parts.username or "")]
    found += [v for k, v in parse_qsl(parts.query) if looks_secret(k, SECRET_QUERY_PARTS)]
    spelled = {s for raw in found if raw for s in (raw, unquote(raw))}
    # Longest first, so a password containing another is masked whole.
    return tuple(sorted(spelled, key=len, reverse=True))


def scrub(text: str, secrets: Iterable[str]) -> str:
    """``text`` with every secret replaced by ``***``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return text
