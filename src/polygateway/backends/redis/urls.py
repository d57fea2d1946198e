"""A Redis URL as it may be shown: its credentials masked wherever they could appear.

The backend names its server in every error message and in its repr; the
credential of ``redis://user:password@host``, ``redis://token@host`` or
``?password=`` must never be part of either, nor of a foreign exception's text
that a message quotes. The URL is masked by the settings' own ``mask_url``, so
a URL shows the same wherever it is printed; ``secrets_of`` finds what to
scrub from foreign text.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlsplit

from polygateway.config.masking import SECRET_QUERY_PARTS, looks_secret, mask_url

__all__ = ["REDACTED", "mask_url", "secrets_of"]

REDACTED = "***"


def secrets_of(url: str) -> tuple[str, ...]:
    """Every spelling of the URL's password that a foreign message could contain."""
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
