"""Import cost of one module in a fresh interpreter: seconds and RSS over bare Python.

    python -m bench.import_probe polygateway

Prints one JSON object. The RSS baseline is read in the same process just
before the import, so it is the bare interpreter (plus ``runpy``); only the
standard library's ``json`` is imported after the measurement.
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["main"]

_EXTRAS = ("redis", "aiohttp", "rich", "prometheus_client", "starlette", "uvicorn", "opentelemetry")
"""Optional dependencies ``import polygateway`` must not load (DESIGN.md section 3)."""


def _rss_mib() -> float:
    """Current resident memory (VmRSS) in MiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    """Import the module named on the command line and print what it cost."""
    args = sys.argv[1:] if argv is None else argv
    module = args[0] if args else "polygateway"
    if module == "litellm":
        # Keep LiteLLM on this machine: the bundled cost map instead of a download.
        os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    before = _rss_mib()
    t0 = time.perf_counter()
    if module != "-":
        __import__(module)
    seconds = time.perf_counter() - t0
    after = _rss_mib()
    loaded = [m for m in _EXTRAS if m in sys.modules]
    import json

    result = {
        "module": module,
        "import_s": seconds,
        "bare_rss_mib": before,
        "rss_over_bare_mib": after - before,
        "extras_loaded": loaded,
    }
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
