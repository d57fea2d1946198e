"""Fault profiles: how one simulated source misbehaves, and the named built-in profiles.

Every request to a source draws at most one random fault, so the fault rates
of a profile are probabilities of disjoint outcomes and must add up to at most
1. The server-side limits (``request_limit`` / ``rpm_limit``, ``token_limit``,
``max_concurrency``) are not random: they answer 429 exactly when a real
provider would.

The ``wire`` is orthogonal to the faults: it says which provider the source
imitates (routes, stream shape, error bodies, rate-limit and back-off
headers), and every fault is played in that provider's shapes. What each wire
sends is written down, with its sources, in research-wiki/guides/providers.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Literal, get_args

__all__ = [
    "FAULTS",
    "PROFILES",
    "WIRES",
    "AzureFilter",
    "Fault",
    "FaultProfile",
    "RetryAfterStyle",
    "Wire",
    "get_profile",
]

Fault = Literal["429", "5xx", "hang", "reset", "malformed", "error_body", "truncate"]
"""A random fault a request can draw (``truncate`` only changes streams)."""

FAULTS: tuple[Fault, ...] = get_args(Fault)

RetryAfterStyle = Literal["seconds", "http-date"]

AzureFilter = Literal["default", "asynchronous"]
"""How Azure's content filter streams: buffered and rated per chunk, or rated afterwards."""

Wire = Literal["openai", "azure", "anthropic", "litellm", "vllm"]
"""The provider a source imitates on the wire."""

WIRES: tuple[Wire, ...] = get_args(Wire)


