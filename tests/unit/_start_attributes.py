"""A sampler that keeps what each span started with: the attributes a real sampler decides on."""

from __future__ import annotations

from typing import Any

from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Sampler, SamplingResult

__all__ = ["StartAttributes"]


class StartAttributes(Sampler):
    """Samples every span, keeping the name and attributes each had as it started."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []

    def should_sample(
        self,
        parent_context: Any,
        trace_id: int,
        name: str,
        kind: Any = None,
        attributes: Any = None,
        links: Any = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        self.seen.append((name, dict(attributes or {})))
        return ALWAYS_ON.should_sample(parent_context, trace_id, name, kind, attributes, links)

    def get_description(self) -> str:
        return "StartAttributes"
