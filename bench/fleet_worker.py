"""One fleet member: an OS process with one ChatClient on Redis, and the parent's handle on it.

The process (``python -m bench.fleet_worker CONFIG_JSON``) is what
``bench/fleet.py`` (``make bench-fleet``) runs N of, and what
``tests/integration/test_redis_fleet.py`` starts to check that a fleet shares
one budget. The config is ``{"settings": {...GatewaySettings keywords...},
"scope": "chat"}``, with ``"count_operations": true`` for the benchmark. The
worker builds its client the way an application does
(``ChatClient.from_settings``, so the backend is the shared ``RedisBackend``
of the settings' URL) or, counting, on a ``RedisBackend`` that writes each
call's backend operations into the call's record; it prints
``{"event": "ready"}`` and then serves commands, one JSON object per stdin
line, each answered by one JSON line on stdout carrying the command's ``id``.
Commands run concurrently, so a test can start calls and kill the process
while they are in flight.

Commands (``op``):

- ``calls``: ``n`` chat calls, ``concurrency`` at a time (each bounded by
  ``deadline_s`` when given); answers every call's record.
- ``run``: calls from ``concurrency`` tasks from ``start_at`` (a ``time.monotonic()``
  value; default now) until ``duration_s`` later (no new call starts after that;
  calls under way finish); answers every call's record. With ``every_s``, one call
  starts every ``every_s`` seconds instead (``concurrency`` unused). ``priority_class``
  and ``tenant``, when given, go with every call (and into its record).
- ``acquire``: one ``acquire`` on the shared backend for one source alone, as the
  governance loop would ask it; answers the rejection (a grant is given back at once).
- ``exit``: close the client and the backend, answer, and leave.

A call record holds ``started`` / ``ended`` on ``time.monotonic()``, which on
Linux is one system-wide clock (CLOCK_MONOTONIC): the parent compares them with
its own times and with the simulator's arrival times. Counting adds
``acquires``, ``denied`` (acquires refused), ``releases``, ``other`` (renewals,
progress reads), ``acquired`` (when the first grant came back) and
``queued_behind`` (calls waiting in the process's queue when it started).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polygateway.backends.base import AcquireResult, AttemptOutcome, Lease, SourceSpec
from polygateway.backends.redis import RedisBackend
from polygateway.chat import ChatClient
from polygateway.config import GatewaySettings
from polygateway.errors import AllSourcesExhausted, GatewayError
from polygateway.middleware.waiting import WaitingRoom, room_for

__all__ = ["ANSWER_TIMEOUT_S", "START_TIMEOUT_S", "Json", "Worker"]

Json = dict[str, Any]

MESSAGES = [{"role": "user", "content": "hi"}]

START_TIMEOUT_S = 30.0
"""Bound on a worker's start (interpreter, imports, first Redis round trip) on a busy machine."""
ANSWER_TIMEOUT_S = 60.0
"""Bound on any command's answer beyond its own planned duration."""

_ROOT = Path(__file__).resolve().parents[1]
"""The repository root: ``python -m bench.fleet_worker`` imports ``bench`` from here."""

_ERROR_PAUSE_S = 0.05
"""A ``run`` task's pause after a failed call, as an application would back off, so a
dead Redis (every call refused at once) does not turn the loop into a busy spin."""


_CALL: contextvars.ContextVar[Json | None] = contextvars.ContextVar("fleet_call", default=None)
"""The record of the call this task is making: a counting backend writes into it."""


class _CountingBackend(RedisBackend):
    """The Redis backend, counting each call's operations into the call's record.

    The loop awaits the backend in the call's own task (or one copied from its
    context), so the record found through ``_CALL`` is the call's. Only the
    benchmark counts: a few dict updates per operation, in the client process.
    """

    __slots__ = ("room",)

    room: WaitingRoom
    """The client's waiting room of the scope, set as soon as the client is built."""

    async def acquire(
        self,
        scope: str,
        candidates: Sequence[SourceSpec],
        *,
        cost_tokens: int = 0,
        ttl_s: float,
        priority_class: str = "",
    ) -> AcquireResult:
        result = await super().acquire(
            scope, candidates, cost_tokens=cost_tokens, ttl_s=ttl_s, priority_class=priority_class
        )
        record = _CALL.get()
        if record is not None:
            record["acquires"] = record.get("acquires", 0) + 1
            if result.lease is None:
                record["denied"] = record.get("denied", 0) + 1
            elif "acquired" not in record:
                record["acquired"] = time.monotonic()
        return result

    async def release(self, lease: Lease, outcome: AttemptOutcome) -> None:
        _count("releases")
        await super().release(lease, outcome)

    async def renew(self, lease: Lease) -> bool:
        _count("other")
        return await super().renew(lease)

    async def progress_age_s(self, scope: str) -> float:
        _count("other")
        return await super().progress_age_s(scope)


def _count(field: str) -> None:
    """One more ``field`` operation for the current call, if a call is being made."""
    record = _CALL.get()
    if record is not None:
        record[field] = record.get(field, 0) + 1


