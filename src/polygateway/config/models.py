"""The scopes and their sources: ``ScopeConfig`` and ``SourceConfig``, with their validators.

Validators raise ``config_problem``; ``GatewaySettings`` turns every problem
into one ``ConfigError`` naming the field (``config/loading.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, Self
from urllib.parse import SplitResult, urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from polygateway.config.masking import mask_headers, mask_query, mask_url

__all__ = [
    "NAME_RE",
    "UNSENDABLE_KEY",
    "ScopeConfig",
    "ScopeKind",
    "SourceConfig",
    "SourceProtocol",
    "config_problem",
    "key_is_sendable",
    "typed_number",
]

SourceProtocol = Literal["openai", "anthropic", "monkey_ocr", "vision_ocr"]
ScopeKind = Literal["chat", "embed", "ocr"]

_PROTOCOLS_BY_KIND: dict[str, tuple[str, ...]] = {
    "chat": ("openai", "anthropic"),
    "embed": ("openai",),
    "ocr": ("monkey_ocr", "vision_ocr"),
}

# Scope and source names become parts of backend keys (`pgw:{scope}:src:<source>`):
# braces or colons in them would break the Redis hash tag or the key layout.
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HEADER_NAME_RE = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
# A `verify` string that means a boolean, not a CA bundle's path.
_BOOLEAN_WORDS = frozenset({"true", "false", "yes", "no", "on", "off", "0", "1"})


_MODEL_CONFIG = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
"""Unknown keys refused, and inf and nan: TOML spells them, yet no limit or timeout means them."""


def config_problem(message: str, *, at: str = "") -> PydanticCustomError:
    """A validation problem; ``at`` extends the error's location (e.g. ``[1].protocol``)."""
    return PydanticCustomError("polygateway_config", message, {"at": at} if at else None)


def typed_number(value: object, *, text: bool = False) -> object:
    """``value`` unless it is a boolean (or, unless ``text``, a string) where a number is due.

    pydantic would read ``true`` as 1 and ``"8"`` as 8 without a word. TOML and
    JSON type their numbers, so a string is refused too, except where the
    value may come from a flat environment variable (``text=True``).
    """
    if isinstance(value, bool):
        raise config_problem(f"must be a number, not {str(value).lower()}")
    if isinstance(value, str) and not text:
        raise config_problem("must be a number, not a quoted string: write it without quotes")
    return value


_ENDPOINT_PATHS = ("/chat/completions", "/embeddings", "/messages", "/ocr/text", "/parse")
"""The paths the wires append to ``base_url`` (openai, anthropic, monkey_ocr)."""


def _url_parts(value: str, what: str, shape: str) -> SplitResult:
    """The parts of a URL a connection can use: no whitespace, a host, a port in 1-65535.

    ``what`` names the setting in the problem, ``shape`` is the form it
    should take; the problem never repeats the URL (it may hold a password).
    """
    if any(char.isspace() for char in value):
        raise config_problem(f"{what} must not contain spaces or other whitespace")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        raise config_problem(f"{what} has a port outside 1-65535 or a malformed host") from None
    if not parts.hostname:
        raise config_problem(f"{what} has no host ({shape})")
    if port == 0:
        raise config_problem(f"{what} has a port outside 1-65535")
    return parts


def check_base_url(value: str) -> str:
    """``value`` if it is an http(s) URL with a host and a port in 1-65535, else a problem.

    A ``base_url`` that already ends in an endpoint path is refused with the
    URL it should be: the wire appends that path, and the doubled path would
    answer 404 on every call. Messages show the URL masked (it may hold a password).
    """
    if any(char.isspace() for char in value):
        raise config_problem("base_url must not contain spaces or other whitespace")
    if not value.startswith(("http://", "https://")):
        raise config_problem("base_url must start with http:// or https://")
    parts = _url_parts(value, "base_url", "http://HOST[:PORT]/...")
    path = parts.path.rstrip("/")
    for endpoint in _ENDPOINT_PATHS:
        if path.endswith(endpoint):
            fixed = urlunsplit(parts._replace(path=path.removesuffix(endpoint)))
            raise config_problem(
                f"base_url ends in the endpoint path {endpoint!r}, which each call appends: "
                f"write {mask_url(fixed)!r}"
            )
    return value


