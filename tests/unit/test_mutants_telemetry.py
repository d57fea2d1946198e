"""Telemetry fan-out edges that mutation testing found unpinned (research-wiki/MUTATION.md).

The warning an emitter's failure leaves (its exception, for ``emit_attempt``
and ``is_recording`` as for ``emit_call``), and how the header hooks of
several emitters merge: a hook with nothing to add does not stop the next,
the first to name a header wins it, and a refused header is named in the log.
"""

# Survivors of the run at 4d06f4c these tests kill, all in polygateway.middleware.telemetry:
#   xǁEmittersǁ_any_recording__mutmut_3; xǁEmittersǁemit_attempt__mutmut_3
#   xǁEmittersǁheaders_for__mutmut_18, 26, 34, 35, 36, 37

from __future__ import annotations

import logging
import types
from collections.abc import Mapping
from typing import Any

import pytest

from polygateway.middleware.telemetry import AttemptStart, Emitters
from polygateway.models import AttemptRecord, CallRecord

RECORD = AttemptRecord("c1", "chat", "primary", 1, "success", 200, 0.1)


class Hook:
    """An emitter whose header hook gives fixed headers."""

    def __init__(self, headers: Mapping[str, Any] | None) -> None:
        self.headers = headers

    def emit_attempt(self, record: AttemptRecord) -> None:
        pass

    def emit_call(self, record: CallRecord) -> None:
        pass

    def attempt_headers(self, start: AttemptStart) -> Mapping[str, Any] | None:
        return self.headers


def headers(*hooks: Hook) -> dict[str, str] | None:
    """The headers the fan-out of ``hooks`` gives attempt 1 of call c1."""
    ctx: Any = types.SimpleNamespace(call_id="c1", source="primary", attempt=1)
    return Emitters(list(hooks)).headers_for(ctx, "chat", "chat.complete", 0.0)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_failing_attempt_emitter_is_named_with_its_exception(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An ``emit_attempt`` that raises: the warning names the emitter and its exception."""

    class Flaky:
        def emit_attempt(self, record: AttemptRecord) -> None:
            raise ValueError("sink full")

    with caplog.at_level(logging.WARNING, logger="polygateway.telemetry"):
        Emitters([Flaky()]).emit_attempt(RECORD)
    assert warnings(caplog) == [
        "telemetry emitter Flaky failed (skipped, the call goes on): ValueError('sink full')"
    ]


def test_an_emitter_failing_to_say_whether_it_records_is_named_and_counted_as_recording(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An ``is_recording`` that raises counts as recording; the warning names its exception."""

    class Unsure:
        def is_recording(self) -> bool:
            raise RuntimeError("no idea")

        def emit_attempt(self, record: AttemptRecord) -> None:
            pass

    with caplog.at_level(logging.WARNING, logger="polygateway.telemetry"):
        assert Emitters([Unsure()]).recording() is True
    assert warnings(caplog) == [
        "telemetry emitter Unsure failed (skipped, the call goes on): RuntimeError('no idea')"
    ]


def test_a_hook_with_nothing_to_add_does_not_stop_the_next() -> None:
    """The hooks after one that gives ``None`` or nothing still give their headers."""
    assert headers(Hook(None), Hook({}), Hook({"traceparent": "00-a-b-01"})) == {
        "traceparent": "00-a-b-01"
    }


def test_the_first_hook_to_name_a_header_wins_it_and_the_others_add_theirs() -> None:
    """Merged: the first hook's headers, then each later one's headers not named yet."""
    assert headers(
        Hook({"traceparent": "first"}),
        Hook({"traceparent": "second", "baggage": "k=v"}),
        Hook({"tracestate": "t=1", "baggage": "late"}),
    ) == {"traceparent": "first", "baggage": "k=v", "tracestate": "t=1"}


def test_a_refused_header_is_named_in_the_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A header a transport would refuse: skipped, and the warning quotes its name."""
    with caplog.at_level(logging.WARNING, logger="polygateway.telemetry"):
        assert headers(Hook({"bad name": "x"}), Hook({"ok": "1"})) == {"ok": "1"}
    assert warnings(caplog) == [
        "telemetry emitter Hook failed (skipped, the call goes on): "
        "TypeError(\"header 'bad name': not a header name and ASCII value\")"
    ]
