"""Redis behind Sentinel: the backend's one connection goes to whichever server is the primary.

Before each new connection the primary's wire asks the Sentinels, in turn,
``SENTINEL get-master-addr-by-name <master>`` (each within the socket
timeout; the one that answered is asked first next time), connects there, and
checks with ``ROLE`` that the server is a primary, as Sentinel's client
guidelines ask: a Sentinel that has not yet noticed a failover names a server
that now refuses writes, and that connection fails like any other. Once the
connection is up the Sentinels are asked again, and a server they no longer
name is left: connecting to a frozen primary waits until it thaws, and a
Sentinel names the promoted replica a moment before it announces
``+switch-master``, so a primary thawed in between (its ROLE still master)
would otherwise receive what was queued for the connection, lost at its
demotion.

A failover is followed as Sentinel announces it: the backend listens to
``+switch-master`` on one Sentinel (through redis-py's ``PubSub``: rare
messages, no hot path) and drops its connection to the old primary at once,
so a primary that comes back before Sentinel has demoted it (a thawed VM, a
healed partition) receives no writes from this process. It is followed
without the announcement too, should it be missed:

- the old primary is gone with a reset (killed, restarted): its connection
  is lost at once, and the next command reconnects through the Sentinels;
- it stopped answering without a reset (frozen, its host vanished): the
  wire's silence bound is the socket timeout in this mode (``limiter.py``), so
  its connection is abandoned one socket timeout after a reply was due;
- it answers as a replica (demoted, and back): ``READONLY`` replies make the
  wire drop the connection and send the command again to the primary the
  Sentinels name now.

So a command that finds the primary gone waits a socket timeout at most for
it, plus one Sentinel round; until Sentinel has promoted a replica, commands
fail closed.

Over TLS (a ``rediss://`` URL) the Sentinels are asked with the URL's TLS
settings too, the primary's CA and checks: a Sentinel watching TLS servers
talks TLS to them (``tls-replication yes``) and then listens on a
``tls-port`` of its own, which is the one to list (redis.io's TLS page,
"Sentinel"). The ``+switch-master`` subscription uses the same context.

Sentinels that require a password (``requirepass`` in ``sentinel.conf``) are
logged in to with the one given for them all (with an ACL user of theirs,
``AUTH <user> <password>``, when a user name is given too), both by the wire that asks
them and by the ``+switch-master`` subscription; the primary's own
credentials come from the URL and are never sent to a Sentinel. A Sentinel
that refuses the password (or wants one and is given none) counts as one
that did not answer, and the error names it and says that authentication
failed, without the password: with every Sentinel refusing, commands fail
closed, within a socket timeout per Sentinel at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

from polygateway.backends.redis import codec
from polygateway.backends.redis.endpoint import Endpoint
from polygateway.backends.redis.wakeups import pubsub_client
from polygateway.backends.redis.wire import OnReply, Script, Wire, command

__all__ = ["SentinelPrimary"]

logger = logging.getLogger("polygateway.backends.redis")


class SentinelPrimary:
    """The backend's ``Topology`` behind Sentinel: one ``Wire`` to the current primary.

    Args:
        sentinels: the Sentinels' addresses (``host``, ``port``).
        master: the name they monitor the primary under.
        template: credentials, database, TLS and timeouts of the primary's connection;
            its TLS context (only) is the Sentinels' connections' too.
        timeout_s: how long one Sentinel may take to answer (connect included).
        password: the Sentinels' own password (``requirepass``, or their ACL user's);
            ``None`` or empty: none.
        username: the Sentinels' ACL user (``AUTH <username> <password>``); ``None`` or
            empty: ``AUTH <password>`` alone. Never part of a message.
    """

    __slots__ = (
        "_listening",
        "_master",
        "_password",
        "_primary",
        "_query",
        "_sentinels",
        "_subscribed",
        "_timeout_s",
        "_username",
    )

    def __init__(
        self,
        sentinels: Sequence[tuple[str, int]],
        master: str,
        template: Endpoint,
        *,
        late_reply_s: float,
        scripts: Sequence[Script] = (),
        timeout_s: float,
        password: str | None = None,
        username: str | None = None,
    ) -> None:
        self._master = master
        self._timeout_s = timeout_s
        self._password = password or None
        self._username = username or None
        self._query = command("SENTINEL", "get-master-addr-by-name", master)
        self._sentinels = [
            Wire(
                Endpoint(
                    host=host,
                    port=port,
                    username=self._username,
                    password=self._password,
                    tls=template.tls,
                    connect_timeout_s=timeout_s,
                ),
                late_reply_s=timeout_s,
            )
            for host, port in sentinels
        ]
        self._primary = Wire(
            replace(template, primary_only=True),
            late_reply_s=late_reply_s,
            scripts=scripts,
            locate=functools.partial(self.locate, template),
            redirect=self._demoted,
        )
        self._listening: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    def route(self, scope: str) -> Wire:
        """Every scope lives on the primary."""
        return self._primary

    async def locate(self, template: Endpoint) -> Endpoint:
        """The primary's endpoint, as the first Sentinel that answers names it.

        Raises:
            redis.exceptions.ConnectionError: no Sentinel named a primary.
        """
        loop = asyncio.get_running_loop()
        if self._listening is None or self._listening.get_loop() is not loop:
            # Listening before the first connection: a failover from then on is heard. Again
            # after aclose (a backend used again), and in a new event loop (a backend shared
            # across asyncio.run calls): the last loop's task never runs again. Each start
            # waits for its own subscription, never one an earlier listener made.
            self._subscribed = asyncio.Event()
            self._listening = loop.create_task(self._listen())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._timeout_s):
                    await self._subscribed.wait()
        errors: list[str] = []
        for index, sentinel in enumerate(self._sentinels):
            try:
                reply = await self._ask(sentinel)
            except AuthenticationError as exc:
                # Redis's words (WRONGPASS, NOAUTH) repeat neither the user nor the password.
                given = "with the" if self._password else "without a"
                what = "user and password" if self._username else "password"
                errors.append(
                    f"{sentinel.endpoint.address}: authentication failed {given} Sentinel"
                    f" {what}: {exc}"
                )
                continue
            except RedisError as exc:
                errors.append(f"{sentinel.endpoint.address}: {exc}")
                continue
            if not reply:
                errors.append(f"{sentinel.endpoint.address}: no primary named {self._master!r}")
                continue
            if index:  # ask the one that answered first from now on
                self._sentinels.insert(0, self._sentinels.pop(index))
            host, port = codec.text(reply[0]), int(codec.text(reply[1]))
            return replace(template, host=host, port=port, primary_only=True)
        raise RedisConnectionError(
            f"no Sentinel named the primary {self._master!r} ({'; '.join(errors)})"
        )

    async def _ask(self, sentinel: Wire) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        def on_reply(reply: Any) -> None:
            if not future.done():
                future.set_result(reply)

        sentinel.send(self._query, on_reply)
        try:
            async with asyncio.timeout(self._timeout_s):
                reply = await future
        except TimeoutError as exc:
            raise RedisConnectionError(f"no reply within {self._timeout_s:g} s") from exc
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def _listen(self) -> None:
        """Drop the primary's connection whenever a Sentinel announces a new primary."""
        while True:
            for sentinel in list(self._sentinels):
                # No retry: a Sentinel down, the next one, at once. Its login and TLS context.
                client = pubsub_client(sentinel.endpoint, self._timeout_s)
                try:
                    async with client.pubsub() as pubsub:
                        await pubsub.subscribe("+switch-master")
                        self._subscribed.set()
                        async for message in pubsub.listen():
                            self._announced(message)
                except (RedisError, OSError):
                    pass  # the next Sentinel; the wire follows failovers without us meanwhile
                except Exception as exc:  # a bug: nobody awaits this task, so say it and go on
                    logger.warning(
                        "Sentinel %s: +switch-master listener failed: %r",
                        sentinel.endpoint.address,
                        exc,
                    )
                finally:
                    await client.aclose()
            self._subscribed.set()  # tried them all: the first connection waits no longer
            await asyncio.sleep(self._timeout_s)  # edge: a real pause between real Sentinel rounds

    def _announced(self, message: dict[str, Any]) -> None:
        """``<master> <old ip> <old port> <new ip> <new port>``: leave a primary not the new one."""
        if message.get("type") != "message":
            return
        fields = codec.text(message.get("data", b"")).split()
        if len(fields) != 5 or fields[0] != self._master:
            return
        now = self._primary.endpoint
        if (now.host, str(now.port)) != (fields[3], fields[4]):
            self._primary.abandon()

    def _demoted(
        self, reply: ResponseError, data: bytes, on_reply: OnReply, script: Script | None
    ) -> None:
        """A ``READONLY`` reply: the server is no longer the primary; go where Sentinel says."""
        if not str(reply).startswith("READONLY"):
            on_reply(reply)
            return
        self._primary.abandon()
        # Sent once more: the new connection is made only to a server whose ROLE is master.
        self._primary.send(data, on_reply, script)

    async def drain(self) -> None:
        """Return once no reply is due from the primary."""
        await self._primary.drain()

    async def aclose(self) -> None:
        """Close the primary's connection and the Sentinels'."""
        listening, self._listening = self._listening, None
        if listening is not None and listening.get_loop() is asyncio.get_running_loop():
            listening.cancel()
            with contextlib.suppress(BaseException):
                await listening
        await self._primary.aclose()
        for sentinel in self._sentinels:
            with contextlib.suppress(RedisError, OSError):
                await sentinel.aclose()
