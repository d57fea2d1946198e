"""The exception tree of research-wiki/ARCHITECTURE.md §2b and what its errors carry."""

from __future__ import annotations

import pytest

from polygateway.errors import (
    AllSourcesExhausted,
    ConfigError,
    GatewayError,
    GatewayUnavailableError,
    GovernanceBackendError,
    RequestRejected,
    StreamInterrupted,
)
from polygateway.models import AttemptRecord


@pytest.mark.parametrize(
    ("cls", "parent"),
    [
        (ConfigError, GatewayError),
        (ConfigError, ValueError),
        (RequestRejected, GatewayError),
        (StreamInterrupted, GatewayError),
        (GatewayUnavailableError, GatewayError),
        (AllSourcesExhausted, GatewayUnavailableError),
        (GovernanceBackendError, GatewayUnavailableError),
    ],
)
def test_tree_matches_the_design(cls: type[Exception], parent: type[Exception]) -> None:
    """Each error sits where research-wiki/ARCHITECTURE.md §2b draws it."""
    assert issubclass(cls, parent)


def test_all_sources_exhausted_carries_reason_attempts_and_retry_after() -> None:
    """Callers read reason, retry_after_s, attempts, scope and sources from the error."""
    record = AttemptRecord(
        call_id="c1",
        scope="chat",
        source="a",
        attempt=1,
        outcome="transient",
        status_code=503,
        latency_s=0.1,
    )
    err = AllSourcesExhausted(
        "gave up",
        reason="retry_exhausted",
        scope="chat",
        sources=["a", "b"],
        retry_after_s=2.5,
        attempts=[record],
    )
    assert err.reason == "retry_exhausted"
    assert err.retry_after_s == 2.5
    assert err.attempts == (record,)
    assert err.sources == ("a", "b")
    assert "retry_exhausted" in str(err)
    assert "chat" in repr(err)


def test_config_error_names_field_and_file() -> None:
    """A ConfigError message says which field of which file was wrong."""
    err = ConfigError("must be positive", field="scopes.chat.sources[0].rpm", path="/x/p.toml")
    assert "scopes.chat.sources[0].rpm" in str(err)
    assert "/x/p.toml" in str(err)
    assert err.field == "scopes.chat.sources[0].rpm"


def test_backend_error_names_operation_and_scope() -> None:
    """A GovernanceBackendError says which backend operation failed for which scope."""
    err = GovernanceBackendError("redis unreachable", operation="acquire", scope="embed")
    assert err.operation == "acquire"
    assert "acquire" in str(err)
    assert "embed" in str(err)


def test_embedding_errors_name_the_batch() -> None:
    """An error of an embedding call names the failing batch's input indices."""
    err = RequestRejected("bad input", scope="embed", batch=(64, 128))
    assert err.batch == (64, 128)
    assert "(64, 128)" in str(err)
