"""The Lua scripts of the Redis backend: the governance policies' one permitted twin.

Each script mirrors ``governance/source_state.py`` (and the breaker, AIMD and
token-bucket functions it composes) step for step, in the same order and with
the same float arithmetic, so that both backends make bit-identical
decisions; research-wiki/designs/governance-policies.md is the specification
and the differential test the guard. The scripts are constants: values only
ever travel as KEYS / ARGV, never by building Lua text (the texts the
scripts share, ``_CLOCK`` and ``_TENANT_FUNCTIONS``, are spliced in once, at
import).

Conventions shared by every script:

- ``ARGV[1]`` is ``now`` in seconds, or ``""`` for the server clock
  (``redis.call('TIME')``). Only tests pass a ``now``.
- Floats travel as strings: Python sends ``repr(float)``, Lua stores and
  returns ``string.format('%.17g', x)`` (Lua's own number-to-string keeps only
  14 digits, and Redis truncates Lua numbers returned to integers). ``""``
  stands for "none" (no rpm limit, no reopen time, never served).
- Keys of one scope share the hash tag ``{scope}``, so a scope lives in one
  Redis Cluster slot and every script touches one slot only.
- Per-source hash ``pgw:{scope}:src:<source>``: breaker (``breaker``,
  ``failures``, ``trips``, ``open_until``, ``probe_id``, ``probe_until``), AIMD
  (``limit``, ``last_decrease``: absent is -inf), pacer (``not_before``, and
  the pause's probe: ``reopen_probe`` "1"/"0", ``pprobe_id``, ``pprobe_until``;
  absent is "0" / none),
  buckets (``rpm_tokens``, ``rpm_at``, ``tpm_tokens``, ``tpm_at``: absent is
  no bucket yet), the last spec seen (``max_concurrency``, ``rpm``,
  ``rpm_cap``, ``tpm``, ``tpm_cap``, ``breaker_failures``, ``cooldown_s``,
  ``cooldown_max_s``), which release and snapshot need, with ``spec``, the
  same eight values as one string (written only when it changes),
  ``expires_at``, when the source's keys were last set to expire, and
  ``verdict`` (the offset of the source's mark in ``pgw:{scope}:verdicts``,
  "" once cleared).
- Spec sets and verdicts (ACQUIRE's header; research-wiki/designs/
  script-cost.md, "The O(1) contract"): hash ``pgw:{scope}:specs:<digest>``
  (``n<i>`` / ``s<i>``: the name and spec of index ``i``) and string
  ``pgw:{scope}:verdicts`` (a digest, then 13 bytes per index: until when, in
  ms, that source is full). ACQUIRE makes the keys of its candidates after the
  first from the stored names: the same hash tag, so the same slot.
- Leases: zset ``pgw:{scope}:leases:<source>`` (lease id -> expiry). A lease
  with ``expiry <= now`` is dead: never counted, and dropped by RELEASE and
  RENEW. What a release or a renewal needs of a lease (its tpm reservation,
  its TTL) travels with the call: the client's ``Lease`` holds it. One member
  is no lease: ``_SKIPLIST`` at score -inf, which every grant (and hand-off)
  adds, so that Redis keeps the zset a skiplist, and which no count and no
  sweep reaches (they start above -inf); the key outlives its last lease.
- Lifetimes: the keys of a source (and its scope's list of sources) outlive
  the last call by at least half a day (``state TTL / 2``, longer when a
  lease's TTL or a breaker's cool-down needs it) and at most a day. ACQUIRE
  sets them to expire when ``expires_at`` says half that time is gone, not
  at every call: a handful of EXPIREs per source per day
  (research-wiki/designs/script-cost.md).
- Waiting registry (Redis-only queueing state, not policy: the memory backend
  has no twin; research-wiki/designs/fleet-wakeups.md): zset
  ``pgw:{scope}:waiting`` (process id -> when it was registered or last woken,
  least recently woken first) and zset ``pgw:{scope}:waiting_until`` (process
  id -> expiry, swept like leases). ACQUIRE registers a process it refuses for
  want of a release and unregisters one it grants (unless calls of the process are
  left waiting: then it moves it to the back); RELEASE, when it frees a
  permit, wakes the least recently woken live process on its channel
  ``pgw:wake:<process id>`` (message: the scope) and holds the permit for it
  for a moment: a placeholder member ``handoff:<process id>`` in the source's
  lease zset, which only that process's ACQUIRE may claim and which lapses like
  a lease. Both take these keys and arguments last, optionally, so the policy
  half of each contract is unchanged.
- Tenants (research-wiki/designs/priority-fairness.md, "On Redis"), per class (or
  for the scope without classes), only from a process whose room named a tenant:
  zset ``pgw:{scope}:flows[:<class>]`` (all scores 0, members
  ``"<len>:<tenant><process id>"``: the processes of a tenant by prefix), hash
  ``pgw:{scope}:flows_of[:<class>]`` (process id -> its tenant list, what a
  grant, a new list or a lapse removes) and zset ``pgw:{scope}:tenants[:<class>]``
  (tenant -> place in the fleet's turn, lowest next). A process's tenant
  registrations live and lapse with its registration in the class.
- Reserved floors (research-wiki/designs/priority-fairness.md, "On Redis"), per class
  with reserved permits, only from a process whose room declares such classes: zset
  ``pgw:{scope}:held:<class>`` (lease id -> expiry, like the lease zsets: a crashed
  process's leases stop counting when they lapse). ACQUIRE adds a grant's lease when
  the call's class is one, RENEW extends it, RELEASE removes it and, choosing the class
  to wake, prefers a live class with fewer live members than its reserved.
"""

from __future__ import annotations

__all__ = ["ACQUIRE", "PROGRESS", "RELEASE", "RENEW", "SNAPSHOT"]

_TENANT_FUNCTIONS = """
-- Tenants (fleet-wide turns of tenants inside a class): a list "<len>:<tenant>..." as a
-- table; the index member of (tenant, process); forgetting a process's tenants (the
-- index members and its list).
local function tenants_of(list)
  local out, at = {}, 1
  while at <= #list do
    local colon = string.find(list, ':', at, true)
    local len = num(string.sub(list, at, colon - 1))
    table.insert(out, string.sub(list, colon + 1, colon + len))
    at = colon + len + 1
  end
  return out
end

local function flow(t, p)
  return #t .. ':' .. t .. p
end

local function drop_flows(fk, fok, p)
  local list = redis.call('HGET', fok, p)
  if list then
    for _, t in ipairs(tenants_of(list)) do
      redis.call('ZREM', fk, flow(t, p))
    end
    redis.call('HDEL', fok, p)
  end
end
"""
"""Lua functions ACQUIRE and RELEASE both use, written once; spliced in at its marker line."""

_CLOCK = """-- A float as text that reads back as the same double: its 17 significant digits. A
-- whole number below 1e15 (a full bucket's tokens, say) as '%d', the same digits for a
-- fraction of the cost (research-wiki/designs/script-cost.md, "The Lua's own share");
-- zero, whose sign '%d' would lose, as '%.17g'.
local function fmt(x)
  if x % 1 == 0 and x > -1e15 and x < 1e15 and x ~= 0 then
    return string.format('%d', x)
  end
  return string.format('%.17g', x)
end

-- A number's text (or a number) as a number; nil for none: absent (nil, or false from a
-- reply) or "". One parse where tonumber makes two (research-wiki/designs/script-cost.md,
-- "The Lua's own share"); text that is no number stops the script. ``* 1``, not ``+ 0``,
-- which would turn -0 into 0.
local function num(s)
  if s and s ~= '' then
    return s * 1
  end
end

-- now, and now_s, its text for Redis's score ranges: from ARGV[1], or the server's TIME
-- read as the decimal "<seconds>.<microseconds>", which Redis and Lua both parse to the
-- same double, so no float is formatted.
local now, now_s = num(ARGV[1]), nil
if now == nil then
  local t = redis.call('TIME')
  now_s = t[1] .. '.' .. string.sub('00000' .. t[2], -6)  -- microseconds: 6 digits
  now = now_s * 1
else
  now_s = fmt(now)
end
"""
"""The clock every script starts with (``now`` and its text ``now_s``, from ``ARGV[1]`` or
the server's ``TIME``), ``fmt``, which writes a float as its 17 significant digits, and
``num``, which reads one; spliced in at its marker line."""

_HASHTABLE = (
    "kept a hashtable by this value, longer than hash-max-listpack-value (64 bytes by default)"
)
"""The value of a hash's ``encoding`` field; over 64 bytes (ACQUIRE's ``HASHTABLE``)."""

_SKIPLIST = "kept a skiplist by this member, longer than zset-max-listpack-value (64 bytes)"
"""A lease zset's member at score -inf; over 64 bytes (ACQUIRE's and RELEASE's ``SKIPLIST``)."""

