--[[ redisched get: inspect one job by id, without changing anything.

KEYS: 1 scheduled ZSET, 2 reserved ZSET, 3 jobs HASH, 4 seq STRING (see put.lua)
ARGV: 1 id
Reply: nil if there is no such job, else
  { state, due_at, attempts, token, deadline, meta, body }
  state     'scheduled', 'reserved', or 'unindexed' (a record in neither set: an
            invariant violation that `redisched check` reports and repairs)
  due_at    epoch ms the job is (or was) due
  attempts  reservations so far (0 before the first)
  token     the current reservation's token, 0 if never reserved
  deadline  epoch ms the reservation expires, -1 when not reserved
Errors: CORRUPT_RECORD.
]]
local scheduled, reserved, jobs = KEYS[1], KEYS[2], KEYS[3]
local id = ARGV[1]
if #KEYS ~= 4 then
  return redis.error_reply('INVALID_ARGUMENT get takes 4 keys, got ' .. #KEYS)
end
local rec = redis.call('HGET', jobs, id)
if not rec then
  return nil
end
local due, attempts, token, mlen, pos = string.match(rec, '^1|(%d+)|(%d+)|(%d+)|(%d+)|()')
if not pos then
  return redis.error_reply('CORRUPT_RECORD job ' .. id .. ' has an unreadable record')
end
mlen = tonumber(mlen)
local state, deadline = 'unindexed', -1
local reserved_until = redis.call('ZSCORE', reserved, id)
if reserved_until then
  state, deadline = 'reserved', tonumber(reserved_until)
elseif redis.call('ZSCORE', scheduled, id) then
  state = 'scheduled'
  due = redis.call('ZSCORE', scheduled, id)
end
return { state, tonumber(due), tonumber(attempts), tonumber(token), deadline,
  string.sub(rec, pos, pos + mlen - 1), string.sub(rec, pos + mlen) }
