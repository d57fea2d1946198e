"""Which acquires go to Redis together (``backends/redis/runs.py``).

A call goes at once when nothing of its key is in flight; calls that arrive
meanwhile go, in arrival order, once that run is answered, in runs of
``MAX_RUN`` at most; a call whose caller left before it was written is never
written; keys are independent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

import pytest

from polygateway.backends.redis.bounded import Reply
from polygateway.backends.redis.runs import MAX_RUN, Asked, Runs


def _asked(loop: asyncio.AbstractEventLoop, name: str) -> Asked:
    reply = Reply(loop.create_future(), None, "acquire", "scope", lambda *_: None)
    return Asked(name, 30.0, 0, reply, b"")


class _Sent:
    def __init__(self) -> None:
        self.runs: list[tuple[Hashable, list[str]]] = []

    def __call__(self, key: Hashable, calls: list[Asked]) -> None:
        self.runs.append((key, [asked.lease_id for asked in calls]))


async def test_a_call_goes_at_once_when_nothing_of_its_key_is_in_flight() -> None:
    loop = asyncio.get_running_loop()
    sent = _Sent()
    runs = Runs(sent)
    runs.ask("k", _asked(loop, "a"))
    runs.ask("other", _asked(loop, "b"))
    assert sent.runs == [("k", ["a"]), ("other", ["b"])]
    assert len(runs) == 2


async def test_calls_arriving_meanwhile_go_together_once_it_is_answered() -> None:
    loop = asyncio.get_running_loop()
    sent = _Sent()
    runs = Runs(sent)
    runs.ask("k", _asked(loop, "a"))
    for name in ("b", "c", "d"):
        runs.ask("k", _asked(loop, name))
    assert sent.runs == [("k", ["a"])]
    runs.answered("k")
    assert sent.runs == [("k", ["a"]), ("k", ["b", "c", "d"])]
    runs.ask("k", _asked(loop, "e"))  # the run of three is in flight: e waits for it
    assert len(sent.runs) == 2
    runs.answered("k")
    assert sent.runs[-1] == ("k", ["e"])
    runs.answered("k")
    assert len(runs) == 0  # nothing in flight: the next call goes at once again
    runs.ask("k", _asked(loop, "f"))
    assert sent.runs[-1] == ("k", ["f"])


async def test_a_long_queue_goes_in_runs_of_max_run_in_arrival_order() -> None:
    loop = asyncio.get_running_loop()
    sent = _Sent()
    runs = Runs(sent)
    runs.ask("k", _asked(loop, "first"))
    names = [f"c{i:02d}" for i in range(2 * MAX_RUN + 3)]
    for name in names:
        runs.ask("k", _asked(loop, name))
    runs.answered("k")
    written = [ids for _, ids in sent.runs[1:]]
    assert [len(ids) for ids in written] == [MAX_RUN, MAX_RUN, 3]
    assert [name for ids in written for name in ids] == names
    for _ in written:
        runs.answered("k")
    assert len(runs) == 0


@pytest.mark.parametrize("how", ["cancelled", "timed out"])
async def test_a_call_whose_caller_left_before_its_run_is_never_written(how: str) -> None:
    loop = asyncio.get_running_loop()
    sent = _Sent()
    runs = Runs(sent)
    runs.ask("k", _asked(loop, "a"))
    gone, staying = _asked(loop, "b"), _asked(loop, "c")
    runs.ask("k", gone)
    runs.ask("k", staying)
    waiter = gone.reply.waiter
    assert waiter is not None
    if how == "cancelled":
        waiter.cancel()
    else:
        waiter.set_result(object())  # what the deadline sets
    runs.answered("k")
    assert sent.runs[-1] == ("k", ["c"])


async def test_only_left_calls_queued_writes_nothing_and_frees_the_key() -> None:
    loop = asyncio.get_running_loop()
    sent = _Sent()
    runs = Runs(sent)
    runs.ask("k", _asked(loop, "a"))
    gone = _asked(loop, "b")
    runs.ask("k", gone)
    assert gone.reply.waiter is not None
    gone.reply.waiter.cancel()
    runs.answered("k")
    assert sent.runs == [("k", ["a"])]
    assert len(runs) == 0


async def test_a_run_failing_as_it_is_written_sends_what_is_left_once() -> None:
    """A run whose failure is answered inside the write (a closed link) frees its key once."""
    loop = asyncio.get_running_loop()
    written: list[list[str]] = []
    runs: Runs

    def send(key: Hashable, calls: list[Asked]) -> None:
        written.append([asked.lease_id for asked in calls])
        if len(written) > 1:
            runs.answered(key)  # failed at once, in the write

    runs = Runs(send)
    runs.ask("k", _asked(loop, "a"))
    for i in range(MAX_RUN + 1):
        runs.ask("k", _asked(loop, f"c{i:02d}"))
    runs.answered("k")
    assert [len(ids) for ids in written] == [1, MAX_RUN, 1]
    assert len(runs) == 0
    runs.answered("k")  # an answer for a key no longer tracked changes nothing
    assert len(runs) == 0
