"""``GatewaySettings``: the governance knobs, the scopes, and where their values come from.

See the package docstring for the order of precedence; ``load`` reads a TOML
file and hands its values to the constructor as the lowest-precedence source.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self
from urllib.parse import parse_qsl, urlsplit

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
)
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from polygateway.config.loading import (
    Origin,
    check_env_names,
    check_null_overrides,
    config_error,
    dotenv_not_text,
    file_layer,
    override_error,
    read_toml,
    resolve_api_keys,
    value_origin,
)
from polygateway.config.masking import mask_url
from polygateway.config.models import NAME_RE, ScopeConfig, config_problem, typed_number
from polygateway.errors import ConfigError

__all__ = [
    "PROGRESS_TTL_S",
    "GatewaySettings",
    "RedisMode",
    "redis_replica_acks_problem",
    "redis_topology_problem",
    "sentinel_address",
]

PROGRESS_TTL_S = 3600.0
"""Lifetime of the fleet-wide progress key; a longer stall window could never see progress."""


RedisMode = Literal["standalone", "cluster", "sentinel"]


def sentinel_address(value: str) -> tuple[str, int]:
    """A Sentinel's ``host:port`` (``[v6]:port``) as ``(host, port)``; else ``ValueError``.

    A URL is refused without being repeated: its user part may be a password.
    """
    if "@" in value or "/" in value:
        raise ValueError(
            "a Sentinel is host:port, not a URL (the entry is not shown: it may hold a "
            "password); the Sentinels' credentials go in redis_sentinel_password and "
            "redis_sentinel_username"
        )
    if any(char.isspace() for char in value.strip()):
        raise ValueError(f"a Sentinel's host:port has no spaces, unlike {value!r}")
    host, colon, port = value.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a Sentinel is host:port with a port in 1-65535, not {value!r}")
    return host, int(port)


def redis_topology_problem(
    mode: str,
    url: str,
    sentinels: Sequence[str],
    master: str | None,
    sentinel_password: str | None = None,
    sentinel_username: str | None = None,
) -> tuple[str, str] | None:
    """What makes a Redis topology unusable, as ``(field, message)``; ``None`` when it is fine.

    The one rule for the settings (at load) and for a ``RedisBackend`` built in
    code. Messages never quote the URL or the Sentinels' user name or password.
    """
    if mode != "sentinel" and (sentinels or master or sentinel_password or sentinel_username):
        if sentinels:
            name = "redis_sentinels"
        elif master:
            name = "redis_sentinel_master"
        elif sentinel_password:
            name = "redis_sentinel_password"
        else:
            name = "redis_sentinel_username"
        return name, f'{name} is only read with redis_mode = "sentinel" (redis_mode is {mode!r})'
    if sentinel_username and not sentinel_password:
        return "redis_sentinel_username", (
            "redis_sentinel_username needs redis_sentinel_password: a Sentinel ACL user logs in"
            " with AUTH <user> <password>"
        )
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None  # the backend's URL parser says what is wrong with it
    if mode == "cluster":
        if parts.scheme == "unix":
            return "redis_url", (
                'redis_mode = "cluster" needs a redis:// or rediss:// seed node: cluster nodes '
                "are discovered by TCP address, not through a unix socket"
            )
        db = dict(parse_qsl(parts.query)).get("db") or parts.path.replace("/", "") or "0"
        if db != "0":
            return "redis_url", (
                f'redis_mode = "cluster" has only database 0; redis_url selects database {db}'
            )
    if mode == "sentinel":
        if not sentinels:
            return "redis_sentinels", (
                'redis_mode = "sentinel" needs redis_sentinels = ["host:26379", ...]'
            )
        if not master:
            return "redis_sentinel_master", (
                'redis_mode = "sentinel" needs redis_sentinel_master, the name the Sentinels '
                "monitor the primary under"
            )
        for sentinel in sentinels:
            try:
                sentinel_address(sentinel)
            except ValueError as exc:
                return "redis_sentinels", str(exc)
        if parts.scheme == "unix" or host is not None or port is not None:
            return "redis_url", (
                'with redis_mode = "sentinel" the Sentinels name the primary: redis_url carries '
                "only the password and database (redis://:PASSWORD@/DB), no host, port or socket"
            )
    return None


def redis_replica_acks_problem(
    mode: str, acks: int, ack_timeout_s: float, socket_timeout_s: float
) -> tuple[str, str] | None:
    """What makes the replica-ack opt-in unusable, as ``(field, message)``; ``None`` when fine.

    The one rule for the settings (at load) and for a ``RedisBackend`` built in
    code (research-wiki/guides/redis-fleet.md, "Replica lag").
    """
    if acks < 0:
        return "redis_replica_acks", f"redis_replica_acks must be >= 0 (0: off), not {acks}"
    if ack_timeout_s < 0:
        return "redis_replica_ack_timeout_s", (
            f"redis_replica_ack_timeout_s must be >= 0 (0: half of redis_socket_timeout_s), "
            f"not {ack_timeout_s:g}"
        )
    if acks == 0:
        return None
    if mode == "cluster":
        # A script redirected to another node (MOVED, ASK) would leave its WAIT behind on the
        # node it was first sent to, which would acknowledge another shard's replication.
        return "redis_replica_acks", (
            'redis_replica_acks is not supported with redis_mode = "cluster" (a redirected '
            "acquire would be acknowledged by the wrong shard's replicas); use 0"
        )
    if ack_timeout_s >= socket_timeout_s:
        return "redis_replica_ack_timeout_s", (
            f"redis_replica_ack_timeout_s ({ack_timeout_s:g}) must be below "
            f"redis_socket_timeout_s ({socket_timeout_s:g}): an acquire waits for both its "
            "script and its acknowledgement within the socket timeout"
        )
    return None


@dataclass(frozen=True, slots=True)
class _Loading:
    """What ``load`` hands to the constructor: the file's values and its name for messages."""

    data: dict[str, Any] | None
    path: str | None