_AZURE_OPENAI_ROUTES = "/openai/"
"""Where Azure OpenAI's routes start (``/openai/deployments/...``, ``/openai/v1``) on any host."""

_EMBEDDING_INPUTS_CAP = 2048
"""Inputs OpenAI and Azure OpenAI accept in one embeddings request; more is a 400."""


def _embedding_inputs_cap(base_url: str) -> tuple[str, int] | None:
    """The provider at ``base_url`` and the most inputs it takes per embeddings request.

    Only providers whose documentation states such a limit are known: OpenAI
    (``api.openai.com`` and its regional ``<region>.api.openai.com``) and Azure
    OpenAI (``*.openai.azure.com``, or an ``/openai/`` route on another
    ``*.azure.com`` resource), both 2048. Any other server (vLLM, a LiteLLM
    proxy, a gateway in front of either) is ``None``: its limit is unknown.
    """
    parts = urlsplit(base_url)
    host = (parts.hostname or "").rstrip(".")
    if host == "api.openai.com" or host.endswith(".api.openai.com"):
        return "OpenAI", _EMBEDDING_INPUTS_CAP
    if host.endswith(".openai.azure.com") or (
        host.endswith(".azure.com") and parts.path.startswith(_AZURE_OPENAI_ROUTES)
    ):
        return "Azure OpenAI", _EMBEDDING_INPUTS_CAP
    return None


def _looks_like_key(name: str) -> bool:
    """Whether a valid variable name is more likely a pasted key (an Azure hex key, say).

    Twenty characters or more, no ``_`` between words, lower case and several
    digits mixed in: how keys are written, not how anyone names a variable.
    Such a name would otherwise be echoed by "variable ... is not set".
    """
    return (
        len(name) >= 20
        and "_" not in name
        and any(char.islower() for char in name)
        and sum(char.isdigit() for char in name) >= 3
    )


UNSENDABLE_KEY = (
    "holds characters an HTTP header cannot carry (non-ASCII, such as a typographic quote, "
    "or control characters); the value is not shown"
)


def key_is_sendable(value: str) -> bool:
    """Whether an API key can travel in a header: printable ASCII, surrounding spaces aside.

    Anything else fails inside the HTTP client on every call (``UnicodeEncodeError``
    for a pasted curly quote), so it is refused once, at load.
    """
    inner = value.strip()
    return inner.isascii() and all(0x20 <= ord(char) < 0x7F for char in inner)