ACQUIRE = """
-- ACQUIRE: lease the first admissible candidate, in the given order.
--
-- What a call carries does not grow with its candidates (research-wiki/designs/
-- script-cost.md, "The O(1) contract"): the first candidate travels whole, the others
-- as two bytes each, their index in the scope's spec set, a list of (name, spec) that
-- the client stores once under its digest and the script reads when it reaches them.
-- KEYS[1]  pgw:{scope}:sources          zset: source name -> order of first sight
-- KEYS[2]  pgw:{scope}:src:<first>      hash: the first candidate's state and last spec
-- KEYS[3]  pgw:{scope}:leases:<first>   zset: lease id -> expiry
-- KEYS[4]  pgw:{scope}:verdicts         string: a spec set's digest, then per index in
--          that set 13 bytes: the time (ms, zero-padded) until which the source is full
-- KEYS[5]  pgw:{scope}:specs:<digest>   hash: "n<index>" -> name, "s<index>" -> spec
-- The other candidates' keys, pgw:{scope}:src:<name> and pgw:{scope}:leases:<name>, are
-- made here from KEYS[1]'s prefix and the stored name: same hash tag, same slot.
-- ARGV[1]  now ("" = server TIME)       ARGV[2] lease id       ARGV[3] ttl_s
-- ARGV[4]  cost_tokens                  ARGV[5] state key TTL in seconds
-- A run (several calls of one process, class and candidate order in one script run:
-- research-wiki/designs/script-cost.md, "Several calls per script run"): ARGV[2], ARGV[3]
-- and ARGV[4] hold a word per call, in order, joined by spaces.
-- ARGV[6 .. 15] the first candidate: name, max_concurrency, rpm, rpm_cap, tpm, tpm_cap,
--          breaker_failures, cooldown_s, cooldown_max_s   (rpm / tpm "" = no limit),
--          then the eight limits joined by spaces (its spec: compared with the one
--          stored to write the limits only when they changed)
-- ARGV[16] the spec set's digest ("" for a single candidate: no set, no verdicts)
-- ARGV[17] the candidates' order, two bytes (big-endian) each: their indices in the set
-- ARGV[18] "" or the set itself, stored under the digest first: "<len>:<name><len>:
--          <spec>" per index from 0, one after another (lengths in bytes)
-- Optional, last (the three arguments, or the four, or none):
-- KEYS[6]  pgw:{scope}:waiting          zset: process id -> registered / last woken
-- KEYS[7]  pgw:{scope}:waiting_until    zset: process id -> registration expiry
-- ARGV[19] the caller's process id      ARGV[20] registration TTL in seconds
-- ARGV[21] the class flags, one character per class (one, m = 1, without classes):
--          "0" when no call of the caller's process waits or asks in the class, "1"
--          when some do but none will once this call is granted, "2" when some will.
--          A run sends two such words, joined by a space: the flags of its calls before
--          the last (its own class "2"), then those of the last.
-- With priority classes (m of them), the registry is one such pair per class
-- (KEYS[4+2j], KEYS[5+2j]: pgw:{scope}:waiting:<class j>, ...:waiting_until:<class j>).
-- With tenants (the caller's room named one; m = 1 without classes):
-- ARGV[22] lists per class j, in order, the tenants the process waits with there, as
-- "<len>:<list>" with list "<len>:<tenant>" after one another (lengths in bytes), and
-- after the registries come per class three keys, KEYS[2m+3j+3 .. 2m+3j+5]:
-- pgw:{scope}:flows[:<class>] (zset, all scores 0: "<len>:<tenant><process id>", the
-- tenants' index), pgw:{scope}:flows_of[:<class>] (hash: process id -> its tenant list)
-- and pgw:{scope}:tenants[:<class>] (zset: tenant -> place in the fleet's turn, lowest
-- first). A refusal registers (tenant, process) for each tenant listed, a tenant new to
-- the turn at its back, and forgets the process's tenants no longer listed; a grant that
-- unregisters the process from a class, or a class it no longer waits in, forgets them
-- all (a grant that keeps it leaves them as they are).
-- With reserved floors (the call's class reserves permits: research-wiki/designs/
-- priority-fairness.md, "On Redis"): one key more, the very last, KEYS[#KEYS]
-- pgw:{scope}:held:<class> (zset: lease id -> expiry, the class's permits held
-- fleet-wide); a grant adds the lease to it with the lease's expiry.
-- Returns {granted, probe, codes, reopen_1, reopen_2, ...}: granted is the 1-based
-- position of the leased candidate (0 = none), probe 1 when the lease is the half-open
-- probe, codes one letter per rejected candidate in order (c concurrency, b
-- breaker_open, i probe_in_flight, p paced, r rpm, t tpm) and then the reopen time of
-- each rejection that has one (b, p, r, t), in order. Candidates after the granted one
-- are not examined (nor registered). {-1} when a candidate after the first needs the
-- spec set and none is stored under the digest: the client sends it and calls again.
-- A run decides its calls in order, each as if alone after the ones before it (a run of
-- one is a lone call), and returns a reply per call, in a list. It stops before a call
-- that needs the spec set where none is stored: the replies are then fewer ({-1} when
-- there is none), and the calls after them undecided, to be asked again. Its state,
-- registries and held permits end as the decided calls one by one would leave them:
-- each candidate's state read once and written once, and the calls' steps in the
-- registries taken in order, a step like the one before it once (at one now, it would
-- change nothing).
-- Verdicts (calls of two candidates or more): a candidate refused for concurrency is
-- marked full until its earliest live lease expires (not when that is at most 1 s away,
-- as a hand-off placeholder may be), and later calls refuse it for concurrency
-- without examining it while the mark stands. A concurrency refusal means the breaker
-- and the pacer passed, which only a RELEASE at the source can change, as it alone
-- moves the AIMD limit and frees a lease before its expiry; RELEASE clears the mark
-- (its offset is the source state's ``verdict``), a different spec set reads none.
-- With a process id: a grant unregisters the process from each class, but where its
-- flag is "2": there it stays registered, moved to the back (score now); a
-- refusal in which some candidate waits for a release (concurrency, probe_in_flight)
-- registers it in each class it waits in (a new member's score is now, an existing one
-- keeps its score), extends those registrations by the TTL, and unregisters it from the
-- classes it no longer waits in.
-- A full candidate holding the live placeholder ``handoff:<process id>`` (a permit
-- RELEASE promised this process, counted already) passes the concurrency check; a grant
-- at a candidate holding one, full or not, replaces it with the lease. Every other check
-- applies as usual.

-- @clock
-- Speed (research-wiki/designs/script-cost.md, "Hashes as hashtables"): the source state
-- and the spec set store this value, longer than hash-max-listpack-value (64 bytes by
-- default), in their field "encoding" when their lifetime is set, so that Redis keeps
-- them hashtables, which find a field by its hash where a listpack scans every field.
local HASHTABLE = '@hashtable'
-- Speed (research-wiki/designs/script-cost.md, "Lease zsets as skiplists"): every lease
-- zset holds this member at score -inf, which is no lease (leases score their expiry,
-- sweeps start above -inf), longer than zset-max-listpack-value (64 bytes by default),
-- so that Redis keeps it a skiplist, which adds and counts a lease in O(log n) where a
-- listpack parses every lease's score.
local SKIPLIST = '@skiplist'
-- The run's calls, in order: one, or several of one process, class and candidate order,
-- each a lease id, a TTL and a cost, as words of ARGV[2], ARGV[3] and ARGV[4].
local ids, ttls, costs
if string.find(ARGV[2], ' ', 1, true) then
  ids, ttls, costs = {}, {}, {}
  for w in string.gmatch(ARGV[2], '%S+') do ids[#ids + 1] = w end
  for w in string.gmatch(ARGV[3], '%S+') do ttls[#ttls + 1] = w end
  for w in string.gmatch(ARGV[4], '%S+') do costs[#costs + 1] = w end
else
  ids, ttls, costs = {ARGV[2]}, {ARGV[3]}, {ARGV[4]}
end
local state_ttl = num(ARGV[5])
local digest, order = ARGV[16], ARGV[17]
local count = math.max(1, #order / 2)
local tail = #ARGV - 18
local proc, promised
-- Per class: its two registry keys, whether proc waits in it, with tenants its three
-- tenant keys (flows, flows_of, tenants) and the tenant list proc waits with there, at
-- [8] whether calls of proc are left there once the run's last call is granted (flag
-- "2"), and at [9] the same once a call before the last is (a run's first flags).
local classes = {}
if tail >= 3 then
  proc = ARGV[19]
  promised = 'handoff:' .. proc
  local flags = ARGV[21]
  local mid = flags
  local space = string.find(flags, ' ', 1, true)
  if space then
    mid, flags = string.sub(flags, 1, space - 1), string.sub(flags, space + 1)
  end
  for j = 1, #flags do
    local flag = string.sub(flags, j, j)
    classes[j] = {KEYS[4 + 2 * j], KEYS[5 + 2 * j], flag ~= '0'}
    classes[j][8] = flag == '2'
    classes[j][9] = string.sub(mid, j, j) == '2'
  end
  if tail == 4 then
    local lists, at = ARGV[22], 1
    for j, c in ipairs(classes) do
      local base = 3 + 2 * #flags + 3 * j
      local colon = string.find(lists, ':', at, true)
      local len = num(string.sub(lists, at, colon - 1))
      c[4], c[5], c[6] = KEYS[base], KEYS[base + 1], KEYS[base + 2]
      c[7] = string.sub(lists, colon + 1, colon + len)
      at = colon + len + 1
    end
  end
end
-- The call's class's held-permits zset (reserved floors), after every other key.
local others = 5 + 2 * #classes
if tail == 4 then
  others = others + 3 * #classes
end
local hk = KEYS[others + 1]
local vk, setk = KEYS[4], KEYS[5]
local verdicts = ''  -- this run's view of the marks: the digest, then 13 bytes an index
local sources_life  -- the scope's list of sources: its lifetime, when set again

-- A field and its text, to store in one HSET (a field put twice: the last wins).
local function put(w, field, value)
  local n = #w
  w[n + 1] = field
  w[n + 2] = value
end

-- A candidate's state, read and parsed once a run (load), then each call of the run
-- decided on it (decide), then what moved written once (store): the calls one by one
-- would leave the same (research-wiki/designs/script-cost.md, "Several calls per script
-- run"). ``t.w`` lists the fields to store and their texts; ``t.leases`` the grants'
-- (expiry, lease id) pairs, added in one ZADD.
local function load(c, off)
  -- What every call reads; the probes' fields only when a breaker is not closed or a
  -- pause waits for its probe (one more read, in those states alone).
  local h = redis.call('HMGET', c.sk, 'limit', 'breaker', 'not_before', 'rpm_tokens',
    'rpm_at', 'tpm_tokens', 'tpm_at', 'reopen_probe', 'spec', 'expires_at')
  local limit = num(h[1])
  local t = {sk = c.sk, lk = c.lk, name = c[1], off = off, w = {}, leases = {},
    maxc = num(c[2]), rpm = num(c[3]), rpm_cap = num(c[4]), tpm = num(c[5]),
    tpm_cap = num(c[6]), cooldown_max = num(c[9]), limit = limit, breaker = h[2],
    not_before = num(h[3]), rpm_tokens = num(h[4]), rpm_at = num(h[5]),
    tpm_tokens = num(h[6]), tpm_at = num(h[7]), reopen_probe = h[8] == '1',
    expires_at = num(h[10])}
  local w = t.w
  if limit == nil then
    -- First sight (source_state.new_source_state): closed, limit at its max, buckets full
    -- (made so when first checked, as a full bucket refills to itself).
    limit = t.maxc
    t.breaker, t.open_until, t.probe_id, t.probe_until, t.not_before = 'closed', 0, '', 0, 0
    t.rpm_tokens, t.rpm_at, t.tpm_tokens, t.tpm_at = nil, nil, nil, nil
    put(w, 'limit', fmt(limit))
    put(w, 'breaker', 'closed')
    put(w, 'failures', '0')
    put(w, 'trips', '0')
    put(w, 'open_until', '0')
    put(w, 'probe_id', '')
    put(w, 'probe_until', '0')
    put(w, 'not_before', '0')
  elseif t.breaker ~= 'closed' or t.reopen_probe then
    local p = redis.call('HMGET', c.sk, 'open_until', 'probe_id', 'probe_until',
      'pprobe_id', 'pprobe_until')
    t.open_until, t.probe_id, t.probe_until = num(p[1]), p[2] or '', num(p[3])
    t.pprobe_id, t.pprobe_until = p[4] or '', num(p[5]) or 0
  end
  -- The last spec seen, which release and snapshot work from: written when it changed,
  -- and then the state brought inside it (source_state.new_limits): a lowered max lowers
  -- the limit to it (aimd.on_max_change).
  if h[9] ~= c[10] then
    if limit > t.maxc then
      limit = t.maxc
      put(w, 'limit', fmt(limit))
    end
    put(w, 'max_concurrency', c[2])
    put(w, 'rpm', c[3])
    put(w, 'rpm_cap', c[4])
    put(w, 'tpm', c[5])
    put(w, 'tpm_cap', c[6])
    put(w, 'breaker_failures', c[7])
    put(w, 'cooldown_s', c[8])
    put(w, 'cooldown_max_s', c[9])
    put(w, 'spec', c[10])
  end
  t.limit = limit
  return t
end

-- The checks of source_state.admit, in order, for one call at candidate ``t``; returns
-- the reason (its code letter, as in the reply: see the header; nil for a grant),
-- reopen_in_s, probe. What moves is kept in ``t`` (first sight, a changed spec, open ->
-- half_open, refills, the commit, the lifetimes) for ``store``. Dead leases are not
-- counted (and left to RELEASE's sweep).
local function decide(t, lease_id, ttl, cost)
  local w = t.w
  -- The checks run in one block that a refusal leaves by ``break``, with its reason set:
  -- written inline, not as functions of returns (research-wiki/designs/script-cost.md,
  -- "The Lua's own share").
  local reason, reopen, probe = nil, nil, false
  repeat
    -- 1. Breaker (breaker.admit).
    if t.breaker == 'open' then
      if now < t.open_until then
        reason, reopen = 'b', t.open_until - now  -- breaker_open
        break
      end
      t.breaker = 'half_open'
      put(w, 'breaker', 'half_open')
    end
    if t.breaker == 'half_open' then
      if t.probe_id ~= '' and t.probe_until > now then
        reason = 'i'  -- probe_in_flight
        break
      end
      probe = true
    end

    -- 2. Pacer; once a failure's pause lapses, one probe fleet-wide.
    if now < t.not_before then
      reason, reopen = 'p', t.not_before - now  -- paced
      break
    end
    local pace_probe = false
    if t.reopen_probe then
      if t.pprobe_id ~= '' and t.pprobe_until > now then
        reason = 'i'  -- probe_in_flight
        break
      end
      pace_probe = true
    end

    -- 3. Concurrency (aimd.concurrency_cap): floor(limit), at least 1, at most the max. A
    -- full source still admits the process a release promised a permit to (RELEASE's
    -- hand-off): its placeholder is counted already. Looked up here only when full; a
    -- grant removes it whether full or not (below). The live leases are counted once a
    -- run (again after a placeholder is taken), with the run's grants not yet added.
    local live = t.live
    if live == nil then
      live = redis.call('ZCOUNT', t.lk, '(' .. now_s, '+inf') + #t.leases / 2
      t.live = live
    end
    if live >= math.max(1, math.min(t.maxc, math.floor(t.limit))) then
      local held = promised and not t.claimed and num(redis.call('ZSCORE', t.lk, promised))
      if not (held and held > now) then
        if t.off then
          -- The verdict (see the header): full until the earliest live lease lapses, in ms
          -- rounded down, so that it never outlasts the lease. None when that is at most a
          -- second away: a hand-off placeholder (at most 1 s, RELEASE) may be live here,
          -- and the process it waits for would skip the source it may claim; a lease that
          -- close to its end would lapse the mark at once anyway.
          local first = redis.call('ZRANGEBYSCORE', t.lk, '(' .. now_s, '+inf', 'WITHSCORES',
            'LIMIT', 0, 1)
          local lapse = num(first[2])
          if t.soonest and not (lapse and lapse <= t.soonest) then
            lapse = t.soonest  -- a grant of this run, not added yet, lapses first
          end
          if lapse > now + 1 then
            if verdicts == '' then
              redis.call('SET', vk, digest, 'EX', state_ttl)
              verdicts = digest
            end
            redis.call('SETRANGE', vk, t.off,
              string.format('%013d', math.floor(lapse * 1000)))
            put(w, 'verdict', t.off)
            t.full = true  -- the run's later calls skip it, as they would read the mark
          end
        end
        reason = 'c'  -- concurrency
        break
      end
    end

    -- 4. rpm bucket (ratelimit.refill, then wait_for 1 token).
    if t.rpm ~= nil then
      local tokens = t.rpm_tokens
      if tokens == nil then
        tokens, t.rpm_at = t.rpm_cap, now
      end
      tokens = math.min(t.rpm_cap, tokens + (now - t.rpm_at) * t.rpm / 60)
      t.rpm_tokens, t.rpm_at, t.rpm_moved = tokens, now, true
      if not (tokens >= 1) then
        reason, reopen = 'r', (1 - tokens) * 60 / t.rpm  -- rpm
        break
      end
    end

    -- 5. tpm bucket: the reservation is capped at the bucket, so a big request can pass.
    if t.tpm ~= nil then
      local tokens = t.tpm_tokens
      if tokens == nil then
        tokens, t.tpm_at = t.tpm_cap, now
      end
      tokens = math.min(t.tpm_cap, tokens + (now - t.tpm_at) * t.tpm / 60)
      t.tpm_tokens, t.tpm_at, t.tpm_moved = tokens, now, true
      local need = math.min(cost, t.tpm_cap)
      if not (tokens >= need) then
        reason, reopen = 't', (need - tokens) * 60 / t.tpm  -- tpm
        break
      end
    end

    -- Commit (source_state.commit): take the tokens (buckets may go negative), add the
    -- lease.
    if t.rpm ~= nil then
      t.rpm_tokens = t.rpm_tokens - 1
    end
    if t.tpm ~= nil then
      t.tpm_tokens = t.tpm_tokens - cost
    end
    local expiry = now + ttl
    if promised and not t.claimed then
      -- A grant here fulfils the process's promise, claimed at a full source or not:
      -- left standing, it would hold a permit for nobody once the process stops waiting.
      t.claimed = true
      if redis.call('ZREM', t.lk, promised) == 1 then
        t.live = nil  -- counted again when next needed
      end
    end
    local leases = t.leases
    leases[#leases + 1] = fmt(expiry)
    leases[#leases + 1] = lease_id
    if t.live then
      t.live = t.live + 1
    end
    if not (t.soonest and t.soonest <= expiry) then
      t.soonest = expiry
    end
    if probe then
      t.probe_id, t.probe_until = lease_id, expiry
      put(w, 'probe_id', lease_id)
      put(w, 'probe_until', fmt(expiry))
    end
    if pace_probe then
      t.pprobe_id, t.pprobe_until = lease_id, expiry
      put(w, 'pprobe_id', lease_id)
      put(w, 'pprobe_until', fmt(expiry))
    end
  until true

  -- Lifetimes: the source's keys (and the scope's list of sources) outlive the last
  -- touch by between ``life / 2`` and ``life``, so that a lease, a breaker's cool-down
  -- and a day's idleness fit in. ``expires_at`` is when they were last set to expire;
  -- they are set again only once half of that is gone, not at every call.
  local need = math.max(math.ceil(ttl), math.ceil(t.cooldown_max)) + 1
  local life = math.max(state_ttl, 2 * need)
  if t.expires_at == nil or t.expires_at - now < life / 2 then
    t.expires_at = now + life
    put(w, 'expires_at', fmt(t.expires_at))
    put(w, 'encoding', HASHTABLE)
    t.life = life
    if not redis.call('ZSCORE', KEYS[1], t.name) then
      redis.call('ZADD', KEYS[1], redis.call('ZCARD', KEYS[1]), t.name)
    end
    sources_life = life
  end
  return reason, reopen, reason == nil and probe
end

-- What moved at candidate ``t`` in the run, written: one HSET, one ZADD of its grants,
-- the lifetimes as the run's last renewal (or its first grant's new key) left them.
local function store(t)
  local w = t.w
  -- A bucket that moved was refilled up to now: its time is now_s.
  if t.rpm_moved then
    put(w, 'rpm_tokens', fmt(t.rpm_tokens))
    put(w, 'rpm_at', now_s)
  end
  if t.tpm_moved then
    put(w, 'tpm_tokens', fmt(t.tpm_tokens))
    put(w, 'tpm_at', now_s)
  end
  if #w > 0 then
    redis.call('HSET', t.sk, unpack(w))
  end
  local made = false
  local leases = t.leases
  if #leases > 0 then
    leases[#leases + 1] = '-inf'
    leases[#leases + 1] = SKIPLIST
    -- Every lease id is new: SKIPLIST is too exactly when the grant made the key anew.
    made = redis.call('ZADD', t.lk, unpack(leases)) == #leases / 2
  end
  if t.life then
    redis.call('EXPIRE', t.sk, t.life)
    redis.call('EXPIRE', t.lk, t.life)
  elseif made then
    -- The lease made the key anew (with SKIPLIST): it gets the lifetime the others have
    -- left.
    redis.call('EXPIRE', t.lk, math.ceil(t.expires_at - now))
  end
end

-- @tenant-functions

-- The calls' steps in the waiting registries, made only for a call with a process id (a
-- function made costs its upvalues at every run: research-wiki/designs/script-cost.md,
-- "The Lua's own share").
local granted_in_classes, refused_in_classes
if proc then
-- A grant's step: per class, with its flag at ``at`` (8 for the run's last call, 9 for a
-- call before it), the process stays registered at the back or leaves the class.
function granted_in_classes(at)
  for _, k in ipairs(classes) do
    if k[at] then
      -- Calls of the process are left here: it stays registered, at the back, where
      -- its next call's refusal would put it, with no moment out of the turn between.
      redis.call('ZADD', k[1], 'XX', now_s, proc)
    else
      redis.call('ZREM', k[1], proc)
      redis.call('ZREM', k[2], proc)
      if k[4] then
        drop_flows(k[4], k[5], proc)
      end
    end
  end
end

-- A refusal's step when a candidate waits for a release: the process is registered to be
-- woken by one, in each class it waits in, and leaves the others.
function refused_in_classes()
  local wttl = num(ARGV[20])
  local keep = math.ceil(wttl) + 1
  for _, c in ipairs(classes) do
    if c[3] then
      redis.call('ZADD', c[1], 'NX', now_s, proc)
      redis.call('ZADD', c[2], fmt(now + wttl), proc)
      redis.call('EXPIRE', c[1], keep)
      redis.call('EXPIRE', c[2], keep)
    else
      redis.call('ZREM', c[1], proc)
      redis.call('ZREM', c[2], proc)
    end
    if c[4] then
      -- Its tenants in the class as listed now (none listed: its calls there are only
      -- asking, tenants unknown yet; it counts as a process of no tenant until its next
      -- refused poll). A tenant new to the fleet's turn joins it at the back.
      local list = c[3] and c[7] or ''
      local old = redis.call('HGET', c[5], proc)
      if old and old ~= list then
        drop_flows(c[4], c[5], proc)
      end
      if list ~= '' then
        local last = redis.call('ZRANGE', c[6], -1, -1, 'WITHSCORES')
        local turn = (num(last[2]) or 0) + 1
        for _, t in ipairs(tenants_of(list)) do
          redis.call('ZADD', c[4], 0, flow(t, proc))
          turn = turn + redis.call('ZADD', c[6], 'NX', turn, t)
        end
        redis.call('HSET', c[5], proc, list)
        for k = 4, 6 do
          redis.call('EXPIRE', c[k], keep)
        end
      end
    end
  end
end

end

-- The first candidate from ARGV; the others from the spec set, read when reached (the
-- set, when the call carries it, stored first).
local first = {ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11], ARGV[12], ARGV[13],
  ARGV[14], ARGV[15], sk = KEYS[2], lk = KEYS[3]}
local prefix = string.sub(KEYS[1], 1, -8)  -- "pgw:{scope}:" of "pgw:{scope}:sources"
local dl = #digest
if ARGV[18] ~= '' then
  local items, fields = tenants_of(ARGV[18]), {}
  for k = 1, #items / 2 do
    fields[4 * k - 3] = 'n' .. (k - 1)
    fields[4 * k - 2] = items[2 * k - 1]
    fields[4 * k - 1] = 's' .. (k - 1)
    fields[4 * k] = items[2 * k]
  end
  fields[#fields + 1] = 'encoding'
  fields[#fields + 1] = HASHTABLE
  redis.call('HSET', setk, unpack(fields))
  redis.call('EXPIRE', setk, state_ttl)
end
if dl > 0 then
  verdicts = redis.call('GET', vk) or ''
  if string.sub(verdicts, 1, dl) ~= digest then
    verdicts = ''
  end
end

local now_ms = dl > 0 and string.format('%013d', math.floor(now * 1000))  -- marks' clock
local byte, sub = string.byte, string.sub  -- per candidate walked: no global lookups
-- Per source, its state once loaded (by its offset among the marks, which the spec set's
-- index makes one per source; 0 for a single candidate), so that a source listed twice
-- is one state; the loaded ones in load order.
local states, loaded = {}, {}
-- Per decided call its reply, and its step in the registries: a grant's flags (8 for the
-- run's last call, 9 for one before it), or 'r' for a refusal waiting for a release.
local replies, steps, held, holds = {}, {}, {}, {}
local unset = false  -- a candidate's spec is not stored under the digest
for i = 1, #ids do
  local lease_id, ttl, cost = ids[i], num(ttls[i]), num(costs[i])
  local codes, reopens, skipped = {}, {}, 0
  local granted, probe, for_release = 0, false, false
  for j = 1, count do
    local off
    if dl > 0 then
      local hi, lo = byte(order, 2 * j - 1, 2 * j)
      off = dl + 13 * (hi * 256 + lo)
    end
    -- Marked full, and it stands (in Redis, or by an earlier call of this run, which the
    -- calls one by one would read there): refused for concurrency unexamined.
    local t, marked = nil, false
    if not off then
      t = states[0]
    elseif sub(verdicts, off + 1, off + 13) > now_ms then
      marked = true
    else
      t = states[off]
      marked = t ~= nil and t.full
    end
    if marked then
      -- Refused unexamined (a row of them is written as one string).
      skipped = skipped + 1
      for_release = true
    else
      if skipped > 0 then
        codes[#codes + 1] = string.rep('c', skipped)  -- the run before it
        skipped = 0
      end
      if t == nil then
        local c = first
        if j > 1 then
          local idx = (off - dl) / 13
          local s = redis.call('HMGET', setk, 'n' .. idx, 's' .. idx)
          if not s[1] then
            unset = true
            break
          end
          c = {s[1]}
          for w in string.gmatch(s[2] .. ' ', '([^ ]*) ') do
            c[#c + 1] = w
          end
          c[10] = s[2]
          c.sk, c.lk = prefix .. 'src:' .. s[1], prefix .. 'leases:' .. s[1]
        end
        t = load(c, off)
        states[off or 0] = t
        loaded[#loaded + 1] = t
      end
      local reason, reopen
      reason, reopen, probe = decide(t, lease_id, ttl, cost)
      if reason == nil then
        granted = j
        break
      end
      if reason == 'c' or reason == 'i' then
        for_release = true  -- concurrency, probe_in_flight
      end
      codes[#codes + 1] = reason
      if reopen ~= nil then
        reopens[#reopens + 1] = fmt(reopen)
      end
    end
  end
  if unset then
    break  -- this call and the ones after it are left undecided
  end
  if granted > 0 then
    replies[i] = {granted, probe and 1 or 0, table.concat(codes), unpack(reopens)}
    steps[#steps + 1] = i == #ids and 8 or 9
    if hk then
      held[#held + 1] = fmt(now + ttl)
      held[#held + 1] = lease_id
      holds[#holds + 1] = ttl
    end
  else
    codes[#codes + 1] = string.rep('c', skipped)
    replies[i] = {0, 0, table.concat(codes), unpack(reopens)}
    if for_release then
      steps[#steps + 1] = 'r'
    end
  end
end
for _, t in ipairs(loaded) do
  store(t)
end
if sources_life then
  redis.call('EXPIRE', KEYS[1], sources_life)
end
local decided = #replies
if decided == 0 then
  return {-1}  -- the first call needs the spec set: the client sends it and calls again
end
if #held > 0 then
  -- Each grant counts toward its class's permits held fleet-wide until it ends or lapses;
  -- the key outlives every live member (each grant's need checked in turn, as one by one).
  redis.call('ZADD', hk, unpack(held))
  local left = redis.call('TTL', hk)
  local set = left
  for _, ttl in ipairs(holds) do
    local need = math.ceil(ttl) + 1
    if set < need then
      set = 2 * need
    end
  end
  if set ~= left then
    redis.call('EXPIRE', hk, set)
  end
end
if proc then
  -- Each decided call's step, in order; a step like the one before it changes nothing at
  -- one now (the moves and registrations are idempotent), so it is not taken again.
  local last
  for _, step in ipairs(steps) do
    if step ~= last then
      if step == 'r' then
        refused_in_classes()
      else
        granted_in_classes(step)
      end
      last = step
    end
  end
end
if #ids == 1 then
  return replies[1]
end
return replies
"""

