"""Settings: the TOML shape, env and .env overrides, validation, and secret hygiene."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from polygateway.config import (
    PROGRESS_TTL_S,
    GatewaySettings,
    ScopeConfig,
    SourceConfig,
    mask_url,
)
from polygateway.errors import ConfigError, GatewayError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_TOML = REPO / "polygateway.example.toml"
ENV_EXAMPLE = REPO / ".env.example"

API_KEY = "sk-test-0123456789abcdef-SECRET"
REDIS_PASSWORD = "hunter2-redis-SECRET"

GATEWAY_DEFAULTS: dict[str, object] = {
    "backend": "memory",
    "redis_socket_timeout_s": 1.0,
    "transport": "httpx",
    "stall_window_s": 300,
    "max_attempts": 3,
    "poll_interval_s": 0.5,
    "backoff_base_s": 0.5,
    "backoff_cap_s": 8.0,
    "breaker_failures": 5,
    "breaker_cooldown_s": 30,
    "breaker_cooldown_max_s": 300,
    "lease_grace_s": 30,
    "close_grace_s": 10,
}

MINIMAL_SOURCE = """
[scopes.chat]
kind = "chat"
[[scopes.chat.sources]]
name = "primary"
protocol = "openai"
base_url = "http://127.0.0.1:8001/v1"
"""


pytestmark = pytest.mark.usefixtures("clean_environment")
"""An empty directory and no PolyGateway variables (``conftest.clean_environment``)."""


@pytest.fixture
def write_toml(tmp_path: Path) -> Callable[[str], Path]:
    """Write a settings file into the test's directory and return its path."""

    def write(text: str) -> Path:
        path = tmp_path / "polygateway.toml"
        path.write_text(text, encoding="utf-8")
        return path

    return write


def load_error(path: Path, *, env_file: str | None = None) -> ConfigError:
    """Load ``path`` expecting a ConfigError, and return it."""
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(path, env_file=env_file)
    return info.value


def source(**overrides: object) -> dict[str, object]:
    """A valid chat source as a dict, with some keys changed."""
    base: dict[str, object] = {
        "name": "primary",
        "protocol": "openai",
        "base_url": "http://127.0.0.1:8001/v1",
    }
    base.update(overrides)
    return base


# --- the documented shape -------------------------------------------------------------------


def test_example_file_loads_every_key_with_its_documented_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """polygateway.example.toml loads; every key holds the value documented there."""
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    settings = GatewaySettings.load(EXAMPLE_TOML)

    for key, value in GATEWAY_DEFAULTS.items():
        assert getattr(settings, key) == value, key
    assert settings.get_redis_url() == "redis://127.0.0.1:6379/0"

    chat = settings.scope("chat")
    assert chat.kind == "chat"
    assert chat.exempt_429 is True
    (primary,) = chat.sources
    assert primary.name == "primary"
    assert primary.protocol == "openai"
    assert primary.base_url == "http://127.0.0.1:8001/v1"
    assert primary.model == "gpt-4o-mini"
    assert primary.api_key_env == "OPENAI_API_KEY"
    assert primary.api_key is not None
    assert primary.api_key.get_secret_value() == API_KEY
    assert primary.max_concurrency == 8
    assert primary.rpm == 600
    assert primary.rpm_burst == 10
    assert primary.tpm == 100000
    assert primary.tpm_burst is None
    assert primary.timeout_s == 60
    assert primary.ttft_timeout_s == 10
    assert primary.stream_idle_timeout_s == 30
    assert primary.connect_timeout_s == 5
    assert primary.priority == 0
    assert primary.weight == 1
    assert primary.headers == {"X-Org": "acme"}
    assert primary.verify is True
    assert primary.proxy == ""
    assert primary.max_batch_size == 64
    assert primary.max_batch_tokens == 8000
    assert primary.max_upload_bytes == 20_000_000

    embed = settings.scope("embed")
    assert (embed.kind, embed.exempt_429) == ("embed", False)
    assert embed.sources[0].max_batch_size == 64
    assert embed.sources[0].max_batch_tokens == 8000
    ocr = settings.scope("ocr")
    assert (ocr.kind, ocr.exempt_429) == ("ocr", False)
    assert ocr.sources[0].protocol == "monkey_ocr"
    assert ocr.sources[0].api_key is None
    assert ocr.sources[0].max_upload_bytes == 20_000_000


