--[[ redisched-bench layout prototype, NOT the product: reserve due jobs.
The calls of lua/reserve.lua (ZRANGEBYSCORE, ZREM, INCRBY, one HGET per job, the new
records written back, ZADD to reserved) without its checks, pause and parking; the
records go back with one HSET per hash (today: one; bucketed: one per bucket touched).

KEYS: as put.lua (1 scheduled, 2 reserved, 3 jobs or the bucket name, 4 seq).
ARGV: 1 ttr ms, 2 limit, 3 buckets (see put.lua).
Reply: array of { id, due_at, attempt, token, body }; ids without a readable record are
dropped from `scheduled` and left out.
]]
local buckets = tonumber(ARGV[3])
local function jobs_key(id)
  if buckets == 0 then
    return KEYS[3]
  end
  return KEYS[3] .. ':' .. (tonumber(string.sub(redis.sha1hex(id), 1, 8), 16) % buckets)
end
local t = redis.call('TIME')
local us = t[2] + 0
local now = t[1] * 1000 + (us - us % 1000) / 1000
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now), 'LIMIT', 0, tonumber(ARGV[2]))
if #ids == 0 then
  return {}
end
redis.call('ZREM', KEYS[1], unpack(ids))
local first = redis.call('INCRBY', KEYS[4], #ids) - #ids
local deadline = string.format('%d', now + ARGV[1])
local writes, order, index, taken = {}, {}, {}, {}
for i, id in ipairs(ids) do
  local key = jobs_key(id)
  local rec = redis.call('HGET', key, id)
  local due, attempts, mlen, pos
  if rec then
    due, attempts, mlen, pos = string.match(rec, '^1|(%d+)|(%d+)|%d+|(%d+)|()')
  end
  if pos then
    local token = first + i
    local tail = string.sub(rec, pos)
    local w = writes[key]
    if not w then
      w = {}
      writes[key] = w
      order[#order + 1] = key
    end
    w[#w + 1] = id
    w[#w + 1] = '1|' .. due .. '|' .. (attempts + 1) .. '|' .. token .. '|' .. mlen .. '|' .. tail
    index[#index + 1] = deadline
    index[#index + 1] = id
    taken[#taken + 1] = { id, tonumber(due), attempts + 1, token, tail }
  end
end
for _, key in ipairs(order) do
  redis.call('HSET', key, unpack(writes[key]))
end
if #index > 0 then
  redis.call('ZADD', KEYS[2], unpack(index))
end
return taken
