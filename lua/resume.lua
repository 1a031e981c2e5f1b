--[[ redisched resume: dispatch a paused topic again, and wake the dispatchers.

KEYS: the full list of 8 (see put.lua): 1 scheduled, 2 reserved, 3 jobs, 4 seq,
  5 damaged, 6 paused STRING, 7 history, 8 failing.
ARGV:
  1 channel  optional Pub/Sub channel (normally `<prefix>:notify`) told
             '<due_at>|<topic>' (the topic's earliest waiting job) when the topic was
             paused and has jobs waiting; '' or absent to stay silent
Reply: 1 if the topic was paused and now runs, 0 if it was not paused.
Errors: INVALID_ARGUMENT (not 8 keys), WRONGTYPE (from Redis).
Invariant: after it, reserve.lua takes the topic's due jobs again (the backlog first,
earliest first, `limit` per call as for any topic, so other topics are not starved).
]]
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
local _, bad_keys = full_keys('resume')
if bad_keys then
  return bad_keys
end
if redis.call('DEL', KEYS[6]) == 0 then
  return 0
end
local channel = ARGV[1]
if channel and #channel > 0 then
  local head = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. PARKED_S, 'WITHSCORES', 'LIMIT', 0, 1)
  if head[2] then
    redis.call('PUBLISH', channel, fmt(tonumber(head[2])) .. '|' .. (string.match(KEYS[1], '{(.-)}') or ''))
  end
end
return 1
