"""Reading an upstream's limits from its headers: every form real providers send, garbage ignored.

Also the pacer's figures (``pace_for``, ``pause_for``) that turn those hints into pauses.
"""

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
    pause_for,
)
from polygateway.transport.hints import (
    ServerHint,
    parse_remaining,
    parse_reset_duration,
    parse_reset_time,
    parse_retry_after,
    read_hint,
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


# --- every form real providers send ------------------------------------------------------------


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=UTC).isoformat().replace("+00:00", "Z")


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after": "2"}, 2.0),
        ({"Retry-After": _http_date(NOW_WALL + 30)}, 30.0),
        ({"retry-after-ms": "1500"}, 1.5),
        ({"llm_provider-retry-after": "4"}, 4.0),
        ({"llm_provider-retry-after-ms": "750"}, 0.75),
        ({"llm_provider-retry-after": "4", "retry-after": "2"}, 2.0),
        ({"llm_provider-retry-after-ms": "750", "llm_provider-retry-after": "4"}, 0.75),
    ],
)
def test_explicit_back_off_in_every_form(headers: dict[str, str], expected: float) -> None:
    """Retry-After (seconds or date), retry-after-ms and LiteLLM's forwarded forms."""
    assert retry_after_from_headers(headers, NOW_WALL) == pytest.approx(expected)


@pytest.mark.parametrize("status_429", [True, False])
def test_explicit_back_off_counts_on_every_status(status_429: bool) -> None:
    """A 503 or 529 naming its back-off is honoured as a 429's is."""
    got = retry_after_from_headers({"retry-after": "3"}, NOW_WALL, rate_limited=status_429)
    assert got == 3.0


def test_window_resets_back_off_only_a_429() -> None:
    """x-ratelimit-reset-* speak of rate windows: a 503 carrying them is not paced by them."""
    headers = {"x-ratelimit-reset-requests": "2s"}
    assert retry_after_from_headers(headers, NOW_WALL, rate_limited=True) == 2.0
    assert retry_after_from_headers(headers, NOW_WALL, rate_limited=False) is None


def test_429_backs_off_until_the_exhausted_window_resets() -> None:
    """A 429 saying which window is spent backs off until that window's reset, not the other."""
    headers = {
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "17ms",
        "x-ratelimit-remaining-tokens": "90000",
        "x-ratelimit-reset-tokens": "6m0s",
    }
    assert retry_after_from_headers(headers, NOW_WALL) == pytest.approx(0.017)


def test_openai_and_azure_windows() -> None:
    """OpenAI's / Azure's remaining counts and Go-duration resets."""
    hint = read_hint(
        {
            "x-ratelimit-limit-requests": "60",
            "x-ratelimit-remaining-requests": "59",
            "x-ratelimit-remaining-tokens": "149984",
            "x-ratelimit-reset-requests": "1s",
            "x-ratelimit-reset-tokens": "6m0s",
        },
        NOW_WALL,
    )
    assert hint == ServerHint(
        remaining_requests=59,
        remaining_tokens=149984,
        requests_reset_s=1.0,
        tokens_reset_s=360.0,
    )


def test_litellm_forwarded_windows() -> None:
    """LiteLLM forwards the provider's headers with an ``llm_provider-`` prefix."""
    hint = read_hint(
        {
            "llm_provider-x-ratelimit-remaining-requests": "0",
            "llm_provider-x-ratelimit-reset-requests": "2s",
        },
        NOW_WALL,
    )
    assert hint is not None
    assert (hint.remaining_requests, hint.requests_reset_s) == (0, 2.0)


def test_anthropic_windows_keep_the_tightest_tokens() -> None:
    """Anthropic's RFC 3339 resets; of its token windows the one with least left is kept."""
    hint = read_hint(
        {
            "anthropic-ratelimit-requests-remaining": "0",
            "anthropic-ratelimit-requests-reset": _iso(NOW_WALL + 2),
            "anthropic-ratelimit-tokens-remaining": "50000",
            "anthropic-ratelimit-tokens-reset": _iso(NOW_WALL + 60),
            "anthropic-ratelimit-output-tokens-remaining": "100",
            "anthropic-ratelimit-output-tokens-reset": _iso(NOW_WALL + 9),
        },
        NOW_WALL,
    )
    assert hint == ServerHint(
        remaining_requests=0,
        remaining_tokens=100,
        requests_reset_s=pytest.approx(2.0),
        tokens_reset_s=pytest.approx(9.0),
    )


def test_no_limit_headers_is_no_hint() -> None:
    """A response announcing nothing gives ``None`` (nothing to do)."""
    assert read_hint({"content-type": "application/json", "x-request-id": "1"}, NOW_WALL) is None


