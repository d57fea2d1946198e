"""Reading a settings file and turning what goes wrong into one ``ConfigError``.

- ``read_toml`` / ``file_layer``: the TOML file, its ``[gateway]`` and
  ``[scopes.*]`` tables flattened into settings values, secrets refused.
- ``resolve_api_keys``: each source's key from the variable ``api_key_env``
  names, in the process environment first, then the ``.env`` file.
- ``config_error``: the one translation of pydantic's validation errors,
  naming where the bad value came from (``value_origin``: a variable of the
  environment or ``.env``, else the file).
- ``override_error``: a variable pydantic-settings could not read (not JSON
  where JSON is due), naming that variable rather than the file.
- ``check_null_overrides``: a list or table setting's variable holding JSON
  ``null``, which pydantic-settings would drop without a word, refused.
- ``check_env_names``: a ``POLYGATEWAY_*`` variable that names no setting is
  refused with the closest setting's variable, as an unknown key in the file is.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, get_origin

from pydantic import SecretStr, ValidationError
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    EnvSettingsSource,
    SettingsError,
)

from polygateway.config.masking import SECRET_HEADER_PARTS, looks_secret
from polygateway.config.models import (
    UNSENDABLE_KEY,
    ScopeConfig,
    SourceConfig,
    key_is_sendable,
)
from polygateway.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "Origin",
    "check_env_names",
    "check_null_overrides",
    "config_error",
    "dotenv_not_text",
    "file_layer",
    "override_error",
    "read_toml",
    "resolve_api_keys",
    "value_origin",
]

ENV_PREFIX = "POLYGATEWAY_"

Origin = tuple[str | None, str | None]
"""Where a value came from, as ``ConfigError`` names it: ``(path, env)``."""


def read_toml(path: Path, shown: str) -> dict[str, Any]:
    """The parsed TOML file; ``ConfigError`` naming it when it is missing, unreadable or invalid."""
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError as exc:
        raise ConfigError("settings file not found", path=shown) from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"settings file is not valid TOML: {exc}", path=shown) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"settings file {_not_text(exc)}", path=shown) from None
    except OSError as exc:
        raise ConfigError(f"cannot read settings file: {exc.strerror}", path=shown) from exc


def _not_text(exc: UnicodeDecodeError) -> str:
    """Why a file could not be decoded (a Latin-1 ``é`` in a UTF-8 file, say); no content shown."""
    return f"is not {exc.encoding.upper()} text (an undecodable byte at offset {exc.start})"


def dotenv_not_text(exc: UnicodeDecodeError, env_file: Any) -> ConfigError:
    """A ``.env`` file its encoding cannot decode, as a ``ConfigError`` naming the file."""
    return ConfigError(f"dotenv file {_not_text(exc)}", path=_env_file_shown(env_file))


def file_layer(raw: dict[str, Any], shown: str) -> dict[str, Any]:
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
                if looks_secret(str(h), SECRET_HEADER_PARTS)
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


def _env_file_shown(env_file: Any) -> str | None:
    """The ``.env`` file as messages name it (``None`` when several or none)."""
    return os.fspath(env_file) if isinstance(env_file, str | os.PathLike) else None


def _setting_variable(names: Collection[str], field: str) -> str | None:
    """The variable among ``names`` that sets ``field`` (case-insensitive, nested ``__`` too)."""
    wanted = f"{ENV_PREFIX}{field.upper()}"
    for name in names:
        upper = name.upper()
        if upper == wanted or upper.startswith(f"{wanted}__"):
            return name
    return None


def value_origin(
    field: str,
    path: str | None,
    env_file: Any,
    *,
    settings_cls: type[BaseSettings],
    given: Collection[str] = (),
    within: Sequence[int | str] = (),
) -> Origin:
    """Where top-level ``field``'s value came from, by precedence: code, environment, .env, file.

    ``within`` is a location inside a table such as ``scopes`` (``("chat",
    "sources", 0, "rpm")``): tables are merged key by key, so a variable only
    answers for the keys it sets (a list it sets, it replaces whole).

    Returns ``(path, env)`` for ``ConfigError``: ``(None, NAME)`` for the
    process environment, ``(".env path", NAME)`` for the dotenv file, else
    ``(path, None)`` (the settings file, or ``None`` for code and defaults).
    """
    if field in given:
        return None, None
    name = _setting_variable(os.environ, field)
    if name is not None and (
        not within or _reaches(EnvSettingsSource(settings_cls)().get(field), within)
    ):
        return None, name
    name = _setting_variable(_read_dotenv(env_file, settings_cls), field)
    if name is not None and (
        not within
        or _reaches(DotEnvSettingsSource(settings_cls, env_file=env_file)().get(field), within)
    ):
        return _env_file_shown(env_file), name
    return path, None


def _reaches(value: object, within: Sequence[int | str]) -> bool:
    """Whether a variable's table sets the key at ``within`` (a list on the way is set whole)."""
    for key in within:
        if isinstance(value, list):
            return True
        if not isinstance(value, dict) or key not in value:
            return False
        value = value[key]
    return True


