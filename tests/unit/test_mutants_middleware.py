"""Middleware edges that mutation testing found unpinned (research-wiki/MUTATION.md).

The attempt helpers (lease renewal, orphaned backend operations, a release
that fails), the client lifecycle's errors, the telemetry records and log
lines, and the policy read from settings.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from polygateway.backends.base import AttemptOutcome, Lease, SourceSpec
from polygateway.backends.memory import MemoryBackend
from polygateway.chat import ChatClient
from polygateway.embedding import EmbeddingClient
from polygateway.errors import ConfigError, GatewayError, GovernanceBackendError
from polygateway.middleware import lifecycle as lifecycle_module
from polygateway.middleware.attempt import AttemptContext, Served, release_quietly
from polygateway.middleware.classify import verdict_for
from polygateway.middleware.lifecycle import InFlight, Lifecycle
from polygateway.middleware.policy import LoopPolicy
from polygateway.middleware.telemetry import LoggingEmitter, PrometheusEmitter, attempt_record
from polygateway.models import AttemptRecord
from polygateway.testing import (
    CountingBackend,
    FakeClock,
    FakeTransport,
    TransientError,
    chat_completion,
    gateway_settings,
)
from polygateway.testing import recording as recording_module

LEASE = Lease("chat", "primary", "7", 30.0, 0, False)


def _ctx(**fields: Any) -> AttemptContext:
    return AttemptContext("c0ffee", 1, LEASE, 10.0, 5.0, 5.0, 1000.0, **fields)


class _Renewals(MemoryBackend):
    """A backend whose renew answers from a script: True, False, or an error."""

    __slots__ = ("answers",)

    def __init__(self, *answers: bool | Exception) -> None:
        super().__init__()
        self.answers = list(answers)

    async def renew(self, lease: Lease) -> bool:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


# --- attempt ----------------------------------------------------------------------------


def test_an_attempt_context_starts_with_no_wait_no_stall_and_no_ttft() -> None:
    """Without the optional figures an attempt waited 0 s, stalled 0 s, and has no TTFT yet."""
    ctx = _ctx()
    assert (ctx.permit_wait_s, ctx.stalled_s, ctx.ttft_s) == (0.0, 0.0, None)
    record = attempt_record(
        ctx, scope="chat", outcome="success", status_code=None, error=None, ended_at=1000.5
    )
    assert record.ttft_s is None


async def test_a_session_body_that_never_completes_is_released_as_cancelled() -> None:
    """A Served value starts not completed: ending without complete() is no success."""
    clock = FakeClock()
    served = Served("v", _ctx(), [], MemoryBackend(now=clock), clock)
    assert served.completed is False
    served.complete()
    assert served.completed is True


async def test_renewal_is_due_at_exactly_a_third_of_the_ttl(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """TTL 30: no renewal before 10 s, one at exactly 10 s, and its answer is logged if dead."""
    clock = FakeClock()
    backend = _Renewals(True, False)
    served = Served("v", _ctx(), [], backend, clock)
    clock.advance(9.0)
    assert await served.renew_if_due() is False
    clock.advance(1.0)
    assert served.renew_due()
    assert await served.renew_if_due() is True
    assert caplog.records == []
    clock.advance(10.0)
    with caplog.at_level(logging.WARNING, logger="polygateway"):
        assert await served.renew_if_due() is True
    assert [r.getMessage() for r in caplog.records] == [
        "the lease at primary expired before its renewal"
    ]


async def test_a_failed_renewal_is_logged_and_tried_again_at_the_next_chunk(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A backend error on renewal is logged, reported as sent, and the next chunk retries."""
    clock = FakeClock()
    error = GovernanceBackendError("redis gone", operation="renew", scope="chat")
    served = Served("v", _ctx(), [], _Renewals(error, True), clock)
    clock.advance(10.0)
    with caplog.at_level(logging.WARNING, logger="polygateway"):
        assert await served.renew_if_due() is True
    assert [r.getMessage() for r in caplog.records] == [
        "lease renewal failed at primary: redis gone (operation=renew) (scope='chat')"
    ]
    assert served.renew_due()  # not renewed: still due
    assert await served.renew_if_due() is True
    assert not served.renew_due()


