--[[ redisched pull: take up to `limit` due jobs and delete them at once (at-most-once).

For consumers that do their own bookkeeping and prefer losing a job on a crash to
running it twice. The bridge itself uses reserve/release.

KEYS: 1 scheduled ZSET, 2 reserved ZSET, 3 jobs HASH, 4 seq STRING (see put.lua)
ARGV:
  1 limit  1..1000 jobs at most
Reply: { now, next_due, jobs, corrupt } as in reserve.lua; each job's token is 0 and
its attempt is the one this delivery would have been.
Invariant: a pulled job is gone from all three keys in the same step.
]]
local scheduled, jobs = KEYS[1], KEYS[3]
local limit = tonumber(ARGV[1])
if #KEYS ~= 4 then
  return redis.error_reply('INVALID_ARGUMENT pull takes 4 keys, got ' .. #KEYS)
end
if not limit or limit ~= math.floor(limit) or limit < 1 or limit > 1000 then
  return redis.error_reply('INVALID_ARGUMENT limit must be an integer 1..1000')
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local ids = redis.call('ZRANGEBYSCORE', scheduled, '-inf', string.format('%d', now), 'LIMIT', 0, limit)
local taken, corrupt = {}, {}
if #ids > 0 then
  redis.call('ZREM', scheduled, unpack(ids))
  for _, id in ipairs(ids) do
    local rec = redis.call('HGET', jobs, id)
    local due, attempt, mlen, pos
    if rec then
      due, attempt, mlen, pos = string.match(rec, '^1|(%d+)|(%d+)|%d+|(%d+)|()')
    end
    if pos then
      mlen = tonumber(mlen)
      taken[#taken + 1] = { id, tonumber(due), tonumber(attempt) + 1, 0,
        string.sub(rec, pos, pos + mlen - 1), string.sub(rec, pos + mlen) }
      redis.call('HDEL', jobs, id)
    else
      corrupt[#corrupt + 1] = id
    end
  end
end

local head = redis.call('ZRANGE', scheduled, 0, 0, 'WITHSCORES')
local next_due = -1
if head[2] then
  next_due = tonumber(head[2])
end
return { now, next_due, taken, corrupt }
