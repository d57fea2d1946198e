"""Settings: ``GatewaySettings`` with its ``ScopeConfig`` scopes and their ``SourceConfig`` sources.

Where values come from, highest precedence first::

    keyword arguments  >  POLYGATEWAY_* environment  >  .env file  >  TOML file  >  defaults

``GatewaySettings.load(path)`` reads the TOML file (``[gateway]`` flat keys,
``[scopes.<name>]`` tables with ``[[scopes.<name>.sources]]``), lays the
environment and the ``.env`` file over it, resolves every source's API key from
the variable named by ``api_key_env`` (the process environment first, then the
``.env`` file), and validates the result. Gateway keys are overridden flat
(``POLYGATEWAY_STALL_WINDOW_S=120``); scopes as JSON in ``POLYGATEWAY_SCOPES``,
merged key by key over the file's scopes (a ``sources`` list is replaced whole).
Only variables that name a setting are read from the environment and ``.env``:
``OPENAI_API_KEY`` and friends may live in the same ``.env``.

Every problem is a ``ConfigError`` naming the field as a dotted path
(``scopes.chat.sources[0].max_concurrency``) and the file. Secrets never reach a
message, ``repr``, ``str`` or dump: API keys are ``SecretStr``, the Redis URL is
kept as a ``SecretStr`` and printed with its password masked, and headers that
look like credentials are masked.
"""

from __future__ import annotations

# The package splits one concept four ways: masking.py (what may be printed),
# models.py (scopes and sources), loading.py (the file, keys, error messages)
# and settings.py (GatewaySettings). Users import from here.
from polygateway.config.masking import mask_url
from polygateway.config.models import ScopeConfig, ScopeKind, SourceConfig, SourceProtocol
from polygateway.config.settings import PROGRESS_TTL_S, GatewaySettings

__all__ = [
    "PROGRESS_TTL_S",
    "GatewaySettings",
    "ScopeConfig",
    "ScopeKind",
    "SourceConfig",
    "SourceProtocol",
    "mask_url",
]
