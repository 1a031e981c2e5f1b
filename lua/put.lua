--[[ redisched put: schedule a job, or replace one by id.

KEYS (all under one hash tag, see lua/README.md), 4, 8 or 9:
  1 scheduled  ZSET  id -> due time (epoch ms); parked jobs at 10^17
  2 reserved   ZSET  id -> reservation deadline (epoch ms)
  3 jobs       HASH  id -> job record (format 1 or 2, lua/README.md)
  4 seq        STRING reservation token counter (unused here; passed so every script
                      takes the same keys)
  5 damaged, 6 paused (unused here), 7 history LIST, 8 failing ZSET: the full list;
                      with only the first four no history is written
  9 fence      STRING optional: the topic's ingest fence (highest ingest epoch seen)
ARGV:
  1 id            1..256 bytes of UTF-8 text without control characters (the rule of
                  the Rust JobId); anything else is refused, so every client can read
                  back every id it is handed
  2 body          any bytes, stored verbatim
  3 meta          opaque bytes forwarded with the job ('' for none)
  4 mode          'nx' (keep an existing job with this id) or 'replace'
  5 when_kind     'delay' (ARGV[6] is ms from the server's now; <= 0 means now)
                  or 'at' (ARGV[6] is epoch ms; a past time means now)
  6 when          integer
  7 max_delay_ms  a due time further than this from now is refused
  8 max_body      bodies longer than this many bytes are refused
  9 channel       Pub/Sub channel told '<due_at>|<topic>' when this job becomes the
                  topic's earliest; '' to stay silent
  10 spec         optional: the job's schedule spec, 1..256 bytes without control
                  characters, opaque here (convention: 'every:<ms>' or
                  'cron:<expr>|<tz>'); '' or absent for a one-shot job. A job with a
                  spec is a recurring series: release.lua reschedules it
  11 history_max  optional (8 keys): cap of the topic's history list, default 1000,
                  0 = write none; a replace is logged as 'replaced'
  12 epoch        optional (9 keys): the writer's ingest epoch, a positive integer;
                  refused (FENCED) if older than the fence, else raises it. '' or
                  absent: unfenced
  13 jitter_ms    optional: 0..10^12, only with a spec ('' or 0: none). The first
                  occurrence waits in `scheduled` at due + delay, where delay =
                  FNV-1a-32(topic .. '\0' .. id .. '\0' .. due) mod jitter_ms (due in
                  decimal; lua/README.md "Jitter"); the record keeps due itself, so a
                  series' grid never drifts. The caller bounds jitter_ms so that
                  due + delay stays before the series' next occurrence
Reply: { status, due_at } (due_at: the unjittered due time) where status is
  'scheduled'  a new job was stored,
  'replaced'   mode 'replace' overwrote an existing job (scheduled, reserved or
               parked): body, meta, spec, due time; attempts, failures, last error
               and token reset,
  'duplicate'  mode 'nx' found the id (scheduled or reserved) and changed nothing;
               due_at is then the existing job's due time (its current place in
               `scheduled`, which a retry or requeue may have moved, else the due
               time in its record, also for a parked job).
Errors: INVALID_ARGUMENT (keys, id, mode, when, limits, spec, history_max, jitter_ms
out of range or without a spec),
BODY_TOO_LARGE, DELAY_TOO_LONG, CORRUPT_RECORD (mode 'nx' on an unreadable record),
FENCED (epoch older than the topic's fence: nothing written),
WRONGTYPE (from Redis: a key holds another type).
Invariant: an id is in `jobs` exactly when it is in exactly one of `scheduled`,
`reserved`. Replacing a reserved job resets its token, so a late release or retry for
the old reservation cannot touch the new job.
]]
local scheduled, reserved, jobs = KEYS[1], KEYS[2], KEYS[3]
local id, body, meta, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local when_kind, when = ARGV[5], ARGV[6]
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

-- FNV-1a, 32 bits, of `s` (offset basis 2166136261, prime 16777619 = 2^24 + 403), exact
-- in Lua's doubles: the XOR touches the low byte only, and h * prime mod 2^32 is
-- (h mod 2^8) * 2^24 + h * 403 mod 2^32, every term below 2^42. The bridge computes the
-- same (src/job/schedule.rs, jitter_delay) for the occurrences it releases.
local function fnv1a32(s)
  local h = 2166136261
  for i = 1, #s do
    local low = h % 256
    h = h - low + bit.bxor(low, string.byte(s, i))
    h = ((h % 256) * 16777216 + h * 403) % 4294967296
  end
  return h
end

-- True for 1..256 bytes of UTF-8 without control characters (C0, DEL, C1), the same
-- rule as JobId in src/job.rs. ASCII ids (the common case) take the fast path.
local function valid_id(s)
  if type(s) ~= 'string' or #s == 0 or #s > 256 then
    return false
  end
  -- Printable ASCII, the common id, passes in one anchored scan (the cheapest pattern
  -- form in Lua); anything else is checked byte by byte.
  if string.find(s, '^[ -~]+$') then
    return true
  end
  if string.find(s, '%c') then
    return false
  end
  local i, n = 1, #s
  while i <= n do
    local c = string.byte(s, i)
    local len
    if c < 0x80 then
      len = 1
    elseif c >= 0xC2 and c <= 0xDF then
      len = 2
    elseif c >= 0xE0 and c <= 0xEF then
      len = 3
    elseif c >= 0xF0 and c <= 0xF4 then
      len = 4
    else
      return false
    end
    for k = i + 1, i + len - 1 do
      local cc = string.byte(s, k)
      if not cc or cc < 0x80 or cc > 0xBF then
        return false
      end
    end
    local c2 = string.byte(s, i + 1)
    if (c == 0xC2 and c2 <= 0x9F) or (c == 0xE0 and c2 < 0xA0) or (c == 0xED and c2 > 0x9F)
      or (c == 0xF0 and c2 < 0x90) or (c == 0xF4 and c2 > 0x8F) then
      return false
    end
    i = i + len
  end
  return true
end

local full, bad_keys = full_keys('put', 4, true)
if bad_keys then
  return bad_keys
end
if #ARGV < 8 or #ARGV > 13 then
  return redis.error_reply('INVALID_ARGUMENT put takes 8 to 13 arguments, got ' .. #ARGV)
end
if not valid_id(id) then
  return redis.error_reply('INVALID_ARGUMENT id must be 1..256 bytes of UTF-8 without control characters')
end
if mode ~= 'nx' and mode ~= 'replace' then
  return redis.error_reply("INVALID_ARGUMENT mode must be 'nx' or 'replace', got " .. tostring(mode))
end
if when_kind ~= 'delay' and when_kind ~= 'at' then
  return redis.error_reply("INVALID_ARGUMENT when_kind must be 'delay' or 'at', got " .. tostring(when_kind))
end
local when_ms, max_delay, max_body = int_arg(when), int_arg(ARGV[7]), int_arg(ARGV[8])
if not (when_ms and max_delay and max_body) then
  return redis.error_reply('INVALID_ARGUMENT when, max_delay_ms and max_body must be integers')
end
local spec = ARGV[10] or ''
if #spec > 256 or string.find(spec, '%c') then
  return redis.error_reply('INVALID_ARGUMENT spec must be at most 256 bytes without control characters')
end
local history_max, bad_history = history_max_arg(ARGV[11])
if bad_history then
  return bad_history
end
local jitter = 0
if ARGV[13] and ARGV[13] ~= '' then
  jitter = int_arg(ARGV[13])
  if not jitter or jitter < 0 or jitter > 1000000000000 then
    return redis.error_reply('INVALID_ARGUMENT jitter_ms must be an integer 0..1000000000000, got ' .. ARGV[13])
  end
  if jitter > 0 and spec == '' then
    return redis.error_reply('INVALID_ARGUMENT jitter_ms is only for a recurring job (give a spec)')
  end
end
if #body > max_body then
  return redis.error_reply('BODY_TOO_LARGE body is ' .. #body .. ' bytes, the limit is ' .. max_body)
end

local now = now_ms()
local due
if when_kind == 'delay' then
  due = now + math.max(when_ms, 0)
else
  due = math.max(when_ms, now)
end
if due - now > max_delay then
  return redis.error_reply('DELAY_TOO_LONG due in ' .. string.format('%d', due - now) ..
    ' ms, the limit is ' .. string.format('%d', max_delay) .. ' ms')
end
local fenced = fence_refusal(ARGV[12])
if fenced then
  return fenced
end

-- The common case, a new id put with 'nx', writes its record in the same call that
-- checks for the id (HSETNX); a duplicate is the rare case that reads the record.
local due_s = fmt(due)
local record = new_record(due_s, spec, meta, body)
-- The place in `scheduled`: the due time, plus the first occurrence's jitter.
local score_s = due_s
if jitter > 0 then
  local topic = string.match(scheduled, '{(.-)}') or ''
  score_s = fmt(due + fnv1a32(topic .. '\0' .. id .. '\0' .. due_s) % jitter)
end
local existing = false
if mode == 'nx' then
  if redis.call('HSETNX', jobs, id, record) == 0 then
    local old = parse(redis.call('HGET', jobs, id))
    if not old then
      return redis.error_reply('CORRUPT_RECORD job ' .. id .. ' has an unreadable record')
    end
    local current = tonumber(redis.call('ZSCORE', scheduled, id))
    if not current or current >= PARKED then
      current = old.due
    end
    return { 'duplicate', current }
  end
else
  existing = redis.call('HGET', jobs, id)
  if existing then
    redis.call('ZREM', reserved, id)
    if full then
      redis.call('ZREM', KEYS[8], id)
      -- A damaged record is replaced all the same (that is how to repair one).
      local old = parse(existing) or { attempts = 0 }
      history_push(KEYS[7], history_max, { history_entry(now, 'replaced', old.attempts, due, id) })
    end
  end
  redis.call('HSET', jobs, id, record)
end
redis.call('ZADD', scheduled, score_s, id)

-- Rank 0 after the ZADD: this job is now the topic's earliest (ZRANK answers a number,
-- cheaper to hand to Lua than the member list ZRANGE would).
local channel = ARGV[9]
if channel and #channel > 0 and redis.call('ZRANK', scheduled, id) == 0 then
  redis.call('PUBLISH', channel, score_s .. '|' .. (string.match(scheduled, '{(.-)}') or ''))
end

if existing then
  return { 'replaced', due }
end
return { 'scheduled', due }
