--[[ threadlog apply_checkpointed: an async projection's writes and its checkpoint, atomically.

KEYS[1] the partition's checkpoint hash      KEYS[2..] the projection's hashes
ARGV[1] projection name                      ARGV[2] new checkpoint (feed id "<ms>-<n>")
ARGV[3] N increments, then per increment: key index, field, amount

Applies only when the new checkpoint is above the stored one, so a batch delivered twice
(a crashed consumer's entries reclaimed by another) is written once. Returns 1 or 0.
]]

local function parse(id)
  local ms, n = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(n)
end
local new_ms, new_n = parse(ARGV[2])
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local ms, n = parse(cur)
  if new_ms < ms or (new_ms == ms and new_n <= n) then return 0 end
end
local pos = 4
for i = 1, tonumber(ARGV[3]) do
  redis.call('HINCRBY', KEYS[tonumber(ARGV[pos])], ARGV[pos + 1], ARGV[pos + 2])
  pos = pos + 3
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
