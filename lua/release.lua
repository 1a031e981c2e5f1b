--[[ redisched release: a reserved job was delivered; delete it, if it is still ours.

KEYS: 1 scheduled ZSET, 2 reserved ZSET, 3 jobs HASH, 4 seq STRING (see put.lua)
ARGV: id1, token1 [, id2, token2 ...]  up to 1000 pairs, from reserve.lua replies
Reply: the number of jobs deleted.
Invariant: only a job that is reserved *and* carries the given token is deleted. A late
release, after the reservation expired and the job was requeued (and maybe reserved
again under a new token), or after the job was replaced or deleted by id, deletes
nothing.
]]
local reserved, jobs = KEYS[2], KEYS[3]
if #KEYS ~= 4 then
  return redis.error_reply('INVALID_ARGUMENT release takes 4 keys, got ' .. #KEYS)
end
if #ARGV == 0 or #ARGV % 2 ~= 0 or #ARGV > 2000 then
  return redis.error_reply('INVALID_ARGUMENT release takes 1..1000 id, token pairs')
end
local released = 0
for i = 1, #ARGV, 2 do
  local id, token = ARGV[i], ARGV[i + 1]
  local rec = redis.call('HGET', jobs, id)
  if rec and string.match(rec, '^1|%d+|%d+|(%d+)|') == token and redis.call('ZSCORE', reserved, id) then
    redis.call('HDEL', jobs, id)
    redis.call('ZREM', reserved, id)
    released = released + 1
  end
end
return released
