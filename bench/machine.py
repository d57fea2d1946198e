"""What the numbers were measured on: the machine, the interpreter and the package versions."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from typing import Any

__all__ = ["PACKAGES", "describe_machine", "package_versions"]

PACKAGES = (
    "polygateway",
    "httpx",
    "httpcore",
    "httpx-sse",
    "aiohttp",
    "openai",
    "litellm",
    "redis",
    "pydantic",
    "starlette",
    "uvicorn",
)
"""Distributions whose versions the page records."""


def _cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or the platform's guess)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    """Total memory in GiB from /proc/meminfo."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 1024 / 1024
    except OSError:
        pass
    return None


def _redis_server_version() -> str | None:
    """``redis-server --version``'s version field, when it is installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for part in out.split():
        if part.startswith("v="):
            return part.removeprefix("v=")
    return out.strip() or None


def describe_machine() -> dict[str, Any]:
    """The machine and interpreter, as plain data."""
    return {
        "nproc": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "memory_gib": _memory_gib(),
        "kernel": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "python_impl": platform.python_implementation(),
        "redis_server": _redis_server_version(),
    }


def package_versions() -> dict[str, str | None]:
    """Installed version of each package in ``PACKAGES`` (``None`` when absent)."""
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out
