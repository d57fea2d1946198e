"""``redis_mode`` and its companions: what each topology accepts, refused at load with the field."""

from __future__ import annotations

import pytest

from polygateway.backends.redis import RedisBackend
from polygateway.backends.redis.cluster import read_shards, read_slots
from polygateway.cli.settings_report import report_lines, setting_rows
from polygateway.config import GatewaySettings
from polygateway.errors import ConfigError

SENTINEL = {"redis_mode": "sentinel", "redis_sentinels": ["127.0.0.1:26379"]}
SENTINEL_PASSWORD = "sentinel-pw-SECRET-5e1f"
SENTINEL_USERNAME = "sentinel-user-SECRET-8a3c"


def test_standalone_is_the_default_topology() -> None:
    """No redis_mode: standalone, no Sentinels."""
    settings = GatewaySettings()
    assert settings.redis_mode == "standalone"
    assert settings.redis_sentinels == []
    assert settings.redis_sentinel_master == ""
    assert settings.redis_sentinel_password.get_secret_value() == ""
    assert settings.redis_sentinel_username.get_secret_value() == ""


def test_sentinel_mode_without_a_url_means_no_password_and_database_0() -> None:
    """The default redis_url names a host the Sentinels replace: it is read as redis:///0."""
    settings = GatewaySettings(**SENTINEL, redis_sentinel_master="mymaster")
    assert settings.get_redis_url() == "redis:///0"


def test_sentinel_mode_takes_a_password_and_database_only() -> None:
    """redis://:PASSWORD@/DB is the sentinel-mode URL; it stays masked when printed."""
    settings = GatewaySettings(
        **SENTINEL, redis_sentinel_master="mymaster", redis_url="redis://:pw-SECRET@/2"
    )
    assert settings.get_redis_url() == "redis://:pw-SECRET@/2"
    assert "pw-SECRET" not in repr(settings)


@pytest.mark.parametrize(
    ("values", "field", "problem"),
    [
        ({"redis_mode": "sentinel"}, "redis_sentinels", "needs redis_sentinels"),
        (SENTINEL, "redis_sentinel_master", "needs redis_sentinel_master"),
        (
            {**SENTINEL, "redis_sentinel_master": "m", "redis_url": "redis://:pw@h:6379/0"},
            "redis_url",
            "no host, port or socket",
        ),
        (
            {"redis_mode": "sentinel", "redis_sentinels": ["nohost"], "redis_sentinel_master": "m"},
            "redis_sentinels",
            "host:port",
        ),
        (
            {"redis_mode": "sentinel", "redis_sentinels": ["h:0"], "redis_sentinel_master": "m"},
            "redis_sentinels",
            "1-65535",
        ),
        ({"redis_sentinels": ["h:26379"]}, "redis_sentinels", "only read with"),
        ({"redis_sentinel_master": "m"}, "redis_sentinel_master", "only read with"),
        ({"redis_sentinel_password": "pw"}, "redis_sentinel_password", "only read with"),
        (
            {"redis_mode": "cluster", "redis_sentinel_password": "pw"},
            "redis_sentinel_password",
            "redis_mode is 'cluster'",
        ),
        ({"redis_sentinel_username": "u"}, "redis_sentinel_username", "only read with"),
        (
            {"redis_mode": "cluster", "redis_sentinel_username": "u"},
            "redis_sentinel_username",
            "redis_mode is 'cluster'",
        ),
        (
            {**SENTINEL, "redis_sentinel_master": "m", "redis_sentinel_username": "u"},
            "redis_sentinel_username",
            "needs redis_sentinel_password",
        ),
        ({"redis_mode": "cluster", "redis_url": "unix:///tmp/r.sock"}, "redis_url", "TCP"),
        ({"redis_mode": "cluster", "redis_url": "redis://h:7000/1"}, "redis_url", "database 0"),
        ({"redis_mode": "cluster", "redis_url": "redis://h:7000?db=2"}, "redis_url", "database 0"),
        ({"redis_mode": "replicas"}, "redis_mode", "standalone"),
    ],
)
def test_a_topology_that_cannot_work_is_refused_at_load(
    values: dict[str, object], field: str, problem: str
) -> None:
    """Each unusable combination is a ConfigError naming the field, without the URL."""
    with pytest.raises(ConfigError, match=problem) as info:
        GatewaySettings(**values)
    assert info.value.field == field
    assert "pw@" not in str(info.value)


