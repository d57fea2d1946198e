"""One member of a fleet for ``test_redis_fleet.py``: an OS process with one ChatClient on Redis.

Run as ``python _fleet_worker.py CONFIG_JSON`` where the config is
``{"settings": {...GatewaySettings keywords...}, "scope": "chat"}``. The
worker builds its client the way an application does
(``ChatClient.from_settings``, so the backend is the shared ``RedisBackend``
of the settings' URL), prints ``{"event": "ready"}`` and then serves
commands, one JSON object per stdin line, each answered by one JSON line on
stdout carrying the command's ``id``. Commands run concurrently, so a test
can start calls and kill the process while they are in flight.

Commands (``op``):

- ``calls``: ``n`` chat calls, ``concurrency`` at a time (each bounded by
  ``deadline_s`` when given); answers every call's record.
- ``run``: calls from ``concurrency`` tasks from ``start_at`` (a ``time.monotonic()``
  value; default now) until ``duration_s`` later (no new call starts after that;
  calls under way finish); answers every call's record.
- ``acquire``: one ``acquire`` on the shared backend for one source alone, as the
  governance loop would ask it; answers the rejection (a grant is given back at once).
- ``exit``: close the client and the backend, answer, and leave.

A call record holds ``started`` / ``ended`` on ``time.monotonic()``, which on
Linux is one system-wide clock (CLOCK_MONOTONIC): the test compares them with
its own times and with the simulator's arrival times.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Any

from polygateway.backends.base import AttemptOutcome, SourceSpec
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings
from polygateway.errors import AllSourcesExhausted, GatewayError

MESSAGES = [{"role": "user", "content": "hi"}]

_ERROR_PAUSE_S = 0.05
"""A ``run`` task's pause after a failed call, as an application would back off, so a
dead Redis (every call refused at once) does not turn the loop into a busy spin."""


def _emit(obj: dict[str, Any]) -> None:
    """One JSON line on stdout, flushed: the test reads them as they come."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _one_call(client: ChatClient, deadline_s: float | None = None) -> dict[str, Any]:
    """One governed chat call, recorded whatever its end."""
    started = time.monotonic()
    record: dict[str, Any] = {"started": started}
    try:
        response = await client.complete(MESSAGES, max_tokens=8, deadline_s=deadline_s)
    except GatewayError as exc:
        record.update(
            ok=False,
            error=type(exc).__name__,
            reason=exc.reason if isinstance(exc, AllSourcesExhausted) else None,
            message=str(exc),
            attempts=[[a.source, a.outcome] for a in getattr(exc, "attempts", ())],
        )
    else:
        record.update(
            ok=True,
            source=response.source,
            attempts=[[a.source, a.outcome] for a in response.attempts],
        )
    record["ended"] = time.monotonic()
    return record


async def _calls(
    client: ChatClient, n: int, concurrency: int, deadline_s: float | None = None
) -> list[dict[str, Any]]:
    """``n`` calls, at most ``concurrency`` at a time, each bounded by ``deadline_s`` if given."""
    gate = asyncio.Semaphore(concurrency)

    async def gated() -> dict[str, Any]:
        async with gate:
            return await _one_call(client, deadline_s)

    return list(await asyncio.gather(*(gated() for _ in range(n))))


async def _run(
    client: ChatClient, start_at: float, duration_s: float, concurrency: int
) -> list[dict[str, Any]]:
    """Calls from ``concurrency`` tasks in ``[start_at, start_at + duration_s)``."""
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    end = start_at + duration_s
    records: list[dict[str, Any]] = []

    async def task() -> None:
        while time.monotonic() < end:
            record = await _one_call(client)
            records.append(record)
            if not record["ok"]:
                await asyncio.sleep(_ERROR_PAUSE_S)

    await asyncio.gather(*(task() for _ in range(concurrency)))
    return records


def _spec(settings: GatewaySettings, scope: str, name: str) -> SourceSpec:
    """The limits the governance loop hands the backend for source ``name``."""
    source = next(s for s in settings.scope(scope).sources if s.name == name)
    return SourceSpec(
        name=source.name,
        max_concurrency=source.max_concurrency,
        rpm=source.rpm,
        rpm_burst=source.rpm_burst,
        tpm=source.tpm,
        tpm_burst=source.tpm_burst,
        breaker_failures=settings.breaker_failures,
        cooldown_s=settings.breaker_cooldown_s,
        cooldown_max_s=settings.breaker_cooldown_max_s,
    )


async def _acquire(client: ChatClient, settings: GatewaySettings, name: str) -> dict[str, Any]:
    """Ask the shared backend for ``name`` alone; a grant goes straight back as cancelled."""
    scope = client.scope
    result = await client.backend.acquire(scope, [_spec(settings, scope, name)], ttl_s=5.0)
    if result.lease is not None:
        await client.backend.release(result.lease, AttemptOutcome("cancelled"))
        return {"granted": True, "reason": None, "reopen_in_s": None}
    rejection = result.rejections[0]
    return {"granted": False, "reason": rejection.reason, "reopen_in_s": rejection.reopen_in_s}


async def _serve(config: dict[str, Any]) -> None:
    """Build the client, say ready, then answer commands until ``exit`` or end of input."""
    settings = GatewaySettings(_env_file=None, **config["settings"])
    client = ChatClient.from_settings(settings, config["scope"])
    # Open the Redis connection now, so the first command does not pay for it.
    await client.backend.progress_age_s(client.scope)
    _emit({"event": "ready"})
    loop = asyncio.get_running_loop()
    running: set[asyncio.Task[None]] = set()

    async def handle(command: dict[str, Any]) -> None:
        answer: dict[str, Any] = {"id": command["id"]}
        try:
            await answer_(command, answer)
        except Exception as exc:  # reported to the test, which fails on it
            answer["crash"] = repr(exc)
        _emit(answer)

    async def answer_(command: dict[str, Any], answer: dict[str, Any]) -> None:
        op = command["op"]
        if op == "calls":
            answer["records"] = await _calls(
                client, command["n"], command["concurrency"], command.get("deadline_s")
            )
        elif op == "run":
            start_at = command.get("start_at", time.monotonic())
            answer["records"] = await _run(
                client, start_at, command["duration_s"], command["concurrency"]
            )
        elif op == "acquire":
            answer.update(await _acquire(client, settings, command["source"]))
        else:
            raise ValueError(f"unknown op {op!r}")

    try:
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            command = json.loads(line)
            if command["op"] == "exit":
                await asyncio.gather(*running)
                await client.aclose()
                await client.backend.aclose()
                _emit({"id": command["id"]})
                return
            task = asyncio.create_task(handle(command))
            running.add(task)
            task.add_done_callback(running.discard)
    finally:
        for task in running:
            task.cancel()


def main() -> None:
    """Serve the config given as the one argument; warnings go to stderr for the test to read."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(_serve(json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()
