--[[ redisched-bench layout prototype, NOT the product: put a one-shot job,
records in bucket hashes (as put.lua with buckets > 0) and the schedule in time slots.

The schedule: job ids sit in small ZSETs, one per time slot of `width` ms
(<KEYS[1]>:<slot>, id -> due), which Redis keeps as listpacks up to
zset-max-listpack-entries (128 by default); KEYS[1] is then an index of the slots
(slot number -> its start). Slot and bucket keys are NOT in KEYS (same hash tag).
KEYS: 1 slot index ZSET, 2 reserved (unused), 3 the bucket hashes' name, 4 seq (unused).
ARGV: 1 id, 2 body, 3 delay ms, 4 record buckets (> 0), 5 slot width ms.
Reply: 1 stored, 0 the id exists (nothing changed).
]]
local id, buckets, width = ARGV[1], tonumber(ARGV[4]), tonumber(ARGV[5])
local jobs = KEYS[3] .. ':' .. (tonumber(string.sub(redis.sha1hex(id), 1, 8), 16) % buckets)
local t = redis.call('TIME')
local us = t[2] + 0
local due = t[1] * 1000 + (us - us % 1000) / 1000 + ARGV[3]
local due_s = string.format('%d', due)
if redis.call('HSETNX', jobs, id, '1|' .. due_s .. '|0|0|0|' .. ARGV[2]) == 0 then
  return 0
end
local slot = (due - due % width) / width
local slot_s = string.format('%d', slot)
redis.call('ZADD', KEYS[1] .. ':' .. slot_s, due_s, id)
redis.call('ZADD', KEYS[1], 'NX', string.format('%d', slot * width), slot_s)
return 1
