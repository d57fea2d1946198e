"""Settings review: bad values refused at load with the key path, secrets never shown."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from polygateway.cli import EXIT_CONFIG, main, positive_float
from polygateway.cli.settings_report import report_lines, setting_rows
from polygateway.config import GatewaySettings, SourceConfig
from polygateway.errors import ConfigError

QUERY_KEY = "AIza-query-key-SECRET"

ONE_SOURCE = """
[scopes.chat]
kind = "chat"
[[scopes.chat.sources]]
name = "a"
protocol = "openai"
base_url = "http://127.0.0.1:8001/v1"
"""


pytestmark = pytest.mark.usefixtures("clean_environment")
"""An empty directory and no PolyGateway variables (``conftest.clean_environment``)."""


def settings_file(tmp_path: Path, extra: str = "") -> Path:
    """``polygateway.toml`` with one chat source (plus ``extra`` lines in its source table)."""
    path = tmp_path / "polygateway.toml"
    path.write_text(ONE_SOURCE + extra, encoding="utf-8")
    return path


def load_error(path: Path) -> ConfigError:
    """Load ``path`` (no .env) expecting a ConfigError, and return it."""
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(path, env_file=None)
    return info.value


def problem(error: ConfigError) -> str:
    """The message of ``error`` without its ``[field ... in FILE]`` tail (paths name tests)."""
    return str(error).partition(" [")[0]


# --- secrets never printed ---------------------------------------------------------------


def test_a_credential_query_parameter_is_masked_when_printed() -> None:
    """``query = {key = ...}`` is masked in repr and dumps as ``?key=`` in base_url is."""
    src = SourceConfig(
        name="a",
        protocol="openai",
        base_url="https://api.example/v1",
        query={"key": QUERY_KEY, "api-version": "2024-06-01"},
    )
    assert src.query["key"] == QUERY_KEY
    for shown in (repr(src), str(src), src.model_dump_json(), str(src.model_dump())):
        assert QUERY_KEY not in shown
        assert "2024-06-01" in shown


def test_check_config_report_masks_a_credential_query_parameter(tmp_path: Path) -> None:
    """The check-config report shows a credential query value as ``***``, never the value."""
    path = settings_file(tmp_path, f'query = {{key = "{QUERY_KEY}", "api-version" = "v1"}}\n')
    settings = GatewaySettings.load(path, env_file=None)
    rows = setting_rows(settings, {"scopes": {}}, str(path), None)
    report = "\n".join(report_lines(rows))
    assert QUERY_KEY not in report
    assert "key=***, api-version=v1" in report


# --- numbers: finite only ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "key", "value"),
    [
        ("source", "timeout_s", "inf"),
        ("source", "weight", "inf"),
        ("source", "rpm", "inf"),
        ("source", "tpm", "nan"),
        ("source", "connect_timeout_s", "nan"),
        ("gateway", "close_grace_s", "inf"),
        ("gateway", "lease_grace_s", "inf"),
        ("gateway", "redis_socket_timeout_s", "inf"),
        ("gateway", "redis_replica_ack_timeout_s", "inf"),
        ("gateway", "backoff_base_s", "nan"),
    ],
)
def test_a_non_finite_number_is_refused_naming_its_key(
    tmp_path: Path, table: str, key: str, value: str
) -> None:
    """``inf`` or ``nan`` (valid TOML) is refused at load as not finite, naming the key."""
    line = f"{key} = {value}\n"
    if table == "gateway":
        path = tmp_path / "polygateway.toml"
        path.write_text(f"[gateway]\n{line}{ONE_SOURCE}", encoding="utf-8")
        field = key
    else:
        path = settings_file(tmp_path, line)
        field = f"scopes.chat.sources[0].{key}"
    error = load_error(path)
    assert error.field == field
    assert "finite" in problem(error)


def test_an_infinite_share_of_a_priority_class_is_refused(tmp_path: Path) -> None:
    """A priority class's ``share = inf`` is refused, naming the class's key."""
    path = tmp_path / "polygateway.toml"
    path.write_text(
        ONE_SOURCE.replace('kind = "chat"', 'kind = "chat"\ndefault_priority_class = "bulk"')
        + "[scopes.chat.priority_classes.bulk]\nshare = inf\n",
        encoding="utf-8",
    )
    error = load_error(path)
    assert error.field == "scopes.chat.priority_classes.bulk.share"
    assert "finite" in problem(error)


def test_an_infinite_value_from_the_environment_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``POLYGATEWAY_CLOSE_GRACE_S=inf`` is refused, naming that variable."""
    monkeypatch.setenv("POLYGATEWAY_CLOSE_GRACE_S", "inf")
    error = load_error(settings_file(tmp_path))
    assert (error.field, error.env) == ("close_grace_s", "POLYGATEWAY_CLOSE_GRACE_S")
    assert "finite" in problem(error)