class SourceConfig(BaseModel):
    """One upstream endpoint: where it is, how to talk to it, and the limits it must be held to."""

    model_config = _MODEL_CONFIG

    name: str
    protocol: SourceProtocol
    base_url: str
    model: str = ""
    api_key_env: str | None = None
    api_key: SecretStr | None = None
    api_key_header: str | None = None
    query: dict[str, str] = Field(default_factory=dict)
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
    max_output_tokens: PositiveInt | None = None
    """vision_ocr only: the most tokens a transcription may take, sent as ``max_tokens``.

    ``None`` sends none and leaves the bound to the server, whose default may be
    small: a transcription it cuts is a failure (``vision_ocr.transcription``).
    """

    @field_validator(
        "max_concurrency",
        "rpm",
        "rpm_burst",
        "tpm",
        "tpm_burst",
        "timeout_s",
        "ttft_timeout_s",
        "stream_idle_timeout_s",
        "connect_timeout_s",
        "priority",
        "weight",
        "max_batch_size",
        "max_batch_tokens",
        "max_upload_bytes",
        "max_output_tokens",
        mode="before",
    )
    @classmethod
    def _check_numbers(cls, value: object) -> object:
        """Numbers typed as numbers (``typed_number``)."""
        return typed_number(value)

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        """Source names end up in backend keys, so they are kept to a safe alphabet."""
        if not NAME_RE.match(value):
            raise config_problem(
                "a source name is 1-64 characters of letters, digits, '_', '-' and '.', "
                "starting with a letter or digit"
            )
        return value

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, value: str) -> str:
        """A URL every call can use: caught now, once, rather than as a failure per call."""
        return check_base_url(value)

    @field_validator("api_key_env")
    @classmethod
    def _check_api_key_env(cls, value: str | None) -> str | None:
        """A variable name, not a key: the value is not echoed in case a key was pasted here."""
        if value is not None and (not _ENV_NAME_RE.match(value) or _looks_like_key(value)):
            raise config_problem(
                "api_key_env must be the NAME of an environment variable "
                "(letters, digits and '_'), not the key itself"
            )
        return value

    @field_validator("api_key")
    @classmethod
    def _check_api_key(cls, value: SecretStr | None) -> SecretStr | None:
        """A key given in code must be sendable too (see ``key_is_sendable``)."""
        if value is not None and not key_is_sendable(value.get_secret_value()):
            raise config_problem(f"api_key {UNSENDABLE_KEY}")
        return value

    @field_validator("api_key_header")
    @classmethod
    def _check_api_key_header(cls, value: str | None) -> str | None:
        """A header name (Azure's ``api-key``); ``None`` keeps the protocol's own."""
        if value is not None and not _HEADER_NAME_RE.match(value):
            raise config_problem("api_key_header must be an HTTP header name, such as 'api-key'")
        return value

    @model_validator(mode="after")
    def _check_output_bound(self) -> Self:
        """``max_output_tokens`` is sent by vision OCR alone; elsewhere it would do nothing."""
        if self.max_output_tokens is not None and self.protocol != "vision_ocr":
            raise config_problem(
                f"max_output_tokens applies to vision_ocr sources only, not {self.protocol} "
                "(a chat call sets max_tokens per call)"
            )
        return self

    @model_validator(mode="after")
    def _check_key_header_clash(self) -> Self:
        """The key's header is set from the environment; a fixed value beside it would clash."""
        if self.api_key_header is not None:
            for header in self.headers:
                if header.strip().lower() == self.api_key_header.lower():
                    raise config_problem(
                        f"headers must not set {header!r}: it carries the key (api_key_header); "
                        "name the variable holding the key with api_key_env",
                        at=f".headers.{header}",
                    )
        return self

    @field_validator("headers")
    @classmethod
    def _check_headers(cls, value: dict[str, str]) -> dict[str, str]:
        """Headers every call can send; ``Authorization`` comes from ``api_key`` alone.

        A name or value an HTTP header cannot carry would fail inside the HTTP
        client on every call, as an untyped error: refused here, once.
        """
        for header, text in value.items():
            if header.strip().lower() in ("authorization", "proxy-authorization"):
                raise config_problem(
                    "an Authorization header is not accepted: name the variable holding the key "
                    "with api_key_env",
                    at=f".{header}",
                )
            if not _HEADER_NAME_RE.match(header):
                raise config_problem("not an HTTP header name", at=f".{header}")
            if not key_is_sendable(text):
                raise config_problem(
                    "the value holds characters an HTTP header cannot carry (non-ASCII or "
                    "control characters)",
                    at=f".{header}",
                )
        return value

    @field_validator("verify", mode="before")
    @classmethod
    def _check_verify(cls, value: object) -> object:
        """A boolean, or a CA bundle file that exists; one clear message per mistake.

        A string is a path handed to ``ssl`` on the first call: ``"false"`` or a
        missing file would fail every call with a raw ``FileNotFoundError``.
        """
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _BOOLEAN_WORDS:
            raise config_problem(
                f"verify = {value!r} reads as a CA bundle path: write true or false without quotes"
            )
        if isinstance(value, str) and value:
            if not Path(value).is_file():
                raise config_problem(
                    f"verify names no file: {value!r} is not a CA bundle here (relative paths "
                    "are read from the current directory)"
                )
            return value
        raise config_problem("verify must be true, false or the path of a CA bundle")

    @field_validator("proxy")
    @classmethod
    def _check_proxy(cls, value: str) -> str:
        """An empty proxy means none; otherwise a URL with a host and a port in 1-65535.

        A proxy no connection can use would fail every call as a connect error
        (charged, tripping the breaker): refused here, once. Messages never
        repeat the URL (it may hold a password).
        """
        if not value:
            return value
        if not value.startswith(("http://", "https://", "socks5://", "socks5h://")):
            raise config_problem("proxy must be empty or start with http://, https:// or socks5://")
        _url_parts(value, "proxy", "http://[USER:PASSWORD@]HOST:PORT")
        return value

    @model_validator(mode="after")
    def _check_bursts(self) -> Self:
        """A burst without its rate limits nothing: most likely the rate was forgotten.

        An rpm burst below 1 could never hold the one token a request takes, so
        the source would never run (a tpm take is capped at its burst instead).
        """
        if self.rpm_burst is not None and self.rpm is None:
            raise config_problem("rpm_burst is set without rpm", at=".rpm_burst")
        if self.rpm_burst is not None and self.rpm_burst < 1:
            raise config_problem(
                f"rpm_burst ({self.rpm_burst:g}) must be at least 1: a request takes one whole "
                "token, which a smaller bucket never holds",
                at=".rpm_burst",
            )
        if self.tpm_burst is not None and self.tpm is None:
            raise config_problem("tpm_burst is set without tpm", at=".tpm_burst")
        return self

    @field_serializer("headers")
    def _dump_headers(self, headers: dict[str, str]) -> dict[str, str]:
        """Dumps are for display and logs: credential-looking headers are masked."""
        return mask_headers(headers)

    @field_serializer("query")
    def _dump_query(self, query: dict[str, str]) -> dict[str, str]:
        """Dumps are for display and logs: credential-looking query values are masked."""
        return mask_query(query)

    @field_serializer("base_url", "proxy")
    def _dump_url(self, url: str) -> str:
        """Dumps are for display and logs: URL credentials are masked."""
        return mask_url(url) if url else url

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        """The repr masks what the dump masks (the API key is a ``SecretStr`` already)."""
        for name, value in super().__repr_args__():
            if name == "headers":
                yield name, mask_headers(value)
            elif name == "query":
                yield name, mask_query(value)
            elif name in ("base_url", "proxy") and value:
                yield name, mask_url(value)
            else:
                yield name, value