def check_env_names(
    fields: Collection[str],
    key_names: Collection[str],
    env_file: Any,
    *,
    settings_cls: type[BaseSettings],
    tables: Collection[str] = (),
) -> None:
    """Refuse a ``POLYGATEWAY_*`` variable (environment or ``.env``) that sets no setting.

    A misspelt override would otherwise be ignored without a word, and the
    default used instead. Variables an ``api_key_env`` names are keys, not settings.
    Only the ``tables`` fields take nested keys (``POLYGATEWAY_SCOPES__CHAT__KIND``):
    ``POLYGATEWAY_MAX_ATTEMPTS__X`` sets nothing, so it is refused too.
    """
    known = sorted(f"{ENV_PREFIX}{field.upper()}" for field in fields)
    nestable = {f"{ENV_PREFIX}{field.upper()}" for field in tables}
    layers: tuple[tuple[str | None, Collection[str]], ...] = (
        (None, tuple(os.environ)),
        (_env_file_shown(env_file), tuple(_read_dotenv(env_file, settings_cls))),
    )
    for shown, names in layers:
        for name in names:
            upper = name.upper()
            if not upper.startswith(ENV_PREFIX) or name in key_names:
                continue
            head, nested, _ = upper.partition("__")
            if head in known and (not nested or head in nestable):
                continue
            if head in known:
                raise ConfigError(
                    f"unknown setting variable {name}: {head} is a single value, which takes "
                    f"no __ keys; did you mean {head}?",
                    path=shown,
                    env=name,
                )
            close = difflib.get_close_matches(upper, known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"the settings are {', '.join(known)}"
            raise ConfigError(f"unknown setting variable {name}: {hint}", path=shown, env=name)


def config_error(
    exc: ValidationError,
    path: str | None,
    origin: Callable[[str, Sequence[int | str]], Origin] | None = None,
) -> ConfigError:
    """The one translation of pydantic's errors: first location as the field, every error listed.

    ``origin`` tells where the value at a location came from (a top-level
    field, and the place inside it); without it the file (``path``) is named.
    """
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
    first = exc.errors(include_url=False, include_input=False)[0]
    first_loc = first["loc"]
    shown, env = path, None
    if origin is not None and first_loc:
        # A missing key is set by no one: the layer that wrote its table is to blame.
        within = first_loc[1:-1] if first["type"] == "missing" else first_loc[1:]
        shown, env = origin(str(first_loc[0]), tuple(within))
    return ConfigError(message, field=field, path=shown, scope=first_scope, env=env)


# pydantic-settings says which field and source failed in its message alone.
_SETTINGS_ERROR_RE = re.compile(
    r'parsing value for field "(?P<field>\w+)" from source "(?P<source>\w+)"'
)


def override_error(
    exc: SettingsError, path: str | None, env_file: Any, *, settings_cls: type[BaseSettings]
) -> ConfigError:
    """A variable pydantic-settings could not read (not JSON where JSON is due), as ``ConfigError``.

    Names the field and the variable, and the ``.env`` file when the variable
    was read there: the settings file holds nothing wrong. The value is not
    repeated (``POLYGATEWAY_SCOPES`` may carry keys).
    """
    found = _SETTINGS_ERROR_RE.search(str(exc))
    if found is None:
        return ConfigError(f"cannot read a POLYGATEWAY_* override: {exc}", path=path)
    field = found["field"]
    from_env = found["source"] == "EnvSettingsSource"
    names = os.environ if from_env else _read_dotenv(env_file, settings_cls)
    shown = None if from_env else _env_file_shown(env_file)
    return ConfigError(
        "cannot read a POLYGATEWAY_* override: the value is not valid JSON (a list or table "
        "setting is written as JSON in a variable)",
        field=field,
        path=shown,
        env=_setting_variable(names, field) or f"{ENV_PREFIX}{field.upper()}",
    )


# What a variable of a list or table setting holds, as messages name it.
_JSON_SHAPES: dict[object, str] = {dict: "a JSON object", list: "a JSON list"}


def check_null_overrides(env_file: Any, *, settings_cls: type[BaseSettings]) -> None:
    """Refuse a list or table setting's variable (environment or ``.env``) holding JSON ``null``.

    pydantic-settings reads ``null`` as no value at all and drops it, so
    ``POLYGATEWAY_SCOPES=null`` would keep the file's scopes (or none) without a
    word, where ``[]`` or ``"text"`` is refused as the wrong type. Nothing makes
    ``null`` mean "unset": unsetting the variable does that.
    """
    layers: tuple[tuple[str | None, Mapping[str, str | None]], ...] = (
        (None, os.environ),
        (_env_file_shown(env_file), _read_dotenv(env_file, settings_cls)),
    )
    for field, info in settings_cls.model_fields.items():
        shape = _JSON_SHAPES.get(get_origin(info.annotation))
        if shape is None:
            continue
        wanted = f"{ENV_PREFIX}{field.upper()}"
        for shown, variables in layers:
            for name, value in variables.items():
                if name.upper() == wanted and value is not None and _is_json_null(value):
                    raise ConfigError(
                        f"invalid setting: the value is JSON null and {field} takes {shape} "
                        "(to keep the file's value or the default, unset the variable rather "
                        "than set it to null)",
                        field=field,
                        path=shown,
                        env=name,
                    )


def _is_json_null(text: str) -> bool:
    """Whether ``text`` is JSON ``null`` (blanks around it allowed, as ``json.loads`` allows)."""
    try:
        return json.loads(text) is None
    except ValueError:
        return False


def resolve_api_keys(
    scopes: dict[str, ScopeConfig],
    env_file: Any,
    path: str | None,
    *,
    settings_cls: type[BaseSettings],
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
                    dotenv = _read_dotenv(env_file, settings_cls)
                value = dotenv.get(name)
            if not value:
                shown_env = _env_file_shown(env_file)
                assert dotenv is not None  # read just above: the environment had no value
                if name in os.environ or name in dotenv:
                    # Set to nothing: "not set" would send the reader looking for a missing line.
                    where = "the environment" if name in os.environ else f"{shown_env or '.env'}"
                    problem = f"is set but empty in {where}"
                else:
                    nor = f" nor in {shown_env}" if shown_env else ""
                    problem = f"is not set in the environment{nor}"
                raise ConfigError(
                    f"environment variable {name!r} (api_key_env of source {source.name!r}) "
                    f"{problem}",
                    field=f"scopes.{scope_name}.sources[{index}].api_key_env",
                    path=path,
                    scope=scope_name,
                    sources=(source.name,),
                )
            if not key_is_sendable(value):
                raise ConfigError(
                    f"environment variable {name!r} (api_key_env of source {source.name!r}) "
                    f"{UNSENDABLE_KEY}",
                    field=f"scopes.{scope_name}.sources[{index}].api_key_env",
                    path=path,
                    scope=scope_name,
                    sources=(source.name,),
                )
            new_sources.append(source.model_copy(update={"api_key": SecretStr(value)}))
            changed = True
        resolved[scope_name] = scope.model_copy(update={"sources": tuple(new_sources)})
    return resolved if changed else scopes


def _read_dotenv(env_file: Any, settings_cls: type[BaseSettings]) -> Mapping[str, str | None]:
    """Every variable of the ``.env`` file(s), names as written (not only POLYGATEWAY_* ones)."""
    if env_file is None:
        return {}
    source = DotEnvSettingsSource(settings_cls, env_file=env_file, case_sensitive=True)
    return source.env_vars
