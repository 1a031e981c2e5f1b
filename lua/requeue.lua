--[[ redisched requeue: make reservations whose time-to-run expired due again.

Every bridge runs this periodically, so a job reserved by a bridge that died before it
released the job is delivered by another (at-least-once).

KEYS: 1 scheduled ZSET, 2 reserved ZSET, 3 jobs HASH, 4 seq STRING (see put.lua)
ARGV:
  1 limit    1..1000 reservations at most
  2 channel  Pub/Sub channel told '<now>|<topic>' when jobs were requeued; '' for none
Reply: { requeued, next_deadline } where next_deadline is the earliest deadline still
reserved (epoch ms) or -1.
Invariant: a requeued job keeps its record (and attempt count) and becomes due now;
its old token no longer releases it, because it is no longer in `reserved`.
]]
local scheduled, reserved = KEYS[1], KEYS[2]
local limit = tonumber(ARGV[1])
if #KEYS ~= 4 then
  return redis.error_reply('INVALID_ARGUMENT requeue takes 4 keys, got ' .. #KEYS)
end
if not limit or limit ~= math.floor(limit) or limit < 1 or limit > 1000 then
  return redis.error_reply('INVALID_ARGUMENT limit must be an integer 1..1000')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_s = string.format('%d', now)

local ids = redis.call('ZRANGEBYSCORE', reserved, '-inf', now_s, 'LIMIT', 0, limit)
if #ids > 0 then
  local index = {}
  for _, id in ipairs(ids) do
    index[#index + 1] = now_s
    index[#index + 1] = id
  end
  redis.call('ZREM', reserved, unpack(ids))
  redis.call('ZADD', scheduled, unpack(index))
  local channel = ARGV[2]
  if channel and #channel > 0 then
    redis.call('PUBLISH', channel, now_s .. '|' .. (string.match(scheduled, '{(.-)}') or ''))
  end
end

local head = redis.call('ZRANGE', reserved, 0, 0, 'WITHSCORES')
local next_deadline = -1
if head[2] then
  next_deadline = tonumber(head[2])
end
return { #ids, next_deadline }
