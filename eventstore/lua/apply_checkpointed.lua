--[[ threadlog apply_checkpointed: an async projection's writes and its checkpoint, atomically.

KEYS[1] the partition's checkpoint hash      KEYS[2..] the projection's hashes
ARGV[1] projection name
ARGV[2] expected checkpoint (the one the batch was read after; "0-0": none yet)
ARGV[3] new checkpoint (the last feed id of the batch)
ARGV[4] N increments, then per increment: key index, field, amount

A compare-and-set: applies only when the stored checkpoint is still the expected one, so a
batch read twice (by two runners of the projection, or again after a crash) is written once.
Returns 1 when applied, 0 when the checkpoint had moved (nothing written).
]]

local cur = redis.call('HGET', KEYS[1], ARGV[1]) or '0-0'
if cur ~= ARGV[2] then return 0 end
local pos = 5
for i = 1, tonumber(ARGV[4]) do
  redis.call('HINCRBY', KEYS[tonumber(ARGV[pos])], ARGV[pos + 1], ARGV[pos + 2])
  pos = pos + 3
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
