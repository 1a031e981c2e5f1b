--[[ redisched check: verify one topic's invariants, and optionally repair them (fsck).

Works incrementally, like SCAN: call it with cursor '0', then with the cursor it
returns, until it returns '0'. Each call examines about `count` entries, atomically, so
a bridge can keep running on the topic while it is checked (and repaired).

KEYS: 1 scheduled ZSET, 2 reserved ZSET, 3 jobs HASH, 4 seq STRING (see put.lua), and
  5 damaged HASH  `<prefix>:{<topic>}:damaged`: where repair sets aside what it cannot
                  fix, so nothing is ever deleted. Required (same hash tag as the others).
  and optionally 6 paused STRING, 7 history LIST, 8 failing ZSET (the full list): then
  their types and the `failing` index are checked too.
ARGV:
  1 mode    'report' (change nothing) or 'repair'
  2 cursor  '0' to start, else the cursor the previous call returned
  3 count   1..1000 entries to examine in this call (a SCAN COUNT hint)
Reply: { cursor, examined, problems, damaged }
  cursor    where to continue; '0' when the whole topic was checked
  examined  entries looked at in this call
  problems  array of { kind, id, repaired, detail }; repaired is 1 if this call fixed
            it (mode 'repair'), else 0. Kinds, and what repair does:
    wrong_type         a key (id = scheduled|reserved|jobs|seq|paused|history|failing)
                       holds another Redis type,
                       or seq is not an integer: its DUMP is stored in `damaged` under
                       'key:<name>:<now>' (RESTORE brings it back), then the key is
                       deleted; a new seq starts at the server's now in ms, above every
                       token handed out before. Until repaired, report mode stops here.
    unreadable_record  a record of neither format 1 nor 2 (lua/README.md): moved to
                       `damaged` under 'record:<id>' (the id is taken off both sets and
                       `failing`)
    unindexed          a readable record in neither set (e.g. half-written by a crashed
                       writer, or taken off the schedule by reserve.lua): scheduled again
                       at its record's due time (so due now if that is past; never early)
    in_both            an id in both sets: taken off `scheduled` (the reservation stays;
                       requeue.lua makes it due again if it expires)
    orphan_scheduled   an id in `scheduled` with no record: removed from `scheduled`
    orphan_reserved    an id in `reserved` with no record: removed from `reserved`
    failing_unindexed  (8 keys) a record with a recorded failure missing from `failing`:
                       added at its last_error_at
    orphan_failing     (8 keys) an id in `failing` with no record, or whose record has
                       no failure: removed from `failing`
  Parked jobs are members of `scheduled` (score 10^17) and are sound as such.
  damaged   entries in the `damaged` hash (things set aside, now or earlier)
Errors: INVALID_ARGUMENT (keys, mode, count, cursor); WRONGTYPE only if `damaged`
itself has the wrong type.
Invariant (what a clean run proves): every key has its type, every record is readable,
and an id is in `jobs` exactly when it is in exactly one of `scheduled`, `reserved`.
]]
local scheduled, reserved, jobs, seq, damaged = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local mode, cursor, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
-- >>> shared: copied verbatim from lua/shared.lua by lua/sync-shared.sh (a test checks it) >>>
-- Helpers every script carries, so that each file stays one self-contained EVAL script
-- (see "Redis Functions or EVALSHA" in lua/README.md). Unused ones cost a closure
-- each per call (about 20 ns).

-- Parked jobs wait in `scheduled` at this score: above any due time a script accepts
-- (16 digits at most), so "due up to now" never reaches them.
local PARKED = 1e17
local PARKED_S = '100000000000000000'
local DEFAULT_HISTORY_MAX = 1000

local function fmt(n)
  return string.format('%d', n)
end

