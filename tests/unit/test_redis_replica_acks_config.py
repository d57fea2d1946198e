"""``redis_replica_acks`` and its timeout: off by default, refused at load when unusable."""

from __future__ import annotations

import pytest

from polygateway.backends.factory import shared_backend
from polygateway.config import GatewaySettings
from polygateway.errors import ConfigError


def test_replica_acks_are_off_by_default() -> None:
    """No WAIT unless asked for; the timeout 0 means half of redis_socket_timeout_s."""
    settings = GatewaySettings()
    assert settings.redis_replica_acks == 0
    assert settings.redis_replica_ack_timeout_s == 0.0


def test_replica_acks_with_a_timeout_below_the_socket_timeout_load() -> None:
    """One replica, 0.2 s to acknowledge, under a 1 s socket timeout: accepted."""
    settings = GatewaySettings(
        backend="redis", redis_replica_acks=1, redis_replica_ack_timeout_s=0.2
    )
    assert settings.redis_replica_acks == 1


def test_replica_acks_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """POLYGATEWAY_REDIS_REPLICA_ACKS, as every flat gateway key."""
    monkeypatch.setenv("POLYGATEWAY_REDIS_REPLICA_ACKS", "2")
    assert GatewaySettings().redis_replica_acks == 2


@pytest.mark.parametrize(
    ("values", "field", "problem"),
    [
        ({"redis_replica_acks": -1}, "redis_replica_acks", "greater than or equal to 0"),
        ({"redis_replica_ack_timeout_s": -0.5}, "redis_replica_ack_timeout_s", "0"),
        (
            {"redis_replica_acks": 1, "redis_mode": "cluster"},
            "redis_replica_acks",
            'not supported with redis_mode = "cluster"',
        ),
        (
            {"redis_replica_acks": 1, "redis_replica_ack_timeout_s": 1.0},
            "redis_replica_ack_timeout_s",
            "must be below redis_socket_timeout_s",
        ),
        (
            {
                "redis_replica_acks": 1,
                "redis_socket_timeout_s": 0.5,
                "redis_replica_ack_timeout_s": 0.8,
            },
            "redis_replica_ack_timeout_s",
            "must be below redis_socket_timeout_s",
        ),
    ],
)
def test_an_unusable_replica_ack_setting_is_refused_at_load(
    values: dict[str, object], field: str, problem: str
) -> None:
    """Each unusable value or combination is a ConfigError naming the key."""
    with pytest.raises(ConfigError, match=problem) as info:
        GatewaySettings(**values)
    assert info.value.field == field


def test_a_cluster_without_replica_acks_still_loads() -> None:
    """The cluster refusal is for the opt-in only."""
    settings = GatewaySettings(redis_mode="cluster", redis_url="redis://h:7000/0")
    assert settings.redis_replica_acks == 0


def test_settings_with_replica_acks_get_a_backend_of_their_own() -> None:
    """The opt-in reaches the backend, and settings that differ in it do not share one."""
    url = "redis://127.0.0.1:6397/0"
    plain = shared_backend(GatewaySettings(backend="redis", redis_url=url))
    acked = shared_backend(
        GatewaySettings(
            backend="redis", redis_url=url, redis_replica_acks=1, redis_replica_ack_timeout_s=0.3
        )
    )
    assert acked is not plain
    assert acked._acks == 1  # type: ignore[attr-defined]
    assert acked._ack_command == b"*3\r\n$4\r\nWAIT\r\n$1\r\n1\r\n$3\r\n300\r\n"  # type: ignore[attr-defined]
    assert plain._acks == 0  # type: ignore[attr-defined]
