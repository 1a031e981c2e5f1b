--[[ redisched reserve: take up to `limit` due jobs for delivery, under a time-to-run.

KEYS: 1 scheduled ZSET, 2 reserved ZSET, 3 jobs HASH, 4 seq STRING (see put.lua)
ARGV:
  1 ttr_ms  integer 1..10^12; the reservation lasts this long; after it, requeue.lua makes the job due again
  2 limit   1..1000 jobs at most
  3 max     optional epoch ms: take only jobs due at or before min(max, now)
Reply: { now, next_due, jobs, corrupt }
  now       the server's clock, epoch ms
  next_due  due time of the earliest job still scheduled, or -1 when none is left
  jobs      array of { id, due_at, attempt, token, meta, body }; attempt counts
            reservations, 1 on the first; token identifies this reservation and must be
            given back to release.lua or retry.lua
  corrupt   ids whose record was missing or unreadable: taken off the schedule (their
            record, if any, is kept for `redisched check`) so they cannot block the topic
Invariant: each job moves from `scheduled` to `reserved` atomically; a job is never
taken before its due time by the server's clock; tokens are unique per topic.
]]
local scheduled, reserved, jobs, seq = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ttr, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
if #KEYS ~= 4 then
  return redis.error_reply('INVALID_ARGUMENT reserve takes 4 keys, got ' .. #KEYS)
end
if not ttr or ttr ~= math.floor(ttr) or ttr < 1 or ttr > 1e12
  or not limit or limit ~= math.floor(limit) or limit < 1 or limit > 1000 then
  return redis.error_reply('INVALID_ARGUMENT ttr_ms must be an integer 1..10^12 and limit 1..1000')
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local upto = now
if ARGV[3] and #ARGV[3] > 0 then
  upto = math.min(now, tonumber(ARGV[3]) or now)
end

local ids = redis.call('ZRANGEBYSCORE', scheduled, '-inf', string.format('%d', upto), 'LIMIT', 0, limit)
local taken, corrupt = {}, {}
if #ids > 0 then
  redis.call('ZREM', scheduled, unpack(ids))
  local first = redis.call('INCRBY', seq, #ids) - #ids
  local deadline = string.format('%d', now + ttr)
  local records, index = {}, {}
  for i, id in ipairs(ids) do
    local rec = redis.call('HGET', jobs, id)
    local due, attempt, mlen, pos
    if rec then
      due, attempt, mlen, pos = string.match(rec, '^1|(%d+)|(%d+)|%d+|(%d+)|()')
    end
    if pos then
      attempt = tonumber(attempt) + 1
      local token = first + i
      mlen = tonumber(mlen)
      local tail = string.sub(rec, pos)
      records[#records + 1] = id
      records[#records + 1] = string.format('1|%s|%d|%d|%d|', due, attempt, token, mlen) .. tail
      index[#index + 1] = deadline
      index[#index + 1] = id
      taken[#taken + 1] = { id, tonumber(due), attempt, token,
        string.sub(tail, 1, mlen), string.sub(tail, mlen + 1) }
    else
      corrupt[#corrupt + 1] = id
    end
  end
  if #records > 0 then
    redis.call('HSET', jobs, unpack(records))
    redis.call('ZADD', reserved, unpack(index))
  end
end

local head = redis.call('ZRANGE', scheduled, 0, 0, 'WITHSCORES')
local next_due = -1
if head[2] then
  next_due = tonumber(head[2])
end
return { now, next_due, taken, corrupt }
