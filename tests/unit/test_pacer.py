"""The pacer's header parsers: every Retry-After form, and garbage ignored without crashing."""

from __future__ import annotations

from datetime import UTC, datetime
from email.utils import format_datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polygateway.governance.pacer import (
    DEFAULT_RATE_LIMIT_PACE_S,
    MAX_PACE_S,
    pace_for,
    parse_reset_duration,
    parse_retry_after,
    retry_after_from_headers,
)

NOW_WALL = 1_700_000_000.0


def _http_date(epoch: float) -> str:
    return format_datetime(datetime.fromtimestamp(epoch, tz=UTC), usegmt=True)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("120", 120.0), ("0", 0.0), (" 7 ", 7.0), ("1.5", 1.5), (".25", 0.25), ("-3", 0.0)],
)
def test_retry_after_delta_seconds(value: str, expected: float) -> None:
    """Retry-After as integer or float delta-seconds; negative clamps to 0."""
    assert parse_retry_after(value, NOW_WALL) == pytest.approx(expected)


def test_retry_after_http_date_is_relative_to_now_wall() -> None:
    """An HTTP date becomes seconds from ``now_wall``."""
    assert parse_retry_after(_http_date(NOW_WALL + 42), NOW_WALL) == pytest.approx(42.0)


def test_retry_after_http_date_in_the_past_is_zero() -> None:
    """A date already past asks for no pause at all."""
    assert parse_retry_after(_http_date(NOW_WALL - 100), NOW_WALL) == 0.0


def test_retry_after_naive_http_date_is_read_as_gmt() -> None:
    """A ``-0000`` date (naive once parsed) is GMT, as RFC 9110 says every HTTP date is."""
    value = "Tue, 14 Nov 2023 22:13:40 -0000"
    assert parse_retry_after(value, NOW_WALL) == pytest.approx(20.0)


@pytest.mark.parametrize("value", ["", "soon", "nan", "inf", "1_0", "12abc", "Tue, 99 Foo", "--1"])
def test_retry_after_garbage_is_none(value: str) -> None:
    """Unreadable Retry-After values are ignored, never guessed."""
    assert parse_retry_after(value, NOW_WALL) is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("1s", 1.0),
        ("6m0s", 360.0),
        ("20ms", 0.02),
        ("1h2m3.5s", 3723.5),
        ("0.5", 0.5),
        ("17", 17.0),
        ("150us", 150e-6),
        ("3ns", 3e-9),
        (" 2m ", 120.0),
    ],
)
def test_reset_duration_forms(value: str, expected: float) -> None:
    """x-ratelimit-reset-* Go durations and plain seconds."""
    assert parse_reset_duration(value) == pytest.approx(expected)


@pytest.mark.parametrize("value", ["", "s", "1x", "1s2", "1.2.3s", "abc", "1 s", "-"])
def test_reset_duration_garbage_is_none(value: str) -> None:
    """Unreadable reset durations are ignored."""
    assert parse_reset_duration(value) is None


def test_headers_prefer_retry_after_ms() -> None:
    """``retry-after-ms`` wins over ``retry-after`` and is read as milliseconds."""
    headers = {"Retry-After-Ms": "250", "Retry-After": "9", "x-ratelimit-reset-requests": "1m"}
    assert retry_after_from_headers(headers, NOW_WALL) == pytest.approx(0.25)


def test_headers_retry_after_is_case_insensitive() -> None:
    """Header names match whatever their case."""
    assert retry_after_from_headers({"RETRY-AFTER": "3"}, NOW_WALL) == 3.0


def test_headers_retry_after_http_date() -> None:
    """A Retry-After header holding an HTTP date works through the header look-up too."""
    headers = {"retry-after": _http_date(NOW_WALL + 5)}
    assert retry_after_from_headers(headers, NOW_WALL) == pytest.approx(5.0)


def test_headers_fall_back_to_max_of_reset_headers() -> None:
    """Without Retry-After, the larger of the reset-requests / reset-tokens durations is used."""
    headers = {"x-ratelimit-reset-requests": "20ms", "X-RateLimit-Reset-Tokens": "6m0s"}
    assert retry_after_from_headers(headers, NOW_WALL) == pytest.approx(360.0)


def test_headers_skip_unreadable_forms_to_the_next() -> None:
    """A garbage higher-priority header does not hide a readable lower-priority one."""
    headers = {"retry-after-ms": "lots", "retry-after": "later", "x-ratelimit-reset-tokens": "1s"}
    assert retry_after_from_headers(headers, NOW_WALL) == pytest.approx(1.0)


def test_headers_without_any_back_off_is_none() -> None:
    """No back-off header at all gives ``None`` (the default pace applies later)."""
    assert retry_after_from_headers({"content-type": "application/json"}, NOW_WALL) is None


def test_pace_for_defaults_and_caps() -> None:
    """No Retry-After paces 1 s; huge ones are capped at an hour; negatives at 0."""
    assert pace_for(None) == DEFAULT_RATE_LIMIT_PACE_S == 1.0
    assert pace_for(5.0) == 5.0
    assert pace_for(1e9) == MAX_PACE_S == 3600.0
    assert pace_for(float("inf")) == MAX_PACE_S
    assert pace_for(-1.0) == 0.0
    assert pace_for(float("nan")) == DEFAULT_RATE_LIMIT_PACE_S


@given(st.text())
def test_parsers_never_raise_on_arbitrary_text(value: str) -> None:
    """Any text is parsed or ignored; results are finite and non-negative when present."""
    for parsed in (parse_retry_after(value, NOW_WALL), parse_reset_duration(value)):
        assert parsed is None or (parsed >= 0.0 and parsed != float("inf"))
    headers = {
        "retry-after-ms": value,
        "retry-after": value,
        "x-ratelimit-reset-requests": value,
        "x-ratelimit-reset-tokens": value,
    }
    result = retry_after_from_headers(headers, NOW_WALL)
    assert result is None or 0.0 <= pace_for(result) <= MAX_PACE_S


@given(
    st.one_of(
        st.from_regex(
            r"\A[A-Za-z]{3}, \d{1,2} [A-Za-z]{3} \d{1,5} \d\d:\d\d:\d\d [A-Z+-]{0,5}\d{0,4}\Z"
        ),
        st.from_regex(r"\A(\d{0,4}(\.\d{0,3})?(h|m|s|ms|us|ns|x)?){0,4}\Z"),
    )
)
def test_parsers_never_raise_on_near_miss_forms(value: str) -> None:
    """Strings shaped almost like dates or durations are parsed or ignored, never raise."""
    for parsed in (parse_retry_after(value, NOW_WALL), parse_reset_duration(value)):
        assert parsed is None or parsed >= 0.0


@given(st.floats(min_value=0, max_value=1e6, allow_nan=False))
def test_delta_seconds_roundtrip(seconds: float) -> None:
    """Any non-negative decimal written out is read back as itself."""
    assert parse_retry_after(f"{seconds:.6f}", NOW_WALL) == pytest.approx(seconds, abs=1e-6)
