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

import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from polygateway.errors import ConfigError

__all__ = [
    "PROGRESS_TTL_S",
    "GatewaySettings",
    "ScopeConfig",
    "ScopeKind",
    "SourceConfig",
    "SourceProtocol",
    "mask_url",
]

SourceProtocol = Literal["openai", "monkey_ocr", "vision_ocr"]
ScopeKind = Literal["chat", "embed", "ocr"]

PROGRESS_TTL_S = 3600.0
"""Lifetime of the fleet-wide progress key; a longer stall window could never see progress."""

_PROTOCOLS_BY_KIND: dict[str, tuple[str, ...]] = {
    "chat": ("openai",),
    "embed": ("openai",),
    "ocr": ("monkey_ocr", "vision_ocr"),
}

# Scope and source names become parts of backend keys (`pgw:{scope}:src:<source>`):
# braces or colons in them would break the Redis hash tag or the key layout.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Header names that carry credentials: refused in files, masked whenever printed.
_SECRET_HEADER_PARTS = ("auth", "key", "token", "secret", "cookie", "password")
# Query parameters of a URL that carry credentials, masked whenever printed.
_SECRET_QUERY_PARTS = ("password", "passwd", "key", "token", "secret", "auth")
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
            [(k, _MASK if _looks_secret(k, _SECRET_QUERY_PARTS) else v) for k, v in pairs],
            safe="*",
        )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _looks_secret(name: str, parts: tuple[str, ...]) -> bool:
    """Whether a header or parameter name suggests its value is a credential."""
    lowered = name.lower()
    return any(part in lowered for part in parts)


def _mask_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """Headers as they may be printed: credential-looking values replaced by ``***``."""
    return {k: (_MASK if _looks_secret(k, _SECRET_HEADER_PARTS) else v) for k, v in headers.items()}


def _problem(message: str, *, at: str = "") -> PydanticCustomError:
    """A validation problem; ``at`` extends the error's location (e.g. ``[1].protocol``)."""
    return PydanticCustomError("polygateway_config", message, {"at": at} if at else None)


