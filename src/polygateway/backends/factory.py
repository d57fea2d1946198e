"""One shared backend per settings object (memory) or per Redis URL (redis).

Two clients of one scope in one process must draw on one budget, or they
would double its limits: ``shared_backend`` hands every client built from
the same settings the same ``MemoryBackend``, and every client pointed at the
same Redis URL, with the same connection settings, the same ``RedisBackend``
(one pipelined connection).

The memory backends are keyed by the settings object's identity and dropped
when it is garbage-collected (``weakref.finalize``), so a long-lived process
that builds settings repeatedly does not keep every one alive. The Redis
backend is imported lazily: ``import polygateway`` never imports redis.
"""

from __future__ import annotations

import importlib
import weakref
from typing import TYPE_CHECKING

from polygateway.backends.base import Backend
from polygateway.backends.memory import MemoryBackend
from polygateway.errors import ConfigError

if TYPE_CHECKING:
    from polygateway.config import GatewaySettings

__all__ = ["shared_backend"]

_MEMORY: dict[int, Backend] = {}
"""``id(settings)`` -> its memory backend, for as long as the settings object lives."""

_REDIS: dict[tuple[str, str, tuple[str, ...], str, str, str, int, float, float], Backend] = {}
"""Every setting the backend is built from (Sentinels' password and user never printed) -> backend.

A setting left out of the key would let settings that differ in it share a backend
built with the first one's value.
"""


def shared_backend(settings: GatewaySettings) -> Backend:
    """The backend the settings name, shared with every client built from the same settings.

    Raises:
        ConfigError: ``backend = "redis"`` without the ``redis`` extra installed.
    """
    if settings.backend == "memory":
        key = id(settings)
        backend = _MEMORY.get(key)
        if backend is None:
            backend = _MEMORY[key] = MemoryBackend()
            # An id may be reused once its object is gone: forget the backend with it.
            weakref.finalize(settings, _MEMORY.pop, key, None)
        return backend
    url = settings.get_redis_url()
    sentinels = tuple(settings.redis_sentinels)
    topology = (
        url,
        settings.redis_mode,
        sentinels,
        settings.redis_sentinel_master,
        settings.redis_sentinel_password.get_secret_value(),
        settings.redis_sentinel_username.get_secret_value(),
        settings.redis_replica_acks,
        settings.redis_replica_ack_timeout_s,
        settings.redis_socket_timeout_s,
    )
    backend = _REDIS.get(topology)
    if backend is None:
        backend = _REDIS[topology] = _redis_backend(url, settings)
    return backend


def _redis_backend(url: str, settings: GatewaySettings) -> Backend:
    """A ``RedisBackend``, imported only now; ``ConfigError`` says which extra is missing."""
    try:
        module = importlib.import_module("polygateway.backends.redis")
        backend_cls = module.RedisBackend
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            'backend = "redis" needs the redis extra: install polygateway[redis]',
            field="backend",
        ) from exc
    backend: Backend = backend_cls(
        url,
        socket_timeout_s=settings.redis_socket_timeout_s,
        mode=settings.redis_mode,
        sentinels=settings.redis_sentinels,
        sentinel_master=settings.redis_sentinel_master,
        sentinel_password=settings.redis_sentinel_password.get_secret_value(),
        sentinel_username=settings.redis_sentinel_username.get_secret_value(),
        replica_acks=settings.redis_replica_acks,
        replica_ack_timeout_s=settings.redis_replica_ack_timeout_s,
    )
    return backend
