--[[ redisched list: the next scheduled jobs of a topic, earliest first.

KEYS: 1 scheduled ZSET, 2 reserved ZSET, 3 jobs HASH, 4 seq STRING (see put.lua)
ARGV:
  1 limit   1..1000
  2 offset  optional, >= 0, for paging
Reply: flat array id1, due_at1, id2, due_at2, ...
]]
local scheduled = KEYS[1]
local limit, offset = tonumber(ARGV[1]), tonumber(ARGV[2] or '0')
if #KEYS ~= 4 then
  return redis.error_reply('INVALID_ARGUMENT list takes 4 keys, got ' .. #KEYS)
end
if not limit or limit ~= math.floor(limit) or limit < 1 or limit > 1000
  or not offset or offset ~= math.floor(offset) or offset < 0 or offset > 1e12 then
  return redis.error_reply('INVALID_ARGUMENT limit must be an integer 1..1000 and offset an integer >= 0')
end
local entries = redis.call('ZRANGE', scheduled, offset, offset + limit - 1, 'WITHSCORES')
local reply = {}
for i = 1, #entries, 2 do
  reply[#reply + 1] = entries[i]
  reply[#reply + 1] = tonumber(entries[i + 1])
end
return reply
