"""What each failure class does to the governance loop (research-wiki/ARCHITECTURE.md §2b).

``transport/http.py`` turns what the upstream did into a class; this module
is the one place that says what each class does to shared state (the
``AttemptOutcome`` released to the backend) and to the loop (charged to
``max_attempts`` or not, raise ``RequestRejected`` at once or retry)::

    class                 released as     breaker    AIMD                 loop
    rate_limited          rate_limited    -          decrease; paused     retry, free if exempt_429
    transient             transient       failure    on timeout/503/529;  retry, charged
                                                     paused if hinted
    source_misconfigured  misconfigured   trip long  -                    retry elsewhere, charged
    request_rejected      rejected        -          -                    RequestRejected at once

One row stands outside the table because the upstream's answer does not
decide it: a timeout that the caller's ``deadline_s`` cut short (``DEADLINE_CUT``)
is released as ``cancelled``, like a caller's cancellation: no breaker
failure, no AIMD decrease. The source was not shown slow by its own
measure, only slower than this caller would wait. The call then ends with
``AllSourcesExhausted(reason="deadline")``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from polygateway.backends.base import AttemptOutcome, OutcomeKind
from polygateway.models import FailureClass
from polygateway.transport.http import TransientError

__all__ = [
    "DEADLINE_CUT",
    "FAILURE_TABLE",
    "OVERLOAD_STATUSES",
    "Decrease",
    "FailureRule",
    "Verdict",
    "clamped_hint",
    "verdict_for",
]


Decrease = Literal["always", "on_overload", "never"]
"""When a failure shrinks the source's AIMD limit: ``on_overload`` is a timeout, 503 or 529."""

OVERLOAD_STATUSES: Final = frozenset({503, 529})
"""Transient statuses that mean overload (with a timeout): the AIMD limit shrinks."""


@dataclass(frozen=True, slots=True)
class FailureRule:
    """One row of the table: what the backend records and what the loop does next.

    ``exempt_if_429``: not charged to ``max_attempts`` when the loop runs with
    ``exempt_429`` (chat). ``paces``: the upstream's back-off (Retry-After and
    its variants) goes to the pacer, which pauses the source
    (``governance/pacer.py``: a 429 always, other failures only when hinted).
    ``raises``: the loop raises ``RequestRejected`` at once and tries no other source.
    """

    outcome: OutcomeKind
    decrease: Decrease = "never"
    paces: bool = False
    exempt_if_429: bool = False
    raises: bool = False


FAILURE_TABLE: Final[Mapping[FailureClass, FailureRule]] = {
    # Back-pressure, not a fault: the breaker is untouched, the source is paced.
    "rate_limited": FailureRule("rate_limited", decrease="always", paces=True, exempt_if_429=True),
    # 408/5xx/connect/reset/timeout/malformed: a breaker failure; a 503/529 that names
    # its back-off pauses the source too (RFC 9110 defines Retry-After for 503).
    "transient": FailureRule("transient", decrease="on_overload", paces=True),
    # 401/402/403/404, an out-of-credit 429: this source is wrong (the breaker trips
    # long); other sources are tried.
    "source_misconfigured": FailureRule("source_misconfigured"),
    # 400/413/422: the request itself is wrong; no other source would take it.
    "request_rejected": FailureRule("request_rejected", raises=True),
}


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one failed attempt comes to: the release outcome and the loop's next move."""

    outcome: AttemptOutcome
    charged: bool
    raises: bool


DEADLINE_CUT: Final = Verdict(AttemptOutcome("cancelled"), charged=False, raises=False)
"""An attempt cut by the caller's deadline: released as cancelled; the call ends "deadline"."""


def verdict_for(
    error: TransientError, *, exempt_429: bool, max_pause_s: float = math.inf
) -> Verdict:
    """Apply ``FAILURE_TABLE`` to a failed attempt; a back-off is clamped to ``max_pause_s``.

    The loop passes its stall window as ``max_pause_s``: a hint longer than
    that would park the source past the point where its callers give up.
    """
    rule = FAILURE_TABLE[error.failure]
    if rule.decrease == "always":
        decrease = True
    else:
        decrease = rule.decrease == "on_overload" and (
            error.timeout or error.status_code in OVERLOAD_STATUSES
        )
    outcome = AttemptOutcome(
        kind=rule.outcome,
        aimd_decrease=decrease,
        retry_after_s=clamped_hint(error.retry_after_s, max_pause_s) if rule.paces else None,
    )
    return Verdict(
        outcome=outcome,
        charged=not (rule.exempt_if_429 and exempt_429),
        raises=rule.raises,
    )


def clamped_hint(hint_s: float | None, max_pause_s: float) -> float | None:
    """An upstream's back-off, at most ``max_pause_s``; ``None`` stays ``None``."""
    if hint_s is None or not hint_s > max_pause_s:
        return hint_s
    return max_pause_s
