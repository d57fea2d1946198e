"""Reading a lease zset as the scripts do: its leases, without its SKIPLIST member.

Every lease zset holds one member that is no lease, at score -inf, which keeps
Redis from storing it as a listpack (``polygateway.backends.redis.scripts``;
research-wiki/designs/script-cost.md, "Lease zsets as skiplists"). A lease
scores its expiry, so the leases are the members above -inf.
"""

from __future__ import annotations

LEASES_ONLY = ("(-inf", "+inf")
"""The score range of a lease zset's leases: ``zrangebyscore(key, *LEASES_ONLY)``."""
