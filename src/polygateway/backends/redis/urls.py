"""A Redis URL as it may be shown: its password masked wherever it could appear.

The backend names its server in every error message and in its repr; the
password of ``redis://user:password@host`` or ``?password=`` must never be
part of either, nor of a foreign exception's text that a message quotes.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

__all__ = ["REDACTED", "mask_url", "secrets_of"]

REDACTED = "***"


def mask_url(url: str) -> str:
    """The URL with its password (userinfo or ``?password=``) replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable redis url>"
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, host = netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        netloc = f"{user}:{REDACTED}@{host}"
    query = parts.query
    if "password" in query.lower():
        pairs = [
            (k, REDACTED if k.lower() == "password" else v)
            for k, v in parse_qsl(query, keep_blank_values=True)
        ]
        query = urlencode(pairs, safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def secrets_of(url: str) -> tuple[str, ...]:
    """Every spelling of the URL's password that a foreign message could contain."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return ()
    found = [parts.password or ""]
    found += [v for k, v in parse_qsl(parts.query) if k.lower() == "password"]
    spelled = {s for raw in found if raw for s in (raw, unquote(raw))}
    # Longest first, so a password containing another is masked whole.
    return tuple(sorted(spelled, key=len, reverse=True))
