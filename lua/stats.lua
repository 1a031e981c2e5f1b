--[[ redisched stats: count a topic's jobs by state.

KEYS: 1 scheduled ZSET, 2 reserved ZSET, 3 jobs HASH, 4 seq STRING (see put.lua)
ARGV: none
Reply: { now, scheduled, due_now, reserved, expired, records }
  scheduled  jobs waiting, due or not
  due_now    those of them due at the server's now (the backlog)
  reserved   jobs handed to a deliverer and not yet released
  expired    those of them whose time-to-run has passed (requeue.lua will fix them)
  records    entries in the jobs hash; equals scheduled + reserved when the store is sound
]]
local scheduled, reserved, jobs = KEYS[1], KEYS[2], KEYS[3]
if #KEYS ~= 4 then
  return redis.error_reply('INVALID_ARGUMENT stats takes 4 keys, got ' .. #KEYS)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_s = string.format('%d', now)
return { now, redis.call('ZCARD', scheduled), redis.call('ZCOUNT', scheduled, '-inf', now_s),
  redis.call('ZCARD', reserved), redis.call('ZCOUNT', reserved, '-inf', now_s), redis.call('HLEN', jobs) }
