"""The numbers one scope's governance loop runs by, read once from the settings.

Gateway-wide knobs (stall window, attempts, polling, back-off, breaker, lease
grace) plus the scope's one policy flag, ``exempt_429``: chat does not charge
429s to ``max_attempts`` and checks the stall rule at the top of every
iteration; embedding and OCR charge every failure (research-wiki/designs/stall-budget.md §3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from polygateway.config import GatewaySettings, ScopeConfig

__all__ = ["LoopPolicy"]


@dataclass(frozen=True, slots=True)
class LoopPolicy:
    """The numbers one scope's loop runs by; built from settings once per client."""

    stall_window_s: float = 300.0
    max_attempts: int = 3
    poll_interval_s: float = 0.5
    backoff_base_s: float = 0.5
    backoff_cap_s: float = 8.0
    lease_grace_s: float = 30.0
    breaker_failures: int = 5
    breaker_cooldown_s: float = 30.0
    breaker_cooldown_max_s: float = 300.0
    exempt_429: bool = False

    @classmethod
    def from_settings(cls, settings: GatewaySettings, scope: ScopeConfig) -> LoopPolicy:
        """The gateway's numbers with the scope's ``exempt_429``."""
        return cls(
            stall_window_s=settings.stall_window_s,
            max_attempts=settings.max_attempts,
            poll_interval_s=settings.poll_interval_s,
            backoff_base_s=settings.backoff_base_s,
            backoff_cap_s=settings.backoff_cap_s,
            lease_grace_s=settings.lease_grace_s,
            breaker_failures=settings.breaker_failures,
            breaker_cooldown_s=settings.breaker_cooldown_s,
            breaker_cooldown_max_s=settings.breaker_cooldown_max_s,
            exempt_429=scope.exempt_429,
        )
