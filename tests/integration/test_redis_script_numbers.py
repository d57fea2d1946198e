"""How the Redis scripts read and write numbers: their clock, ``fmt`` and ``num``.

Every script starts with the same prelude (``scripts._CLOCK``): ``now`` and its
text ``now_s`` from the call or the server's ``TIME``, ``fmt``, which writes a
float so that it reads back as the same double, and ``num``, which reads one
(research-wiki/designs/script-cost.md, "The Lua's own share"). The policies'
exact agreement with the memory backend rests on these three; each is run here
on a real server, alone, with the values where a shortcut could go wrong.
"""

from __future__ import annotations

import math
import struct
from collections.abc import AsyncIterator

import pytest
import redis
from _behind import released

from polygateway.backends.base import AttemptOutcome, SourceSpec
from polygateway.backends.redis import RedisBackend, scripts

# Runs the prelude, then answers by ARGV[2]: "fmt" writes each later argument read as a
# number, "num" reads each as a number (or says none), "clock" gives now_s and fmt(now).
_PROBE = (
    scripts._CLOCK
    + """
local out = {}
if ARGV[2] == 'fmt' then
  for i = 3, #ARGV do
    out[#out + 1] = fmt(num(ARGV[i]))
  end
elseif ARGV[2] == 'num' then
  for i = 3, #ARGV do
    local v = num(ARGV[i])
    out[#out + 1] = v == nil and 'none' or fmt(v)
  end
else
  out = {now_s, fmt(now)}
end
return out
"""
)


@pytest.fixture
def client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url, decode_responses=True)


def _run(client: redis.Redis, *args: str) -> list[str]:
    return list(client.eval(_PROBE, 0, *args))  # type: ignore[no-untyped-call]


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


VALUES = [
    0.0,
    -0.0,
    1.0,
    -1.0,
    7.0,
    -250.0,
    60000.0,
    999999.0,
    1e15 - 1,
    1e15,
    -(1e15 - 1),
    2.0**53,
    0.1,
    1 / 3,
    999999.00000000012,
    -0.5,
    1796212800.1234567,
    1e-300,
    5e-324,
    1.7976931348623157e308,
]


def test_fmt_writes_every_float_so_that_it_reads_back_bit_for_bit(client: redis.Redis) -> None:
    """Whole numbers take the short path, the others 17 digits: both read back exactly,
    the sign of zero included."""
    texts = _run(client, "", "fmt", *(repr(v) for v in VALUES))
    assert [_bits(float(t)) for t in texts] == [_bits(v) for v in VALUES]


def test_fmt_writes_a_whole_number_as_its_digits_as_before(client: redis.Redis) -> None:
    """The short path writes what 17 significant digits wrote: a stored field's text does
    not change with it (the memory backend and older processes read the same)."""
    whole = [1.0, -1.0, 7.0, -250.0, 60000.0, 1e15 - 1, -(1e15 - 1), 1e15, 2.0**53]
    texts = _run(client, "", "fmt", *(repr(v) for v in whole))
    assert texts == [f"{v:.17g}" for v in whole]
    assert texts[:7] == ["1", "-1", "7", "-250", "60000", "999999999999999", "-999999999999999"]


def test_fmt_writes_infinities_and_negative_zero_as_17_digits(client: redis.Redis) -> None:
    texts = _run(client, "", "fmt", "inf", "-inf", "-0.0")
    assert texts[2] == "-0"
    assert [float(t) for t in texts[:2]] == [math.inf, -math.inf]


def test_num_reads_once_and_says_none_for_what_is_no_value(client: redis.Redis) -> None:
    out = _run(client, "", "num", "", "0", "-0.0", "1.5", "1796212800.123456", "60")
    assert out[0] == "none"
    assert [_bits(float(t)) for t in out[1:]] == [
        _bits(v) for v in (0.0, -0.0, 1.5, 1796212800.123456, 60.0)
    ]


def test_num_stops_the_script_on_text_that_is_no_number(client: redis.Redis) -> None:
    """A damaged field fails loudly instead of reading as absent (a source seen anew)."""
    with pytest.raises(redis.ResponseError):
        _run(client, "", "num", "closed")


def test_the_server_clock_text_and_number_are_the_same_double(client: redis.Redis) -> None:
    """From TIME, now_s is "<seconds>.<6 digits>", and now the double it denotes: the
    score ranges Redis parses from now_s and Lua's comparisons with now agree."""
    for _ in range(20):
        now_s, now_text = _run(client, "", "clock")
        seconds, micros = now_s.split(".")
        assert len(micros) == 6
        assert seconds.isdigit()
        assert micros.isdigit()
        assert _bits(float(now_s)) == _bits(float(now_text))


def test_a_given_now_is_used_as_given(client: redis.Redis) -> None:
    now_s, now_text = _run(client, "1000.25", "clock")
    assert (now_s, now_text) == ("1000.25", "1000.25")


@pytest.fixture
async def server_clock(redis_url: str) -> AsyncIterator[RedisBackend]:
    b = RedisBackend(redis_url)
    yield b
    await b.aclose()


def _server_now(client: redis.Redis) -> float:
    seconds, micros = client.time()
    return seconds + micros / 1e6


async def test_acquire_on_the_server_clock_stamps_the_lease_from_that_moment(
    server_clock: RedisBackend, client: redis.Redis
) -> None:
    """The real ACQUIRE, on TIME: each lease expires its TTL after a moment between the
    server's clock read before and after the call (a fraction read wrong, padded to more
    or fewer than six digits say, lands up to a second off)."""
    spec = SourceSpec("a", max_concurrency=100)
    for _ in range(10):
        before = _server_now(client)
        lease = (await server_clock.acquire("numbers", [spec], ttl_s=30.0)).lease
        after = _server_now(client)
        assert lease is not None
        expiry = client.zscore("pgw:{numbers}:leases:a", lease.lease_id)
        assert expiry is not None
        assert before - 1e-6 <= expiry - 30.0 <= after + 1e-6


async def test_release_on_the_server_clock_opens_the_breaker_from_that_moment(
    server_clock: RedisBackend, client: redis.Redis
) -> None:
    """The real RELEASE, on TIME: a failure that trips the breaker opens it for the
    cool-down from a moment between the server's clock read before and after."""
    spec = SourceSpec("b", max_concurrency=4, breaker_failures=1, cooldown_s=30.0)
    lease = (await server_clock.acquire("numbers", [spec], ttl_s=30.0)).lease
    assert lease is not None
    before = _server_now(client)
    await released(server_clock, lease, AttemptOutcome("transient"))
    after = _server_now(client)
    open_until = client.hget("pgw:{numbers}:src:b", "open_until")
    assert open_until is not None
    assert before - 1e-6 <= float(open_until) - 30.0 <= after + 1e-6
    # SNAPSHOT, on TIME too, counts the cool-down left from its own moment.
    before = _server_now(client)
    source = (await server_clock.snapshot("numbers")).source("b")
    after = _server_now(client)
    assert source is not None
    assert source.reopen_in_s is not None
    assert float(open_until) - after - 1e-6 <= source.reopen_in_s
    assert source.reopen_in_s <= float(open_until) - before + 1e-6