def _emit(obj: dict[str, Any]) -> None:
    """One JSON line on stdout, flushed: the test reads them as they come."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _one_call(
    client: ChatClient, deadline_s: float | None = None, flow: dict[str, str] | None = None
) -> dict[str, Any]:
    """One governed chat call (``flow``: its class and tenant), recorded whatever its end."""
    flow = flow or {}
    started = time.monotonic()
    record: dict[str, Any] = {"started": started, **flow}
    backend = client.backend
    if isinstance(backend, _CountingBackend):
        # Calls already queued: this one waits its turn behind them, whatever it is granted.
        record["queued_behind"] = len(backend.room)
    token = _CALL.set(record)
    try:
        response = await client.complete(
            MESSAGES,
            max_tokens=8,
            deadline_s=deadline_s,
            priority_class=flow.get("priority_class"),
            tenant=flow.get("tenant"),
        )
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
    finally:
        _CALL.reset(token)
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
    client: ChatClient,
    start_at: float,
    duration_s: float,
    concurrency: int,
    every_s: float | None = None,
    flow: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Calls from ``concurrency`` tasks (or one every ``every_s``) for ``duration_s``."""
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    end = start_at + duration_s
    records: list[dict[str, Any]] = []

    async def task() -> None:
        while time.monotonic() < end:
            record = await _one_call(client, flow=flow)
            records.append(record)
            if not record["ok"]:
                await asyncio.sleep(_ERROR_PAUSE_S)

    async def one() -> None:
        records.append(await _one_call(client, flow=flow))

    if every_s is None:
        await asyncio.gather(*(task() for _ in range(concurrency)))
        return records
    started: list[asyncio.Task[None]] = []
    at = start_at
    while at < end:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        started.append(asyncio.create_task(one()))
        at += every_s
    await asyncio.gather(*started)
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
    if config.get("count_operations"):
        backend = _CountingBackend(
            settings.get_redis_url(), socket_timeout_s=settings.redis_socket_timeout_s
        )
        client = ChatClient(settings, config["scope"], backend=backend)
        backend.room = room_for(backend, client.scope)
    else:
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
            flow: dict[str, str] = {
                k: command[k] for k in ("priority_class", "tenant") if k in command
            }
            answer["records"] = await _run(
                client,
                start_at,
                command["duration_s"],
                command.get("concurrency", 1),
                command.get("every_s"),
                flow,
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


class Worker:
    """The parent's handle on one fleet member: a subprocess answering JSON commands."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.stderr: list[str] = []
        self.stdout: list[str] = []
        self._serial = 0
        self._pending: dict[int, asyncio.Future[Json]] = {}
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._readers = (
            asyncio.create_task(self._read_stdout()),
            asyncio.create_task(self._read_stderr()),
        )

    @classmethod
    async def start(
        cls, config: Json, cwd: Path, *, start_timeout_s: float = START_TIMEOUT_S
    ) -> Worker:
        """Start a worker in ``cwd`` and wait until its client is built and Redis answered it."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("POLYGATEWAY_")}
        env["PYTHONUNBUFFERED"] = "1"
        # ``bench`` from this tree; ``polygateway`` still from wherever PYTHONPATH says.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_ROOT), env.get("PYTHONPATH")]))
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "bench.fleet_worker",
            json.dumps(config),
            cwd=cwd,
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            limit=1 << 24,  # a `run` answer is one long line
        )
        worker = cls(process)
        try:
            async with asyncio.timeout(start_timeout_s):
                await asyncio.shield(worker._ready)
        except BaseException:
            await worker.stop()
            raise
        return worker

    async def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            line = raw.decode()
            self.stdout.append(line)
            message = json.loads(line)
            if message.get("event") == "ready":
                self._ready.set_result(None)
                continue
            answered = self._pending.pop(message["id"], None)
            if answered is not None and not answered.done():
                answered.set_result(message)
        ended = RuntimeError(f"worker {self.process.pid} ended; stderr:\n{''.join(self.stderr)}")
        unanswered: list[asyncio.Future[Any]] = [self._ready, *self._pending.values()]
        for future in unanswered:
            if not future.done():
                future.set_exception(ended)
                future.exception()  # retrieved here: a killed worker's answers are expected to fail

    async def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        async for raw in self.process.stderr:
            self.stderr.append(raw.decode())

    def send(self, op: str, **fields: Any) -> asyncio.Future[Json]:
        """Send one command now; the future is its answer."""
        assert self.process.stdin is not None
        if self._readers[0].done():
            raise RuntimeError(f"worker {self.process.pid} has ended")
        self._serial += 1
        future: asyncio.Future[Json] = asyncio.get_running_loop().create_future()
        self._pending[self._serial] = future
        command = {"id": self._serial, "op": op, **fields}
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        return future

    async def ask(self, op: str, *, within_s: float = ANSWER_TIMEOUT_S, **fields: Any) -> Json:
        """Send one command and wait (bounded) for its answer."""
        async with asyncio.timeout(within_s):
            answer = await self.send(op, **fields)
        assert "crash" not in answer, answer
        return answer

    async def records(self, op: str, **fields: Any) -> list[Json]:
        """The call records a ``calls`` or ``run`` command answers."""
        within = ANSWER_TIMEOUT_S + float(fields.get("duration_s", 0.0))
        records: list[Json] = (await self.ask(op, within_s=within, **fields))["records"]
        return records

    def kill(self) -> None:
        """``kill -9``: the process dies at once, holding whatever it held."""
        self.process.send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        """Ask the worker to close and exit; kill it if it does not in time. Idempotent."""
        if self.process.returncode is None:
            with contextlib.suppress(TimeoutError, RuntimeError, ConnectionError):
                await self.ask("exit", within_s=10.0)
            if self.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self.kill()
        await self.process.wait()
        await asyncio.gather(*self._readers)

    @property
    def output(self) -> str:
        """Everything the worker wrote, for "never printed" checks."""
        return "".join(self.stdout) + "".join(self.stderr)


def main() -> None:
    """Serve the config given as the one argument; warnings go to stderr for the test to read."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(_serve(json.loads(sys.argv[1])))


if __name__ == "__main__":
    main()
