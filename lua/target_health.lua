--[[ redisched target_health: a webhook target's circuit breaker, shared by every bridge.

KEYS: 1 health HASH (`<prefix>:target:{<name>}:health`), 2 events LIST
  (`<prefix>:target:{<name>}:events`, the state changes no bridge has announced yet).
ARGV:
  1 op       `sync`, `probe`, `gone`, `enable`, `disable` or `get`
  2 failure_ratio   a decimal in (0, 1]
  3 window_ms       4 min_requests    5 open_ms    6 disable_after_trips  (integers >= 1)
  7 sync: successes (>= 0)   probe: `ok` or `fail`   others: ignored
  8 sync: failures (>= 0)    others: ignored
  9 sync: lease_ms (>= 0; > 0 claims the half-open probe for that long if it is free)
 10 reason (a change's reason; '' for the op's default)
Ops (the policy; src/targets/health.rs's `step` is the same, with unit tests):
  sync    while closed, add the outcomes to the window (a fixed window: counts start
          afresh once window_ms has run out); failures/requests >= failure_ratio with
          requests >= min_requests opens it (a trip). Open for open_ms -> half_open.
          Half-open with the probe unclaimed (or its lease over) and lease_ms > 0: this
          call claims it (reply `claimed` 1): exactly one request decides.
  probe   the probe's outcome, while half_open only: `ok` -> closed (counts and trips
          reset), `fail` -> open again (a trip). Otherwise nothing.
  gone    the target's own URL answered 410 Gone: disabled (unless it is).
  disable disabled by hand (unless it is).   enable: closed, counts and trips reset;
          the change is `enabled` (was disabled), `closed` (was open or half_open) or none.
  A trip that makes `trips` (opens in a row, no closed between) reach
  disable_after_trips disables the target instead of opening it.
Reply: { state, claimed, reason, changed_at, requests, failures, trips, opened_at, now,
  events } where events is a flat array `to1, reason1, at1, ...` of the changes waiting
  in KEYS[2], this call's own included, taken (deleted) by this call: ops sync, probe
  and gone take them (the bridge that took them logs, counts and publishes them, once);
  enable, disable and get leave them for the next bridge's sync and answer {}.
Errors: INVALID_ARGUMENT (keys, op, a setting, a count, lease_ms, probe outcome),
  WRONGTYPE (from Redis).
Invariant: state is one of closed, open, half_open, disabled (absent hash: closed);
  nothing but enable leaves disabled; probe_until > now only while half_open; every
  change is pushed to KEYS[2] exactly once (capped at the newest 100) and taken once.
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

if #KEYS ~= 2 then
  return redis.error_reply('INVALID_ARGUMENT target_health takes 2 keys, got ' .. #KEYS)
end
local op = ARGV[1]
if op ~= 'sync' and op ~= 'probe' and op ~= 'gone' and op ~= 'enable' and op ~= 'disable'
    and op ~= 'get' then
  return redis.error_reply('INVALID_ARGUMENT op must be sync, probe, gone, enable, disable or get, got ' .. tostring(op))
end
local ratio = tonumber(ARGV[2] or '')
if not ratio or ratio <= 0 or ratio > 1 then
  return redis.error_reply('INVALID_ARGUMENT failure_ratio must be in (0, 1], got ' .. tostring(ARGV[2]))
end
local cfg = {}
for i, name in ipairs({ 'window_ms', 'min_requests', 'open_ms', 'disable_after_trips' }) do
  local v = int_arg(ARGV[i + 2])
  if not v or v < 1 then
    return redis.error_reply('INVALID_ARGUMENT ' .. name .. ' must be an integer >= 1, got ' .. tostring(ARGV[i + 2]))
  end
  cfg[name] = v
end

local now = now_ms()
local f = redis.call('HMGET', KEYS[1], 'state', 'window_start', 'requests', 'failures',
  'opened_at', 'trips', 'probe_until', 'reason', 'changed_at')
local h = {
  state = f[1] or 'closed', window_start = tonumber(f[2] or '0'), requests = tonumber(f[3] or '0'),
  failures = tonumber(f[4] or '0'), opened_at = tonumber(f[5] or '0'), trips = tonumber(f[6] or '0'),
  probe_until = tonumber(f[7] or '0'), reason = f[8] or '', changed_at = tonumber(f[9] or '0'),
}
local changes = {}
local reason = ARGV[10] or ''

local function change(to, why)
  changes[#changes + 1] = { to, why }
  h.reason = why
  h.changed_at = now
end

-- Opens the breaker (a trip), or disables the target at the last trip allowed.
local function trip(why)
  h.trips = h.trips + 1
  h.opened_at = now
  h.probe_until = 0
  if h.trips >= cfg.disable_after_trips then
    h.state = 'disabled'
    change('disabled', why .. '; opened ' .. fmt(h.trips) .. ' times in a row (disable_after_trips)')
  else
    h.state = 'open'
    change('open', why)
  end
end

local function close()
  h.state, h.window_start, h.requests, h.failures = 'closed', now, 0, 0
  h.opened_at, h.trips, h.probe_until = 0, 0, 0
end

local claimed = 0
if op == 'sync' then
  local s, fl, lease = int_arg(ARGV[7]), int_arg(ARGV[8]), int_arg(ARGV[9])
  if not s or s < 0 or not fl or fl < 0 or not lease or lease < 0 then
    return redis.error_reply('INVALID_ARGUMENT successes, failures and lease_ms must be integers >= 0')
  end
  if h.state == 'closed' then
    if now - h.window_start >= cfg.window_ms then
      h.window_start, h.requests, h.failures = now, 0, 0
    end
    h.requests = h.requests + s + fl
    h.failures = h.failures + fl
    if h.requests >= cfg.min_requests and h.failures / h.requests >= ratio then
      trip(reason ~= '' and reason or (fmt(h.failures) .. ' of ' .. fmt(h.requests) ..
        ' requests failed in the window'))
    end
  end
  if h.state == 'open' and now - h.opened_at >= cfg.open_ms then
    h.state = 'half_open'
    h.probe_until = 0
    change('half_open', 'open_ms passed: one probe request decides')
  end
  if h.state == 'half_open' and lease > 0 and h.probe_until <= now then
    h.probe_until = now + lease
    claimed = 1
  end
elseif op == 'probe' then
  local outcome = ARGV[7]
  if outcome ~= 'ok' and outcome ~= 'fail' then
    return redis.error_reply('INVALID_ARGUMENT probe outcome must be ok or fail, got ' .. tostring(outcome))
  end
  if h.state == 'half_open' then
    if outcome == 'ok' then
      close()
      change('closed', reason ~= '' and reason or 'the probe request succeeded')
    else
      trip(reason ~= '' and reason or 'the probe request failed')
    end
  end
elseif op == 'gone' or op == 'disable' then
  if h.state ~= 'disabled' then
    h.state = 'disabled'
    h.probe_until = 0
    change('disabled', reason ~= '' and reason or (op == 'gone' and 'the target answered 410 Gone' or 'disabled by hand'))
  end
elseif op == 'enable' then
  local was = h.state
  close()
  if was == 'disabled' then
    change('enabled', reason ~= '' and reason or 'enabled by hand')
  elseif was ~= 'closed' then
    change('closed', reason ~= '' and reason or 'enabled by hand')
  end
end

if op ~= 'get' then
  redis.call('HSET', KEYS[1], 'state', h.state, 'window_start', fmt(h.window_start),
    'requests', fmt(h.requests), 'failures', fmt(h.failures), 'opened_at', fmt(h.opened_at),
    'trips', fmt(h.trips), 'probe_until', fmt(h.probe_until), 'reason', h.reason,
    'changed_at', fmt(h.changed_at))
end
for _, c in ipairs(changes) do
  redis.call('RPUSH', KEYS[2], c[1] .. '|' .. fmt(now) .. '|' .. c[2])
end
if #changes > 0 then
  redis.call('LTRIM', KEYS[2], -100, -1)
end
local events = {}
if op == 'sync' or op == 'probe' or op == 'gone' then
  for _, e in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
    local bar1 = string.find(e, '|', 1, true)
    local bar2 = bar1 and string.find(e, '|', bar1 + 1, true)
    if bar2 then
      events[#events + 1] = string.sub(e, 1, bar1 - 1)
      events[#events + 1] = string.sub(e, bar2 + 1)
      events[#events + 1] = tonumber(string.sub(e, bar1 + 1, bar2 - 1))
    end
  end
  redis.call('DEL', KEYS[2])
end
return { h.state, claimed, h.reason, h.changed_at, h.requests, h.failures, h.trips, h.opened_at,
  now, events }
