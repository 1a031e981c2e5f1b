--[[ redisched check: verify one topic's invariants, and optionally repair them (fsck).

Works incrementally, like SCAN: call it with cursor '0', then with the cursor it
returns, until it returns '0'. Each call examines about `count` entries, atomically, so
a bridge can keep running on the topic while it is checked (and repaired).

KEYS: 1 scheduled ZSET, 2 reserved ZSET, 3 jobs HASH, 4 seq STRING (see put.lua), and
  5 damaged HASH  `<prefix>:{<topic>}:damaged`: where repair sets aside what it cannot
                  fix, so nothing is ever deleted. Required (same hash tag as the others).
ARGV:
  1 mode    'report' (change nothing) or 'repair'
  2 cursor  '0' to start, else the cursor the previous call returned
  3 count   1..1000 entries to examine in this call (a SCAN COUNT hint)
Reply: { cursor, examined, problems, damaged }
  cursor    where to continue; '0' when the whole topic was checked
  examined  entries looked at in this call
  problems  array of { kind, id, repaired, detail }; repaired is 1 if this call fixed
            it (mode 'repair'), else 0. Kinds, and what repair does:
    wrong_type         a key (id = scheduled|reserved|jobs|seq) holds another Redis type,
                       or seq is not an integer: its DUMP is stored in `damaged` under
                       'key:<name>:<now>' (RESTORE brings it back), then the key is
                       deleted; a new seq starts at the server's now in ms, above every
                       token handed out before. Until repaired, report mode stops here.
    unreadable_record  a record that is not '1|due|attempts|token|mlen|meta body': moved
                       to `damaged` under 'record:<id>' (the id is taken off both sets)
    unindexed          a readable record in neither set (e.g. half-written by a crashed
                       writer, or taken off the schedule by reserve.lua): scheduled again
                       at its record's due time (so due now if that is past; never early)
    in_both            an id in both sets: taken off `scheduled` (the reservation stays;
                       requeue.lua makes it due again if it expires)
    orphan_scheduled   an id in `scheduled` with no record: removed from `scheduled`
    orphan_reserved    an id in `reserved` with no record: removed from `reserved`
  damaged   entries in the `damaged` hash (things set aside, now or earlier)
Errors: INVALID_ARGUMENT; WRONGTYPE only if `damaged` itself has the wrong type.
Invariant (what a clean run proves): every key has its type, every record is readable,
and an id is in `jobs` exactly when it is in exactly one of `scheduled`, `reserved`.
]]
local scheduled, reserved, jobs, seq, damaged = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local mode, cursor, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
if #KEYS ~= 5 then
  return redis.error_reply('INVALID_ARGUMENT check takes 5 keys (scheduled, reserved, jobs, seq, damaged), got ' .. #KEYS)
end
if mode ~= 'report' and mode ~= 'repair' then
  return redis.error_reply("INVALID_ARGUMENT mode must be 'report' or 'repair', got " .. tostring(mode))
end
if not count or count ~= math.floor(count) or count < 1 or count > 1000 then
  return redis.error_reply('INVALID_ARGUMENT count must be an integer 1..1000')
end
local phase, at = 'j', '0'
if cursor and cursor ~= '' and cursor ~= '0' then
  phase, at = string.match(cursor, '^([jsr])(%d+)$')
  if not phase then
    return redis.error_reply('INVALID_ARGUMENT cursor must be 0 or one this script returned, got ' .. cursor)
  end
end
local repair = mode == 'repair'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_s = string.format('%d', now)

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

-- A record's due time, or nil if it is unreadable.
local function readable(rec)
  local due, _, _, mlen, pos = string.match(rec, '^1|(%d+)|(%d+)|(%d+)|(%d+)|()')
  if pos and pos + tonumber(mlen) - 1 <= #rec then
    return due
  end
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
    local due = readable(rec)
    local in_s = redis.call('ZSCORE', scheduled, id)
    local in_r = redis.call('ZSCORE', reserved, id)
    if not due then
      if repair then
        set_aside('record:' .. id, rec)
        redis.call('HDEL', jobs, id)
        redis.call('ZREM', scheduled, id)
        redis.call('ZREM', reserved, id)
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
else
  next_cursor = '0'
end
return { next_cursor, examined, problems, redis.call('HLEN', damaged) }