def test_sentinels_come_from_the_environment_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """POLYGATEWAY_REDIS_SENTINELS is a JSON list, as every list setting is."""
    monkeypatch.setenv("POLYGATEWAY_REDIS_MODE", "sentinel")
    monkeypatch.setenv("POLYGATEWAY_REDIS_SENTINELS", '["10.0.0.1:26379", "[::1]:26380"]')
    monkeypatch.setenv("POLYGATEWAY_REDIS_SENTINEL_MASTER", "mymaster")
    settings = GatewaySettings()
    assert settings.redis_sentinels == ["10.0.0.1:26379", "[::1]:26380"]


def test_a_sentinel_password_outside_sentinel_mode_is_refused_without_echoing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Set from the environment in standalone mode: refused naming the field, not the value."""
    monkeypatch.setenv("POLYGATEWAY_REDIS_SENTINEL_PASSWORD", SENTINEL_PASSWORD)
    with pytest.raises(ConfigError, match="only read with") as info:
        GatewaySettings()
    assert info.value.field == "redis_sentinel_password"
    assert SENTINEL_PASSWORD not in str(info.value)
    assert SENTINEL_PASSWORD not in repr(info.value)


def test_a_backend_built_in_code_refuses_a_sentinel_password_outside_sentinel_mode() -> None:
    """RedisBackend(sentinel_password=...) follows the same rule as the settings."""
    with pytest.raises(ConfigError, match="only read with") as info:
        RedisBackend("redis://127.0.0.1:6379/0", sentinel_password=SENTINEL_PASSWORD)
    assert info.value.field == "redis_sentinel_password"
    assert SENTINEL_PASSWORD not in str(info.value)


def test_the_sentinel_credentials_come_from_the_environment_and_are_never_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """POLYGATEWAY_REDIS_SENTINEL_PASSWORD and _USERNAME are read; no repr, dump or report
    row shows either."""
    monkeypatch.setenv("POLYGATEWAY_REDIS_MODE", "sentinel")
    monkeypatch.setenv("POLYGATEWAY_REDIS_SENTINELS", '["127.0.0.1:26379"]')
    monkeypatch.setenv("POLYGATEWAY_REDIS_SENTINEL_MASTER", "mymaster")
    monkeypatch.setenv("POLYGATEWAY_REDIS_SENTINEL_PASSWORD", SENTINEL_PASSWORD)
    monkeypatch.setenv("POLYGATEWAY_REDIS_SENTINEL_USERNAME", SENTINEL_USERNAME)
    settings = GatewaySettings.load(env_file=None)
    assert settings.redis_sentinel_password.get_secret_value() == SENTINEL_PASSWORD
    assert settings.redis_sentinel_username.get_secret_value() == SENTINEL_USERNAME
    rows = setting_rows(settings, {}, None, None)
    for key in ("redis_sentinel_password", "redis_sentinel_username"):
        row = next(r for r in rows["gateway"] if r.key == key)
        assert row.origin == f"env POLYGATEWAY_{key.upper()}"
        assert "**********" in row.value
    for shown in (
        str(settings),
        repr(settings),
        settings.model_dump_json(),
        str(settings.model_dump()),
        "\n".join(report_lines(rows)),
    ):
        assert SENTINEL_PASSWORD not in shown
        assert SENTINEL_USERNAME not in shown


def test_a_sentinel_username_without_a_password_is_refused_without_echoing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From the environment, in sentinel mode, alone: refused naming the key, not the value."""
    monkeypatch.setenv("POLYGATEWAY_REDIS_SENTINEL_USERNAME", SENTINEL_USERNAME)
    with pytest.raises(ConfigError, match="needs redis_sentinel_password") as info:
        GatewaySettings(**SENTINEL, redis_sentinel_master="mymaster")
    assert info.value.field == "redis_sentinel_username"
    assert SENTINEL_USERNAME not in str(info.value)
    assert SENTINEL_USERNAME not in repr(info.value)