ACQUIRE = ACQUIRE.replace("-- @tenant-functions\n", _TENANT_FUNCTIONS, 1)
ACQUIRE = ACQUIRE.replace("'@hashtable'", f"'{_HASHTABLE}'", 1)
ACQUIRE = ACQUIRE.replace("'@skiplist'", f"'{_SKIPLIST}'", 1)
ACQUIRE = ACQUIRE.replace("-- @clock\n", _CLOCK, 1)

RELEASE = """
-- RELEASE: free a live lease and record its attempt's outcome (source_state.apply_outcome);
-- or, in one run, several leases of one source (research-wiki/designs/script-cost.md,
-- "Several calls per script run").
--
-- KEYS[1] pgw:{scope}:src:<source>   KEYS[2] pgw:{scope}:leases:<source>
-- KEYS[3] pgw:{scope}:progress     KEYS[4] pgw:{scope}:verdicts (see ACQUIRE)
-- ARGV[1] now ("" = server TIME)   ARGV[2] lease id
-- ARGV[3] outcome kind: success | transient | rate_limited | source_misconfigured |
--         request_rejected | cancelled
-- ARGV[4] "1" when the failure asks for an AIMD decrease (transient only)
-- ARGV[5] pause_s ("" = none): pacer.pause_for already applied by the caller, so it is
--         set for rate_limited always and for success / transient only when hinted
-- ARGV[6] tokens_used ("" = not reported)   ARGV[7] the lease's tpm reservation (tokens)
-- ARGV[8] AIMD cool-off s   ARGV[9] AIMD factor   ARGV[10] progress key TTL s
-- ARGV[11] state key TTL s
-- Optional, last (all or none):
-- KEYS[5] pgw:{scope}:waiting   KEYS[6] pgw:{scope}:waiting_until   (see ACQUIRE)
-- ARGV[12] the releasing process's id   ARGV[13] the scope (the wake-up's message)
-- ARGV[14] "1" when a PUBLISH that reaches no subscriber means the process is gone
--          (one server); "0" when receivers are not counted here (a cluster's bus)
-- ARGV[15] hand-off TTL in seconds, at most 1 (optional: absent, no hand-off; more is
--          taken as 1: ACQUIRE's marks rely on a placeholder living at most 1 s)
-- With priority classes (m of them, after ARGV[15]): KEYS[3+2j], KEYS[4+2j] class j's
-- registry (see ACQUIRE) in place of KEYS[5], KEYS[6]; KEYS[5+2m] pgw:{scope}:classes
-- (hash: vtime, pass:<class>, on:<class>); ARGV[14+2j] class j's name, ARGV[15+2j] its
-- share. The class whose turn it is is chosen first (stride scheduling, below), then
-- the process; the wake-up's message is the scope, a newline and the class, and the
-- releasing process's own turn returns {1, class} in place of 1.
-- With reserved floors (a class reserves permits; research-wiki/designs/priority-fairness.md,
-- "On Redis"): one argument more, the last, ARGV[16+2m] = "<i> <reserved_1> ... <reserved_m>"
-- (i: the released lease's class, 1-based, 0 when it is in no count), and after every
-- other key per class j its zset KEYS[#KEYS-m+j] pgw:{scope}:held:<class j> (lease id ->
-- expiry: the class's permits held fleet-wide). The lease leaves its class's zset (dead
-- members swept). The class choice first prefers a live class holding fewer live members
-- than its reserved (among several, the stride order decides); such a turn does not move
-- the pass (nor vtime), then stride as below.
-- With tenants (the releasing process's room named one): after the keys above come per
-- class (one, without classes) its three tenant keys, flows, flows_of and tenants (see
-- ACQUIRE). When the chosen class has tenant registrations, the turn goes to the tenant
-- first (the lowest place in the class's turn that has a live registered process; a
-- process registered with no tenant counts as the tenant ""), then to that tenant's
-- least recently woken process; the tenant goes to the back of the turn, the message is
-- the scope, the class ("" without classes) and the tenant, each on a line of its own,
-- and the releasing process's own turn returns {1, class, tenant}.
-- A run: ARGV[2 .. 7] each a list of N words joined by single spaces (a word may be
-- empty: "" between two spaces), the leases' in the same order, all of one source and
-- of one class (the floors argument's); every other key and argument as above. A lone
-- release is one without a space in ARGV[2]. A run leaves Redis and replies exactly as
-- the N releases one after another at the same ``now`` would, and replies a list of their
-- N replies in order; it reads the source's state once (and the failures' fields once,
-- at its first lease that needs them), decides each lease's outcome on what the ones
-- before it left, runs each freed permit's wake-up in turn, and writes what moved once.
-- Returns 1 when the lease was live and is now freed, 0 when it was unknown or expired
-- (then nothing but the dropping of the source's dead leases happened, which only
-- RELEASE and RENEW do: ACQUIRE counts live leases and leaves the dead). With the
-- optional arguments, a freed permit wakes one registered process, the least recently
-- woken live one (its score becomes now): itself, or nobody registered, returns 1 (the
-- releasing process wakes its own waiters); another process is sent the scope on
-- ``pgw:wake:<id>`` and 2 is returned (the releasing process leaves the permit to it).
-- With a hand-off TTL, and room for the permit under the source's limit (AIMD may just
-- have lowered it), the permit is also held for the woken process, itself included: the
-- placeholder ``handoff:<id>`` in the lease zset, expiring after the TTL, counts as a
-- lease for everyone else. A process already holding one here has its turn pending and
-- is passed over; when every registered process is, the first is woken with nothing
-- held.

-- @clock
local sk, lk = KEYS[1], KEYS[2]

-- A run's leases, in order: ARGV[2 .. 7] as lists of one word per lease, ``lists[a][i]``
-- (a lone release makes no list: its arguments are read as they are).
local run = string.find(ARGV[2], ' ', 1, true) ~= nil
local lists, n = nil, 1
if run then
  lists = {}
  for a = 2, 7 do
    local words = {}
    for w in string.gmatch(ARGV[a] .. ' ', '([^ ]*) ') do
      words[#words + 1] = w
    end
    lists[a] = words
  end
  n = #lists[2]
end

-- Reserved floors: per class its reserved permits and its held-permits zset; ``own``, the
-- run's class's (its leases leave it one by one, below, each before its wake-up).
local floors, own
if #ARGV >= 16 and (#ARGV - 15) % 2 == 1 then
  local nclasses = math.floor((#ARGV - 15) / 2)
  local words = {}
  for w in string.gmatch(ARGV[#ARGV], '%d+') do
    table.insert(words, num(w))
  end
  floors = {}
  for j = 1, nclasses do
    floors[j] = {words[j + 1], KEYS[#KEYS - nclasses + j]}
  end
  own = floors[words[1]]
  if own then
    -- Lapsed leases no longer count toward the class's floor (nothing in a run adds any).
    redis.call('ZREMRANGEBYSCORE', own[2], '-inf', now_s)
  end
end

-- The lease zsets' member that is no lease (see ACQUIRE); a hand-off adds it too.
local SKIPLIST = '@skiplist'

-- @tenant-functions

-- The freed permit's one wake-up: the least recently woken live registered process (of
-- the class whose turn it is, with priority classes), for whom the permit is held when
-- there is room for it (``cap``: the source's limit). ``turn`` (a run's; nil for a lone
-- release) is what a lease's wake-up leaves for the next leases of the run, each seeing
-- what the calls one by one would: ``nobody``, no process is registered (registries only
-- shrink here, so that holds for the run once found); ``resweep``, the lease zset may
-- hold a dead member (a placeholder that expires at once); ``lk_life``, the lease zset's
-- lifetime was last set here, after the last lease's lifetimes.
local function wake(cap, expires_at, turn)
  if #ARGV < 14 or (turn and turn.nobody) then
    return 1
  end
  local m = math.floor((#ARGV - 15) / 2)
  -- Who is registered, per class (one, without classes): one command a class, and nothing
  -- more when nobody is, the case of every call that does not wait.
  local counts, anyone = {}, false
  for j = 1, math.max(m, 1) do
    counts[j] = redis.call('ZCARD', KEYS[m < 1 and 5 or 3 + 2 * j])
    anyone = anyone or counts[j] > 0
  end
  if not anyone then
    if turn then
      turn.nobody = true
    end
    return 1
  end
  local me = ARGV[12]
  -- The registries: per class its two keys, its name and its share (one, nameless,
  -- without classes), and with tenants its three tenant keys. Swept of lapsed
  -- registrations; those with someone left are live.
  local regs, live = {}, {}
  if m < 1 then
    regs[1] = {KEYS[5], KEYS[6], nil, 1}
    if #KEYS >= 9 then
      regs[1][5], regs[1][6], regs[1][7] = KEYS[7], KEYS[8], KEYS[9]
    end
  else
    local tenants = #KEYS - (floors and m or 0) >= 5 + 5 * m
    for j = 1, m do
      regs[j] = {KEYS[3 + 2 * j], KEYS[4 + 2 * j], ARGV[14 + 2 * j], num(ARGV[15 + 2 * j])}
      if tenants then
        local base = 5 + 2 * m + 3 * j
        regs[j][5], regs[j][6], regs[j][7] = KEYS[base - 2], KEYS[base - 1], KEYS[base]
      end
    end
  end

  -- A process's tenants in a class with tenant keys, forgotten (``drop_flows``).
  local function forget_tenants(r, p)
    if r[5] then
      drop_flows(r[5], r[6], p)
    end
  end

  for j, r in ipairs(regs) do
    local n = counts[j]
    if n > 0 then
      local gone = redis.call('ZRANGEBYSCORE', r[2], '-inf', now_s)
      for first = 1, #gone, 1000 do
        local last = math.min(first + 999, #gone)
        n = n - redis.call('ZREM', r[1], unpack(gone, first, last))
        redis.call('ZREM', r[2], unpack(gone, first, last))
      end
      for _, p in ipairs(gone) do
        forget_tenants(r, p)
      end
      if n > 0 then
        table.insert(live, j)
      end
    end
  end
  if #live == 0 then
    if turn then
      turn.nobody = true  -- every registry is empty now
    end
    return 1
  end
  local j = live[1]
  if m > 1 then
    -- Whose turn: stride scheduling over the classes with registrations, as the waiting
    -- room orders its own classes (middleware/waiting.py): the lowest pass goes (the
    -- larger share on a tie, then the class listed first) and moves on by 1 / share; a
    -- class back from idle (no registration at the last wake-up) starts level with the
    -- classes that were waiting, or where the last one served left off (vtime).
    local ck = KEYS[5 + 2 * m]
    local fields = {'vtime'}
    for _, r in ipairs(regs) do
      table.insert(fields, 'pass:' .. r[3])
      table.insert(fields, 'on:' .. r[3])
    end
    local h = redis.call('HMGET', ck, unpack(fields))
    local pass, on, lowest = {}, {}, nil
    for k = 1, m do
      pass[k] = num(h[2 * k]) or 0
    end
    for _, k in ipairs(live) do
      on[k] = true
      if h[2 * k + 1] == '1' and (lowest == nil or pass[k] < lowest) then
        lowest = pass[k]
      end
    end
    local vtime = lowest or num(h[1]) or 0
    -- Reserved floors first: a live class holding fewer live permits fleet-wide than its
    -- reserved is preferred (among several, the stride order decides).
    local below, floor = {}, false
    if floors then
      for _, k in ipairs(live) do
        local reserved = floors[k][1]
        if reserved > 0
            and redis.call('ZCOUNT', floors[k][2], '(' .. now_s, '+inf') < reserved then
          below[k], floor = true, true
        end
      end
    end
    j = nil
    for _, k in ipairs(live) do
      if h[2 * k + 1] ~= '1' then
        pass[k] = math.max(pass[k], vtime)
      end
      if (below[k] or not floor) and (j == nil or pass[k] < pass[j]
          or (pass[k] == pass[j] and regs[k][4] > regs[j][4])) then
        j = k
      end
    end
    local writes = {}
    if not floor then
      -- A turn at the floor comes on top of the share: only a stride turn moves the pass.
      writes = {'vtime', fmt(pass[j])}
      pass[j] = pass[j] + 1 / regs[j][4]
    end
    for k, r in ipairs(regs) do
      table.insert(writes, 'pass:' .. r[3])
      table.insert(writes, fmt(pass[k]))
      table.insert(writes, 'on:' .. r[3])
      table.insert(writes, on[k] and '1' or '0')
    end
    redis.call('HSET', ck, unpack(writes))
    redis.call('EXPIRE', ck, ARGV[11])
  end
  local reg = regs[j]
  local wk, wuk, class = reg[1], reg[2], reg[3]
  local handoff = num(ARGV[15])
  if handoff then
    handoff = math.min(handoff, 1)
  end
  -- Room for the permit to be held: the live leases (swept above; SKIPLIST not counted)
  -- below the limit. A placeholder put below for a process that turns out gone is taken
  -- back at once, so the room stays what it is here.
  local held = cap and handoff and redis.call('ZCOUNT', lk, '(-inf', '+inf') < cap

  -- With tenant registrations in the class: the tenant whose turn it is, fleet-wide,
  -- then its least recently woken live process. Returns the process and the tenant, or
  -- nil when nobody is found (the process order below then decides).
  local function by_tenant()
    local fk, fok, tk = reg[5], reg[6], reg[7]
    -- Processes registered with no tenant list take their turns as the tenant "".
    if redis.call('ZCARD', wk) > redis.call('HLEN', fok) then
      local last = redis.call('ZRANGE', tk, -1, -1, 'WITHSCORES')
      redis.call('ZADD', tk, 'NX', (num(last[2]) or 0) + 1, '')
      -- Made here (no expiry yet): it lives as long as wk, to the millisecond.
      if redis.call('PTTL', tk) < 0 then
        redis.call('PEXPIRE', tk, math.max(redis.call('PTTL', wk), 1))
      end
    end
    local fallback, fallback_t
    local i = 0
    while true do
      local t = redis.call('ZRANGE', tk, i, i)[1]
      if t == nil then
        if fallback then
          held = false  -- each holds a promise here: wake the first, holding nothing more
        end
        return fallback, fallback_t
      end
      -- Its processes, least recently woken first, those with a promise here pending last.
      local procs = {}
      if t == '' then
        for _, p in ipairs(redis.call('ZRANGE', wk, 0, -1)) do
          if redis.call('HEXISTS', fok, p) == 0 or redis.call('ZSCORE', fk, flow('', p)) then
            table.insert(procs, p)
          end
        end
      else
        local prefix = #t .. ':' .. t
        for _, member in ipairs(redis.call('ZRANGEBYLEX', fk, '[' .. prefix,
            '(' .. prefix .. string.char(255))) do
          table.insert(procs, string.sub(member, #prefix + 1))
        end
      end
      local best, best_s, first, first_s
      for _, p in ipairs(procs) do
        local score = num(redis.call('ZSCORE', wk, p))
        if score == nil or not redis.call('ZSCORE', wuk, p) then
          -- Not registered (or its expiry lost with its key): not live.
          redis.call('ZREM', wk, p)
          redis.call('ZREM', wuk, p)
          forget_tenants(reg, p)
        else
          if first == nil or score < first_s then
            first, first_s = p, score
          end
          if not (held and redis.call('ZSCORE', lk, 'handoff:' .. p))
              and (best == nil or score < best_s) then
            best, best_s = p, score
          end
        end
      end
      if best then
        return best, t
      end
      if first == nil then
        redis.call('ZREM', tk, t)  -- nobody waits with it: out of the turn (back at the end)
      else
        if fallback == nil then
          fallback, fallback_t = first, t  -- every one of its processes has a turn pending
        end
        i = i + 1
      end
    end
  end

  local i = 0
  while true do
    local head, tenant
    if reg[5] and redis.call('ZCARD', reg[5]) > 0 then
      head, tenant = by_tenant()
    end
    if tenant == nil then
      head = redis.call('ZRANGE', wk, i, i)[1]
    end
    if head == nil then
      if not held then
        return 1
      end
      held, i = false, 0  -- each holds a promise here: wake the first, holding nothing more
    elseif tenant == nil and not redis.call('ZSCORE', wuk, head) then
      redis.call('ZREM', wk, head)  -- its expiry was lost with its key: not live
      forget_tenants(reg, head)
    elseif tenant == nil and held and redis.call('ZSCORE', lk, 'handoff:' .. head) then
      i = i + 1  -- a permit here is promised to it already: its turn is pending
    else
      redis.call('ZADD', wk, 'XX', now_s, head)
      if held then
        if turn and handoff <= 0 then
          turn.resweep = true  -- dead at once: the next lease's sweep drops it
        end
        if redis.call('ZADD', lk, fmt(now + handoff), 'handoff:' .. head, '-inf', SKIPLIST)
            == 2 then
          -- The placeholder made the key anew: it gets the lifetime the source's state
          -- has left (ACQUIRE's leases may join it), at least the placeholder's own.
          local life = math.ceil(handoff) + 1
          if expires_at ~= nil then
            life = math.max(life, math.ceil(expires_at - now))
          end
          redis.call('EXPIRE', lk, life)
          if turn then
            turn.lk_life = true
          end
        end
      end
      local heard = head == me
      local message = ARGV[13]
      if tenant ~= nil then
        message = message .. string.char(10) .. (class or '') .. string.char(10) .. tenant
      elseif class then
        message = message .. string.char(10) .. class  -- "<scope>" newline "<class>"
      end
      if not heard then
        heard = redis.call('PUBLISH', 'pgw:wake:' .. head, message) > 0 or ARGV[14] ~= '1'
      end
      if heard then
        if tenant ~= nil then
          -- The tenant goes to the back of the class's turn.
          local last = redis.call('ZRANGE', reg[7], -1, -1, 'WITHSCORES')
          redis.call('ZADD', reg[7], 'XX', num(last[2]) + 1, tenant)
        end
        if head ~= me then
          return 2
        end
        if tenant ~= nil then
          return {1, class or '', tenant}
        end
        if class then
          return {1, class}
        end
        return 1
      end
      -- Nobody listens on its channel: the process is gone (or not yet listening).
      redis.call('ZREM', wk, head)
      redis.call('ZREM', wuk, head)
      redis.call('ZREM', lk, 'handoff:' .. head)
      forget_tenants(reg, head)
    end
  end
end

-- The source's state, read once a run, at its first live lease: what every outcome reads
-- (h); what only a failure or a pause uses (the breaker's threshold and cool-down, its
-- reopen time, AIMD's last decrease, the pacer), read by a second HMGET at the run's first
-- lease that needs it (f): a success without a pause touches none of it. Each lease's
-- outcome moves these locals as the calls one by one would move the stored fields.
local h, f, maxc
local tpm, tpm_cap, cooldown_max, breaker, failures, trips, probe_id, probe_until
local limit, tpm_tokens, reopen_probe, pprobe_id, verdict, expires_at
local threshold, cooldown, open_until, last_decrease, not_before
-- Lifetimes (see ACQUIRE): a lease renewed past half the state's life still leaves a
-- breaker's cool-down time to run out. ``expires_at`` is left to ACQUIRE, which also keeps
-- the scope's list of sources; RELEASE moves neither it nor the spec, so whether the keys'
-- lifetimes are set, and to what (``life``), is the same for every lease of a run.
local life, lives = nil, false
local progress = false

-- Only what moved is written, once a run. ``was_*``: each field as the calls one by one
-- would have stored it so far (as read, or as last written; a number as its number, which
-- its 17 digits read back exactly). A field already holding its new value (as text, or as
-- a number) is not written, so a success at a closed source at its limit writes nothing;
-- one written and then set back is written, in our spelling, as the calls one by one
-- would have.
local was_breaker, was_failures, was_trips, was_open_until, was_probe_id, was_probe_until
local was_limit, was_not_before, was_reopen_probe
-- Writes ``field`` when its ``value`` differs from what ``was`` stored (nil: always) and
-- returns the value: a lone release's straight to the HSET's arguments ``w``; a run's to
-- ``w`` as a map, each field one of its leases would have written with its last value,
-- in the order first written (``order``). No upvalue but ``fmt``: a closure pays for each.
local function put(w, order, field, value, was)
  if value ~= was then
    if order then
      if w[field] == nil then
        order[#order + 1] = field
      end
      w[field] = value
    else
      w[#w + 1] = field
      w[#w + 1] = type(value) == 'number' and fmt(value) or value
    end
  end
  return value
end
local writes = {}
local w, order = writes, nil

-- Each lease in turn: it leaves its class's floor; dead leases (expiry <= now) go, the
-- sweep starting above -inf, where SKIPLIST stays; the lease is live exactly when it is
-- still there. A live lease is freed, its outcome applied (source_state.apply_outcome) on
-- the state as the leases before it left it, and its permit's wake-up run; with the
-- source's state outlived by its own lease (state TTL), the permit is freed, no more. Its
-- reply is the lone release's (``reply``; a run's, in order, in ``replies``).
local reply, replies, turn = nil, nil, nil
if run then
  replies, w, order = {}, {}, {}
  turn = {nobody = false, resweep = false, lk_life = false}
end
for i = 1, n do
  local lease_id = ARGV[2]
  if run then
    lease_id = lists[2][i]
  end
  if own then
    redis.call('ZREM', own[2], lease_id)
  end
  if i == 1 or turn.resweep then
    redis.call('ZREMRANGEBYSCORE', lk, '(-inf', now_s)
    if turn then
      turn.resweep = false
    end
  end
  if redis.call('ZREM', lk, lease_id) == 0 then
    reply = 0
  else
    if h == nil then
      h = redis.call('HMGET', sk, 'max_concurrency', 'tpm', 'tpm_cap', 'cooldown_max_s',
        'breaker', 'failures', 'trips', 'probe_id', 'probe_until', 'limit', 'tpm_tokens',
        'reopen_probe', 'pprobe_id', 'expires_at', 'verdict')
      maxc = num(h[1])
      if maxc ~= nil then
        tpm, tpm_cap, cooldown_max = num(h[2]), num(h[3]), num(h[4])
        breaker, failures, trips = h[5], num(h[6]), num(h[7])
        probe_id, probe_until = h[8] or '', num(h[9])
        limit, tpm_tokens = num(h[10]), num(h[11])
        reopen_probe, pprobe_id = h[12] or '0', h[13] or ''
        expires_at, verdict = num(h[14]), h[15] or ''
        -- As read; an absent reopen_probe reads as "0" everywhere.
        was_breaker, was_failures, was_trips = h[5], failures, trips
        was_probe_id, was_probe_until, was_limit = h[8], probe_until, limit
        was_reopen_probe = reopen_probe
        local need = math.ceil(cooldown_max) + 1
        if expires_at == nil or expires_at - now < need then
          life = math.max(num(ARGV[11]), 2 * need)
        end
      end
    end
    if maxc == nil then
      reply = wake(nil, nil, turn)
    else
      local kind, aimd, pause_s = ARGV[3], ARGV[4], ARGV[5]
      local used_s, reserved_s = ARGV[6], ARGV[7]
      if run then
        kind, aimd, pause_s = lists[3][i], lists[4][i], lists[5][i]
        used_s, reserved_s = lists[6][i], lists[7][i]
      end
      local pause = num(pause_s)
      if f == nil and (kind ~= 'success' or pause ~= nil) then
        f = redis.call('HMGET', sk, 'breaker_failures', 'cooldown_s', 'open_until',
          'last_decrease', 'not_before')
        threshold, cooldown, open_until = num(f[1]), num(f[2]), num(f[3])
        last_decrease, not_before = num(f[4]), num(f[5])
        -- Unread (nil) until now: no lease before this one moved them.
        was_open_until, was_not_before = open_until, not_before
      end
      local decreased = false

      -- The pause's probe slot is freed by its own lease's release, whatever the outcome.
      local pprobe_freed = pprobe_id ~= '' and pprobe_id == lease_id
      if kind == 'success' then
        breaker, failures, trips = 'closed', 0, 0
        probe_id, probe_until = '', 0
        limit = math.min(maxc, limit + 1 / limit)
        reopen_probe = '0'
      else
        -- The failures' helpers, made for a failure only: a function nested here closes
        -- over the locals it uses each time it is made (research-wiki/designs/
        -- script-cost.md, "The Lua's own share").
        local function free_probe(only)
          if only == nil or (probe_id ~= '' and probe_id == only) then
            probe_id, probe_until = '', 0
          end
        end

        -- breaker.trip: the cool-down doubles per consecutive trip, capped.
        local function trip()
          trips = trips + 1
          local doublings = math.min(math.max(trips - 1, 0), 1000)
          open_until = now + math.min(cooldown * 2 ^ doublings, cooldown_max)
          breaker, failures = 'open', 0
          free_probe(nil)
        end

        -- aimd.on_overload: at most one decrease per cool-off.
        local function overload()
          if last_decrease ~= nil and now - last_decrease < num(ARGV[8]) then
            return
          end
          limit = math.max(1, limit * num(ARGV[9]))
          last_decrease = now
          decreased = true
        end

        if kind == 'transient' then
          if breaker == 'closed' then
            failures = failures + 1
            if failures >= threshold then
              trip()
            end
          elseif breaker == 'half_open' and probe_id ~= '' and probe_id == lease_id then
            trip()
          end
          if aimd == '1' then
            overload()
          end
          if pause ~= nil then
            reopen_probe = '1'
          end
        elseif kind == 'rate_limited' then
          free_probe(lease_id)
          overload()
          reopen_probe = '1'
        elseif kind == 'source_misconfigured' then
          -- breaker.trip_long: misconfigured, not overloaded.
          trips = trips + 1
          open_until = now + cooldown_max
          breaker, failures = 'open', 0
          free_probe(nil)
          pause = nil
        else
          free_probe(lease_id)
          pause = nil
        end
      end
      if pause ~= nil then
        not_before = math.max(not_before, now + pause)
      end

      was_breaker = put(w, order, 'breaker', breaker, was_breaker)
      was_failures = put(w, order, 'failures', failures, was_failures)
      was_trips = put(w, order, 'trips', trips, was_trips)
      was_open_until = put(w, order, 'open_until', open_until, was_open_until)
      was_probe_id = put(w, order, 'probe_id', probe_id, was_probe_id)
      was_probe_until = put(w, order, 'probe_until', probe_until, was_probe_until)
      was_limit = put(w, order, 'limit', limit, was_limit)
      was_not_before = put(w, order, 'not_before', not_before, was_not_before)
      was_reopen_probe = put(w, order, 'reopen_probe', reopen_probe, was_reopen_probe)
      if pprobe_freed then
        pprobe_id = ''
        put(w, order, 'pprobe_id', '', nil)
        put(w, order, 'pprobe_until', '0', nil)
      end
      if decreased then
        put(w, order, 'last_decrease', last_decrease, nil)
      end

      -- ratelimit.reconcile: replace the reservation with real usage.
      local used = num(used_s)
      if used ~= nil and tpm ~= nil and tpm_tokens ~= nil then
        tpm_tokens = math.min(tpm_cap, tpm_tokens + (num(reserved_s) or 0) - used)
        put(w, order, 'tpm_tokens', tpm_tokens, nil)
      end
      -- A verdict on the source (ACQUIRE's mark) no longer holds: a lease is freed, and
      -- the outcome may have moved the limit, the breaker or the pacer.
      if verdict ~= '' then
        if redis.call('EXISTS', KEYS[4]) == 1 then
          redis.call('SETRANGE', KEYS[4], verdict, '0000000000000')
        end
        verdict = ''
        put(w, order, 'verdict', '', nil)
      end
      if life and turn then
        lives, turn.lk_life = true, false
      elseif life then
        -- A lone release: before its wake-up, which may set the lease zset's lifetime anew.
        redis.call('EXPIRE', sk, life)
        redis.call('EXPIRE', lk, life)
      end
      progress = progress or kind == 'success'
      reply = wake(math.min(maxc, math.floor(limit)), expires_at, turn)
    end
  end
  if run then
    replies[i] = reply
  end
end

-- What moved, written once, and the lifetimes and the progress mark as the last of the
-- calls one by one would leave them (a wake-up's lifetime of a lease zset it made anew
-- stands when it came after).
if run then
  for _, field in ipairs(order) do
    local value = w[field]
    writes[#writes + 1] = field
    writes[#writes + 1] = type(value) == 'number' and fmt(value) or value
  end
end
if #writes > 0 then
  redis.call('HSET', sk, unpack(writes))
end
if lives then
  redis.call('EXPIRE', sk, life)
  if not turn.lk_life then
    redis.call('EXPIRE', lk, life)
  end
end
if progress then
  redis.call('SET', KEYS[3], now_s, 'EX', ARGV[10])
end
if run then
  return replies
end
return reply
"""