def test_defaults_apply_when_nothing_is_configured() -> None:
    """With no file, environment or keyword, every gateway key holds its documented default."""
    settings = GatewaySettings()
    for key, value in GATEWAY_DEFAULTS.items():
        assert getattr(settings, key) == value, key
    assert settings.scopes == {}
    assert settings.get_redis_url() == "redis://127.0.0.1:6379/0"


def test_source_defaults_match_the_design() -> None:
    """A source given only name, protocol and base_url gets the documented defaults."""
    src = SourceConfig(name="a", protocol="openai", base_url="http://x")
    assert src.model == ""
    assert (src.api_key_env, src.api_key) == (None, None)
    assert src.max_concurrency == 8
    assert (src.rpm, src.rpm_burst, src.tpm, src.tpm_burst) == (None, None, None, None)
    assert (src.timeout_s, src.ttft_timeout_s) == (60, 10)
    assert (src.stream_idle_timeout_s, src.connect_timeout_s) == (30, 5)
    assert (src.priority, src.weight) == (0, 1)
    assert (src.headers, src.verify, src.proxy) == ({}, True, "")
    assert (src.max_batch_size, src.max_batch_tokens) == (64, 8000)
    assert src.max_upload_bytes == 20_000_000


@pytest.mark.parametrize(
    ("kind", "protocol", "expected"),
    [("chat", "openai", True), ("embed", "openai", False), ("ocr", "monkey_ocr", False)],
)
def test_exempt_429_resolves_from_the_kind(kind: str, protocol: str, expected: bool) -> None:
    """Unset exempt_429 becomes a bool: true for chat, false for embed and ocr."""
    scope = ScopeConfig.model_validate({"kind": kind, "sources": [source(protocol=protocol)]})
    assert scope.exempt_429 is expected
    assert scope.exempt_429_effective is expected


def test_exempt_429_given_explicitly_wins_over_the_kind_default(
    write_toml: Callable[[str], Path],
) -> None:
    """exempt_429 = false in a chat scope is kept, not replaced by the chat default."""
    path = write_toml(MINIMAL_SOURCE.replace('kind = "chat"', 'kind = "chat"\nexempt_429 = false'))
    assert GatewaySettings.load(path).scope("chat").exempt_429 is False


def test_total_concurrency_sums_the_sources() -> None:
    """total_concurrency is the sum of max_concurrency over the scope's sources."""
    scope = ScopeConfig.model_validate(
        {
            "kind": "chat",
            "sources": [source(max_concurrency=3), source(name="b", max_concurrency=4)],
        }
    )
    assert scope.total_concurrency == 7


def test_settings_built_in_code_accept_an_api_key() -> None:
    """Code may give api_key as a SecretStr; no environment variable is needed then."""
    settings = GatewaySettings(
        scopes={
            "chat": {"kind": "chat", "sources": [source(api_key=SecretStr(API_KEY))]},
        }
    )
    key = settings.scope("chat").sources[0].api_key
    assert key is not None
    assert key.get_secret_value() == API_KEY


