--[[ redisched reserve: take up to `limit` due jobs for delivery, under a time-to-run.

KEYS: 1 scheduled ZSET, 2 reserved ZSET, 3 jobs HASH, 4 seq STRING, and optionally
  5 damaged, 6 paused STRING, 7 history, 8 failing (the full list, see put.lua), and
  optionally after them 9 rate HASH (the topic's rate limit and its state). With the
  full list a paused topic gives nothing (see pause.lua); with four keys the pause is
  not seen (version-1 callers). Only with the ninth key is a rate limit seen.
ARGV:
  1 ttr_ms  integer 1..10^12; the reservation lasts this long; after it, requeue.lua makes the job due again
  2 limit   1..1000 jobs at most
  3 max     optional epoch ms (integer, '' for none): take only jobs due at or before
            min(max, now), e.g. to stop at a time the caller planned for
  4 max_per_second  optional (nine keys), the caller's default limit when `rate` holds
            none (a policy of its configuration): a decimal 0.001..1000000, '' for none
  5 burst   with 4: integer 1..1000000
  6 format  optional: '' (default) or 'msgpack'; with 'msgpack', `jobs` is one bulk
            string, the MessagePack encoding (Redis's built-in cmsgpack) of the same
            array of arrays, so a client parses one string rather than 7 values per job
  7 retry_cap optional (full key list): '' (default) or an integer 0..1000: take at most
            this many retries (jobs reserved before: attempt > 1 on this reservation);
            due retries past the cap are skipped and stay scheduled, so first attempts
            behind them are reached, looking at no more than limit + 1000 due jobs
Reply: { now, next_due, jobs, corrupt, paused [, throttled, next_token] [, held, unseen] }
  now       the server's clock, epoch ms
  next_due  due time of the earliest job still scheduled (parked jobs excluded), or -1
            when none is left, or when the topic is paused
  jobs      array of { id, due_at, attempt, token, meta, body, spec }; attempt counts
            reservations (of this occurrence for a recurring job), 1 on the first;
            token identifies this reservation and must be given back to release.lua
            or retry.lua; spec is the job's schedule spec, '' for a one-shot job (the
            caller computes the next occurrence from it for release.lua)
  corrupt   ids whose record was missing or unreadable: taken off the schedule (their
            record, if any, is kept for `redisched check`) so they cannot block the topic
  paused    1 if the topic is paused (then jobs is empty), else 0
  throttled (nine keys) due jobs the rate limit held back in this call, 0 if it held
            back none
  next_token (nine keys) epoch ms from which the limit lets the next job go (now if it
            would at once), -1 when no limit applies: a caller plans the topic for
            max(next_due, next_token)
  held      (retry_cap) due retries the cap skipped in this call (they stay scheduled);
            with retry_cap the reply always has all nine fields (throttled 0 and
            next_token -1 without the ninth key)
  unseen    (retry_cap) 1 if due jobs this call did not look at may wait (it stopped at
            limit or at the bound of its scan), 0 if it saw every due job: then no first
            attempt was left due, and a caller may take the held retries after all
  With four keys the reply has the version-1 shape: { now, next_due, jobs, corrupt },
  jobs without spec.
Rate limit: a GCRA (token bucket) on the server's clock: `max_per_second` jobs per
  second on average, up to `burst` at once after an idle spell; in any window of w
  seconds at most burst + max_per_second * w jobs are taken, by all callers together.
  The live limit (fields max_per_second, burst of `rate`, written by rate_limit.lua)
  overrides ARGV 4-5; the state (field tat) lives in the same hash.
Errors: INVALID_ARGUMENT (keys, ttr_ms, limit, max, max_per_second, burst, format,
  retry_cap, or retry_cap with four keys), WRONGTYPE
  (from Redis).
Invariant: each job moves from `scheduled` to `reserved` atomically; a job is never
taken before its due time by the server's clock; tokens are unique per topic; parked
jobs (score 10^17) and paused topics are never taken; the limit holds for the sum of
all callers that pass the ninth key; within a topic jobs are taken earliest first
(with retry_cap: earliest first among first attempts and the retries the cap admits).
]]
local scheduled, reserved, jobs, seq = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ttr, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
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
-- A rate in jobs per second: a decimal 0.001..1000000 of at most 16 characters, else nil
-- (also in rate_limit.lua; kept out of shared.lua so other scripts do not carry it).
local function rate_arg(value)
  if type(value) == 'string' and #value <= 16 and
    (string.find(value, '^%d+%.?%d*$') or string.find(value, '^%.%d+$')) then
    local r = tonumber(value)
    if r and r >= 0.001 and r <= 1000000 then
      return r
    end
  end
end
local full, bad_keys = full_keys('reserve', 4, true)
if bad_keys then
  return bad_keys
end
if not ttr or ttr ~= math.floor(ttr) or ttr < 1 or ttr > 1e12
  or not limit or limit ~= math.floor(limit) or limit < 1 or limit > 1000 then
  return redis.error_reply('INVALID_ARGUMENT ttr_ms must be an integer 1..10^12 and limit 1..1000')
end
local max = nil
if ARGV[3] and #ARGV[3] > 0 then
  max = int_arg(ARGV[3])
  if not max then
    return redis.error_reply('INVALID_ARGUMENT max must be an integer (epoch ms) or empty, got ' .. ARGV[3])
  end
end

-- Lanes (ARGV 7): the most retries this call may take, nil for no cap.
local cap = nil
if ARGV[7] and ARGV[7] ~= '' then
  cap = int_arg(ARGV[7])
  if not cap or cap < 0 or cap > 1000 then
    return redis.error_reply('INVALID_ARGUMENT retry_cap must be an integer 0..1000 or empty, got ' .. ARGV[7])
  end
  if not full then
    return redis.error_reply('INVALID_ARGUMENT retry_cap needs the full key list (8 or 9 keys)')
  end
end
-- Due retries a capped scan may skip past, beyond `limit`: the bound of its work.
local SKIP_MAX = 1000

-- The rate limit in force: the live one stored in KEYS[9], else the caller's default.
local packed = false
if ARGV[6] and ARGV[6] ~= '' then
  if ARGV[6] ~= 'msgpack' then
    return redis.error_reply('INVALID_ARGUMENT format must be msgpack or empty, got ' .. ARGV[6])
  end
  packed = true
end
-- The reply's `jobs` in the format asked for (ARGV 6).
local function jobs_reply(list)
  if packed then
    return cmsgpack.pack(list)
  end
  return list
end

local rate_key = KEYS[9]
local interval, burst, live
if rate_key then
  local stored = redis.call('HMGET', rate_key, 'max_per_second', 'burst', 'tat')
  local per_s, b = stored[1], stored[2]
  live = per_s ~= false
  if not live and ARGV[4] and ARGV[4] ~= '' then
    per_s, b = ARGV[4], ARGV[5]
  end
  if per_s then
    local r, n = rate_arg(per_s), int_arg(b)
    if not r or not n or n < 1 or n > 1000000 then
      return redis.error_reply('INVALID_ARGUMENT max_per_second must be a decimal 0.001..1000000 and burst an integer 1..1000000, got '
        .. tostring(per_s) .. ' and ' .. tostring(b))
    end
    interval, burst = 1000 / r, n
    rate_key = { key = rate_key, tat = tonumber(stored[3] or '') }
  end
end

local now = now_ms()
if full and redis.call('GET', KEYS[6]) then
  if cap then
    return { now, -1, jobs_reply({}), {}, 1, 0, -1, 0, 0 }
  end
  if rate_key then
    return { now, -1, jobs_reply({}), {}, 1, 0, -1 }
  end
  return { now, -1, jobs_reply({}), {}, 1 }
end
local upto = now
if max then
  upto = math.min(now, max)
end

-- Tokens left: burst minus the jobs taken ahead of the schedule (tat, the theoretical
-- arrival time, runs ahead of now by one interval per job taken early).
local tat, allowed = now, limit
if interval then
  if rate_key.tat and rate_key.tat > now then
    tat = rate_key.tat
  end
  allowed = math.floor(burst - (tat - now) / interval + 1e-6)
  if allowed < 0 then
    allowed = 0
  end
  if allowed > limit then
    allowed = limit
  end
end

-- With a cap: up to `allowed` due jobs, earliest first, at most `cap` of them retries
-- (attempts already >= 1); the retries past it are skipped (counted in `held`). The
-- records are read before choosing, in chunks from the head that grow as retries are
-- skipped, up to SKIP_MAX jobs beyond `allowed`. Returns the ids chosen, their parsed
-- records, the unreadable ids, the retries held, and whether due jobs went unseen.
local function scan_capped()
  local chosen, parsed, bad = {}, {}, {}
  local seen, retries, held, unseen = 0, 0, 0, 1
  local bound = allowed + SKIP_MAX
  while #chosen < allowed do
    local n = math.min(math.max(allowed - #chosen, seen), bound - seen)
    if n <= 0 then
      break
    end
    local chunk = redis.call('ZRANGEBYSCORE', scheduled, '-inf', fmt(upto), 'LIMIT', seen, n)
    if #chunk == 0 then
      unseen = 0
      break
    end
    local recs = redis.call('HMGET', jobs, unpack(chunk))
    local looked = #chunk
    for i, id in ipairs(chunk) do
      local j = parse(recs[i])
      if not j then
        bad[#bad + 1] = id
      elseif j.attempts >= 1 and retries >= cap then
        held = held + 1
      else
        if j.attempts >= 1 then
          retries = retries + 1
        end
        chosen[#chosen + 1] = id
        parsed[#parsed + 1] = j
        if #chosen == allowed then
          looked = i
          break
        end
      end
    end
    seen = seen + looked
    if #chunk < n and looked == #chunk then
      unseen = 0
      break
    end
  end
  return chosen, parsed, bad, held, unseen
end

local ids = {}
local taken, corrupt = {}, {}
local held, unseen = 0, 1
if cap and allowed > 0 then
  local parsed
  ids, parsed, corrupt, held, unseen = scan_capped()
  if #ids > 0 then
    redis.call('ZREM', scheduled, unpack(ids))
  end
  if #corrupt > 0 then
    redis.call('ZREM', scheduled, unpack(corrupt))
  end
  if #ids > 0 then
    local first = redis.call('INCRBY', seq, #ids) - #ids
    local deadline = fmt(now + ttr)
    local records, index = {}, {}
    for i, id in ipairs(ids) do
      local j = parsed[i]
      j.attempts = j.attempts + 1
      j.token = fmt(first + i)
      records[#records + 1] = id
      records[#records + 1] = encode(j)
      index[#index + 1] = deadline
      index[#index + 1] = id
      taken[#taken + 1] = { id, j.due, j.attempts, first + i, meta_of(j), body_of(j), j.spec }
    end
    redis.call('HSET', jobs, unpack(records))
    redis.call('ZADD', reserved, unpack(index))
  end
elseif allowed > 0 then
  ids = redis.call('ZRANGEBYSCORE', scheduled, '-inf', fmt(upto), 'LIMIT', 0, allowed)
end
if not cap and #ids > 0 then
  redis.call('ZREM', scheduled, unpack(ids))
  local first = redis.call('INCRBY', seq, #ids) - #ids
  local deadline = fmt(now + ttr)
  local records, index = {}, {}
  -- One HMGET for the batch: a call per job cost more than the command itself.
  local recs = redis.call('HMGET', jobs, unpack(ids))
  for i, id in ipairs(ids) do
    local j = parse(recs[i])
    if j then
      j.attempts = j.attempts + 1
      j.token = fmt(first + i)
      records[#records + 1] = id
      records[#records + 1] = encode(j)
      index[#index + 1] = deadline
      index[#index + 1] = id
      -- Each entry built at its final size (a seventh element added later resized it).
      if full then
        taken[#taken + 1] = { id, j.due, j.attempts, first + i, meta_of(j), body_of(j), j.spec }
      else
        taken[#taken + 1] = { id, j.due, j.attempts, first + i, meta_of(j), body_of(j) }
      end
    else
      corrupt[#corrupt + 1] = id
    end
  end
  if #records > 0 then
    redis.call('HSET', jobs, unpack(records))
    redis.call('ZADD', reserved, unpack(index))
  end
end

local head = redis.call('ZRANGEBYSCORE', scheduled, '-inf', '(' .. PARKED_S, 'WITHSCORES', 'LIMIT', 0, 1)
local next_due = -1
if head[2] then
  next_due = tonumber(head[2])
end
local taken_count = #taken
taken = jobs_reply(taken)
if not full then
  return { now, next_due, taken, corrupt }
end
if not interval then
  if cap then
    return { now, next_due, taken, corrupt, 0, 0, -1, held, unseen }
  end
  if not KEYS[9] then
    return { now, next_due, taken, corrupt, 0 }
  end
  return { now, next_due, taken, corrupt, 0, 0, -1 }
end
local throttled = 0
if taken_count > 0 then
  tat = tat + taken_count * interval
  redis.call('HSET', rate_key.key, 'tat', string.format('%.3f', tat))
  if not live then
    -- Only state: once tat is past it equals a full bucket, so let it go.
    redis.call('PEXPIRE', rate_key.key, math.ceil(tat - now) + 1000)
  end
end
if #ids == allowed and allowed < limit then
  throttled = redis.call('ZCOUNT', scheduled, '-inf', fmt(upto))
end
-- One token again once tat has come within burst - 1 intervals of now.
local next_token = math.ceil(tat - (burst - 1) * interval - 1e-6)
if next_token < now then
  next_token = now
end
if cap then
  return { now, next_due, taken, corrupt, 0, throttled, next_token, held, unseen }
end
return { now, next_due, taken, corrupt, 0, throttled, next_token }