RELEASE = RELEASE.replace("-- @tenant-functions\n", _TENANT_FUNCTIONS, 1)
RELEASE = RELEASE.replace("-- @clock\n", _CLOCK, 1)
RELEASE = RELEASE.replace("'@skiplist'", f"'{_SKIPLIST}'", 1)

RENEW = """
-- RENEW: extend a live lease by its own TTL from now (and the probe slot it may hold).
--
-- KEYS[1] pgw:{scope}:src:<source>   KEYS[2] pgw:{scope}:leases:<source>
-- ARGV[1] now ("" = server TIME)   ARGV[2] lease id   ARGV[3] the lease's TTL in seconds
-- ARGV[4] state key TTL s
-- Optional: KEYS[3] pgw:{scope}:held:<class> (the lease's class counts its permits held
-- fleet-wide, reserved floors: see ACQUIRE), whose member is extended too.
-- Returns 1 when the lease was live and is renewed, 0 when it was unknown or expired.

-- @clock
local sk, lk = KEYS[1], KEYS[2]
local lease_id = ARGV[2]
local ttl = num(ARGV[3])

redis.call('ZREMRANGEBYSCORE', lk, '(-inf', now_s)  -- ACQUIRE's SKIPLIST member stays
if not redis.call('ZSCORE', lk, lease_id) then
  return 0
end
local expiry = fmt(now + ttl)
redis.call('ZADD', lk, 'XX', expiry, lease_id)
if KEYS[3] then
  redis.call('ZADD', KEYS[3], 'XX', expiry, lease_id)
  local need = math.ceil(ttl) + 1
  if redis.call('TTL', KEYS[3]) < need then
    redis.call('EXPIRE', KEYS[3], 2 * need)
  end
end
local h = redis.call('HMGET', sk, 'probe_id', 'pprobe_id', 'expires_at')
if h[1] and h[1] ~= '' and h[1] == lease_id then
  redis.call('HSET', sk, 'probe_until', expiry)
end
if h[2] and h[2] ~= '' and h[2] == lease_id then
  redis.call('HSET', sk, 'pprobe_until', expiry)
end
-- Lifetimes (see ACQUIRE): a lease renewed past half the state's life keeps its keys.
local expires_at = num(h[3])
local need = math.ceil(ttl) + 1
if expires_at == nil or expires_at - now < need then
  local life = math.max(num(ARGV[4]), 2 * need)
  redis.call('EXPIRE', sk, life)
  redis.call('EXPIRE', lk, life)
end
return 1
"""
RENEW = RENEW.replace("-- @clock\n", _CLOCK, 1)

