--[[ threadlog delete_checkpointed: an async projection's state in one partition, atomically.

KEYS[1] the partition's checkpoint hash      KEYS[2] the set of the projection's hash names
KEYS[3..] the projection's hashes to delete
ARGV[1] projection name      ARGV[2..] the names of the hashes KEYS[3..] (in the same order)

The caller reads KEYS[2] first to name the hashes (a script may only touch keys it was given).
A name recorded since (a runner still at work) is not among them: then nothing is deleted and
{0, names} is returned for the caller to try again with every name. Otherwise the checkpoint
field, the hashes and the set are deleted and {1, checkpoint or false, deleted names} returned
(the names of the hashes that existed).
]]

local given = {}
for i = 2, #ARGV do given[ARGV[i]] = true end
local recorded = redis.call('SMEMBERS', KEYS[2])
local missing = {}
for _, name in ipairs(recorded) do
  if not given[name] then missing[#missing + 1] = name end
end
if #missing > 0 then return {0, recorded} end

local checkpoint = redis.call('HGET', KEYS[1], ARGV[1])
if checkpoint then redis.call('HDEL', KEYS[1], ARGV[1]) end
local deleted = {}
for i = 3, #KEYS do
  if redis.call('DEL', KEYS[i]) == 1 then deleted[#deleted + 1] = ARGV[i - 1] end
end
redis.call('DEL', KEYS[2])
return {1, checkpoint, deleted}
