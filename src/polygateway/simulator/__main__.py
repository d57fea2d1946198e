"""``python -m polygateway.simulator``: the same as ``polygateway simulate``."""

from __future__ import annotations

import sys

from polygateway.simulator.command import main

if __name__ == "__main__":
    sys.exit(main())