def test_settings_built_in_code_resolve_api_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Code-built settings resolve api_key_env from the environment like loaded ones."""
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    settings = GatewaySettings(
        scopes={"chat": {"kind": "chat", "sources": [source(api_key_env="OPENAI_API_KEY")]}}
    )
    key = settings.scope("chat").sources[0].api_key
    assert key is not None
    assert key.get_secret_value() == API_KEY


def test_settings_are_frozen() -> None:
    """Validated settings cannot be changed afterwards (checks would be bypassed)."""
    settings = GatewaySettings()
    with pytest.raises(ValidationError):
        settings.stall_window_s = 10_000  # type: ignore[misc]  # the point of the test


def test_scope_lookup_names_the_missing_scope_and_the_known_ones(
    write_toml: Callable[[str], Path],
) -> None:
    """scope(name) returns the scope, or a ConfigError naming it and listing the known scopes."""
    settings = GatewaySettings.load(write_toml(MINIMAL_SOURCE))
    assert settings.scope("chat").kind == "chat"
    with pytest.raises(ConfigError) as info:
        settings.scope("embed")
    assert "'embed'" in str(info.value)
    assert "['chat']" in str(info.value)
    assert info.value.field == "scopes.embed"


# --- bad input: each names the field and the file --------------------------------------------


def assert_names(error: ConfigError, field: str, path: Path | None) -> None:
    """The error carries the field and the file, and says both in its message."""
    assert error.field == field
    assert f"field {field!r}" in str(error)
    if path is not None:
        assert error.path == str(path)
        assert str(path) in str(error)
    assert isinstance(error, ValueError)
    assert isinstance(error, GatewayError)


def test_unknown_gateway_key_is_refused(write_toml: Callable[[str], Path]) -> None:
    """A misspelt [gateway] key fails at load, naming the key and the file."""
    path = write_toml("[gateway]\nstall_window = 120\n" + MINIMAL_SOURCE)
    error = load_error(path)
    assert_names(error, "stall_window", path)
    assert "unknown key" in str(error)


def test_unknown_top_level_section_is_refused(write_toml: Callable[[str], Path]) -> None:
    """A section other than [gateway] and [scopes.*] fails at load, naming it and the file."""
    path = write_toml("[gatway]\nmax_attempts = 2\n")
    assert_names(load_error(path), "gatway", path)


def test_unknown_source_key_is_refused(write_toml: Callable[[str], Path]) -> None:
    """A misspelt source key fails at load with its dotted path and the file."""
    path = write_toml(MINIMAL_SOURCE + "max_concurency = 4\n")
    error = load_error(path)
    assert_names(error, "scopes.chat.sources[0].max_concurency", path)
    assert "unknown key" in str(error)
    assert error.scope == "chat"


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("max_concurrency = 0", "max_concurrency"),
        ("max_concurrency = -3", "max_concurrency"),
        ("rpm = 0", "rpm"),
        ("rpm = -60", "rpm"),
        ("timeout_s = 0", "timeout_s"),
        ("timeout_s = -1.5", "timeout_s"),
    ],
)
def test_non_positive_limits_are_refused(
    write_toml: Callable[[str], Path], line: str, field: str
) -> None:
    """Zero or negative max_concurrency / rpm / timeout_s fails at load, naming the field."""
    path = write_toml(MINIMAL_SOURCE + line + "\n")
    error = load_error(path)
    assert_names(error, f"scopes.chat.sources[0].{field}", path)
    assert "greater than 0" in str(error)


def test_non_positive_gateway_value_is_refused(write_toml: Callable[[str], Path]) -> None:
    """A zero gateway duration fails at load, naming the key."""
    path = write_toml("[gateway]\npoll_interval_s = 0\n")
    assert_names(load_error(path), "poll_interval_s", path)


def test_duplicate_source_names_are_refused(write_toml: Callable[[str], Path]) -> None:
    """Two sources with one name in a scope fail at load, naming the second one."""
    second = MINIMAL_SOURCE.split("[[scopes.chat.sources]]")[1]
    path = write_toml(MINIMAL_SOURCE + "[[scopes.chat.sources]]" + second)
    error = load_error(path)
    assert_names(error, "scopes.chat.sources[1].name", path)
    assert "duplicate source name 'primary'" in str(error)


def test_empty_scope_is_refused(write_toml: Callable[[str], Path]) -> None:
    """A scope without sources fails at load, naming its sources."""
    path = write_toml('[scopes.chat]\nkind = "chat"\nsources = []\n')
    error = load_error(path)
    assert_names(error, "scopes.chat.sources", path)
    assert "at least one source" in str(error)


def test_scope_without_sources_key_is_refused(write_toml: Callable[[str], Path]) -> None:
    """A scope that never lists sources fails at load too."""
    path = write_toml('[scopes.chat]\nkind = "chat"\n')
    error = load_error(path)
    assert_names(error, "scopes.chat.sources", path)
    assert "missing" in str(error)


@pytest.mark.parametrize(
    ("kind", "protocol"),
    [
        ("chat", "monkey_ocr"),
        ("embed", "vision_ocr"),
        ("ocr", "openai"),
        ("embed", "anthropic"),
        ("ocr", "anthropic"),
    ],
)
def test_protocol_not_fitting_the_kind_is_refused(
    write_toml: Callable[[str], Path], kind: str, protocol: str
) -> None:
    """A source whose protocol cannot serve the scope's kind fails at load, naming it."""
    text = MINIMAL_SOURCE.replace('kind = "chat"', f'kind = "{kind}"').replace(
        'protocol = "openai"', f'protocol = "{protocol}"'
    )
    path = write_toml(text)
    error = load_error(path)
    assert_names(error, "scopes.chat.sources[0].protocol", path)
    assert f"protocol {protocol!r}" in str(error)