# --- overrides that are not JSON ---------------------------------------------------------------


def test_scopes_override_that_is_not_json_names_the_variable_not_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Broken JSON in POLYGATEWAY_SCOPES names that variable and the field, not the file."""
    monkeypatch.setenv("POLYGATEWAY_SCOPES", '{"chat": {')
    error = load_error(settings_file(tmp_path))
    assert (error.field, error.env, error.path) == ("scopes", "POLYGATEWAY_SCOPES", None)
    assert "polygateway.toml" not in str(error)


def test_a_list_override_in_dotenv_that_is_not_json_names_the_dotenv_file(
    tmp_path: Path,
) -> None:
    """Broken JSON for a list setting in .env names the variable and the .env file."""
    (tmp_path / ".env").write_text("POLYGATEWAY_REDIS_SENTINELS=h:26379\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(settings_file(tmp_path), env_file=".env")
    error = info.value
    assert (error.field, error.env, error.path) == (
        "redis_sentinels",
        "POLYGATEWAY_REDIS_SENTINELS",
        ".env",
    )
    assert "JSON" in problem(error)


# --- overrides that are JSON, but not of the setting's shape ---------------------------------


@pytest.mark.parametrize("value", ["null", " null ", "[]", '"text"', "1", "true"])
def test_a_scopes_override_that_is_no_table_of_scopes_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """POLYGATEWAY_SCOPES holding JSON that is not an object (``null`` too) names that variable."""
    monkeypatch.setenv("POLYGATEWAY_SCOPES", value)
    error = load_error(settings_file(tmp_path))
    assert (error.field, error.env, error.path) == ("scopes", "POLYGATEWAY_SCOPES", None)
    assert "polygateway.toml" not in str(error)


def test_a_null_scopes_override_says_null_is_not_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``POLYGATEWAY_SCOPES=null`` is refused saying what the variable takes and how to unset it."""
    monkeypatch.setenv("POLYGATEWAY_SCOPES", "null")
    message = problem(load_error(settings_file(tmp_path)))
    assert "null" in message
    assert "JSON object" in message
    assert "unset" in message


def test_a_null_scopes_override_is_refused_without_a_settings_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``POLYGATEWAY_SCOPES=null`` does not quietly leave the scopes empty when built in code."""
    monkeypatch.setenv("POLYGATEWAY_SCOPES", "null")
    with pytest.raises(ConfigError) as info:
        GatewaySettings()
    assert (info.value.field, info.value.env) == ("scopes", "POLYGATEWAY_SCOPES")


@pytest.mark.parametrize("value", ["null", '"h:26379"', "{}"])
def test_a_sentinels_override_in_dotenv_that_is_no_list_names_the_dotenv_file(
    tmp_path: Path, value: str
) -> None:
    """POLYGATEWAY_REDIS_SENTINELS in .env holding JSON that is no list (``null`` too): refused."""
    (tmp_path / ".env").write_text(f"POLYGATEWAY_REDIS_SENTINELS={value}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(settings_file(tmp_path), env_file=".env")
    error = info.value
    assert (error.field, error.env, error.path) == (
        "redis_sentinels",
        "POLYGATEWAY_REDIS_SENTINELS",
        ".env",
    )


def test_a_null_sentinels_override_says_a_json_list_is_due(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``POLYGATEWAY_REDIS_SENTINELS=null`` is refused saying the setting is a JSON list."""
    monkeypatch.setenv("POLYGATEWAY_REDIS_SENTINELS", "null")
    error = load_error(settings_file(tmp_path))
    assert (error.field, error.env, error.path) == (
        "redis_sentinels",
        "POLYGATEWAY_REDIS_SENTINELS",
        None,
    )
    assert "JSON list" in problem(error)