# Set by `load` around the constructor call only; read by `settings_customise_sources`.
# A ContextVar keeps concurrent loads in threads or tasks apart.
_LOADING: ContextVar[_Loading | None] = ContextVar("polygateway_settings_loading", default=None)


class _FileValues(PydanticBaseSettingsSource):
    """The TOML file's values as the lowest-precedence settings source."""

    def __init__(self, settings_cls: type[BaseSettings], data: dict[str, Any]) -> None:
        super().__init__(settings_cls)
        self._data = data

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        """Field-by-field access, as the base class requires (``__call__`` is what is used)."""
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        # Every key, unknown ones included, so that extra="forbid" reports them.
        return dict(self._data)


class _KnownDotEnv(DotEnvSettingsSource):
    """The ``.env`` source, reading only variables that name a setting.

    pydantic-settings passes every other ``.env`` variable on as an extra, which
    ``extra="forbid"`` would refuse; but ``OPENAI_API_KEY`` and friends belong in
    the same file (``api_key_env`` looks them up there), so they are dropped here.
    """

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        return {k: v for k, v in data.items() if k in self.settings_cls.model_fields}


class GatewaySettings(BaseSettings):
    """Everything the gateway needs: governance knobs and the scopes with their sources.

    Build it with ``GatewaySettings.load(path)`` from a TOML file, or directly in
    code (``GatewaySettings(scopes={...})``, where ``api_key=SecretStr(...)`` may
    be given). Construction raises ``ConfigError`` for any invalid value.
    """

    model_config = SettingsConfigDict(
        env_prefix="POLYGATEWAY_",
        env_nested_delimiter="__",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="forbid",
        frozen=True,
        # TOML and the environment spell inf and nan; no timeout, grace or back-off means them.
        allow_inf_nan=False,
    )

    backend: Literal["memory", "redis"] = "memory"
    redis_url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    redis_socket_timeout_s: PositiveFloat = 1.0
    redis_mode: RedisMode = "standalone"
    redis_sentinels: list[str] = Field(default_factory=list)
    redis_sentinel_master: str = ""
    redis_sentinel_password: SecretStr = SecretStr("")
    redis_sentinel_username: SecretStr = SecretStr("")
    redis_replica_acks: NonNegativeInt = 0
    redis_replica_ack_timeout_s: NonNegativeFloat = 0.0
    transport: Literal["httpx", "aiohttp"] = "httpx"
    stall_window_s: PositiveFloat = 300.0
    max_attempts: PositiveInt = 3
    poll_interval_s: PositiveFloat = 0.5
    backoff_base_s: PositiveFloat = 0.5
    backoff_cap_s: PositiveFloat = 8.0
    breaker_failures: PositiveInt = 5
    breaker_cooldown_s: PositiveFloat = 30.0
    breaker_cooldown_max_s: PositiveFloat = 300.0
    lease_grace_s: PositiveFloat = 30.0
    close_grace_s: PositiveFloat = 10.0
    scopes: dict[str, ScopeConfig] = Field(default_factory=dict)

    def __init__(self, **values: Any) -> None:
        loading = _LOADING.get()
        path = loading.path if loading is not None else None
        env_file = values.get("_env_file", type(self).model_config.get("env_file"))

        def origin(field: str, within: Sequence[int | str] = ()) -> Origin:
            return value_origin(
                field, path, env_file, settings_cls=GatewaySettings, given=values, within=within
            )

        try:
            check_null_overrides(env_file, settings_cls=GatewaySettings)
            super().__init__(**values)
        except ValidationError as exc:
            # `from None`: pydantic's own message repeats input values, which may be secrets.
            raise config_error(exc, path, origin) from None
        except SettingsError as exc:
            raise override_error(exc, path, env_file, settings_cls=GatewaySettings) from None
        except UnicodeDecodeError as exc:
            raise dotenv_not_text(exc, env_file) from None
        key_names = {
            source.api_key_env
            for scope in self.scopes.values()
            for source in scope.sources
            if source.api_key_env is not None
        }
        check_env_names(
            type(self).model_fields,
            key_names,
            env_file,
            settings_cls=GatewaySettings,
            tables=("scopes",),
        )
        self._check_stall_covers_ttft(origin("stall_window_s"))
        self._check_redis_topology(origin)
        self._check_replica_acks(origin)
        # .env is read with GatewaySettings' own configuration, as for the class itself.
        resolved = resolve_api_keys(self.scopes, env_file, path, settings_cls=GatewaySettings)
        if resolved is not self.scopes:
            # Frozen model: the one write of construction, like a frozen dataclass's
            # __post_init__; nothing can observe the object before it.
            object.__setattr__(self, "scopes", resolved)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Precedence: keyword arguments > environment > ``.env`` > TOML file (when loading one)."""
        env_file = getattr(dotenv_settings, "env_file", None)
        encoding = getattr(dotenv_settings, "env_file_encoding", None)
        sources: list[PydanticBaseSettingsSource] = [
            init_settings,
            env_settings,
            _KnownDotEnv(settings_cls, env_file=env_file, env_file_encoding=encoding),
        ]
        loading = _LOADING.get()
        if loading is not None and loading.data is not None:
            sources.append(_FileValues(settings_cls, loading.data))
        return tuple(sources)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        env_file: str | os.PathLike[str] | None = ".env",
    ) -> Self:
        """Read the TOML file at ``path`` (if any), lay env and ``.env`` over it, and validate.

        ``env_file`` is read relative to the current directory; ``None`` reads no
        ``.env`` at all. Raises ``ConfigError`` naming the file for a missing or
        unreadable file, invalid TOML, or any invalid setting.
        """
        data: dict[str, Any] | None = None
        shown: str | None = None
        if path is not None:
            shown = os.fspath(path)
            data = file_layer(read_toml(Path(shown), shown), shown)
        token = _LOADING.set(_Loading(data=data, path=shown))
        try:
            return cls(_env_file=env_file)
        finally:
            _LOADING.reset(token)

    @field_validator(
        "redis_socket_timeout_s",
        "redis_replica_acks",
        "redis_replica_ack_timeout_s",
        "stall_window_s",
        "max_attempts",
        "poll_interval_s",
        "backoff_base_s",
        "backoff_cap_s",
        "breaker_failures",
        "breaker_cooldown_s",
        "breaker_cooldown_max_s",
        "lease_grace_s",
        "close_grace_s",
        mode="before",
    )
    @classmethod
    def _check_numbers(cls, value: object) -> object:
        """Not ``true`` for 1; strings stay, since environment variables are text."""
        return typed_number(value, text=True)

    @field_validator("stall_window_s")
    @classmethod
    def _check_stall_window(cls, value: float) -> float:
        """The stall rule needs fleet-wide progress, which the backend keeps for 3600 s only."""
        if value > PROGRESS_TTL_S:
            raise config_problem(
                f"stall_window_s must be <= {PROGRESS_TTL_S:g} s: the fleet-wide progress key "
                f"lives {PROGRESS_TTL_S:g} s, so a longer window would take an expired key for a "
                "stalled scope"
            )
        return value

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: SecretStr) -> SecretStr:
        """Check the scheme now; the message never repeats the URL (it may hold a password)."""
        if not value.get_secret_value().startswith(("redis://", "rediss://", "unix://")):
            raise config_problem("redis_url must start with redis://, rediss:// or unix://")
        return value

    @field_validator("backoff_cap_s")
    @classmethod
    def _check_backoff_cap(cls, value: float, info: ValidationInfo) -> float:
        """A cap below the base would make every back-off the cap: surely a mistake."""
        base = info.data.get("backoff_base_s")
        if isinstance(base, float) and value < base:
            raise config_problem(f"backoff_cap_s ({value:g}) must be >= backoff_base_s ({base:g})")
        return value

    @field_validator("breaker_cooldown_max_s")
    @classmethod
    def _check_cooldown_max(cls, value: float, info: ValidationInfo) -> float:
        """Cool-downs double per trip up to the maximum, which cannot be below the first."""
        first = info.data.get("breaker_cooldown_s")
        if isinstance(first, float) and value < first:
            raise config_problem(
                f"breaker_cooldown_max_s ({value:g}) must be >= breaker_cooldown_s ({first:g})"
            )
        return value

    @field_validator("scopes")
    @classmethod
    def _check_scope_names(cls, scopes: dict[str, ScopeConfig]) -> dict[str, ScopeConfig]:
        """Scope names are the Redis hash tag (``pgw:{scope}:...``), so they use a safe alphabet."""
        for name in scopes:
            if not NAME_RE.match(name):
                raise config_problem(
                    "a scope name is 1-64 characters of letters, digits, '_', '-' and '.', "
                    "starting with a letter or digit",
                    at=f".{name}",
                )
        return scopes

    def _check_stall_covers_ttft(self, origin: Origin) -> None:
        """Refuse ``stall_window_s < max(ttft_timeout_s)``: a conservative guard rail.

        The wait for the first content happens inside an attempt and is
        productive time (research-wiki/designs/stall-budget.md §5): it is
        governed by the attempt's timeouts and ``max_attempts`` and is NOT
        charged to the stall budget. So the check protects nothing, but it is
        harmless (no sensible configuration has a stall window shorter than one
        TTFT wait) and kept as a guard rail, so the settings contract does not move.
        """
        worst: tuple[float, str] | None = None
        for scope_name, scope in self.scopes.items():
            for index, source in enumerate(scope.sources):
                if worst is None or source.ttft_timeout_s > worst[0]:
                    worst = (source.ttft_timeout_s, f"scopes.{scope_name}.sources[{index}]")
        if worst is not None and self.stall_window_s < worst[0]:
            path, env = origin
            raise ConfigError(
                f"stall_window_s ({self.stall_window_s:g}) must be >= the largest ttft_timeout_s "
                f"({worst[0]:g}, {worst[1]}.ttft_timeout_s); a conservative check: time to first "
                "token is productive and not charged to the stall budget",
                field="stall_window_s",
                path=path,
                env=env,
            )

    def _check_redis_topology(self, origin: Callable[[str], Origin]) -> None:
        """Refuse a Redis topology that cannot work (``redis_topology_problem``), at load."""
        problem = redis_topology_problem(
            self.redis_mode,
            self.get_redis_url(),
            self.redis_sentinels,
            self.redis_sentinel_master,
            self.redis_sentinel_password.get_secret_value(),
            self.redis_sentinel_username.get_secret_value(),
        )
        if problem is not None:
            field, message = problem
            path, env = origin(field)
            raise ConfigError(message, field=field, path=path, env=env)

    def _check_replica_acks(self, origin: Callable[[str], Origin]) -> None:
        """Refuse a replica-ack opt-in that cannot work (``redis_replica_acks_problem``)."""
        problem = redis_replica_acks_problem(
            self.redis_mode,
            self.redis_replica_acks,
            self.redis_replica_ack_timeout_s,
            self.redis_socket_timeout_s,
        )
        if problem is not None:
            field, message = problem
            path, env = origin(field)
            raise ConfigError(message, field=field, path=path, env=env)

    def scope(self, name: str) -> ScopeConfig:
        """The scope called ``name``; ``ConfigError`` naming it and the known scopes when absent."""
        try:
            return self.scopes[name]
        except KeyError:
            known = sorted(self.scopes)
            raise ConfigError(
                f"no scope named {name!r}; known scopes: {known if known else 'none configured'}",
                field=f"scopes.{name}",
                scope=name,
            ) from None

    def get_redis_url(self) -> str:
        """The real Redis URL, password included: for the Redis client only, never for printing.

        With ``redis_mode = "sentinel"`` and no ``redis_url`` given, ``redis:///0``:
        the default URL's host is not the primary (the Sentinels name it).
        """
        if self.redis_mode == "sentinel" and "redis_url" not in self.model_fields_set:
            return "redis:///0"
        return self.redis_url.get_secret_value()

    @property
    def redis_url_masked(self) -> str:
        """The Redis URL as it may be printed or logged: password replaced by ``***``."""
        return mask_url(self.redis_url.get_secret_value())

    @property
    def redis_where(self) -> str:
        """Where the Redis backend reads, as it may be printed: the topology, no password.

        A Sentinel topology's primary is the one its Sentinels name, not
        ``redis_url``'s host (with no ``redis_url`` given, the default's
        127.0.0.1 would mislead); a cluster is reached through its seed node.
        """
        url = mask_url(self.get_redis_url())
        if self.redis_mode == "sentinel":
            sentinels = ", ".join(self.redis_sentinels)
            return f"primary {self.redis_sentinel_master!r} via Sentinels {sentinels} ({url})"
        if self.redis_mode == "cluster":
            return f"cluster seeded by {url}"
        return url

    @field_serializer("redis_url", when_used="json")
    def _dump_redis_url(self, value: SecretStr) -> str:
        """JSON dumps show the URL with its password masked (more useful than all stars)."""
        return mask_url(value.get_secret_value())

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        """The repr shows the Redis URL with its password masked."""
        for name, value in super().__repr_args__():
            if name == "redis_url":
                yield name, self.redis_url_masked
            else:
                yield name, value
