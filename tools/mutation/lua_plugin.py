"""A pytest plugin for ``tools/mutation/lua.py``: the suite's settings under mutation.

``lua_worker.py`` swaps the mutated script itself. Run by hand (``pytest -p
lua_plugin``), a mutant can also come in a JSON file named by
``PGW_LUA_MUTANT`` (``{"constant": ..., "text": ...}``), which replaces that constant of
``polygateway.backends.redis.scripts`` in memory before any backend is built
(``RedisBackend`` reads the constants when it registers its scripts); the file
on disk is never touched. Hypothesis runs without its example database, so a
failure found under one mutant is not replayed under the next, and stops at
the first failing example: a mutant is killed by the failure, and shrinking
it (a minute or two for the differential test) would tell nobody anything.
The fleet tests' bound on a wake-up (``_wakeups.BOUND_S``, 10 s) is cut to
``WAKE_BOUND_S``: a mutant that stops wake-ups fails them only at the bound,
while a wake-up that comes arrives in milliseconds (the unmutated baseline
runs under the same bound).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from hypothesis import Phase, settings

from polygateway.backends.redis import scripts

WAKE_BOUND_S = 3.0


def pytest_configure(config: pytest.Config) -> None:
    """Swap in the mutated script and turn off hypothesis's example database."""
    del config
    # tests/conftest.py has registered the suite's profile by now (initial conftests load first).
    settings.register_profile(
        "lua-mutation",
        parent=settings.get_profile("polygateway"),
        database=None,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
    )
    settings.load_profile("lua-mutation")
    path = os.environ.get("PGW_LUA_MUTANT")
    if not path:
        return
    mutant = json.loads(Path(path).read_text(encoding="utf-8"))
    constant = mutant["constant"]
    if constant not in scripts.__all__:
        raise pytest.UsageError(f"no script constant {constant!r}")
    setattr(scripts, constant, mutant["text"])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Cut the fleet tests' wake-up bound, in ``_wakeups`` and in each module that took it."""
    del items
    for name, module in list(sys.modules.items()):
        fleet = name == "_wakeups" or name.startswith("test_redis_")
        if fleet and getattr(module, "BOUND_S", None) == _FLEET_BOUND_S:
            module.BOUND_S = WAKE_BOUND_S


_FLEET_BOUND_S = 10.0
"""``tests/integration/_wakeups.BOUND_S``, the value replaced (another BOUND_S is left alone)."""
