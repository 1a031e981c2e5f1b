--[[ redisched delete: cancel a job by id, wherever it is.

KEYS: 1 scheduled ZSET, 2 reserved ZSET, 3 jobs HASH, 4 seq STRING (see put.lua)
ARGV: 1 id
Reply: 1 if a job was removed, 0 if there was none.
Invariant: after it, the id is in none of the three keys. A job already reserved may
have its publish in flight: the delete removes it, but cannot recall a message the
broker already took (its release then finds nothing, which is harmless).
]]
local scheduled, reserved, jobs = KEYS[1], KEYS[2], KEYS[3]
local id = ARGV[1]
if #KEYS ~= 4 then
  return redis.error_reply('INVALID_ARGUMENT delete takes 4 keys, got ' .. #KEYS)
end
if not id or #id == 0 then
  return redis.error_reply('INVALID_ARGUMENT id must not be empty')
end
local removed = redis.call('HDEL', jobs, id)
removed = removed + redis.call('ZREM', scheduled, id) + redis.call('ZREM', reserved, id)
if removed > 0 then
  return 1
end
return 0
