--[[ redisched put: schedule a job, or replace one by id.

KEYS (all under one hash tag, see lua/README.md):
  1 scheduled  ZSET  id -> due time (epoch ms)
  2 reserved   ZSET  id -> reservation deadline (epoch ms)
  3 jobs       HASH  id -> job record
  4 seq        STRING reservation token counter (unused here; passed so every script
                      takes the same four keys)
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
Reply: { status, due_at } where status is
  'scheduled'  a new job was stored,
  'replaced'   mode 'replace' overwrote an existing job (scheduled or reserved),
  'duplicate'  mode 'nx' found the id (scheduled or reserved) and changed nothing;
               due_at is then the existing job's due time (its current place in
               `scheduled`, which a retry or requeue may have moved, else the due
               time in its record).
Errors: INVALID_ARGUMENT, BODY_TOO_LARGE, DELAY_TOO_LONG, CORRUPT_RECORD.
Invariant: an id is in `jobs` exactly when it is in exactly one of `scheduled`,
`reserved`. Replacing a reserved job resets its token, so a late release or retry for
the old reservation cannot touch the new job.
]]
local scheduled, reserved, jobs = KEYS[1], KEYS[2], KEYS[3]
local id, body, meta, mode = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local when_kind, when = ARGV[5], ARGV[6]

-- True for 1..256 bytes of UTF-8 without control characters (C0, DEL, C1), the same
-- rule as JobId in src/job.rs. ASCII ids (the common case) take the fast path.
local function valid_id(s)
  if type(s) ~= 'string' or #s == 0 or #s > 256 or string.find(s, '%c') then
    return false
  end
  if not string.find(s, '[\128-\255]') then
    return true
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

local function int_arg(value)
  if type(value) == 'string' and #value <= 16 and string.match(value, '^%-?%d+$') then
    return tonumber(value)
  end
end

if #KEYS ~= 4 then
  return redis.error_reply('INVALID_ARGUMENT put takes 4 keys, got ' .. #KEYS)
end
if #ARGV < 8 then
  return redis.error_reply('INVALID_ARGUMENT put takes 8 or 9 arguments, got ' .. #ARGV)
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
if #body > max_body then
  return redis.error_reply('BODY_TOO_LARGE body is ' .. #body .. ' bytes, the limit is ' .. max_body)
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
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

local existing = redis.call('HGET', jobs, id)
if existing then
  if mode == 'nx' then
    local old_due = string.match(existing, '^1|(%d+)|')
    if not old_due then
      return redis.error_reply('CORRUPT_RECORD job ' .. id .. ' has an unreadable record')
    end
    local current = redis.call('ZSCORE', scheduled, id)
    return { 'duplicate', tonumber(current or old_due) }
  end
  redis.call('ZREM', reserved, id)
end

-- Record: '1|<due_at>|<attempts>|<token>|<meta length>|' .. meta .. body
local due_s = string.format('%d', due)
redis.call('HSET', jobs, id, '1|' .. due_s .. '|0|0|' .. #meta .. '|' .. meta .. body)
redis.call('ZADD', scheduled, due_s, id)

local channel = ARGV[9]
if channel and #channel > 0 then
  local head = redis.call('ZRANGE', scheduled, 0, 0)
  if head[1] == id then
    redis.call('PUBLISH', channel, due_s .. '|' .. (string.match(scheduled, '{(.-)}') or ''))
  end
end

if existing then
  return { 'replaced', due }
end
return { 'scheduled', due }