@pytest.mark.parametrize(
    "headers",
    [
        {"retry-after": "soon"},
        {"retry-after-ms": "1e3"},
        {"x-ratelimit-remaining-requests": "-1"},
        {"x-ratelimit-remaining-requests": "many"},
        {"x-ratelimit-reset-requests": "1 minute"},
        {"anthropic-ratelimit-requests-reset": "tomorrow"},
        {"anthropic-ratelimit-tokens-remaining": "1.5"},
    ],
)
def test_malformed_values_are_ignored_with_a_debug_log(
    headers: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """An unreadable value is no hint at all, and says so at debug level (name, no crash)."""
    with caplog.at_level("DEBUG", logger="polygateway.transport"):
        assert read_hint(headers, NOW_WALL) is None
    (name,) = headers
    assert any(name in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2026-12-01T10:00:02Z", 2.0),
        ("2026-12-01T10:00:02+00:00", 2.0),
        ("2026-12-01T11:00:02+01:00", 2.0),
        ("2026-12-01T10:00:02.500Z", 2.5),
        ("2026-12-01T09:00:00Z", 0.0),
    ],
)
def test_reset_time_rfc3339(value: str, expected: float) -> None:
    """Anthropic's reset times, with offsets and fractions; a past time is 0."""
    now = datetime(2026, 12, 1, 10, 0, 0, tzinfo=UTC).timestamp()
    assert parse_reset_time(value, now) == pytest.approx(expected)


@pytest.mark.parametrize("value", ["", "10", "2026-12-01", "12:00:00Z", "2026-13-01T00:00:00Z"])
def test_reset_time_garbage_is_none(value: str) -> None:
    """Not an RFC 3339 time: ignored."""
    assert parse_reset_time(value, NOW_WALL) is None


@pytest.mark.parametrize(("value", "expected"), [("0", 0), (" 42 ", 42), ("+3", 3)])
def test_remaining_counts(value: str, expected: int) -> None:
    """Remaining counts are non-negative integers."""
    assert parse_remaining(value) == expected


# --- what a success's announcement pauses ----------------------------------------------------


def test_success_with_requests_spent_pauses_until_their_reset() -> None:
    """0 requests left: paused until the requests window resets."""
    hint = ServerHint(remaining_requests=0, requests_reset_s=2.0, remaining_tokens=10**6)
    assert hint.exhausted_for_s(next_cost_tokens=100) == 2.0


def test_success_with_too_few_tokens_pauses_until_their_reset() -> None:
    """Fewer tokens left than the next call costs: paused until the tokens window resets."""
    hint = ServerHint(remaining_tokens=50, tokens_reset_s=7.0, remaining_requests=10)
    assert hint.exhausted_for_s(next_cost_tokens=100) == 7.0
    assert hint.exhausted_for_s(next_cost_tokens=50) is None


def test_success_with_both_spent_pauses_until_the_later_reset() -> None:
    """Both windows spent: the later reset."""
    hint = ServerHint(
        remaining_requests=0, requests_reset_s=2.0, remaining_tokens=0, tokens_reset_s=5.0
    )
    assert hint.exhausted_for_s(next_cost_tokens=1) == 5.0


def test_success_with_room_left_pauses_nothing() -> None:
    """Requests and tokens left: no pause."""
    hint = ServerHint(remaining_requests=1, requests_reset_s=2.0, remaining_tokens=500)
    assert hint.exhausted_for_s(100) is None


def test_spent_window_without_its_reset_pauses_the_default() -> None:
    """Azure announces remaining counts but no reset: a spent window pauses the default 1 s."""
    assert ServerHint(remaining_requests=0).exhausted_for_s(1) == DEFAULT_RATE_LIMIT_PACE_S
    assert ServerHint(remaining_tokens=0).exhausted_for_s(1) == DEFAULT_RATE_LIMIT_PACE_S


def test_a_429_without_any_reset_names_no_back_off() -> None:
    """A 429 announcing only a spent count leaves the default pace to the pacer."""
    assert ServerHint(remaining_requests=0).back_off_s(rate_limited=True) is None


def test_pause_for_each_outcome() -> None:
    """A 429 always pauses (default 1 s); other outcomes only when hinted; NaN is no hint."""
    assert pause_for(True, None) == DEFAULT_RATE_LIMIT_PACE_S
    assert pause_for(True, 3.0) == 3.0
    assert pause_for(False, None) is None
    assert pause_for(False, float("nan")) is None
    assert pause_for(False, 2.5) == 2.5
    assert pause_for(False, 1e9) == MAX_PACE_S
    assert pause_for(False, -4.0) == 0.0