def test_anthropic_protocol_serves_a_chat_scope_beside_openai(
    write_toml: Callable[[str], Path],
) -> None:
    """protocol = "anthropic" loads in a chat scope, alone or mixed with an OpenAI source."""
    text = MINIMAL_SOURCE + (
        "[[scopes.chat.sources]]\n"
        'name = "claude"\n'
        'protocol = "anthropic"\n'
        'base_url = "https://api.anthropic.com/v1"\n'
        'model = "claude-sonnet-4-5"\n'
        'headers = { "anthropic-version" = "2023-06-01" }\n'
    )
    scope = GatewaySettings.load(write_toml(text)).scope("chat")
    assert [(s.name, s.protocol) for s in scope.sources] == [
        ("primary", "openai"),
        ("claude", "anthropic"),
    ]
    assert scope.exempt_429 is True


def test_a_chat_protocol_misfit_names_both_chat_protocols(
    write_toml: Callable[[str], Path],
) -> None:
    """The refusal of an OCR protocol in a chat scope says which protocols a chat scope takes."""
    path = write_toml(MINIMAL_SOURCE.replace('protocol = "openai"', 'protocol = "monkey_ocr"'))
    assert "use openai or anthropic" in str(load_error(path))


def test_api_key_in_the_file_is_refused(write_toml: Callable[[str], Path]) -> None:
    """api_key written in a file fails at load, pointing to api_key_env, without the key."""
    path = write_toml(MINIMAL_SOURCE + f'api_key = "{API_KEY}"\n')
    error = load_error(path)
    assert_names(error, "scopes.chat.sources[0].api_key", path)
    assert "api_key_env" in str(error)
    assert API_KEY not in str(error)
    assert API_KEY not in repr(error)


def test_credential_header_in_the_file_is_refused(write_toml: Callable[[str], Path]) -> None:
    """A credential-looking header in a file fails at load, without its value."""
    path = write_toml(MINIMAL_SOURCE + f'headers = {{ "X-Api-Key" = "{API_KEY}" }}\n')
    error = load_error(path)
    assert_names(error, "scopes.chat.sources[0].headers.X-Api-Key", path)
    assert API_KEY not in str(error)


def test_authorization_header_is_refused_even_in_code() -> None:
    """An Authorization header is refused wherever it comes from: the key goes in api_key."""
    with pytest.raises(ConfigError) as info:
        GatewaySettings(
            scopes={
                "chat": {
                    "kind": "chat",
                    "sources": [source(headers={"Authorization": f"Bearer {API_KEY}"})],
                }
            }
        )
    assert info.value.field == "scopes.chat.sources[0].headers.Authorization"
    assert API_KEY not in str(info.value)


def test_stall_window_above_the_progress_ttl_is_refused(write_toml: Callable[[str], Path]) -> None:
    """stall_window_s > 3600 fails at load and says why (the progress key lives 3600 s)."""
    path = write_toml("[gateway]\nstall_window_s = 3601\n")
    error = load_error(path)
    assert_names(error, "stall_window_s", path)
    assert "3600" in str(error)
    assert "progress" in str(error)


def test_stall_window_at_the_progress_ttl_is_accepted(write_toml: Callable[[str], Path]) -> None:
    """stall_window_s = 3600 exactly is the largest accepted window."""
    settings = GatewaySettings.load(write_toml("[gateway]\nstall_window_s = 3600\n"))
    assert settings.stall_window_s == PROGRESS_TTL_S


