--[[ redisched-bench layout prototype, NOT the product: reserve due jobs from
the time-slot schedule of put_timed.lua, records as reserve.lua with buckets > 0.

KEYS: as put_timed.lua (1 slot index, 2 reserved, 3 bucket hashes' name, 4 seq).
ARGV: 1 ttr ms, 2 limit, 3 record buckets (> 0), 4 slot width ms (unused: the index
      holds each slot's start).
Reply: as reserve.lua.
]]
local limit, buckets = tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local us = t[2] + 0
local now = t[1] * 1000 + (us - us % 1000) / 1000
local now_s = string.format('%d', now)
local ids = {}
-- Slots in time order: take what is due; a slot left non-empty holds only later jobs,
-- and every later slot starts later still.
while #ids < limit do
  local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if not head[1] or tonumber(head[2]) > now then
    break
  end
  local slot_key = KEYS[1] .. ':' .. head[1]
  local got = redis.call('ZRANGEBYSCORE', slot_key, '-inf', now_s, 'LIMIT', 0, limit - #ids)
  if #got > 0 then
    redis.call('ZREM', slot_key, unpack(got))
    for _, id in ipairs(got) do
      ids[#ids + 1] = id
    end
  end
  if redis.call('EXISTS', slot_key) == 1 then
    break
  end
  redis.call('ZREM', KEYS[1], head[1])
end
if #ids == 0 then
  return {}
end
local first = redis.call('INCRBY', KEYS[4], #ids) - #ids
local deadline = string.format('%d', now + ARGV[1])
local writes, order, index, taken = {}, {}, {}, {}
for i, id in ipairs(ids) do
  local key = KEYS[3] .. ':' .. (tonumber(string.sub(redis.sha1hex(id), 1, 8), 16) % buckets)
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
