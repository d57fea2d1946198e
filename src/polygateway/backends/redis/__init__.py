"""The Redis backend: governance state shared by a fleet of processes.

See research-wiki/ARCHITECTURE.md §5.

Importing this package imports ``redis``; ``import polygateway`` does not, and
exposes ``RedisBackend`` lazily. Without the extra, the import error says
``pip install 'polygateway[redis]'``.
"""

from __future__ import annotations

from polygateway.backends.redis.limiter import RedisBackend

__all__ = ["RedisBackend"]