def test_a_null_inside_a_scopes_override_is_left_to_validation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a whole variable of ``null`` is refused: ``null`` for a key means that key's null."""
    monkeypatch.setenv("POLYGATEWAY_SCOPES", '{"chat": {"exempt_429": null}}')
    settings = GatewaySettings.load(settings_file(tmp_path), env_file=None)
    assert settings.scope("chat").exempt_429 is True


# --- the command line ----------------------------------------------------------------------


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "Infinity"])
def test_a_non_finite_seconds_or_scale_argument_is_refused(text: str) -> None:
    """``--interval inf`` would never refresh and ``demo --scale inf`` overflows: refused."""
    with pytest.raises(argparse.ArgumentTypeError, match="finite"):
        positive_float(text)


def test_status_with_an_infinite_interval_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``status --interval inf`` exits 2 with argparse's usage error, before any settings."""
    assert main(["status", "--interval", "inf", "--config", "absent.toml"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "argument --interval" in err
    assert "absent.toml" not in err


# --- verify: a boolean or a CA bundle that exists ------------------------------------------


@pytest.mark.parametrize("text", ["false", "true", "False", "no"])
def test_a_quoted_boolean_for_verify_is_refused(tmp_path: Path, text: str) -> None:
    """``verify = "false"`` would be read as a CA bundle path: refused, saying to unquote it."""
    error = load_error(settings_file(tmp_path, f'verify = "{text}"\n'))
    assert error.field == "scopes.chat.sources[0].verify"
    assert "without quotes" in problem(error)


def test_a_verify_path_that_names_no_file_is_refused(tmp_path: Path) -> None:
    """A CA bundle that is not there fails every call (a raw FileNotFoundError): refused at load."""
    error = load_error(settings_file(tmp_path, 'verify = "certs/missing-ca.pem"\n'))
    assert error.field == "scopes.chat.sources[0].verify"
    assert "certs/missing-ca.pem" in problem(error)
    assert "no file" in problem(error)


def test_a_verify_path_to_an_existing_bundle_is_kept(tmp_path: Path) -> None:
    """A CA bundle path that names a file loads as written."""
    (tmp_path / "ca.pem").write_text("not parsed at load\n", encoding="utf-8")
    settings = GatewaySettings.load(settings_file(tmp_path, 'verify = "ca.pem"\n'), env_file=None)
    assert settings.scope("chat").sources[0].verify == "ca.pem"


# --- numbers of the wrong type ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("max_concurrency = true", "max_concurrency"),
        ("priority = false", "priority"),
        ("rpm = true", "rpm"),
        ('max_concurrency = "8"', "max_concurrency"),
        ('timeout_s = "30"', "timeout_s"),
    ],
)
def test_a_source_number_given_as_a_boolean_or_a_string_is_refused(
    tmp_path: Path, line: str, key: str
) -> None:
    """``max_concurrency = true`` is not 1 and ``"8"`` is not 8: TOML types them, so refused."""
    error = load_error(settings_file(tmp_path, line + "\n"))
    assert error.field == f"scopes.chat.sources[0].{key}"
    assert "must be a number" in problem(error)


def test_a_gateway_number_given_as_a_boolean_is_refused(tmp_path: Path) -> None:
    """``max_attempts = true`` in [gateway] is refused, not read as 1 attempt."""
    path = tmp_path / "polygateway.toml"
    path.write_text("[gateway]\nmax_attempts = true\n" + ONE_SOURCE, encoding="utf-8")
    error = load_error(path)
    assert error.field == "max_attempts"
    assert "must be a number" in problem(error)


def test_a_share_given_as_a_boolean_is_refused(tmp_path: Path) -> None:
    """A priority class's ``share = true`` is refused, not read as a share of 1."""
    path = tmp_path / "polygateway.toml"
    path.write_text(
        ONE_SOURCE.replace('kind = "chat"', 'kind = "chat"\ndefault_priority_class = "bulk"')
        + "[scopes.chat.priority_classes.bulk]\nshare = true\n",
        encoding="utf-8",
    )
    error = load_error(path)
    assert error.field == "scopes.chat.priority_classes.bulk.share"
    assert "must be a number" in problem(error)


