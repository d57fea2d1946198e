"""The Redis scripts' values as this client writes and reads them: keys, numbers, replies.

Half of the Lua contract of ``scripts.py`` (the other half is the scripts'
own headers): how a number is written so that Lua reads it back exactly, and
how a reply item is read whether or not the client decodes replies.
"""

from __future__ import annotations

import math
from typing import Any

from polygateway.errors import ConfigError

__all__ = ["age", "is_one", "key", "num", "opt_float", "text", "texts"]


def key(scope: str, *parts: str) -> str:
    """``pgw:{scope}:...``: the hash tag keeps a scope in one Redis Cluster slot."""
    return ":".join(("pgw", "{" + scope + "}", *parts))


def num(value: float | None) -> str:
    """A number as a Lua script reads it back exactly; ``""`` for none."""
    if value is None:
        return ""
    number = float(value)
    if not math.isfinite(number):
        raise ConfigError(f"a governance limit must be a finite number, not {value!r}")
    return repr(number)


def text(value: Any) -> str:
    """A script's reply item as text (the client may or may not decode replies)."""
    if isinstance(value, bytes):
        return value.decode()
    return str(value)


def opt_float(value: Any) -> float | None:
    """A reply item that is a number or ``""`` (none)."""
    found = text(value)
    return None if found == "" else float(found)


def texts(reply: Any) -> list[str]:
    """A reply that is a list of strings."""
    return [text(item) for item in reply]


def is_one(reply: Any) -> bool:
    """A reply that is 1 (yes) or 0 (no)."""
    return int(reply) == 1


def age(reply: Any) -> float:
    """A progress age from a script; ``""`` means never served."""
    found = opt_float(reply)
    return math.inf if found is None else found
