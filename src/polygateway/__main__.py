"""``python -m polygateway``: the same command line as the ``polygateway`` script."""

from __future__ import annotations

from polygateway.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
