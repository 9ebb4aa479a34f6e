--[[ threadlog apply_checkpointed: an async projection's writes and its checkpoint, atomically.

KEYS[1] the partition's checkpoint hash      KEYS[2] the set of the projection's hash names
KEYS[3..] the projection's hashes
ARGV[1] projection name
ARGV[2] expected checkpoint (the one the batch was read after; "0-0": none yet)
ARGV[3] new checkpoint (the last feed id of the batch)
ARGV[4] N increments, then per increment: key index, field, amount (a canonical decimal int
        within +-(2^63 - 1): the caller checks)
then    M, then the names of the M hashes KEYS[3..] (recorded in KEYS[2], so that
        delete_checkpointed finds every hash the projection ever wrote without SCAN)

A compare-and-set: applies only when the stored checkpoint is still the expected one, so a
batch read twice (by two runners of the projection, or again after a crash) is written once.
Returns 1 when applied, 0 when the checkpoint had moved (nothing written).

All or nothing: a script error leaves the writes made before it in place, so an increment that
HINCRBY refuses (the field would overflow 64 bits, or holds no integer) would leave the
batch's earlier increments applied without the checkpoint, and a retry would count them again.
Each increment is made with pcall; on a refusal those made are undone (in reverse: a field the
batch created is deleted again) and {-1, key index, field, error} is returned, nothing written.
]]

local cur = redis.call('HGET', KEYS[1], ARGV[1]) or '0-0'
if cur ~= ARGV[2] then return 0 end
local done = {}
local pos = 5
for i = 1, tonumber(ARGV[4]) do
  local key, field, amount = KEYS[tonumber(ARGV[pos])], ARGV[pos + 1], ARGV[pos + 2]
  local existed = redis.call('HGET', key, field) ~= false
  local reply = redis.pcall('HINCRBY', key, field, amount)
  if type(reply) == 'table' and reply.err then
    for j = #done, 1, -1 do
      local d = done[j]
      if not d[4] then
        redis.call('HDEL', d[1], d[2])
      elseif d[3] ~= '0' then
        local back = string.sub(d[3], 1, 1) == '-' and string.sub(d[3], 2) or '-' .. d[3]
        redis.call('HINCRBY', d[1], d[2], back)
      end
    end
    return {-1, ARGV[pos], field, reply.err}
  end
  done[#done + 1] = {key, field, amount, existed}
  pos = pos + 3
end
local n_names = tonumber(ARGV[pos])
if n_names > 0 then redis.call('SADD', KEYS[2], unpack(ARGV, pos + 1, pos + n_names)) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
