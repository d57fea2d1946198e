"""A scope's spec set: what ACQUIRE reads of candidates it is not handed whole.

ACQUIRE carries O(1) per call, whatever a scope's number of sources
(research-wiki/designs/script-cost.md, "The O(1) contract"): its first
candidate travels whole, the others as their index in a list of (name, spec)
that Redis keeps under a digest of the list. The list holds the last spec this
process sent for each source of the scope, in name order, so that processes of
one configuration agree on it, and with it on the indices of the verdicts
ACQUIRE keeps by index. A spec that changes, or a source new to this process,
makes a new set and a new digest; the client sends the set itself with the
first call of each digest, and again when a script says it has none (expired,
or a new primary after a failover).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

from polygateway.backends.base import SourceSpec
from polygateway.backends.redis import codec
from polygateway.backends.redis.wire import Arg, bulk, bulk_bytes
from polygateway.errors import ConfigError

__all__ = ["SpecSet", "limits_of"]

MAX_SOURCES: Final = 65536
"""Indices travel as two bytes each."""


def limits_of(spec: SourceSpec) -> tuple[str, ...]:
    """A spec's eight limits as the scripts read them (``""``: no rpm or tpm limit)."""
    rpm = spec.rpm is not None
    tpm = spec.tpm is not None
    return (
        str(int(spec.max_concurrency)),
        codec.num(spec.rpm),
        codec.num(spec.rpm_capacity) if rpm else "",
        codec.num(spec.tpm),
        codec.num(spec.tpm_capacity) if tpm else "",
        str(int(spec.breaker_failures)),
        codec.num(spec.cooldown_s),
        codec.num(spec.cooldown_max_s),
    )


def _packed(text: str) -> str:
    """``"<len>:<text>"``, the length in bytes (the scripts' list format)."""
    return f"{len(text.encode())}:{text}"


class SpecSet:
    """One version of a scope's spec set: its specs by name, their indices, its digest.

    Immutable once made; ``stored`` says whether this process believes Redis
    holds it (it sent it, or a call using it was answered).
    """

    __slots__ = ("_index", "digest", "key", "packed", "specs", "stored")

    def __init__(self, scope: str, specs: dict[str, SourceSpec]) -> None:
        if len(specs) > MAX_SOURCES:
            raise ConfigError(f"a scope holds at most {MAX_SOURCES} sources, not {len(specs)}")
        names = sorted(specs)
        self.specs = specs
        self._index = {name: i.to_bytes(2, "big") for i, name in enumerate(names)}
        text = "".join(_packed(n) + _packed(" ".join(limits_of(specs[n]))) for n in names)
        digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        self.digest = bulk(digest)
        self.key = bulk(codec.key(scope, "specs", digest))
        self.packed = bulk(text)
        self.stored = False

    def covers(self, candidates: Sequence[SourceSpec]) -> bool:
        """Whether every candidate is in the set with this very spec."""
        specs = self.specs
        return all(specs.get(spec.name) == spec for spec in candidates)

    def with_specs(self, scope: str, candidates: Sequence[SourceSpec]) -> SpecSet:
        """The next version: these candidates' specs over this one's."""
        merged = dict(self.specs)
        merged.update((spec.name, spec) for spec in candidates)
        return SpecSet(scope, merged)

    def order(self, candidates: Sequence[SourceSpec]) -> Arg:
        """ACQUIRE's order argument: each candidate's index, two bytes, in call order."""
        index = self._index
        return bulk_bytes(b"".join(index[spec.name] for spec in candidates))
