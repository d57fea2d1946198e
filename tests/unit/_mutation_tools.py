"""The mutation tools of ``tools/mutation/``, loaded by path: they are scripts, not a package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "mutation"


def load(name: str, filename: str) -> ModuleType:
    """``tools/mutation/<filename>`` as module ``name`` (registered once, then reused)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TOOLS / filename)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def lua_runner() -> ModuleType:
    """``tools/mutation/lua.py``."""
    return load("pgw_lua_mutation_runner", "lua.py")