class PriorityClassConfig(BaseModel):
    """A priority class of a scope: its share of the scope's permits while its calls wait.

    ``reserved``: while the class holds fewer permits than this (in the
    process on a memory backend, fleet-wide on Redis) and has calls waiting,
    they go first; a floor on who goes first, never permits set aside
    (research-wiki/designs/priority-fairness.md).
    """

    model_config = _MODEL_CONFIG

    share: PositiveFloat
    reserved: int = 0

    @field_validator("share", mode="before")
    @classmethod
    def _check_share(cls, value: object) -> object:
        """A share typed as a number (``typed_number``)."""
        return typed_number(value)

    @field_validator("reserved", mode="before")
    @classmethod
    def _check_reserved(cls, value: object) -> object:
        """A whole number of permits, 0 or more: 1.5 or -1 permits mean nothing."""
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise config_problem(
                f"reserved must be a whole number of permits, 0 or more, not {value!r}"
            )
        return value


class ScopeConfig(BaseModel):
    """A named pool of interchangeable sources for one capability, with its 429 policy."""

    model_config = _MODEL_CONFIG

    kind: ScopeKind
    # Resolved from `kind` before validation when not given (True for chat, False for
    # embed and ocr: research-wiki/designs/stall-budget.md §3), so it is always a bool.
    exempt_429: bool = True
    sources: tuple[SourceConfig, ...]
    priority_classes: dict[str, PriorityClassConfig] = Field(default_factory=dict)
    default_priority_class: str | None = None

    @field_validator("priority_classes")
    @classmethod
    def _check_class_names(
        cls, classes: dict[str, PriorityClassConfig]
    ) -> dict[str, PriorityClassConfig]:
        """Class names are kept to the alphabet of source names (they name queues and flows)."""
        for name in classes:
            if not NAME_RE.match(name):
                raise config_problem(
                    "a priority class name is 1-64 characters of letters, digits, '_', '-' "
                    "and '.', starting with a letter or digit",
                    at=f".{name}",
                )
        return classes

    @model_validator(mode="after")
    def _check_default_class(self) -> Self:
        """Classes need a default class among them; a default without classes means nothing."""
        classes = self.priority_classes
        default = self.default_priority_class
        if classes and default is None:
            raise config_problem(
                f"default_priority_class must name one of the scope's classes "
                f"({', '.join(sorted(classes))})"
            )
        if default is not None and default not in classes:
            known = ", ".join(sorted(classes)) or "none declared"
            raise config_problem(
                f"default_priority_class {default!r} is not a priority class of this scope "
                f"(classes: {known})"
            )
        return self

    @model_validator(mode="after")
    def _check_reserved_fits(self) -> Self:
        """Reserved permits of all classes together fit in the scope: more could never be held."""
        classes = self.priority_classes
        capacity = self.total_concurrency
        reserved = sum(c.reserved for c in classes.values())
        if reserved > capacity:
            last = max((n for n, c in classes.items() if c.reserved), key=list(classes).index)
            raise config_problem(
                f"the classes reserve {reserved} permits in all, more than the scope has "
                f"({capacity}: the sum of its sources' max_concurrency)",
                at=f".priority_classes.{last}.reserved",
            )
        return self

    @model_validator(mode="after")
    def _check_batch_caps(self) -> Self:
        """An embed source's batches fit in one request of its provider (``_embedding_inputs_cap``).

        With a larger ``max_batch_size`` every full batch would be refused with a
        400 at run time (``RequestRejected``, its texts never embedded): refused
        here, once.
        """
        if self.kind != "embed":
            return self
        for index, source in enumerate(self.sources):
            cap = _embedding_inputs_cap(source.base_url)
            if cap is not None and source.max_batch_size > cap[1]:
                provider, limit = cap
                raise config_problem(
                    f"source {source.name!r}: max_batch_size = {source.max_batch_size} is more "
                    f"than the {limit} inputs {provider} accepts in one embeddings request "
                    f"(a larger batch is refused with a 400): set max_batch_size to {limit} "
                    "or less",
                    at=f".sources[{index}].max_batch_size",
                )
        return self

    @model_validator(mode="before")
    @classmethod
    def _resolve_exempt_429(cls, data: Any) -> Any:
        """Chat does not charge 429s to the retry budget; embedding and OCR do.

        See research-wiki/designs/stall-budget.md §3.
        """
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
            raise config_problem("a scope needs at least one source")
        seen: set[str] = set()
        for index, source in enumerate(sources):
            if source.name in seen:
                raise config_problem(
                    f"duplicate source name {source.name!r} in this scope", at=f"[{index}].name"
                )
            seen.add(source.name)
        kind = info.data.get("kind")
        allowed = _PROTOCOLS_BY_KIND.get(kind) if isinstance(kind, str) else None
        if allowed is not None:
            for index, source in enumerate(sources):
                if source.protocol not in allowed:
                    raise config_problem(
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