@dataclass(frozen=True, slots=True)
class FaultProfile:
    """How one simulated source behaves; the defaults are a healthy, instant source.

    Attributes:
        wire: the provider imitated: ``openai``, ``azure`` (deployment routes,
            ``api-version``, ``api-key``, content filter annotations in chat
            answers), ``anthropic`` (Messages API),
            ``litellm`` (OpenAI shapes, provider headers forwarded as
            ``llm_provider-*``, stream errors in band) or ``vllm`` (OpenAI
            shapes, no rate-limit headers, ``: keep-alive`` comments before the
            first token).
        api_key: the key the source demands in its wire's header (``Authorization:
            Bearer``, ``api-key``, ``x-api-key``); a missing or different key is a 401.
            ``None`` accepts any key (the ``anthropic`` wire still wants the header).
        latency_s: mean delay before the response headers.
        latency_jitter_s: the delay is uniform on ``latency_s ± latency_jitter_s``, floored at 0.
        ttft_s: extra delay of a stream before its first content: after the
            events a provider sends at once (the OpenAI role chunk; Anthropic's
            ``message_start``, ``content_block_start`` and ``ping``).
        keepalive_s: on the ``vllm`` wire, one ``: keep-alive`` comment per this
            many seconds of the ``ttft_s`` wait (at least one before the first content).
        rate_429: probability of a 429 answer (1.0: every request, "429 forever").
        retry_after_s: the Retry-After of a random 429 (and of a 5xx when
            ``retry_after_on_5xx``); ``None`` sends no header.
        retry_after_style: Retry-After as delta seconds or as an HTTP date.
        retry_after_on_5xx: a random 5xx (503, 529, ...) carries Retry-After too.
        request_limit: server-side requests per sliding window of
            ``request_window_s``; over it, 429. Remaining = limit minus the
            requests admitted in the last ``request_window_s``; reset = time
            until the oldest of them leaves the window.
        request_window_s: the window of ``request_limit``.
        rpm_limit: the same as ``request_limit`` with a 60 s window (kept for
            existing profiles; give one or the other).
        token_limit: server-side tokens (prompt + completion of each admitted
            request) per sliding window of ``token_window_s``; over it, 429.
        token_window_s: the window of ``token_limit``.
        max_concurrency: server-side requests in service at once; over it, 429 with Retry-After 1.
        rate_5xx: probability of a 5xx answer, its status drawn from ``statuses_5xx``.
        rate_hang: probability of never answering (until ``hang_s``, the client leaves,
            or the server shuts down).
        rate_reset: probability of closing the connection in the middle of the body.
        rate_malformed: probability of a 200 whose body is not valid JSON.
        rate_error_body: probability of a 200 whose body is an error object
            (``{"error": ...}``, MonkeyOCR ``{"success": false, ...}``).
        rate_truncate: probability that a stream stops without a finish_reason and ``[DONE]``.
        stream_chunks: content chunks per streamed answer.
        chunk_interval_s: delay between stream chunks.
        embedding_dim: length of each embedding vector.
        azure_filter: on the ``azure`` wire, the content filter's streaming
            mode: ``default`` (content buffered, every chunk rated) or
            ``asynchronous`` (Azure's Asynchronous Filter: content chunks bare,
            the ratings after them in annotation-only chunks carrying
            ``content_filter_offsets``, the last one after the finish chunk;
            research-wiki/guides/providers.md).
        azure_filter_flags: words the ``asynchronous`` filter flags: a streamed
            text reply that says one is cut a chunk later by an annotation
            with ``finish_reason: "content_filter"`` (``filtered: true``).
            Non-streamed answers are not filtered.
    """

    wire: Wire = "openai"
    # Kept out of repr: a key, even a made-up one, has no business in logs.
    api_key: str | None = field(default=None, repr=False)
    latency_s: float = 0.0
    latency_jitter_s: float = 0.0
    ttft_s: float = 0.0
    keepalive_s: float = 0.5
    rate_429: float = 0.0
    retry_after_s: float | None = 1.0
    retry_after_style: RetryAfterStyle = "seconds"
    retry_after_on_5xx: bool = False
    request_limit: int | None = None
    request_window_s: float = 60.0
    rpm_limit: int | None = None
    token_limit: int | None = None
    token_window_s: float = 60.0
    max_concurrency: int | None = None
    rate_5xx: float = 0.0
    statuses_5xx: tuple[int, ...] = (500, 502, 503)
    rate_hang: float = 0.0
    hang_s: float = 3600.0
    rate_reset: float = 0.0
    rate_malformed: float = 0.0
    rate_error_body: float = 0.0
    rate_truncate: float = 0.0
    stream_chunks: int = 8
    chunk_interval_s: float = 0.0
    embedding_dim: int = 8
    azure_filter: AzureFilter = "default"
    azure_filter_flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """Refuse a profile that cannot be played, naming the field."""
        for f in fields(self):
            value = getattr(self, f.name)
            number = isinstance(value, float | int) and not isinstance(value, bool)
            if number and (not math.isfinite(value) or value < 0):
                raise ValueError(f"FaultProfile.{f.name} must be finite and >= 0, not {value}")
        for name, rate in self.fault_rates().items():
            if rate > 1:
                raise ValueError(f"FaultProfile.rate_{name} must be <= 1, not {rate}")
        total = sum(self.fault_rates().values())
        if total > 1 + 1e-9:
            # One draw picks at most one fault, so the rates share one unit interval.
            raise ValueError(f"FaultProfile fault rates add up to {total:.3f}, more than 1")
        if self.wire not in WIRES:
            raise ValueError(
                f"FaultProfile.wire unknown: {self.wire!r} (known: {', '.join(WIRES)})"
            )
        for knob in ("request_limit", "rpm_limit", "token_limit"):
            limit = getattr(self, knob)
            if limit is not None and limit < 1:
                raise ValueError(f"FaultProfile.{knob} must be >= 1 or None")
        if self.request_limit is not None and self.rpm_limit is not None:
            raise ValueError("FaultProfile: give request_limit or rpm_limit, not both")
        for knob in ("request_window_s", "token_window_s", "keepalive_s"):
            if getattr(self, knob) <= 0:
                raise ValueError(f"FaultProfile.{knob} must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("FaultProfile.max_concurrency must be >= 1 or None")
        if self.rate_5xx > 0 and not self.statuses_5xx:
            raise ValueError("FaultProfile.statuses_5xx must not be empty when rate_5xx > 0")
        if any(not 500 <= s <= 599 for s in self.statuses_5xx):
            raise ValueError(f"FaultProfile.statuses_5xx must be 5xx codes: {self.statuses_5xx}")
        if self.stream_chunks < 1:
            raise ValueError("FaultProfile.stream_chunks must be >= 1")
        if self.embedding_dim < 1:
            raise ValueError("FaultProfile.embedding_dim must be >= 1")
        if self.retry_after_style not in ("seconds", "http-date"):
            raise ValueError(f"FaultProfile.retry_after_style unknown: {self.retry_after_style!r}")
        if self.azure_filter not in ("default", "asynchronous"):
            raise ValueError(f"FaultProfile.azure_filter unknown: {self.azure_filter!r}")
        if self.azure_filter != "default" and self.wire != "azure":
            raise ValueError("FaultProfile.azure_filter is a mode of the azure wire")
        if self.azure_filter_flags and self.azure_filter != "asynchronous":
            raise ValueError("FaultProfile.azure_filter_flags need azure_filter='asynchronous'")
        if any(not isinstance(w, str) or not w.strip() for w in self.azure_filter_flags):
            raise ValueError("FaultProfile.azure_filter_flags must be non-empty words")

    def request_window(self) -> tuple[int, float] | None:
        """The server-side request limit and its window in seconds, or None when unlimited."""
        if self.request_limit is not None:
            return self.request_limit, self.request_window_s
        if self.rpm_limit is not None:
            return self.rpm_limit, 60.0
        return None

    def fault_rates(self) -> dict[Fault, float]:
        """Each random fault and its probability, in the order the draw walks them."""
        return {
            "429": self.rate_429,
            "5xx": self.rate_5xx,
            "hang": self.rate_hang,
            "reset": self.rate_reset,
            "malformed": self.rate_malformed,
            "error_body": self.rate_error_body,
            "truncate": self.rate_truncate,
        }


PROFILES: Mapping[str, FaultProfile] = MappingProxyType(
    {
        # A well-behaved provider: some latency, streams with a visible first-token delay.
        "healthy": FaultProfile(
            latency_s=0.02, latency_jitter_s=0.01, ttft_s=0.02, chunk_interval_s=0.005
        ),
        # Mostly fine, with a low rate of every kind of failure a gateway must survive.
        "flaky": FaultProfile(
            latency_s=0.03,
            latency_jitter_s=0.02,
            ttft_s=0.03,
            chunk_interval_s=0.005,
            rate_429=0.03,
            rate_5xx=0.06,
            rate_hang=0.02,
            rate_reset=0.03,
            rate_malformed=0.02,
            rate_truncate=0.02,
        ),
        # A provider at its quota: a low server-side rpm and 429s that say when to come back.
        "rate_limited": FaultProfile(
            latency_s=0.02,
            latency_jitter_s=0.01,
            rate_429=0.2,
            retry_after_s=2.0,
            rpm_limit=30,
            max_concurrency=4,
        ),
        # A provider that is down: nearly every answer is 503.
        "failing": FaultProfile(latency_s=0.01, rate_5xx=0.9, statuses_5xx=(503,)),
        # No delays and no faults: measures the gateway's own cost in benchmarks.
        "zero_latency": FaultProfile(),
    }
)
"""The built-in profiles, by name (``polygateway simulate --profile NAME``)."""


def get_profile(name: str) -> FaultProfile:
    """The built-in profile called ``name``; the error lists the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise KeyError(f"unknown simulator profile {name!r} (known: {known})") from None