class SourceConfig(BaseModel):
    """One upstream endpoint: where it is, how to talk to it, and the limits it must be held to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    protocol: SourceProtocol
    base_url: str
    model: str = ""
    api_key_env: str | None = None
    api_key: SecretStr | None = None
    max_concurrency: PositiveInt = 8
    rpm: PositiveFloat | None = None
    rpm_burst: PositiveFloat | None = None
    tpm: PositiveFloat | None = None
    tpm_burst: PositiveFloat | None = None
    timeout_s: PositiveFloat = 60.0
    ttft_timeout_s: PositiveFloat = 10.0
    stream_idle_timeout_s: PositiveFloat = 30.0
    connect_timeout_s: PositiveFloat = 5.0
    priority: int = 0
    weight: PositiveFloat = 1.0
    headers: dict[str, str] = Field(default_factory=dict)
    verify: bool | str = True
    proxy: str = ""
    max_batch_size: PositiveInt = 64
    max_batch_tokens: PositiveInt = 8000
    max_upload_bytes: PositiveInt = 20_000_000

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        """Source names end up in backend keys, so they are kept to a safe alphabet."""
        if not _NAME_RE.match(value):
            raise _problem(
                "a source name is 1-64 characters of letters, digits, '_', '-' and '.', "
                "starting with a letter or digit"
            )
        return value

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, value: str) -> str:
        """Only HTTP(S) upstreams exist; anything else is a typo caught now rather than per call."""
        if not value.startswith(("http://", "https://")):
            raise _problem("base_url must start with http:// or https://")
        return value

    @field_validator("api_key_env")
    @classmethod
    def _check_api_key_env(cls, value: str | None) -> str | None:
        """A variable name, not a key: the value is not echoed in case a key was pasted here."""
        if value is not None and not _ENV_NAME_RE.match(value):
            raise _problem(
                "api_key_env must be the NAME of an environment variable "
                "(letters, digits and '_'), not the key itself"
            )
        return value

    @field_validator("headers")
    @classmethod
    def _check_headers(cls, value: dict[str, str]) -> dict[str, str]:
        """The transport sends ``Authorization`` from ``api_key``; a second one would clash."""
        for header in value:
            if header.strip().lower() in ("authorization", "proxy-authorization"):
                raise _problem(
                    "an Authorization header is not accepted: name the variable holding the key "
                    "with api_key_env",
                    at=f".{header}",
                )
        return value

    @field_validator("verify", mode="before")
    @classmethod
    def _check_verify(cls, value: object) -> object:
        """One clear message instead of one error per member of ``bool | str``."""
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value:
            return value
        raise _problem("verify must be true, false or the path of a CA bundle")

    @field_validator("proxy")
    @classmethod
    def _check_proxy(cls, value: str) -> str:
        """An empty proxy means none; otherwise it must be a URL the HTTP clients understand."""
        if value and not value.startswith(("http://", "https://", "socks5://", "socks5h://")):
            raise _problem("proxy must be empty or start with http://, https:// or socks5://")
        return value

    @model_validator(mode="after")
    def _check_bursts(self) -> Self:
        """A burst without its rate limits nothing: most likely the rate was forgotten."""
        if self.rpm_burst is not None and self.rpm is None:
            raise _problem("rpm_burst is set without rpm", at=".rpm_burst")
        if self.tpm_burst is not None and self.tpm is None:
            raise _problem("tpm_burst is set without tpm", at=".tpm_burst")
        return self

    @field_serializer("headers")
    def _dump_headers(self, headers: dict[str, str]) -> dict[str, str]:
        """Dumps are for display and logs: credential-looking headers are masked."""
        return _mask_headers(headers)

    @field_serializer("base_url", "proxy")
    def _dump_url(self, url: str) -> str:
        """Dumps are for display and logs: URL credentials are masked."""
        return mask_url(url) if url else url

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        """The repr masks what the dump masks (the API key is a ``SecretStr`` already)."""
        for name, value in super().__repr_args__():
            if name == "headers":
                yield name, _mask_headers(value)
            elif name in ("base_url", "proxy") and value:
                yield name, mask_url(value)
            else:
                yield name, value


class ScopeConfig(BaseModel):
    """A named pool of interchangeable sources for one capability, with its 429 policy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: ScopeKind
    # Resolved from `kind` before validation when not given (True for chat, False for
    # embed and ocr, DESIGN §5), so the stored value is always a bool.
    exempt_429: bool = True
    sources: tuple[SourceConfig, ...]

    @model_validator(mode="before")
    @classmethod
    def _resolve_exempt_429(cls, data: Any) -> Any:
        """Chat does not charge 429s to the retry budget; embedding and OCR do (seed §5.4)."""
        if isinstance(data, Mapping) and data.get("exempt_429") is None:
            kind = data.get("kind")
            if kind in _PROTOCOLS_BY_KIND:
                return {**data, "exempt_429": kind == "chat"}
        return data

    @field_validator("sources")
    @classmethod
    def _check_sources(
        cls, sources: tuple[SourceConfig, ...], info: ValidationInfo
    ) -> tuple[SourceConfig, ...]:
        """A scope needs at least one source, unique names, and protocols that serve its kind."""
        if not sources:
            raise _problem("a scope needs at least one source")
        seen: set[str] = set()
        for index, source in enumerate(sources):
            if source.name in seen:
                raise _problem(
                    f"duplicate source name {source.name!r} in this scope", at=f"[{index}].name"
                )
            seen.add(source.name)
        kind = info.data.get("kind")
        allowed = _PROTOCOLS_BY_KIND.get(kind) if isinstance(kind, str) else None
        if allowed is not None:
            for index, source in enumerate(sources):
                if source.protocol not in allowed:
                    raise _problem(
                        f"protocol {source.protocol!r} of source {source.name!r} does not fit "
                        f"scope kind {kind!r} (use {' or '.join(allowed)})",
                        at=f"[{index}].protocol",
                    )
        return sources

    @property
    def exempt_429_effective(self) -> bool:
        """Whether a 429 is free of the retry budget in this scope (always resolved)."""
        return self.exempt_429

    @property
    def total_concurrency(self) -> int:
        """Sum of the sources' ``max_concurrency``: the most attempts this scope runs at once."""
        return sum(source.max_concurrency for source in self.sources)


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
    )

    backend: Literal["memory", "redis"] = "memory"
    redis_url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    redis_socket_timeout_s: PositiveFloat = 1.0
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
        try:
            super().__init__(**values)
        except ValidationError as exc:
            # `from None`: pydantic's own message repeats input values, which may be secrets.
            raise _config_error(exc, path) from None
        except SettingsError as exc:
            raise ConfigError(f"cannot read a POLYGATEWAY_* override: {exc}", path=path) from None
        self._check_stall_covers_ttft(path)
        resolved = _resolve_api_keys(self.scopes, env_file, path)
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
            data = _file_layer(_read_toml(Path(shown), shown), shown)
        token = _LOADING.set(_Loading(data=data, path=shown))
        try:
            return cls(_env_file=env_file)
        finally:
            _LOADING.reset(token)

    @field_validator("stall_window_s")
    @classmethod
    def _check_stall_window(cls, value: float) -> float:
        """The stall rule needs fleet-wide progress, which the backend keeps for 3600 s only."""
        if value > PROGRESS_TTL_S:
            raise _problem(
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
            raise _problem("redis_url must start with redis://, rediss:// or unix://")
        return value

    @field_validator("backoff_cap_s")
    @classmethod
    def _check_backoff_cap(cls, value: float, info: ValidationInfo) -> float:
        """A cap below the base would make every back-off the cap: surely a mistake."""
        base = info.data.get("backoff_base_s")
        if isinstance(base, float) and value < base:
            raise _problem(f"backoff_cap_s ({value:g}) must be >= backoff_base_s ({base:g})")
        return value

    @field_validator("breaker_cooldown_max_s")
    @classmethod
    def _check_cooldown_max(cls, value: float, info: ValidationInfo) -> float:
        """Cool-downs double per trip up to the maximum, which cannot be below the first."""
        first = info.data.get("breaker_cooldown_s")
        if isinstance(first, float) and value < first:
            raise _problem(
                f"breaker_cooldown_max_s ({value:g}) must be >= breaker_cooldown_s ({first:g})"
            )
        return value

    @field_validator("scopes")
    @classmethod
    def _check_scope_names(cls, scopes: dict[str, ScopeConfig]) -> dict[str, ScopeConfig]:
        """Scope names are the Redis hash tag (``pgw:{scope}:...``), so they use a safe alphabet."""
        for name in scopes:
            if not _NAME_RE.match(name):
                raise _problem(
                    "a scope name is 1-64 characters of letters, digits, '_', '-' and '.', "
                    "starting with a letter or digit",
                    at=f".{name}",
                )
        return scopes

    def _check_stall_covers_ttft(self, path: str | None) -> None:
        """Refuse ``stall_window_s < max(ttft_timeout_s)``: a conservative guard rail.

        Historically this guarded against a slow first token being taken for a
        stall. Under the current accounting (seed design §5.2, DESIGN §5) the wait
        for the first token happens inside an attempt and is productive time: it
        is governed by the attempt's timeouts and ``max_attempts`` and is NOT
        charged to the stall budget. So the check is redundant, but harmless (no
        sensible configuration has a stall window shorter than one TTFT wait) and
        it is kept as a guard rail, unchanged in meaning, so the contract does not move.
        """
        worst: tuple[float, str] | None = None
        for scope_name, scope in self.scopes.items():
            for index, source in enumerate(scope.sources):
                if worst is None or source.ttft_timeout_s > worst[0]:
                    worst = (source.ttft_timeout_s, f"scopes.{scope_name}.sources[{index}]")
        if worst is not None and self.stall_window_s < worst[0]:
            raise ConfigError(
                f"stall_window_s ({self.stall_window_s:g}) must be >= the largest ttft_timeout_s "
                f"({worst[0]:g}, {worst[1]}.ttft_timeout_s); a conservative check: time to first "
                "token is productive and not charged to the stall budget",
                field="stall_window_s",
                path=path,
            )

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
        """The real Redis URL, password included: for the Redis client only, never for printing."""
        return self.redis_url.get_secret_value()

    @property
    def redis_url_masked(self) -> str:
        """The Redis URL as it may be printed or logged: password replaced by ``***``."""
        return mask_url(self.redis_url.get_secret_value())

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


def _read_toml(path: Path, shown: str) -> dict[str, Any]:
    """The parsed TOML file; ``ConfigError`` naming it when it is missing, unreadable or invalid."""
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError as exc:
        raise ConfigError("settings file not found", path=shown) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"settings file is not valid TOML: {exc}", path=shown) from exc
    except OSError as exc:
        raise ConfigError(f"cannot read settings file: {exc.strerror}", path=shown) from exc


