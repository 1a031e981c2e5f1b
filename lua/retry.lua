--[[ redisched retry: hand a reserved job back, due again after a delay.

Used when the broker refused a publish (nack, unroutable return): the job stays and is
tried again later instead of waiting for its time-to-run to expire.

KEYS: 1 scheduled ZSET, 2 reserved ZSET, 3 jobs HASH, 4 seq STRING (see put.lua)
ARGV:
  1 id
  2 token     from the reserve.lua reply
  3 delay_ms  integer 0..10^12, from the server's now
Reply: 1 if the job was moved back to `scheduled`, 0 if it was no longer ours (released,
replaced, deleted, or requeued after its reservation expired).
Invariant: as release.lua, only the holder of the current token can move the job.
]]
local scheduled, reserved, jobs = KEYS[1], KEYS[2], KEYS[3]
local id, token, delay = ARGV[1], ARGV[2], tonumber(ARGV[3])
if #KEYS ~= 4 then
  return redis.error_reply('INVALID_ARGUMENT retry takes 4 keys, got ' .. #KEYS)
end
if not id or not token or not delay or delay ~= math.floor(delay) or delay < 0 or delay > 1e12 then
  return redis.error_reply('INVALID_ARGUMENT retry takes id, token, delay_ms (an integer 0..10^12)')
end
local rec = redis.call('HGET', jobs, id)
if not rec or string.match(rec, '^1|%d+|%d+|(%d+)|') ~= token or not redis.call('ZSCORE', reserved, id) then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREM', reserved, id)
redis.call('ZADD', scheduled, string.format('%d', now + delay), id)
return 1