async def test_a_gated_acquire_cancelled_runs_on_and_gives_its_late_lease_back() -> None:
    """Cancelled at the gate: the acquire is held until done, then its grant goes back."""
    clock = FakeClock()
    inner = MemoryBackend(now=clock)
    backend = CountingBackend(inner)
    backend.hold_acquire = asyncio.Event()
    spec = [SourceSpec("primary", max_concurrency=1)]
    before = set(recording_module._HELD)  # left by other tests, if any
    caller = asyncio.create_task(backend.acquire("chat", spec, ttl_s=60.0))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert len(recording_module._HELD - before) == 2  # the acquire and its give-back, kept
    assert backend.calls.get("acquire") is None  # still at the gate
    backend.hold_acquire.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert not recording_module._HELD - before  # dropped once done
    assert backend.calls == {"acquire": 1}  # the give-back is the inner backend's, uncounted
    [source] = (await inner.snapshot("chat")).sources
    assert source.in_flight == 0  # the late lease was given back
    backend.hold_acquire = None
    assert (await backend.acquire("chat", spec, ttl_s=60.0)).lease is not None


async def test_a_gated_release_cancelled_still_frees_the_permit() -> None:
    """Cancelled at the release gate: the release runs once the gate opens."""
    clock = FakeClock()
    inner = MemoryBackend(now=clock)
    backend = CountingBackend(inner)
    spec = [SourceSpec("primary", max_concurrency=1)]
    lease = (await backend.acquire("chat", spec, ttl_s=60.0)).lease
    assert lease is not None
    backend.hold_release = asyncio.Event()
    before = set(recording_module._HELD)  # left by other tests, if any
    caller = asyncio.create_task(backend.release(lease, AttemptOutcome("success")))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert len(recording_module._HELD - before) == 1
    assert (await inner.acquire("chat", spec, ttl_s=60.0)).lease is None  # still held
    backend.hold_release.set()
    for _ in range(5):
        await asyncio.sleep(0)
    assert not recording_module._HELD - before  # dropped once done
    assert backend.calls == {"acquire": 1, "release": 1}
    assert await inner.progress_age_s("chat") == 0.0  # released as the success it was


