--[[ redisched redrive_window: make due now the parked jobs of a topic whose last failure
falls in a time window, a bounded step at a time with a cursor.

A step walks the topic's `failing` index (id -> last_error_at) in (score, id) order from
the window's start and examines at most `count` of its entries; each examined job that is
parked (in `scheduled` at 10^17) is made due now, exactly as redrive.lua moves one. A job
failing but not parked (it waits for a retry) is passed over.

KEYS: the full list of 8 (see put.lua): 1 scheduled, 2 reserved, 3 jobs, 4 seq,
  5 damaged, 6 paused, 7 history LIST, 8 failing ZSET.
ARGV:
  1 since_ms     integer 0..9999999999999999: the window's start, epoch ms (included)
  2 until_ms     integer since_ms..9999999999999999: its end, epoch ms (included); ''
                 for the server's now. A client that loops should fix it once: a job
                 re-driven that fails again meanwhile then stays out of the window
  3 cursor       '' for the first step, else the `cursor` of the previous reply
  4 count        optional, 1..1000 (default 100): `failing` entries examined at most
  5 channel      optional Pub/Sub channel told '<now>|<topic>' when jobs were moved;
                 '' or absent to stay silent
  6 history_max  optional: cap of the topic's history list, default 1000, 0 = none;
                 each job is logged as 're-driven'
Reply: { moved, scanned, cursor } — jobs made due now by this step, `failing` entries it
  examined, and the cursor of the next step: '' when the window is done.
Errors: INVALID_ARGUMENT (not 8 keys, since_ms, until_ms, since_ms after until_ms,
  cursor, count, history_max), WRONGTYPE (from Redis).
Invariant: as redrive.lua: a re-driven job keeps its record (attempts, failures and
last error kept; its `failing` entry too) and moves from the parked range of `scheduled`
to the server's now; it is still in exactly one set. A paused topic's re-driven jobs wait
for resume.lua. Bounded: one step costs O(log N) to find its start plus `count` entries
(O(log^2 N) when the cursor's own entry left `failing` or moved, see below).
Cursor: '<last_error_at>:<id>' of the last entry examined. The next step starts right
after it in (score, id) order, also when that job was deleted or failed again in between
(its place is found again by a binary search over the ranks of its score). A step may
be repeated (a client retry): a job it moved is no longer parked and is passed over.
]]
local scheduled, jobs, failing = KEYS[1], KEYS[3], KEYS[8]
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
local _, bad_keys = full_keys('redrive_window')
if bad_keys then
  return bad_keys
end
local MAX_MS = 9999999999999999

-- A time argument 0..MAX_MS, else nil.
local function time_arg(value)
  local n = int_arg(value)
  if n and n >= 0 and n <= MAX_MS then
    return n
  end
end

local since = time_arg(ARGV[1])
if not since then
  return redis.error_reply('INVALID_ARGUMENT since_ms must be an integer 0..' .. fmt(MAX_MS) ..
    ', got ' .. tostring(ARGV[1]))
end
local now = now_ms()
local until_ms = now
if ARGV[2] and ARGV[2] ~= '' then
  until_ms = time_arg(ARGV[2])
  if not until_ms then
    return redis.error_reply('INVALID_ARGUMENT until_ms must be an integer 0..' .. fmt(MAX_MS) ..
      ' or empty for now, got ' .. ARGV[2])
  end
end
if since > until_ms then
  return redis.error_reply('INVALID_ARGUMENT since_ms ' .. fmt(since) .. ' is after until_ms ' ..
    fmt(until_ms))
end
local cursor = ARGV[3] or ''
local after_score, after_id
if cursor ~= '' then
  local score_s, id = string.match(cursor, '^(%d+):(.+)$')
  after_score = time_arg(score_s)
  if not after_score then
    return redis.error_reply('INVALID_ARGUMENT cursor must be \'\' or a reply\'s cursor (<ms>:<id>), got ' ..
      cursor)
  end
  after_id = id
end
local count = 100
if ARGV[4] and ARGV[4] ~= '' then
  count = int_arg(ARGV[4])
  if not count or count < 1 or count > 1000 then
    return redis.error_reply('INVALID_ARGUMENT count must be an integer 1..1000, got ' .. ARGV[4])
  end
end
local history_max, bad_history = history_max_arg(ARGV[6])
if bad_history then
  return bad_history
end

-- Whether `a` sorts after `b` as Redis orders equal scores: bytewise, a prefix first.
-- (Lua's own `>` on strings follows the server's locale.)
local function bytes_after(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then
      return x > y
    end
  end
  return #a > #b
end

-- The rank this step starts at: the window's first entry, or the first after the cursor.
local function start_rank()
  if not after_score then
    return redis.call('ZCOUNT', failing, '-inf', '(' .. fmt(since))
  end
  local score = tonumber(redis.call('ZSCORE', failing, after_id))
  if score == after_score then
    return redis.call('ZRANK', failing, after_id) + 1
  end
  -- The cursor's entry left or moved: among the entries of its score (ranks lo..hi-1,
  -- ordered by id), the first whose id sorts after it.
  local lo = redis.call('ZCOUNT', failing, '-inf', '(' .. fmt(after_score))
  local hi = redis.call('ZCOUNT', failing, '-inf', fmt(after_score))
  while lo < hi do
    local mid = lo + math.floor((hi - lo) / 2)
    local member = redis.call('ZRANGE', failing, mid, mid)[1]
    if bytes_after(member, after_id) then
      hi = mid
    else
      lo = mid + 1
    end
  end
  return lo
end

local first = start_rank()
local page = redis.call('ZRANGE', failing, first, first + count - 1, 'WITHSCORES')
local index, log, scanned, next_cursor = {}, {}, 0, ''
local now_s = fmt(now)
for i = 1, #page, 2 do
  local id, score = page[i], tonumber(page[i + 1])
  if score > until_ms then
    break
  end
  scanned = scanned + 1
  local at = tonumber(redis.call('ZSCORE', scheduled, id))
  if score >= since and at and at >= PARKED then
    index[#index + 1] = now_s
    index[#index + 1] = id
    local j = parse(redis.call('HGET', jobs, id)) or { attempts = 0, due = 0 }
    log[#log + 1] = history_entry(now_s, 're-driven', j.attempts, j.due, id)
  end
  if scanned == count then
    next_cursor = fmt(score) .. ':' .. id
  end
end
if #index > 0 then
  redis.call('ZADD', scheduled, unpack(index))
  history_push(KEYS[7], history_max, log)
  local channel = ARGV[5]
  if channel and #channel > 0 then
    redis.call('PUBLISH', channel, now_s .. '|' .. (string.match(scheduled, '{(.-)}') or ''))
  end
end
return { #index / 2, scanned, next_cursor }