def test_whole_floats_and_gateway_numbers_from_the_environment_still_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``max_batch_size = 64.0`` is 64, and POLYGATEWAY_MAX_ATTEMPTS=2 (a string) is 2."""
    monkeypatch.setenv("POLYGATEWAY_MAX_ATTEMPTS", "2")
    settings = GatewaySettings.load(
        settings_file(tmp_path, "max_batch_size = 64.0\n"), env_file=None
    )
    assert settings.max_attempts == 2
    assert settings.scope("chat").sources[0].max_batch_size == 64


@pytest.mark.parametrize(
    "url",
    [
        "redis://:pw-redis-SECRET@10.0.0.5:99999/2",
        "redis://:pw-redis-SECRET@10.0.0.5:6380/two",
        "redis://:pw-redis-SECRET@10.0.0.5:6380/2?no_such_option=1",
    ],
)
def test_check_config_refuses_a_redis_url_the_backend_cannot_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    """check-config exits 2 for a redis_url every run would refuse, never showing its password."""
    path = tmp_path / "polygateway.toml"
    path.write_text(f'[gateway]\nbackend = "redis"\nredis_url = "{url}"\n{ONE_SOURCE}')
    assert main(["check-config", "--config", str(path), "--no-env-file"]) == EXIT_CONFIG
    captured = capsys.readouterr()
    assert "field 'redis_url'" in captured.err
    assert str(path) in captured.err
    assert "pw-redis-SECRET" not in captured.out + captured.err


# --- proxy: a URL every call can use ----------------------------------------------------------


@pytest.mark.parametrize(
    ("proxy", "says"),
    [
        ("http://", "no host"),
        ("http://:pw-proxy-SECRET@proxy.internal:99999", "port"),
        ("http://u:pw-proxy-SECRET@proxy.internal:port", "port"),
        ("http://proxy internal:3128", "whitespace"),
    ],
)
def test_a_malformed_proxy_is_refused_without_its_password(
    tmp_path: Path, proxy: str, says: str
) -> None:
    """A proxy no call can use (each would fail as a connect error) is refused at load."""
    error = load_error(settings_file(tmp_path, f'proxy = "{proxy}"\n'))
    assert error.field == "scopes.chat.sources[0].proxy"
    assert says in problem(error)
    assert "pw-proxy-SECRET" not in str(error)


def test_a_usable_proxy_is_kept(tmp_path: Path) -> None:
    """A proxy with a host, a port and credentials loads as written."""
    proxy = "http://u:pw@proxy.internal:3128"
    path = settings_file(tmp_path, f'proxy = "{proxy}"\n')
    assert GatewaySettings.load(path, env_file=None).scope("chat").sources[0].proxy == proxy


# --- Sentinels: host:port, never a URL with credentials -------------------------------------


@pytest.mark.parametrize(
    "sentinel",
    ["redis://:pw-sentinel-SECRET@s1.internal", "redis://:pw-sentinel-SECRET@s1.internal:26379"],
)
def test_a_sentinel_written_as_a_url_is_refused_without_its_password(sentinel: str) -> None:
    """A Sentinel given as a URL with a password is refused, and the password is not repeated."""
    with pytest.raises(ConfigError) as info:
        GatewaySettings(
            _env_file=None,
            redis_mode="sentinel",
            redis_sentinels=[sentinel],
            redis_sentinel_master="mymaster",
        )
    assert info.value.field == "redis_sentinels"
    assert "redis_sentinel_password" in problem(info.value)
    assert "pw-sentinel-SECRET" not in str(info.value)
    assert "pw-sentinel-SECRET" not in repr(info.value)


def test_a_sentinel_host_with_a_space_is_refused() -> None:
    """``"s1 internal:26379"`` names no host a connection can reach: refused at load."""
    with pytest.raises(ConfigError) as info:
        GatewaySettings(
            _env_file=None,
            redis_mode="sentinel",
            redis_sentinels=["s1 internal:26379"],
            redis_sentinel_master="mymaster",
        )
    assert info.value.field == "redis_sentinels"


# --- override variables that set nothing ---------------------------------------------------


def test_a_nested_variable_under_a_plain_setting_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``POLYGATEWAY_MAX_ATTEMPTS__X=5`` sets nothing (not a table): refused, not ignored."""
    monkeypatch.setenv("POLYGATEWAY_MAX_ATTEMPTS__X", "5")
    error = load_error(settings_file(tmp_path))
    assert error.env == "POLYGATEWAY_MAX_ATTEMPTS__X"
    assert "POLYGATEWAY_MAX_ATTEMPTS" in problem(error)