async def test_a_release_the_backend_fails_is_logged_with_its_outcome_and_source(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """release_quietly logs kind, source and the scrubbed error, and raises nothing."""

    class _Down(MemoryBackend):
        __slots__ = ()

        async def release(self, lease: Lease, outcome: AttemptOutcome) -> None:
            raise GovernanceBackendError("key sk-123 refused", operation="release")

    with caplog.at_level(logging.WARNING, logger="polygateway"):
        await release_quietly(
            _Down(), LEASE, AttemptOutcome("transient"), lambda e: str(e).replace("sk-123", "***")
        )
    assert [r.getMessage() for r in caplog.records] == [
        "release of a transient lease at primary failed (its expiry frees the permit): "
        "key *** refused (operation=release)"
    ]


# --- lifecycle --------------------------------------------------------------------------


async def test_a_call_cancelled_before_it_ran_fails_its_first_stretch_with_its_scope() -> None:
    """cancel() before any stretch is harmless; the next stretch fails "client closed"."""
    call = InFlight("embed")
    call.cancel()
    with pytest.raises(GatewayError) as caught:
        async with call.running():
            pass
    assert str(caught.value) == "client closed (scope='embed')"
    assert caught.value.scope == "embed"


async def test_a_call_cancelled_by_the_close_fails_with_its_scope() -> None:
    """The close's own cancellation surfaces as GatewayError naming the call's scope."""
    life = Lifecycle(scope="embed", close_grace_s=0.0, sleep=FakeClock().sleep)
    call = life.begin()

    async def body() -> None:
        async with call.running():
            await asyncio.Event().wait()

    task = asyncio.create_task(body())
    await asyncio.sleep(0)
    call.cancel()
    with pytest.raises(GatewayError) as caught:
        await task
    assert caught.value.scope == "embed"
    assert str(caught.value).startswith("client closed while the call was in flight")


async def test_a_closed_lifecycle_refuses_calls_naming_its_scope() -> None:
    """After aclose, check_open and begin raise "client closed" with the scope."""
    life = Lifecycle(scope="ocr", close_grace_s=1.0, sleep=FakeClock().sleep)
    assert life.begin().scope == "ocr"
    life._calls.clear()
    await life.aclose()
    for refuse in (life.check_open, life.begin):
        with pytest.raises(GatewayError) as caught:
            refuse()
        assert str(caught.value) == "client closed (scope='ocr')"
        assert caught.value.scope == "ocr"


async def test_a_client_on_a_scope_of_another_kind_is_a_config_error() -> None:
    """A chat client on an embed scope names both kinds and the scope."""
    settings = gateway_settings(scope="vectors", kind="embed")
    with pytest.raises(ConfigError) as caught:
        ChatClient(settings, "vectors", transport=FakeTransport(), backend=MemoryBackend())
    assert str(caught.value).startswith(
        "ChatClient serves scopes of kind 'chat', but scope 'vectors' is of kind 'embed'"
    )
    assert caught.value.scope == "vectors"


async def test_from_settings_binds_the_named_scope_and_repr_shows_it() -> None:
    """from_settings(settings, name) serves that scope; repr shows the class and scope."""
    settings = gateway_settings("a", scope="vectors", kind="embed")
    client = EmbeddingClient.from_settings(
        settings, "vectors", transport=FakeTransport(), backend=MemoryBackend()
    )
    async with client:
        assert client.scope == "vectors"
        assert repr(client) == "EmbeddingClient(scope='vectors', sources=['a'])"
    with pytest.raises(GatewayError) as caught:
        await client.embed(["x"])
    assert caught.value.scope == "vectors"


async def test_a_client_without_a_sleep_sleeps_on_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With no injected sleep, the loop's back-off goes to asyncio.sleep."""
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(lifecycle_module.asyncio, "sleep", fake_sleep)
    clock = FakeClock()
    transport = FakeTransport(
        [TransientError("x", status_code=503), chat_completion()], clock=clock
    )
    async with ChatClient(
        gateway_settings(), transport=transport, backend=MemoryBackend(now=clock), now=clock
    ) as chat:
        answer = await chat.complete(messages=[{"role": "user", "content": "hi"}])
    assert answer.text == "ok"
    assert len(slept) == 1
    assert 0.25 <= slept[0] <= 0.5


async def test_the_default_transport_is_pooled_to_the_scope_and_a_missing_extra_is_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No transport given: the settings' kind, every source, the summed concurrency."""
    made: list[tuple[Any, ...]] = []

    def fake_make(kind: str, sources: Any, *, max_connections: int) -> FakeTransport:
        made.append((kind, tuple(s.name for s in sources), max_connections))
        return FakeTransport()

    settings = gateway_settings(
        {"name": "a", "max_concurrency": 3}, {"name": "b", "max_concurrency": 4}
    )
    monkeypatch.setattr(lifecycle_module, "make_transport", fake_make)
    async with ChatClient(settings, backend=MemoryBackend()):
        pass
    assert made == [("httpx", ("a", "b"), 7)]

    def missing(kind: str, sources: Any, *, max_connections: int) -> FakeTransport:
        raise ImportError("install polygateway[aiohttp]")

    monkeypatch.setattr(lifecycle_module, "make_transport", missing)
    with pytest.raises(ConfigError) as caught:
        ChatClient(settings, backend=MemoryBackend())
    assert "install polygateway[aiohttp]" in str(caught.value)
    assert caught.value.field == "transport"


# --- policy and classification ----------------------------------------------------------


def test_loop_policy_reads_every_number_from_the_settings() -> None:
    """max_attempts and lease_grace_s come from the settings, not the defaults."""
    settings = gateway_settings(max_attempts=7, lease_grace_s=11.0)
    policy = LoopPolicy.from_settings(settings, settings.scope("chat"))
    assert (policy.max_attempts, policy.lease_grace_s) == (7, 11.0)


def test_a_retry_after_on_a_failure_that_does_not_pace_is_not_kept() -> None:
    """A 401 naming a back-off pauses nothing: its verdict carries no retry_after_s."""
    verdict = verdict_for(TransientError("no", status_code=401, retry_after_s=5.0), exempt_429=True)
    assert verdict.outcome.retry_after_s is None


# --- telemetry --------------------------------------------------------------------------


def _record(**fields: Any) -> AttemptRecord:
    base = dict.fromkeys(AttemptRecord.__dataclass_fields__)
    base.update(
        call_id="c0ffee",
        scope="chat",
        source="primary",
        attempt=2,
        outcome="transient",
        latency_s=0.25,
        prompt_tokens=0,
        completion_tokens=0,
        permit_wait_s=0.0,
        stalled_s=0.0,
    )
    base.update(fields)
    return AttemptRecord(**base)


def test_a_record_without_usage_counts_zero_tokens_and_never_negative_latency() -> None:
    """No usage: 0 prompt and 0 completion tokens; a clock step back gives latency 0."""
    record = attempt_record(
        _ctx(), scope="chat", outcome="success", status_code=None, error=None, ended_at=1000.5
    )
    assert (record.prompt_tokens, record.completion_tokens) == (0, 0)
    assert record.latency_s == 0.5
    early = attempt_record(
        _ctx(), scope="chat", outcome="success", status_code=None, error=None, ended_at=999.0
    )
    assert early.latency_s == 0.0


def test_logging_emitter_writes_one_human_line_per_attempt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The line names scope, source, attempt, outcome, status and error; none when absent."""
    emitter = LoggingEmitter()
    with caplog.at_level(logging.DEBUG, logger="polygateway.attempts"):
        emitter.emit_attempt(_record(status_code=503, error="HTTP 503"))
        emitter.emit_attempt(_record(outcome="success"))
    assert [r.getMessage() for r in caplog.records] == [
        "attempt scope=chat source=primary n=2 outcome=transient status=503 latency=0.250s "
        "error=HTTP 503",
        "attempt scope=chat source=primary n=2 outcome=success latency=0.250s",
    ]
    assert caplog.records[0].name == "polygateway.attempts"


def test_logging_emitter_uses_the_logger_it_is_given(caplog: pytest.LogCaptureFixture) -> None:
    """A logger passed in is the one written to."""
    mine = logging.getLogger("myapp.calls")
    with caplog.at_level(logging.WARNING, logger="myapp.calls"):
        LoggingEmitter(mine).emit_attempt(_record())
    assert [r.name for r in caplog.records] == ["myapp.calls"]


def test_prometheus_metrics_carry_their_help_text() -> None:
    """Each metric is exposed with its documented help line, on the given registry."""
    prometheus = pytest.importorskip("prometheus_client")
    registry = prometheus.CollectorRegistry()
    PrometheusEmitter(registry).emit_attempt(_record(ttft_s=0.1))
    text = prometheus.generate_latest(registry).decode()
    assert "# HELP polygateway_attempts_total Real attempts, by scope, source and outcome." in text
    assert (
        "# HELP polygateway_attempt_latency_seconds Duration of each attempt, "
        "request to release." in text
    )
    assert (
        "# HELP polygateway_stream_ttft_seconds Time from a stream's request to its first chunk."
        in text
    )


def test_prometheus_emitter_defaults_to_the_global_registry() -> None:
    """Without a registry, the metrics go to prometheus_client's default one."""
    prometheus = pytest.importorskip("prometheus_client")
    PrometheusEmitter().emit_attempt(_record(source="global-default-check"))
    value = prometheus.REGISTRY.get_sample_value(
        "polygateway_attempts_total",
        {"scope": "chat", "source": "global-default-check", "outcome": "transient"},
    )
    assert value is not None
    assert value >= 1.0


def test_prometheus_emitter_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing prometheus-client is a ConfigError naming the extra to install."""
    import importlib

    real = importlib.import_module

    def no_prometheus(name: str, *args: Any) -> Any:
        if name == "prometheus_client":
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr("polygateway.middleware.telemetry.importlib.import_module", no_prometheus)
    with pytest.raises(ConfigError) as caught:
        PrometheusEmitter()
    assert str(caught.value).startswith(
        "PrometheusEmitter needs prometheus-client: install polygateway[prometheus]"
    )