def _file_layer(raw: dict[str, Any], shown: str) -> dict[str, Any]:
    """Flatten ``[gateway]`` and ``[scopes.*]`` into settings values; refuse secrets in the file."""
    for section in raw:
        if section not in ("gateway", "scopes"):
            raise ConfigError(
                f"unknown key {section!r} at the top of the file "
                "(expected a [gateway] table and [scopes.<name>] tables)",
                field=section,
                path=shown,
            )
    gateway = raw.get("gateway", {})
    if not isinstance(gateway, dict):
        raise ConfigError("[gateway] must be a table", field="gateway", path=shown)
    if "scopes" in gateway:
        raise ConfigError(
            "scopes are tables of their own ([scopes.<name>]), not a [gateway] key",
            field="gateway.scopes",
            path=shown,
        )
    layer = dict(gateway)
    if "scopes" in raw:
        scopes = raw["scopes"]
        _refuse_file_secrets(scopes, shown)
        layer["scopes"] = scopes
    return layer


def _refuse_file_secrets(scopes: object, shown: str) -> None:
    """Refuse ``api_key`` and credential headers in a file: secrets come from the environment."""
    if not isinstance(scopes, dict):
        return  # the shape error is reported by validation
    for scope_name, scope in scopes.items():
        sources = scope.get("sources") if isinstance(scope, dict) else None
        if not isinstance(sources, list):
            continue
        for index, source in enumerate(sources):
            if not isinstance(source, dict):
                continue
            headers = source.get("headers")
            offending = (["api_key"] if "api_key" in source else []) + [
                f"headers.{h}"
                for h in (headers if isinstance(headers, dict) else ())
                if _looks_secret(str(h), _SECRET_HEADER_PARTS)
            ]
            if offending:
                key = offending[0]
                raise ConfigError(
                    f"{key} looks like a secret and must not be written in a settings file; put "
                    "it in an environment variable (or .env) and name it with api_key_env",
                    field=f"scopes.{scope_name}.sources[{index}].{key}",
                    path=shown,
                    scope=str(scope_name),
                )