PROGRESS = """
-- PROGRESS: seconds since the scope last served anywhere in the fleet.
--
-- KEYS[1] pgw:{scope}:progress   (set by RELEASE on success, with a TTL)
-- ARGV[1] now ("" = server TIME)
-- Returns the age as a string, at least 0, or "" when the scope never served
-- (or not within the key's TTL).

-- @clock
local at = num(redis.call('GET', KEYS[1]))
if at == nil then
  return ''
end
return fmt(math.max(0, now - at))
"""
PROGRESS = PROGRESS.replace("-- @clock\n", _CLOCK, 1)

SNAPSHOT = """
-- SNAPSHOT: the scope's live state as of now, read-only (source_state.view).
--
-- KEYS[1] pgw:{scope}:progress
-- KEYS[2i] pgw:{scope}:src:<name_i>   KEYS[2i+1] pgw:{scope}:leases:<name_i>
-- ARGV[1] now ("" = server TIME)
-- Returns {progress_age ("" = never), then per source i: known (0/1), in_flight, limit,
-- breaker, failures, trips, reopen_in_s, paced_for_s, rpm_tokens, tpm_tokens}
-- with "" for every value that is none.

-- @clock

local result = {''}
local at = num(redis.call('GET', KEYS[1]))
if at ~= nil then
  result[1] = fmt(math.max(0, now - at))
end

-- ratelimit.refilled_tokens, or a full bucket when none exists yet.
local function bucket(rate, cap, tokens, t)
  if rate == nil then
    return ''
  end
  if tokens == nil then
    return fmt(cap)
  end
  return fmt(math.min(cap, tokens + (now - t) * rate / 60))
end

for i = 1, (#KEYS - 1) / 2 do
  local sk, lk = KEYS[2 * i], KEYS[2 * i + 1]
  local h = redis.call('HMGET', sk, 'limit', 'breaker', 'failures', 'trips', 'open_until',
    'not_before', 'rpm', 'rpm_cap', 'rpm_tokens', 'rpm_at', 'tpm', 'tpm_cap', 'tpm_tokens',
    'tpm_at')
  local limit = num(h[1])
  if limit == nil then
    table.insert(result, 0)
    for _ = 1, 9 do
      table.insert(result, '')
    end
  else
    local breaker = h[2]
    local open_until = num(h[5])
    if breaker == 'open' and now >= open_until then
      breaker = 'half_open'
    end
    local reopen = ''
    if breaker == 'open' then
      reopen = fmt(open_until - now)
    end
    local not_before = num(h[6])
    local paced = ''
    if now < not_before then
      paced = fmt(not_before - now)
    end
    table.insert(result, 1)
    table.insert(result, redis.call('ZCOUNT', lk, '(' .. now_s, '+inf'))
    table.insert(result, fmt(limit))
    table.insert(result, breaker)
    table.insert(result, h[3])
    table.insert(result, h[4])
    table.insert(result, reopen)
    table.insert(result, paced)
    table.insert(result, bucket(num(h[7]), num(h[8]), num(h[9]), num(h[10])))
    table.insert(result, bucket(num(h[11]), num(h[12]), num(h[13]), num(h[14])))
  end
end
return result
"""
SNAPSHOT = SNAPSHOT.replace("-- @clock\n", _CLOCK, 1)