def test_a_nested_variable_under_scopes_still_sets_a_scope_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``POLYGATEWAY_SCOPES__CHAT__EXEMPT_429=false`` still reaches the scope's key."""
    monkeypatch.setenv("POLYGATEWAY_SCOPES__CHAT__EXEMPT_429", "false")
    settings = GatewaySettings.load(settings_file(tmp_path), env_file=None)
    assert settings.scope("chat").exempt_429 is False


# --- contradictory limits ---------------------------------------------------------------------


def test_an_rpm_burst_below_one_request_is_refused(tmp_path: Path) -> None:
    """``rpm_burst = 0.5`` could never hold the one token a request takes: refused at load."""
    error = load_error(settings_file(tmp_path, "rpm = 60\nrpm_burst = 0.5\n"))
    assert error.field == "scopes.chat.sources[0].rpm_burst"
    assert "at least 1" in problem(error)


def test_an_rpm_burst_of_one_request_is_accepted(tmp_path: Path) -> None:
    """``rpm_burst = 1`` admits one request at a time: a strict pace, but a usable one."""
    path = settings_file(tmp_path, "rpm = 60\nrpm_burst = 1\n")
    assert GatewaySettings.load(path, env_file=None).scope("chat").sources[0].rpm_burst == 1


# --- a key pasted where a variable's name goes ------------------------------------------------


@pytest.mark.parametrize(
    "pasted",
    ["a3f9c2e17b6d4e0f9a8b7c6d5e4f3a2b", "AIzaSyD4x9Kq2Lm7Np3Rs8Tu1Vw6Xy0Zb5Cd"],
)
def test_a_key_that_is_also_a_valid_variable_name_is_refused_without_echoing_it(
    tmp_path: Path, pasted: str
) -> None:
    """An Azure-style hex key pasted into api_key_env is refused, and never shown."""
    error = load_error(settings_file(tmp_path, f'api_key_env = "{pasted}"\n'))
    assert error.field == "scopes.chat.sources[0].api_key_env"
    assert pasted not in str(error)
    assert pasted not in repr(error)


@pytest.mark.parametrize("name", ["OPENAI_API_KEY", "AZURE_OPENAI_KEY_2", "my_service_api_key_v2"])
def test_an_ordinary_variable_name_is_still_looked_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Ordinary names, lower case or with a digit, are read from the environment as before."""
    monkeypatch.setenv(name, "sk-some-key")
    settings = GatewaySettings.load(
        settings_file(tmp_path, f'api_key_env = "{name}"\n'), env_file=None
    )
    key = settings.scope("chat").sources[0].api_key
    assert key is not None
    assert key.get_secret_value() == "sk-some-key"


# --- where a bad value inside a scope came from ----------------------------------------------


def test_a_bad_value_in_a_file_scope_names_the_file_beside_a_scopes_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """POLYGATEWAY_SCOPES adding another scope does not take the blame for the file's bad rpm."""
    monkeypatch.setenv(
        "POLYGATEWAY_SCOPES",
        '{"embed": {"kind": "embed", "sources": [{"name": "e", "protocol": "openai", '
        '"base_url": "http://127.0.0.1:8001/v1"}]}}',
    )
    path = settings_file(tmp_path, "rpm = -1\n")
    error = load_error(path)
    assert error.field == "scopes.chat.sources[0].rpm"
    assert (error.env, error.path) == (None, str(path))


def test_a_bad_value_the_scopes_override_sets_still_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad value inside POLYGATEWAY_SCOPES's own scope table names that variable."""
    monkeypatch.setenv("POLYGATEWAY_SCOPES", '{"chat": {"exempt_429": "sometimes"}}')
    error = load_error(settings_file(tmp_path))
    assert error.field == "scopes.chat.exempt_429"
    assert (error.env, error.path) == ("POLYGATEWAY_SCOPES", None)


def test_a_bad_source_in_a_replaced_sources_list_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sources list in POLYGATEWAY_SCOPES replaces the file's: its errors are the variable's."""
    monkeypatch.setenv(
        "POLYGATEWAY_SCOPES",
        '{"chat": {"sources": [{"name": "a", "protocol": "openai", '
        '"base_url": "http://127.0.0.1:8001/v1", "rpm": -1}]}}',
    )
    error = load_error(settings_file(tmp_path))
    assert error.field == "scopes.chat.sources[0].rpm"
    assert (error.env, error.path) == ("POLYGATEWAY_SCOPES", None)


def test_a_key_missing_from_a_scope_the_override_adds_names_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scope only POLYGATEWAY_SCOPES defines, without its kind, is that variable's mistake."""
    monkeypatch.setenv(
        "POLYGATEWAY_SCOPES",
        '{"embed": {"sources": [{"name": "e", "protocol": "openai", '
        '"base_url": "http://127.0.0.1:8001/v1"}]}}',
    )
    error = load_error(settings_file(tmp_path))
    assert error.field == "scopes.embed.kind"
    assert (error.env, error.path) == ("POLYGATEWAY_SCOPES", None)


