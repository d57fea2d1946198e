"""``redis_mode`` and its companions: what each topology accepts, refused at load with the field."""

from __future__ import annotations

import pytest

from polygateway.backends.redis.cluster import read_shards, read_slots
from polygateway.config import GatewaySettings
from polygateway.errors import ConfigError

SENTINEL = {"redis_mode": "sentinel", "redis_sentinels": ["127.0.0.1:26379"]}


def test_standalone_is_the_default_topology() -> None:
    """No redis_mode: standalone, no Sentinels."""
    settings = GatewaySettings()
    assert settings.redis_mode == "standalone"
    assert settings.redis_sentinels == []
    assert settings.redis_sentinel_master == ""


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
