"""Test kit, public so users can test their own code against PolyGateway without a network.

- ``FakeClock``: a monotonic clock advanced by hand or by its fake ``sleep``.
- ``BoundedSleep``: a fake sleep that fails the test after N calls instead of looping forever.
- ``FakeTimers``: virtual time for many concurrent sleepers, woken in deadline order;
  ``settle()`` lets the event loop run a few turns.
- ``FakeTransport``: a scripted upstream (bodies, ``TransientError``, ``Hang``,
  ``Delay``, ``Gate``, callables, ``StreamScript``, ``WithHeaders``) that records what
  it was sent.
- ``Recorder``: an emitter that keeps every attempt record.
- ``CountingBackend``: wraps a backend, counts its operations, can hold ``acquire``.
- ``TransientError``: re-exported, to script failures.
- Builders of provider bodies: ``chat_completion``, ``chat_chunk_events``, ``embedding_body``;
  and ``gateway_settings`` for a one-scope configuration in code.
"""

from __future__ import annotations

from polygateway.testing.builders import (
    anthropic_message,
    chat_chunk_events,
    chat_completion,
    embedding_body,
    gateway_settings,
)
from polygateway.testing.clock import (
    BoundedSleep,
    FakeClock,
    FakeTimers,
    SleepBudgetExceeded,
    settle,
)
from polygateway.testing.recording import CountingBackend, Recorder
from polygateway.testing.transport import (
    Delay,
    FakeTransport,
    Gate,
    Hang,
    Outcome,
    ScriptExhausted,
    StreamScript,
    WithHeaders,
)
from polygateway.transport.http import TransientError

__all__ = [
    "BoundedSleep",
    "CountingBackend",
    "Delay",
    "FakeClock",
    "FakeTimers",
    "FakeTransport",
    "Gate",
    "Hang",
    "Outcome",
    "Recorder",
    "ScriptExhausted",
    "SleepBudgetExceeded",
    "StreamScript",
    "TransientError",
    "WithHeaders",
    "anthropic_message",
    "chat_chunk_events",
    "chat_completion",
    "embedding_body",
    "gateway_settings",
    "settle",
]