def test_stall_window_below_a_ttft_timeout_is_refused(write_toml: Callable[[str], Path]) -> None:
    """stall_window_s < max(ttft_timeout_s) fails at load, naming the window and the source."""
    path = write_toml("[gateway]\nstall_window_s = 20\n" + MINIMAL_SOURCE + "ttft_timeout_s = 25\n")
    error = load_error(path)
    assert_names(error, "stall_window_s", path)
    assert "scopes.chat.sources[0].ttft_timeout_s" in str(error)


def test_stall_window_equal_to_the_ttft_timeout_is_accepted(
    write_toml: Callable[[str], Path],
) -> None:
    """The conservative check only refuses a window strictly below a TTFT timeout."""
    path = write_toml("[gateway]\nstall_window_s = 25\n" + MINIMAL_SOURCE + "ttft_timeout_s = 25\n")
    assert GatewaySettings.load(path).stall_window_s == 25


def test_ttft_check_docstring_explains_ttft_is_productive() -> None:
    """The kept TTFT check documents that TTFT is productive, not charged to the stall budget."""
    doc = GatewaySettings._check_stall_covers_ttft.__doc__ or ""
    assert "productive" in doc
    assert "NOT" in doc
    assert "stall-budget.md §5" in doc


def test_breaker_cooldown_max_below_cooldown_is_refused(write_toml: Callable[[str], Path]) -> None:
    """breaker_cooldown_max_s < breaker_cooldown_s fails at load, naming the maximum."""
    path = write_toml("[gateway]\nbreaker_cooldown_s = 60\nbreaker_cooldown_max_s = 30\n")
    assert_names(load_error(path), "breaker_cooldown_max_s", path)


def test_backoff_cap_below_base_is_refused(write_toml: Callable[[str], Path]) -> None:
    """backoff_cap_s < backoff_base_s fails at load, naming the cap."""
    path = write_toml("[gateway]\nbackoff_base_s = 2\nbackoff_cap_s = 1\n")
    assert_names(load_error(path), "backoff_cap_s", path)


def test_missing_api_key_variable_is_refused(write_toml: Callable[[str], Path]) -> None:
    """An api_key_env naming an unset variable fails at load, naming the variable and source."""
    path = write_toml(MINIMAL_SOURCE + 'api_key_env = "OPENAI_API_KEY"\n')
    error = load_error(path, env_file=".env")
    assert_names(error, "scopes.chat.sources[0].api_key_env", path)
    assert "'OPENAI_API_KEY'" in str(error)
    assert "'primary'" in str(error)
    assert error.sources == ("primary",)


