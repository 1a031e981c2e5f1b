--[[ redisched-bench layout prototype, NOT the product: release delivered jobs.
The calls of lua/release.lua for one-shot jobs (per job: HGET, ZSCORE, ZREM, HDEL)
without its checks, series and history.

KEYS: as put.lua (1 scheduled, 2 reserved, 3 jobs or the bucket name, 4 seq).
ARGV: 1 buckets (see put.lua), then id, token pairs.
Reply: the number of jobs deleted (reserved under that token).
]]
local buckets = tonumber(ARGV[1])
local released = 0
for i = 2, #ARGV, 2 do
  local id, token = ARGV[i], ARGV[i + 1]
  local key = KEYS[3]
  if buckets > 0 then
    key = key .. ':' .. (tonumber(string.sub(redis.sha1hex(id), 1, 8), 16) % buckets)
  end
  local rec = redis.call('HGET', key, id)
  if rec and string.match(rec, '^1|%d+|%d+|(%d+)|') == token and redis.call('ZSCORE', KEYS[2], id) then
    redis.call('ZREM', KEYS[2], id)
    redis.call('HDEL', key, id)
    released = released + 1
  end
end
return released