def test_a_backend_built_in_code_refuses_a_sentinel_username_as_the_settings_do() -> None:
    """RedisBackend(sentinel_username=...): outside sentinel mode, or without the password."""
    with pytest.raises(ConfigError, match="only read with") as info:
        RedisBackend("redis://127.0.0.1:6379/0", sentinel_username=SENTINEL_USERNAME)
    assert info.value.field == "redis_sentinel_username"
    with pytest.raises(ConfigError, match="needs redis_sentinel_password") as info:
        RedisBackend(
            "redis:///0",
            mode="sentinel",
            sentinels=["127.0.0.1:26379"],
            sentinel_master="mymaster",
            sentinel_username=SENTINEL_USERNAME,
        )
    assert info.value.field == "redis_sentinel_username"
    assert SENTINEL_USERNAME not in str(info.value)


def test_cluster_shards_reply_is_read_as_the_online_primaries_ranges() -> None:
    """CLUSTER SHARDS (RESP2 flat maps): replicas and failed primaries are skipped."""
    primary = [b"id", b"x", b"port", 7001, b"ip", b"10.0.0.1", b"endpoint", b"node1"]
    primary += [b"role", b"master", b"health", b"online"]
    replica = [b"id", b"y", b"port", 7002, b"ip", b"10.0.0.2", b"endpoint", b"10.0.0.2"]
    replica += [b"role", b"replica", b"health", b"online"]
    failed = [b"id", b"z", b"port", 7003, b"ip", b"10.0.0.3", b"endpoint", b"?"]
    failed += [b"role", b"master", b"health", b"fail"]
    reply = [
        [b"slots", [0, 99, 200, 299], b"nodes", [replica, primary]],
        [b"slots", [100, 199], b"nodes", [failed]],
    ]
    assert read_shards(reply, "seed", tls=False) == [
        (0, 99, ("node1", 7001)),
        (200, 299, ("node1", 7001)),
    ]


def test_cluster_slots_reply_uses_the_answering_node_for_an_empty_endpoint() -> None:
    """CLUSTER SLOTS: "" is the node that answered, "?" an unknown endpoint (skipped)."""
    reply = [
        [0, 5460, [b"", 7001, b"id1"]],
        [5461, 10922, [b"10.0.0.2", 7002, b"id2"], [b"10.0.0.5", 7005, b"id5"]],
        [10923, 16383, [b"?", 7003, b"id3"]],
    ]
    assert read_slots(reply, "10.0.0.1") == [
        (0, 5460, ("10.0.0.1", 7001)),
        (5461, 10922, ("10.0.0.2", 7002)),
    ]


def test_sentinel_mode_is_shown_as_its_sentinels_and_primary_not_the_default_url() -> None:
    """Printed, a Sentinel topology names its primary and Sentinels, not 127.0.0.1:6379."""
    settings = GatewaySettings(
        **SENTINEL, redis_sentinel_master="mymaster", redis_url="redis://:pw-SECRET@/2"
    )
    shown = settings.redis_where
    assert "mymaster" in shown
    assert "127.0.0.1:26379" in shown
    assert "/2" in shown
    assert "6379/0" not in shown
    assert "pw-SECRET" not in shown
    default = GatewaySettings(**SENTINEL, redis_sentinel_master="mymaster")
    assert "127.0.0.1:6379" not in default.redis_where


def test_standalone_and_cluster_are_shown_as_their_masked_url() -> None:
    """Standalone reads as its URL, a cluster as its seed node; the password masked in both."""
    url = "redis://:pw-SECRET@10.0.0.5:7000/0"
    standalone = GatewaySettings(redis_url=url)
    assert standalone.redis_where == "redis://:***@10.0.0.5:7000/0"
    cluster = GatewaySettings(redis_mode="cluster", redis_url=url)
    assert "cluster" in cluster.redis_where
    assert "10.0.0.5:7000" in cluster.redis_where
    assert "pw-SECRET" not in cluster.redis_where


def test_the_status_header_names_the_sentinel_primary(capsys: pytest.CaptureFixture[str]) -> None:
    """``polygateway status`` says where it reads: the Sentinels' primary, not a default URL."""
    from polygateway.cli.commands import _print_status

    settings = GatewaySettings(
        backend="redis", **SENTINEL, redis_sentinel_master="mymaster", redis_url="redis:///0"
    )
    _print_status(settings, [], as_json=False)
    out = capsys.readouterr().out
    assert "mymaster" in out
    assert "127.0.0.1:6379" not in out