def test_empty_api_key_variable_counts_as_missing(
    write_toml: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """OPENAI_API_KEY= (as copied from .env.example) is reported like an unset variable."""
    monkeypatch.setenv("OPENAI_API_KEY", "")
    path = write_toml(MINIMAL_SOURCE + 'api_key_env = "OPENAI_API_KEY"\n')
    assert_names(load_error(path), "scopes.chat.sources[0].api_key_env", path)


def test_a_key_pasted_into_api_key_env_is_refused_without_echoing_it(
    write_toml: Callable[[str], Path],
) -> None:
    """An api_key_env that is not a variable name is refused, and its value is not shown."""
    path = write_toml(MINIMAL_SOURCE + f'api_key_env = "{API_KEY}"\n')
    error = load_error(path)
    assert_names(error, "scopes.chat.sources[0].api_key_env", path)
    assert API_KEY not in str(error)


def test_missing_file_is_refused(tmp_path: Path) -> None:
    """A settings file that does not exist is a ConfigError naming it."""
    path = tmp_path / "nowhere.toml"
    error = load_error(path)
    assert error.path == str(path)
    assert str(path) in str(error)
    assert "not found" in str(error)


def test_invalid_toml_is_refused(write_toml: Callable[[str], Path]) -> None:
    """A file that is not valid TOML is a ConfigError naming it."""
    path = write_toml("[gateway\nmax_attempts = 3\n")
    error = load_error(path)
    assert error.path == str(path)
    assert str(path) in str(error)
    assert "TOML" in str(error)


def test_several_errors_are_all_listed_and_the_first_is_the_field(
    write_toml: Callable[[str], Path],
) -> None:
    """Every validation error is in the message; the first one's location is the field."""
    path = write_toml("[gateway]\nmax_attempts = 0\npoll_interval_s = -1\n")
    error = load_error(path)
    assert error.field == "max_attempts"
    assert "max_attempts" in str(error)
    assert "poll_interval_s" in str(error)


def test_scope_names_outside_the_safe_alphabet_are_refused() -> None:
    """Scope names become Redis hash tags, so braces and colons are refused."""
    with pytest.raises(ConfigError) as info:
        GatewaySettings(scopes={"chat}x": {"kind": "chat", "sources": [source()]}})
    assert info.value.field == "scopes.chat}x"


def test_rpm_burst_without_rpm_is_refused() -> None:
    """A burst without its rate is refused: the rate was most likely forgotten."""
    with pytest.raises(ConfigError) as info:
        GatewaySettings(scopes={"chat": {"kind": "chat", "sources": [source(rpm_burst=5)]}})
    assert info.value.field == "scopes.chat.sources[0].rpm_burst"


def test_bad_base_url_is_refused() -> None:
    """base_url must be http:// or https://."""
    with pytest.raises(ConfigError) as info:
        GatewaySettings(
            scopes={"chat": {"kind": "chat", "sources": [source(base_url="127.0.0.1:8001")]}}
        )
    assert info.value.field == "scopes.chat.sources[0].base_url"


def test_code_built_settings_raise_config_error_without_a_path() -> None:
    """Construction in code raises ConfigError too, with no file to name."""
    with pytest.raises(ConfigError) as info:
        GatewaySettings(max_attempts=0)
    assert info.value.field == "max_attempts"
    assert info.value.path is None


# --- precedence: keyword > env > .env > file --------------------------------------------------


def test_environment_overrides_the_file(
    write_toml: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """POLYGATEWAY_STALL_WINDOW_S=120 wins over stall_window_s in the file."""
    monkeypatch.setenv("POLYGATEWAY_STALL_WINDOW_S", "120")
    path = write_toml("[gateway]\nstall_window_s = 600\nmax_attempts = 4\n")
    settings = GatewaySettings.load(path)
    assert settings.stall_window_s == 120
    assert settings.max_attempts == 4


def test_dotenv_feeds_overrides_and_api_key_lookups(
    write_toml: Callable[[str], Path], tmp_path: Path
) -> None:
    """A .env file overrides gateway keys and supplies the variable named by api_key_env."""
    (tmp_path / ".env").write_text(
        f"OPENAI_API_KEY={API_KEY}\nPOLYGATEWAY_MAX_ATTEMPTS=7\nUNRELATED_TOOL_SETTING=1\n",
        encoding="utf-8",
    )
    path = write_toml(
        "[gateway]\nmax_attempts = 2\n" + MINIMAL_SOURCE + 'api_key_env = "OPENAI_API_KEY"\n'
    )
    settings = GatewaySettings.load(path)
    assert settings.max_attempts == 7
    key = settings.scope("chat").sources[0].api_key
    assert key is not None
    assert key.get_secret_value() == API_KEY


def test_environment_overrides_dotenv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_toml: Callable[[str], Path]
) -> None:
    """The process environment wins over .env, for settings and for API keys."""
    (tmp_path / ".env").write_text(
        "OPENAI_API_KEY=from-dotenv\nPOLYGATEWAY_MAX_ATTEMPTS=7\n", encoding="utf-8"
    )
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv("POLYGATEWAY_MAX_ATTEMPTS", "9")
    path = write_toml(MINIMAL_SOURCE + 'api_key_env = "OPENAI_API_KEY"\n')
    settings = GatewaySettings.load(path)
    assert settings.max_attempts == 9
    key = settings.scope("chat").sources[0].api_key
    assert key is not None
    assert key.get_secret_value() == API_KEY


def test_custom_env_file_is_read_and_none_reads_no_env_file(
    tmp_path: Path, write_toml: Callable[[str], Path]
) -> None:
    """load(env_file=...) reads that file; env_file=None ignores even ./.env."""
    (tmp_path / "prod.env").write_text("POLYGATEWAY_MAX_ATTEMPTS=5\n", encoding="utf-8")
    (tmp_path / ".env").write_text("POLYGATEWAY_MAX_ATTEMPTS=6\n", encoding="utf-8")
    path = write_toml("[gateway]\nmax_attempts = 2\n")
    assert GatewaySettings.load(path, env_file=str(tmp_path / "prod.env")).max_attempts == 5
    assert GatewaySettings.load(path).max_attempts == 6
    assert GatewaySettings.load(path, env_file=None).max_attempts == 2


def test_keyword_arguments_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value given in code wins over POLYGATEWAY_* variables."""
    monkeypatch.setenv("POLYGATEWAY_MAX_ATTEMPTS", "9")
    monkeypatch.setenv("POLYGATEWAY_BACKEND", "redis")
    settings = GatewaySettings(max_attempts=2)
    assert settings.max_attempts == 2
    assert settings.backend == "redis"


def test_scopes_json_in_the_environment_merges_over_the_file(
    write_toml: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """POLYGATEWAY_SCOPES (JSON) adds scopes and changes keys of the file's scopes."""
    monkeypatch.setenv(
        "POLYGATEWAY_SCOPES",
        json.dumps(
            {
                "chat": {"exempt_429": False},
                "embed": {"kind": "embed", "sources": [source(name="e")]},
            }
        ),
    )
    settings = GatewaySettings.load(write_toml(MINIMAL_SOURCE))
    assert settings.scope("chat").exempt_429 is False
    assert settings.scope("chat").sources[0].name == "primary"
    assert settings.scope("embed").sources[0].name == "e"


def test_malformed_scopes_json_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """POLYGATEWAY_SCOPES that is not JSON is a ConfigError, not a pydantic-settings error."""
    monkeypatch.setenv("POLYGATEWAY_SCOPES", "{not json")
    with pytest.raises(ConfigError) as info:
        GatewaySettings()
    assert "scopes" in str(info.value)


def test_invalid_environment_value_is_a_config_error_naming_the_field(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A POLYGATEWAY_* value of the wrong type is a ConfigError naming the setting."""
    monkeypatch.setenv("POLYGATEWAY_STALL_WINDOW_S", "soon")
    with pytest.raises(ConfigError) as info:
        GatewaySettings()
    assert info.value.field == "stall_window_s"


def test_env_example_documents_every_gateway_setting_with_its_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """.env.example has one commented POLYGATEWAY_* line per setting, showing its real default."""
    text = ENV_EXAMPLE.read_text(encoding="utf-8")
    documented = dict(re.findall(r"^# POLYGATEWAY_([A-Z0-9_]+)=(.*)$", text, re.M))
    assert {name.lower() for name in documented} == set(GatewaySettings.model_fields)
    assert re.search(r"^OPENAI_API_KEY=$", text, re.M)
    defaults = GatewaySettings()
    for name, value in documented.items():
        if name != "SCOPES":
            monkeypatch.setenv(f"POLYGATEWAY_{name}", value)
    # Every documented value, read back through the environment, is the default.
    assert GatewaySettings() == defaults
    assert GatewaySettings(max_attempts=4) != defaults
    stall = text.split("POLYGATEWAY_STALL_WINDOW_S")[0].rsplit("\n\n", 1)[1]
    for phrase in ("429", "polling", "cool-down", "rate-limit", "timeout_s", "3600"):
        assert phrase in stall, phrase


def test_env_example_scopes_line_is_valid_json_for_scopes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The commented POLYGATEWAY_SCOPES example in .env.example works when uncommented."""
    text = ENV_EXAMPLE.read_text(encoding="utf-8")
    match = re.search(r"^# POLYGATEWAY_SCOPES=(.*)$", text, re.M)
    assert match is not None
    monkeypatch.setenv("POLYGATEWAY_SCOPES", match.group(1))
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    assert GatewaySettings().scope("chat").sources[0].name == "primary"


# --- secrets never printed ---------------------------------------------------------------------


def test_redis_password_is_masked_when_printed(
    write_toml: Callable[[str], Path],
) -> None:
    """The Redis password appears in no str / repr / dump, only through get_redis_url()."""
    url = f"redis://default:{REDIS_PASSWORD}@redis.internal:6380/2"
    settings = GatewaySettings.load(
        write_toml(f'[gateway]\nbackend = "redis"\nredis_url = "{url}"\n')
    )
    assert settings.get_redis_url() == url
    assert settings.redis_url_masked == "redis://default:***@redis.internal:6380/2"
    for shown in (
        str(settings),
        repr(settings),
        settings.model_dump_json(),
        str(settings.model_dump()),
    ):
        assert REDIS_PASSWORD not in shown
    assert "redis://default:***@redis.internal:6380/2" in repr(settings)


def test_bad_redis_url_error_does_not_repeat_the_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis URL with a wrong scheme is refused without echoing its password."""
    monkeypatch.setenv("POLYGATEWAY_REDIS_URL", f"http://u:{REDIS_PASSWORD}@h/0")
    with pytest.raises(ConfigError) as info:
        GatewaySettings()
    assert info.value.field == "redis_url"
    assert REDIS_PASSWORD not in str(info.value)
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__ is True


def test_api_key_never_appears_in_output(
    write_toml: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resolved API key is in no repr, str or dump of the settings, scope or source."""
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    settings = GatewaySettings.load(write_toml(MINIMAL_SOURCE + 'api_key_env = "OPENAI_API_KEY"\n'))
    src = settings.scope("chat").sources[0]
    assert src.api_key is not None
    assert src.api_key.get_secret_value() == API_KEY
    for shown in (
        repr(settings),
        str(settings),
        settings.model_dump_json(),
        str(settings.model_dump()),
        repr(settings.scope("chat")),
        repr(src),
        str(src),
        src.model_dump_json(),
    ):
        assert API_KEY not in shown


def test_api_key_never_appears_in_a_config_error(
    write_toml: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ConfigError raised while a key is resolvable does not contain the key."""
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv(
        "POLYGATEWAY_SCOPES",
        json.dumps(
            {"chat": {"sources": [source(api_key=API_KEY, max_concurrency=0, bogus=API_KEY)]}}
        ),
    )
    path = write_toml(MINIMAL_SOURCE)
    error = load_error(path)
    assert API_KEY not in str(error)
    assert API_KEY not in repr(error)
    assert error.__cause__ is None
    assert error.__suppress_context__ is True


def test_code_given_credential_headers_are_masked_when_printed() -> None:
    """Headers that look like credentials are masked in repr and dumps; the real value is kept."""
    src = SourceConfig(
        name="a",
        protocol="openai",
        base_url="https://u:pw-SECRET@api.example/v1",
        headers={"X-Api-Key": API_KEY, "X-Org": "acme"},
    )
    assert src.headers["X-Api-Key"] == API_KEY
    for shown in (repr(src), str(src), src.model_dump_json(), str(src.model_dump())):
        assert API_KEY not in shown
        assert "pw-SECRET" not in shown
        assert "acme" in shown


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("rediss://user:pw@h/1", "rediss://user:***@h/1"),
        ("https://token@h/x", "https://***@h/x"),
        ("redis://u:pw@[::1]:6379", "redis://u:***@[::1]:6379"),
        ("redis://h/0?password=pw&db=1", "redis://h/0?password=***&db=1"),
        ("http://[broken", "***"),
    ],
)
def test_mask_url_hides_credentials(url: str, masked: str) -> None:
    """mask_url keeps the URL readable and hides passwords, user tokens and secret parameters."""
    assert mask_url(url) == masked


def test_readme_settings_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The TOML that README.md shows loads as written (a stale example is a user's first error)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv("ANTHROPIC_API_KEY", API_KEY)
    path = tmp_path / "polygateway.toml"
    path.write_text(block, encoding="utf-8")
    settings = GatewaySettings.load(path)
    assert [s.protocol for s in settings.scope("chat").sources] == ["openai", "anthropic"]
