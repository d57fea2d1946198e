"""Token buckets for rpm and tpm, refilled continuously (equivalent to GCRA).

One bucket type serves both limits: ``rate`` is units per minute (requests
or tokens), ``capacity`` the burst. Over any interval ``t`` a bucket admits at
most ``rate / 60 * t + capacity`` units. A take may drive the bucket negative
(a request larger than the whole bucket is admitted when the bucket is full,
and pays its debt before the next one). The arithmetic is written in exactly
the order of the spec page so the Lua twin computes bit-identical floats.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "TokenBucket",
    "new_bucket",
    "reconcile",
    "refill",
    "refilled_tokens",
    "take",
    "wait_for",
]


@dataclass(slots=True)
class TokenBucket:
    """Tokens available as of ``at`` (the backend's clock)."""

    tokens: float
    at: float


def new_bucket(capacity: float, now: float) -> TokenBucket:
    """A bucket first seen at ``now``: full."""
    return TokenBucket(tokens=capacity, at=now)


def refilled_tokens(bucket: TokenBucket, rate: float, capacity: float, now: float) -> float:
    """The tokens the bucket would hold at ``now``, without changing it."""
    tokens = bucket.tokens + (now - bucket.at) * rate / 60
    # min(capacity, tokens) without the builtin's call cost (every acquire of a limited source).
    return tokens if tokens < capacity else capacity


def refill(bucket: TokenBucket, rate: float, capacity: float, now: float) -> None:
    """Bring the bucket up to date (stored even when the request is then refused)."""
    bucket.tokens = refilled_tokens(bucket, rate, capacity, now)
    bucket.at = now


def wait_for(bucket: TokenBucket, need: float, rate: float) -> float | None:
    """Seconds until a refilled bucket holds ``need`` tokens; ``None`` when it already does."""
    if bucket.tokens >= need:
        return None
    return (need - bucket.tokens) * 60 / rate


def take(bucket: TokenBucket, amount: float) -> None:
    """Spend ``amount`` tokens; the bucket may go negative (debt paid by the refill)."""
    bucket.tokens -= amount


def reconcile(bucket: TokenBucket, reserved: float, used: float, capacity: float) -> None:
    """Replace a reservation with real usage: refund the difference, or charge the excess."""
    bucket.tokens = min(capacity, bucket.tokens + reserved - used)