-- The Redis server's clock in epoch ms: the one clock every due time refers to.
-- (Arithmetic converts TIME's decimal strings, cheaper than tonumber and math.floor.)
local function now_ms()
  local t = redis.call('TIME')
  local us = t[2] + 0
  return t[1] * 1000 + (us - us % 1000) / 1000
end

-- An integer argument of at most 16 characters (optionally negative), else nil.
local function int_arg(value)
  if type(value) == 'string' and #value <= 16 and string.find(value, '^%-?%d+$') then
    return tonumber(value)
  end
end

-- The full key list (lua/README.md, "Key schema"): 1 scheduled, 2 reserved, 3 jobs,
-- 4 seq, 5 damaged, 6 paused, 7 history, 8 failing, and for put and delete (`fenced`)
-- optionally 9 fence. Version-1 callers pass the first four (check.lua: five) and get
-- the version-1 behaviour. Returns true for the full list, false for the short one,
-- else nil and the error reply to return.
local function full_keys(name, short, fenced)
  if #KEYS == 8 or (fenced and #KEYS == 9) then
    return true
  end
  if short and #KEYS == short then
    return false
  end
  return nil, redis.error_reply('INVALID_ARGUMENT ' .. name .. ' takes ' ..
    (short and (short .. ' or ') or '') .. '8' .. (fenced and ' or 9' or '') .. ' keys, got ' .. #KEYS)
end

-- Ingest fencing (put and delete; lua/README.md, "Fencing"): a write that carries an
-- ingest epoch older than the topic's fence (KEYS[9]) comes from a superseded bridge
-- session, e.g. a request that waited in the network while its commands were
-- redelivered to another bridge, and must not land after the commands that followed
-- it. Returns nil (admitted; a newer epoch raises the fence) or the error reply. No
-- fence key or an empty epoch: unfenced (other clients, the HTTP API).
local function fence_refusal(epoch)
  if #KEYS < 9 or epoch == nil or epoch == '' then
    return nil
  end
  local e = int_arg(epoch)
  if not e or e < 1 then
    return redis.error_reply('INVALID_ARGUMENT epoch must be a positive integer, got ' .. tostring(epoch))
  end
  local fence = tonumber(redis.call('GET', KEYS[9]) or '0')
  if e < fence then
    return redis.error_reply('FENCED ingest epoch ' .. epoch .. ' is older than this topic\'s fence ' ..
      fmt(fence) .. ': a newer bridge session has written here since')
  end
  if e > fence then
    redis.call('SET', KEYS[9], epoch)
  end
  return nil
end

-- A job record of format 1 or 2 as a table, or nil if it is missing or unreadable:
--   1|<due_at>|<attempts>|<token>|<meta length>|<meta><body>
--   2|<due_at>|<attempts>|<token>|<failures>|<error_at>|<spec length>|<error length>|<meta length>|<spec><error><meta><body>
-- The payload is not copied out (bodies may be large): `rec` and `pos` locate
-- <meta><body>, `mlen` is the meta length; `token` stays a string.
local function parse(rec)
  if not rec then
    return nil
  end
  -- Each table is built by one constructor, at its final size: filled field by field it
  -- was rehashed five times, and parse runs for every job of every reserve and release.
  -- The due time and meta length keep their digits as stored (`due_s`, `mlen_s`), and
  -- their values as parsed (`due0`, `mlen0`), so `encode` spells them again only if
  -- they changed: a string.format each is much of what a reserve costs per job.
  if string.byte(rec, 1) == 49 then -- '1'
    local due_s, attempts, token, mlen_s, pos = string.match(rec, '^1|(%d+)|(%d+)|(%d+)|(%d+)|()')
    if not pos then
      return nil
    end
    local due, mlen = tonumber(due_s), tonumber(mlen_s)
    if pos + mlen - 1 > #rec then
      return nil
    end
    return { due = due, attempts = tonumber(attempts), token = token, mlen = mlen,
      failures = 0, error_at = 0, spec = '', err = '', rec = rec, pos = pos,
      due_s = due_s, due0 = due, mlen_s = mlen_s, mlen0 = mlen }
  end
  local due_s, attempts, token, failures, error_at, slen, elen, mlen_s, pos =
    string.match(rec, '^2|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|(%d+)|()')
  if not pos then
    return nil
  end
  slen, elen = tonumber(slen), tonumber(elen)
  local due, mlen, tail = tonumber(due_s), tonumber(mlen_s), pos + slen + elen
  if tail + mlen - 1 > #rec then
    return nil
  end
  return { due = due, attempts = tonumber(attempts), token = token, mlen = mlen,
    failures = tonumber(failures), error_at = tonumber(error_at),
    spec = string.sub(rec, pos, pos + slen - 1), err = string.sub(rec, pos + slen, tail - 1),
    rec = rec, pos = tail, due_s = due_s, due0 = due, mlen_s = mlen_s, mlen0 = mlen }
end

local function meta_of(j)
  return string.sub(j.rec, j.pos, j.pos + j.mlen - 1)
end

local function body_of(j)
  return string.sub(j.rec, j.pos + j.mlen)
end

-- <meta><body>: a new job's, or the stored one.
local function tail_of(j)
  return j.tail or string.sub(j.rec, j.pos)
end

-- The due time's digits: as stored when unchanged since `parse`, else spelled anew.
local function due_digits(j)
  return j.due == j.due0 and j.due_s or fmt(j.due)
end

-- The record of `j`: format 1 unless the job has a schedule spec or a failure on record,
-- so a one-shot job keeps exactly the bytes it had before format 2 existed.
local function encode(j)
  local due_s = due_digits(j)
  local mlen_s = j.mlen == j.mlen0 and j.mlen_s or fmt(j.mlen)
  if j.spec == '' and j.failures == 0 and j.err == '' then
    return '1|' .. due_s .. '|' .. fmt(j.attempts) .. '|' .. j.token .. '|' .. mlen_s .. '|' .. tail_of(j)
  end
  return '2|' .. due_s .. '|' .. fmt(j.attempts) .. '|' .. j.token .. '|' .. fmt(j.failures) .. '|' ..
    fmt(j.error_at) .. '|' .. #j.spec .. '|' .. #j.err .. '|' .. mlen_s .. '|' .. j.spec .. j.err .. tail_of(j)
end

-- The record of a job just put (attempts, token and failures 0, no error): what `encode`
-- gives for it, built without a table because every put runs it. `due_s` is fmt(due).
local function new_record(due_s, spec, meta, body)
  if spec == '' then
    return '1|' .. due_s .. '|0|0|' .. #meta .. '|' .. meta .. body
  end
  return '2|' .. due_s .. '|0|0|0|0|' .. #spec .. '|0|' .. #meta .. '|' .. spec .. meta .. body
end

-- `history_max` argument: absent or '' means the default; else an integer 0..10^6.
-- Returns nil and the error reply to return when it is neither.
local function history_max_arg(value)
  if value == nil or value == '' then
    return DEFAULT_HISTORY_MAX
  end
  local n = int_arg(value)
  if not n or n < 0 or n > 1000000 then
    return nil, redis.error_reply('INVALID_ARGUMENT history_max must be an integer 0..1000000, got ' .. value)
  end
  return n
end

-- One history entry: '<at>|<outcome>|<attempts>|<due_at>|<id length>|<id><detail>'.
-- `at` and `due` may come already spelled (a batch's one `now`, a parsed `due_s`).
local function history_entry(at, outcome, attempts, due, id, detail)
  if type(at) ~= 'string' then
    at = fmt(at)
  end
  if type(due) ~= 'string' then
    due = fmt(due)
  end
  return at .. '|' .. outcome .. '|' .. fmt(attempts) .. '|' .. due .. '|' .. #id .. '|' .. id .. (detail or '')
end

-- Appends entries (oldest first) to the topic's capped history list, newest at the head.
local function history_push(key, max, entries)
  if key and max > 0 and #entries > 0 then
    redis.call('LPUSH', key, unpack(entries))
    redis.call('LTRIM', key, 0, max - 1)
  end
end
-- <<< shared <<<
local full, bad_keys = full_keys('check (scheduled, reserved, jobs, seq, damaged [, paused, history, failing])', 5)
if bad_keys then
  return bad_keys
end
local failing = full and KEYS[8] or nil
if mode ~= 'report' and mode ~= 'repair' then
  return redis.error_reply("INVALID_ARGUMENT mode must be 'report' or 'repair', got " .. tostring(mode))
end
if not count or count ~= math.floor(count) or count < 1 or count > 1000 then
  return redis.error_reply('INVALID_ARGUMENT count must be an integer 1..1000')
end
local phase, at = 'j', '0'
if cursor and cursor ~= '' and cursor ~= '0' then
  phase, at = string.match(cursor, '^([jsrf])(%d+)$')
  if not phase then
    return redis.error_reply('INVALID_ARGUMENT cursor must be 0 or one this script returned, got ' .. cursor)
  end
end
if phase == 'f' and not failing then
  return redis.error_reply('INVALID_ARGUMENT cursor ' .. cursor .. ' needs the full list of 8 keys')
end
local repair = mode == 'repair'
local now = now_ms()
local now_s = fmt(now)

local function key_type(key)
  local reply = redis.call('TYPE', key)
  return reply.ok or reply
end
local damaged_type = key_type(damaged)
if damaged_type ~= 'hash' and damaged_type ~= 'none' then
  return redis.error_reply('WRONGTYPE ' .. damaged .. ' holds a ' .. damaged_type .. ', not a hash: rename it, then check again')
end

local problems = {}
local function problem(kind, id, fixed, detail)
  problems[#problems + 1] = { kind, id, fixed and 1 or 0, detail }
end

local function printable(s)
  return (string.gsub(s, '[^%w%p ]', '?'))
end

-- Sets a value aside in `damaged` without overwriting anything already there.
local function set_aside(field, value)
  if redis.call('HSETNX', damaged, field, value) == 0 then
    local n = 1
    while redis.call('HSETNX', damaged, field .. ':' .. now_s .. ':' .. n, value) == 0 do
      n = n + 1
    end
  end
end

-- 1. Key types (every call: they are cheap and everything below depends on them).
local expected = { { 'scheduled', scheduled, 'zset' }, { 'reserved', reserved, 'zset' },
  { 'jobs', jobs, 'hash' }, { 'seq', seq, 'string' } }
if full then
  expected[5] = { 'paused', KEYS[6], 'string' }
  expected[6] = { 'history', KEYS[7], 'list' }
  expected[7] = { 'failing', failing, 'zset' }
end
local broken = false
for _, k in ipairs(expected) do
  local name, key, want = k[1], k[2], k[3]
  local have = key_type(key)
  local bad = have ~= want and have ~= 'none'
  local detail = 'holds a ' .. have .. ', expected a ' .. want
  if not bad and name == 'seq' and have == 'string' then
    local v = redis.call('GET', seq)
    if not string.match(v, '^%d+$') or #v > 15 then
      bad, detail = true, 'holds "' .. printable(string.sub(v, 1, 40)) .. '", expected an integer'
    end
  end
  if bad then
    if repair then
      set_aside('key:' .. name .. ':' .. now_s, redis.call('DUMP', key))
      redis.call('DEL', key)
      if name == 'seq' then
        redis.call('SET', seq, now_s)
      end
      problem('wrong_type', name, true, detail .. '; DUMP set aside in damaged')
    else
      problem('wrong_type', name, false, detail)
      broken = true
    end
  end
end
if broken then
  return { '0', 0, problems, 0 }
end


local examined, next_at = 0, '0'
if phase == 'j' then
  -- 2. Every record: readable, and in exactly one of the sets.
  local page = redis.call('HSCAN', jobs, at, 'COUNT', count)
  next_at = page[1]
  local entries = page[2]
  for i = 1, #entries, 2 do
    local id, rec = entries[i], entries[i + 1]
    examined = examined + 1
    local j = parse(rec)
    local due = j and fmt(j.due)
    local in_s = redis.call('ZSCORE', scheduled, id)
    local in_r = redis.call('ZSCORE', reserved, id)
    if not due then
      if repair then
        set_aside('record:' .. id, rec)
        redis.call('HDEL', jobs, id)
        redis.call('ZREM', scheduled, id)
        redis.call('ZREM', reserved, id)
        if failing then
          redis.call('ZREM', failing, id)
        end
      end
      problem('unreadable_record', id, repair, 'record starts "' .. printable(string.sub(rec, 1, 24)) .. '"')
    elseif in_s and in_r then
      if repair then
        redis.call('ZREM', scheduled, id)
      end
      problem('in_both', id, repair, 'in scheduled and reserved')
    elseif not in_s and not in_r then
      if repair then
        redis.call('ZADD', scheduled, due, id)
      end
      problem('unindexed', id, repair, 'record due at ' .. due .. ' in neither set')
    end
    if due and failing and j.error_at > 0 and not redis.call('ZSCORE', failing, id) then
      if repair then
        redis.call('ZADD', failing, fmt(j.error_at), id)
      end
      problem('failing_unindexed', id, repair, 'last error at ' .. fmt(j.error_at) .. ' not in failing')
    end
  end
elseif phase == 'f' then
  -- 4. (full key list) Every member of `failing` has a record with a failure.
  local page = redis.call('ZSCAN', failing, at, 'COUNT', count)
  next_at = page[1]
  local entries = page[2]
  for i = 1, #entries, 2 do
    local id = entries[i]
    examined = examined + 1
    local rec = redis.call('HGET', jobs, id)
    local j = parse(rec)
    -- An unreadable record is reported (and set aside) by the records phase.
    if not rec or (j and j.error_at == 0) then
      if repair then
        redis.call('ZREM', failing, id)
      end
      problem('orphan_failing', id, repair, rec and 'record has no failure' or 'no record')
    end
  end
elseif phase == 's' or phase == 'r' then
  -- 3. Every set member has a record.
  local key = phase == 's' and scheduled or reserved
  local page = redis.call('ZSCAN', key, at, 'COUNT', count)
  next_at = page[1]
  local entries = page[2]
  for i = 1, #entries, 2 do
    local id = entries[i]
    examined = examined + 1
    if redis.call('HEXISTS', jobs, id) == 0 then
      if repair then
        redis.call('ZREM', key, id)
      end
      problem(phase == 's' and 'orphan_scheduled' or 'orphan_reserved', id, repair, 'no record')
    end
  end
end

local next_cursor
if next_at ~= '0' then
  next_cursor = phase .. next_at
elseif phase == 'j' then
  next_cursor = 's0'
elseif phase == 's' then
  next_cursor = 'r0'
elseif phase == 'r' and failing then
  next_cursor = 'f0'
else
  next_cursor = '0'
end
return { next_cursor, examined, problems, redis.call('HLEN', damaged) }
