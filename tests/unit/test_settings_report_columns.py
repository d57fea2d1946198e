"""check-config keeps every setting's name apart from its value, however long the name."""

from __future__ import annotations

from polygateway.cli.settings_report import WIDTH, Row, report_lines, setting_rows
from polygateway.config import GatewaySettings
from polygateway.testing import gateway_settings


def test_the_longest_gateway_setting_name_is_apart_from_its_value() -> None:
    """``redis_replica_ack_timeout_s`` (27 characters) is not glued to its value."""
    lines = report_lines(setting_rows(gateway_settings("a"), {}, None, None))
    line = next(text for text in lines if "redis_replica_ack_timeout_s" in text)
    assert "redis_replica_ack_timeout_s  0 " in line, line


def test_every_gateway_setting_is_followed_by_two_spaces() -> None:
    """Each name, whatever its length, ends where a gap of two spaces begins."""
    lines = report_lines(setting_rows(gateway_settings("a"), {}, None, None))
    for name in GatewaySettings.model_fields:
        if name == "scopes":
            continue  # a section of its own, not a row
        line = next(text for text in lines if text.startswith(f"  {name}"))
        assert line.startswith(f"  {name}  "), line


def test_a_name_wider_than_its_column_keeps_a_gap() -> None:
    rows = {"gateway": [Row("a_setting_name_wider_than_the_column", "1", "default")], "scopes": {}}
    line = report_lines(rows)[1]
    assert line.startswith("  a_setting_name_wider_than_the_column  1")
    assert len(line) <= WIDTH