def test_check_config_report_credits_file_scopes_to_the_file_beside_a_scopes_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The report credits a file scope's values to the file, an added scope's to the variable."""
    monkeypatch.setenv(
        "POLYGATEWAY_SCOPES",
        '{"embed": {"kind": "embed", "sources": [{"name": "e", "protocol": "openai", '
        '"base_url": "http://127.0.0.1:8001/v1"}]}}',
    )
    path = settings_file(tmp_path, "max_concurrency = 4\n")
    settings = GatewaySettings.load(path, env_file=None)
    raw = {"scopes": {"chat": {"sources": [{"max_concurrency": 4}]}}}
    rows = setting_rows(settings, raw, str(path), None)
    chat_rows = {row.key: row.origin for row in rows["scopes"]["chat"]["sources"][0][1]}
    embed_rows = {row.key: row.origin for row in rows["scopes"]["embed"]["sources"][0][1]}
    assert chat_rows["max_concurrency"] == str(path)
    assert chat_rows["rpm"] == "default"
    assert embed_rows["base_url"] == "env POLYGATEWAY_SCOPES"


# --- files that are not UTF-8 --------------------------------------------------------------


def test_a_settings_file_that_is_not_utf8_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """A Latin-1 byte in the settings file is a ConfigError naming the file, not a UnicodeError."""
    path = tmp_path / "polygateway.toml"
    path.write_bytes(b'[gateway]\nbackend = "memory"\n# caf\xe9\n')
    error = load_error(path)
    assert error.path == str(path)
    assert "UTF-8" in problem(error)


def test_a_dotenv_file_that_is_not_utf8_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """A Latin-1 byte in .env is a ConfigError naming .env, not a UnicodeError."""
    (tmp_path / ".env").write_bytes(b"POLYGATEWAY_MAX_ATTEMPTS=2\n# caf\xe9\n")
    with pytest.raises(ConfigError) as info:
        GatewaySettings.load(settings_file(tmp_path), env_file=".env")
    assert info.value.path == ".env"
    assert "UTF-8" in problem(info.value)


def test_check_config_of_a_file_that_is_not_utf8_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """check-config reports a non-UTF-8 file as bad settings (2), not as a crash (1)."""
    path = tmp_path / "polygateway.toml"
    path.write_bytes(b"# caf\xe9\n")
    assert main(["check-config", "--config", str(path), "--no-env-file"]) == EXIT_CONFIG
    assert "UnicodeDecodeError" not in capsys.readouterr().err


# --- --env-file --------------------------------------------------------------------------------


def test_an_env_file_named_on_the_command_line_must_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--env-file prod.env`` that is not there exits 2, rather than reading nothing silently."""
    path = settings_file(tmp_path)
    assert main(["check-config", "--config", str(path), "--env-file", "prod.env"]) == EXIT_CONFIG
    assert "prod.env" in capsys.readouterr().err


def test_the_default_env_file_may_be_absent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --env-file, a missing .env is no error: it is optional."""
    assert main(["check-config", "--config", str(settings_file(tmp_path))]) == 0
    assert "is valid" in capsys.readouterr().out


def test_env_file_and_no_env_file_together_are_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--env-file X --no-env-file`` contradict each other: a usage error, exit 2."""
    (tmp_path / "x.env").write_text("", encoding="utf-8")
    path = settings_file(tmp_path)
    argv = ["check-config", "--config", str(path), "--env-file", "x.env", "--no-env-file"]
    assert main(argv) == EXIT_CONFIG
    assert "--no-env-file" in capsys.readouterr().err


def test_embed_with_texts_and_a_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``embed --file t.txt hello`` would drop the file's texts silently: a usage error instead."""
    (tmp_path / "t.txt").write_text("one\ntwo\n", encoding="utf-8")
    argv = ["embed", "--config", "absent.toml", "--file", "t.txt", "hello"]
    assert main(argv) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "--file" in err
    assert "absent.toml" not in err
