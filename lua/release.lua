--[[ redisched release: reserved jobs were delivered; for each one still ours, delete it
(one-shot) or schedule its next occurrence (recurring), in one atomic step.

KEYS: 1 scheduled ZSET, 2 reserved ZSET, 3 jobs HASH, 4 seq STRING, and optionally
  5 damaged, 6 paused, 7 history LIST, 8 failing ZSET (the full list, see put.lua)
ARGV: id1, lease1 [, id2, lease2 ...] [, history_max]
  1..1000 pairs from reserve.lua replies. `lease` is the reservation's token, or for a
  recurring job `<token>@<next_due>`: next_due is the epoch ms of the series' next
  occurrence, computed by the caller from the job's spec (the first occurrence strictly
  after the server's now, see lua/README.md "Recurring series"); `<token>@-1` ends the
  series (the job is deleted). A next_due for a one-shot job is ignored.
  `<token>@<next_due>+<delay>` (jitter, lua/README.md "Jitter"): the next occurrence
  waits in `scheduled` at next_due + delay (integer ms >= 0) while its record keeps
  next_due, so the series' grid never drifts. Either form may
  end in `;<note>` (at most 100 bytes, e.g. `HTTP 200` from a webhook target): it goes
  into the job's `dispatched` history entry (after the next due time for a series).
  Either form may start with `expired:` (e.g. `expired:17@1000;within 5000 ms`): the
  job was not delivered but set aside as expired (the caller published it elsewhere
  first); it is released exactly the same way (deleted, or a series moved to next_due)
  and logged as `expired` instead of `dispatched`.
  An odd number of arguments: the last one is history_max (8 keys; cap of the topic's
  history list, default 1000, 0 = none); each release is logged as 'dispatched'
  (or 'expired').
Reply: the number of jobs released (deleted or rescheduled).
Errors: INVALID_ARGUMENT (keys; count; a lease that is not `<token>`,
  `<token>@<integer>` or `<token>@<next_due>+<delay>`, each optionally after `expired:`;
  a recurring job, still ours, released without next_due or with a next_due not later
  than the released occurrence's due_at: then nothing at all changes), WRONGTYPE (from
  Redis).
Invariant: only a job that is reserved *and* carries the given token is touched. A late
release, after the reservation expired and the job was requeued (and maybe reserved
again under a new token), or after the job was replaced or deleted by id, changes
nothing. A recurring job leaves `reserved` for `scheduled` at next_due (+ delay) with attempts,
failures and last error reset, in the same step: a crash never loses or doubles it.
]]
local scheduled, reserved, jobs = KEYS[1], KEYS[2], KEYS[3]
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
local full, bad_keys = full_keys('release', 4)
if bad_keys then
  return bad_keys
end
local pairs_end, history_max, bad_history = #ARGV, DEFAULT_HISTORY_MAX, nil
if #ARGV % 2 == 1 then
  pairs_end = #ARGV - 1
  history_max, bad_history = history_max_arg(ARGV[#ARGV])
  if bad_history then
    return bad_history
  end
end
if not full then
  history_max = 0
end
if pairs_end == 0 or pairs_end > 2000 then
  return redis.error_reply('INVALID_ARGUMENT release takes 1..1000 id, token pairs (and an optional history_max)')
end

-- Pass 1 reads and validates everything, so a refusal changes nothing. The records come
-- in one HMGET: a call per job cost more than the command itself.
local ids = {}
for i = 1, pairs_end, 2 do
  ids[#ids + 1] = ARGV[i]
end
local recs = redis.call('HMGET', jobs, unpack(ids))
local plan, seen = {}, {}
for i = 1, pairs_end, 2 do
  local id, lease = ARGV[i], ARGV[i + 1]
  local outcome = 'dispatched'
  local unexpired = string.match(lease, '^expired:(.*)$')
  if unexpired then
    outcome, lease = 'expired', unexpired
  end
  local base, note = string.match(lease, '^([^;]*);(.*)$')
  if base then
    if #note > 100 then
      return redis.error_reply('INVALID_ARGUMENT a release note is at most 100 bytes')
    end
    lease = base
  end
  -- The forms exclude each other; a one-shot job's bare token is the common one.
  local token = string.match(lease, '^(%d+)$')
  local next_s, delay_s
  if not token then
    token, next_s = string.match(lease, '^(%d+)@(%-?%d+)$')
  end
  if not token then
    token, next_s, delay_s = string.match(lease, '^(%d+)@(%d+)%+(%d+)$')
  end
  if not token or (next_s and #next_s > 16) or (delay_s and #delay_s > 13) then
    return redis.error_reply('INVALID_ARGUMENT lease must be <token>, <token>@<next_due> or ' ..
      '<token>@<next_due>+<delay>, got ' .. lease)
  end
  local next_due = next_s and tonumber(next_s)
  if next_due and next_due < -1 then
    return redis.error_reply('INVALID_ARGUMENT next_due must be -1 (end the series) or epoch ms, got ' .. next_s)
  end
  if not seen[id] then
    local j = parse(recs[(i + 1) / 2])
    -- ZSCORE per job rather than one ZMSCORE: a least-privilege user (README, "Security")
    -- may allow only the commands listed there, and an upgrade must not need a new one.
    if j and j.token == token and redis.call('ZSCORE', reserved, id) then
      seen[id] = true
      if j.spec ~= '' and next_due ~= -1 then
        if not next_due then
          return redis.error_reply('INVALID_ARGUMENT job ' .. id .. ' is recurring: release it with <token>@<next_due>')
        end
        if next_due <= j.due then
          return redis.error_reply('INVALID_ARGUMENT next_due ' .. next_s .. ' of job ' .. id ..
            ' is not later than its occurrence due at ' .. fmt(j.due))
        end
        j.next = next_due
        j.delay = delay_s and tonumber(delay_s) or 0
      end
      plan[#plan + 1] = { id, j, note, outcome }
    end
  end
end

local now = history_max > 0 and fmt(now_ms()) or '0'
-- The removals go in one call per key after the loop (ids in `plan` are distinct).
local log, released, failed, deleted = {}, {}, {}, {}
for _, step in ipairs(plan) do
  local id, j, note, outcome = step[1], step[2], step[3], step[4]
  released[#released + 1] = id
  if full and j.error_at > 0 then
    failed[#failed + 1] = id
  end
  local detail = ''
  if j.next then
    detail = fmt(j.next)
    local occurrence, attempts = j.due, j.attempts
    j.due, j.attempts, j.failures, j.error_at, j.err = j.next, 0, 0, 0, ''
    redis.call('HSET', jobs, id, encode(j))
    redis.call('ZADD', scheduled, j.delay > 0 and fmt(j.next + j.delay) or detail, id)
    j.due, j.attempts = occurrence, attempts
  else
    deleted[#deleted + 1] = id
  end
  if note then
    detail = detail == '' and note or (detail .. ' ' .. note)
  end
  if history_max > 0 then
    log[#log + 1] = history_entry(now, outcome, j.attempts, due_digits(j), id, detail)
  end
end
if #released > 0 then
  redis.call('ZREM', reserved, unpack(released))
end
if #failed > 0 then
  redis.call('ZREM', KEYS[8], unpack(failed))
end
if #deleted > 0 then
  redis.call('HDEL', jobs, unpack(deleted))
end
history_push(KEYS[7], history_max, log)
return #plan