def _dotted(loc: tuple[int | str, ...]) -> str:
    """``('scopes', 'chat', 'sources', 0, 'rpm')`` → ``scopes.chat.sources[0].rpm``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _config_error(exc: ValidationError, path: str | None) -> ConfigError:
    """The one translation of pydantic's errors: first location as the field, every error listed."""
    problems: list[tuple[str, str]] = []
    first_scope: str | None = None
    for index, error in enumerate(exc.errors(include_url=False, include_input=False)):
        loc = tuple(error["loc"])
        field = _dotted(loc)
        context = error.get("ctx") or {}
        at = context.get("at")
        if isinstance(at, str):
            field += at
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        elif error["type"] == "missing":
            message = "required key is missing"
        else:
            message = error["msg"]
        problems.append((field, message))
        if index == 0 and len(loc) > 1 and loc[0] == "scopes":
            first_scope = str(loc[1])
    field, message = problems[0]
    if len(problems) > 1:
        listed = "; ".join(f"{f}: {m}" for f, m in problems)
        message = f"{len(problems)} invalid settings: {listed}"
    else:
        message = f"invalid setting: {message}"
    return ConfigError(message, field=field, path=path, scope=first_scope)


def _resolve_api_keys(
    scopes: dict[str, ScopeConfig],
    env_file: Any,
    path: str | None,
) -> dict[str, ScopeConfig]:
    """Fill ``api_key`` from the variable named by ``api_key_env``: the environment, then ``.env``.

    Returns ``scopes`` itself when nothing needed resolving. A missing or empty
    variable is a ``ConfigError`` naming the variable and the source, never a value.
    """
    dotenv: Mapping[str, str | None] | None = None
    changed = False
    resolved: dict[str, ScopeConfig] = {}
    for scope_name, scope in scopes.items():
        new_sources: list[SourceConfig] = []
        for index, source in enumerate(scope.sources):
            name = source.api_key_env
            if source.api_key is not None or name is None:
                new_sources.append(source)
                continue
            value = os.environ.get(name)
            if not value:
                if dotenv is None:
                    dotenv = _read_dotenv(env_file)
                value = dotenv.get(name)
            if not value:
                shown_env = isinstance(env_file, str | os.PathLike)
                where = f" nor in {os.fspath(env_file)}" if shown_env else ""
                raise ConfigError(
                    f"environment variable {name!r} (api_key_env of source {source.name!r}) "
                    f"is not set in the environment{where}",
                    field=f"scopes.{scope_name}.sources[{index}].api_key_env",
                    path=path,
                    scope=scope_name,
                    sources=(source.name,),
                )
            new_sources.append(source.model_copy(update={"api_key": SecretStr(value)}))
            changed = True
        resolved[scope_name] = scope.model_copy(update={"sources": tuple(new_sources)})
    return resolved if changed else scopes


def _read_dotenv(env_file: Any) -> Mapping[str, str | None]:
    """Every variable of the ``.env`` file(s), names as written (not only POLYGATEWAY_* ones)."""
    if env_file is None:
        return {}
    source = DotEnvSettingsSource(GatewaySettings, env_file=env_file, case_sensitive=True)
    return source.env_vars
