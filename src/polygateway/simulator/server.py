"""``SimulatedUpstream``: the simulator app served by uvicorn inside the caller's event loop.

``async with SimulatedUpstream({"a": profile}) as sim:`` binds 127.0.0.1 (a
free port unless one is given), serves every source under ``sim.url``, and on
exit stops cleanly: pauses, hangs and streams end at once (the server's
``closing`` event), uvicorn drains its connections, and no task is left
behind. Uvicorn is kept from touching process-wide state: no signal handlers
(the embedding application owns those), no logging configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Generator, Mapping
from types import TracebackType
from typing import Literal

import uvicorn

from polygateway.simulator.app import ResetLogFilter, SimulatorState, build_app
from polygateway.simulator.profiles import PROFILES, FaultProfile
from polygateway.simulator.stats import SourceStats

__all__ = ["SimulatedUpstream", "SimulatorNotRunning"]

SourceProtocol = Literal["openai", "vision_ocr", "monkey_ocr", "anthropic", "azure"]

# Uvicorn's last resort if something ignores the closing event: cancel what is left.
_GRACEFUL_SHUTDOWN_S = 3


class SimulatorNotRunning(RuntimeError):
    """The simulator's address was asked for before it started or after it stopped."""


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handlers alone and says when it listens."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """Install nothing: the application embedding the simulator owns SIGINT and SIGTERM."""
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """Start listening, then wake ``SimulatedUpstream.start`` whatever happened."""
        try:
            await super().startup(sockets=sockets)
        finally:
            self.ready.set()


async def _serve(server: _EmbeddedServer, sock: socket.socket) -> None:
    """Run uvicorn on ``sock`` until it is told to exit; the socket is closed either way."""
    try:
        await server.serve(sockets=[sock])
    finally:
        # Wakes ``start`` even when serve() failed before reaching startup().
        server.ready.set()
        sock.close()


class SimulatedUpstream:
    """A fault-injecting upstream on a real socket, one URL prefix per source.

    Args:
        sources: source name → fault profile; default one healthy source ``"a"``.
        host: the address to bind; the loopback interface unless told otherwise.
        port: the port to bind; 0 picks a free one.
        seed: seeds every source's dice, so a run's faults repeat.
    """

    def __init__(
        self,
        sources: Mapping[str, FaultProfile] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int = 0,
    ) -> None:
        self.host = host
        self._requested_port = port
        self.state = SimulatorState(sources or {"a": PROFILES["healthy"]}, seed=seed)
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._port: int | None = None
        self._log_filter = ResetLogFilter()

    # -- lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> SimulatedUpstream:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Bind the socket and serve until ``stop``; returns once connections are accepted."""
        if self._task is not None:
            raise RuntimeError("the simulator is already running")
        # Binding here, not in uvicorn, gives the port before serving and a plain OSError
        # (instead of uvicorn's sys.exit) when the port is taken.
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP, not 0: accepted sockets inherit it, and asyncio sets TCP_NODELAY only on
        # sockets that say TCP; without it every answer waits out Nagle and a delayed ACK (~40 ms).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._requested_port))
            port = int(sock.getsockname()[1])
        except OSError:
            sock.close()
            raise
        config = uvicorn.Config(
            build_app(self.state),
            http="h11",
            ws="none",
            lifespan="off",
            log_config=None,  # the embedding application owns logging configuration
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
        )
        server = _EmbeddedServer(config)
        self.state.closing.clear()
        logging.getLogger("uvicorn.error").addFilter(self._log_filter)
        self._server, self._port = server, port
        self._task = asyncio.create_task(_serve(server, sock))
        try:
            await server.ready.wait()
        except BaseException:
            await self.stop()
            raise
        if not server.started:
            await self.stop()  # raises what serve() raised before it could listen
            raise RuntimeError("the simulator stopped before it started listening")

    async def stop(self) -> None:
        """End every pending request, stop serving and wait until uvicorn is done."""
        task, server = self._task, self._server
        if task is None or server is None:
            return
        self.state.closing.set()
        server.should_exit = True
        try:
            # Awaiting the task also hands it any cancellation of the caller.
            await task
        finally:
            self._task = self._server = self._port = None
            logging.getLogger("uvicorn.error").removeFilter(self._log_filter)

    # -- addresses ---------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound port."""
        if self._port is None or self._task is None:
            raise SimulatorNotRunning("the simulator is not running")
        return self._port

    @property
    def url(self) -> str:
        """The server's root URL, e.g. ``http://127.0.0.1:43817``."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def base_url(
        self, name: str, protocol: SourceProtocol = "openai", *, deployment: str = "sim"
    ) -> str:
        """A source's base URL as a PolyGateway source configures it.

        ``/v1`` for the OpenAI-style protocols and ``anthropic`` (the client adds
        ``/chat/completions``, ``/embeddings`` or ``/messages``); for ``azure``,
        the deployment's URL (the client adds ``/chat/completions`` and the
        source's ``query`` its ``api-version``); the bare source prefix for
        MonkeyOCR.
        """
        if name not in self.state.sources:
            raise KeyError(f"unknown simulated source {name!r}")
        if protocol == "monkey_ocr":
            return f"{self.url}/{name}"
        if protocol == "azure":
            return f"{self.url}/{name}/openai/deployments/{deployment}"
        if protocol in ("openai", "vision_ocr", "anthropic"):
            return f"{self.url}/{name}/v1"
        raise ValueError(f"unknown protocol {protocol!r}")

    # -- sources and record -----------------------------------------------------------

    @property
    def sources(self) -> Mapping[str, FaultProfile]:
        """Each source's current profile."""
        return {name: s.profile for name, s in self.state.sources.items()}

    def set_profile(self, name: str, profile: FaultProfile) -> None:
        """Change how a source behaves from now on (adds the source if new)."""
        self.state.set_profile(name, profile)

    def stats(self, name: str) -> SourceStats:
        """A snapshot of what source ``name`` has seen."""
        try:
            return self.state.sources[name].recorder.snapshot()
        except KeyError:
            raise KeyError(f"unknown simulated source {name!r}") from None

    @property
    def record(self) -> dict[str, SourceStats]:
        """A snapshot of every source's record, by name."""
        return {name: s.recorder.snapshot() for name, s in self.state.sources.items()}

    def reset_stats(self) -> None:
        """Forget what every source has seen (limits and dice are not reset)."""
        for source in self.state.sources.values():
            source.recorder.clear()

    def __repr__(self) -> str:
        where = self.url if self._task is not None and self._port is not None else "stopped"
        return f"SimulatedUpstream({where}, sources={sorted(self.state.sources)})"
