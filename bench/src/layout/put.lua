--[[ redisched-bench layout prototype, NOT the product: put a one-shot job.
Only what decides the layout's cost is here (no argument checks, no head check, no
history); today's layout and the bucketed one run this same script.

KEYS: 1 scheduled ZSET id -> due, 2 reserved ZSET (unused), 3 the jobs HASH
      (buckets = 0), or the name the bucket hashes extend (<KEYS[3]>:<b>), 4 seq (unused).
      The bucket hashes are NOT declared in KEYS: they share KEYS[3]'s hash tag, so
      they are in its slot, but the product's rule (every key in KEYS) would break.
ARGV: 1 id, 2 body, 3 delay ms, 4 buckets: 0 = today's layout (one jobs hash); n > 0 =
      records in n hashes, the id's bucket = first 8 hex digits of SHA-1(id) mod n.
Reply: 1 stored, 0 the id exists (nothing changed).
Record: format 1 of lua/README.md, as today.
]]
local id, buckets = ARGV[1], tonumber(ARGV[4])
local jobs = KEYS[3]
if buckets > 0 then
  jobs = jobs .. ':' .. (tonumber(string.sub(redis.sha1hex(id), 1, 8), 16) % buckets)
end
local t = redis.call('TIME')
local us = t[2] + 0
local due_s = string.format('%d', t[1] * 1000 + (us - us % 1000) / 1000 + ARGV[3])
if redis.call('HSETNX', jobs, id, '1|' .. due_s .. '|0|0|0|' .. ARGV[2]) == 0 then
  return 0
end
redis.call('ZADD', KEYS[1], due_s, id)
return 1
