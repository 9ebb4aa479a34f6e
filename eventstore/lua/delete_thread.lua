--[[ threadlog delete_thread: remove a thread and leave a tombstone on the change feed.

KEYS[1] log stream     KEYS[2] meta hash (with the idempotency ledger)
KEYS[3] feed stream    KEYS[4] thread index   KEYS[5..] view keys to delete
ARGV[1] thread id      ARGV[2] the version the thread must be at ("": any)
ARGV[3] the life the thread must be in: "-" (any) | decimal "n"

Returns the version the thread had (0 when it did not exist; nothing is written then)
      | {"conflict", actual version} | {"life", actual incarnation or false, actual version}
        (nothing is written)
]]

local state = redis.call('HMGET', KEYS[2], 'v', 'n')
-- A damaged version (anything but digits, as every other reader of it accepts: tonumber would
-- take '1e1') must not stop a deletion halfway: the tombstone says 0.
local v = state[1] or '0'
local version = (string.match(v, '^%d+$') and #v <= 20) and tonumber(v) or 0
-- The life before the version: another life at the expected version is not the thread the
-- caller means to delete (ABA; as in append.lua).
if ARGV[3] ~= '-' and (state[2] ~= ARGV[3] or not state[1]) then
  return {'life', state[1] and state[2] or false, version}
end
if ARGV[2] ~= '' and version ~= tonumber(ARGV[2]) then return {'conflict', version} end
if version == 0 and redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 1, #KEYS do
  if i ~= 3 and i ~= 4 then redis.call('DEL', KEYS[i]) end
end
redis.call('ZREM', KEYS[4], ARGV[1])
if state[2] then
  redis.call('XADD', KEYS[3], '*', 't', ARGV[1], 'f', 0, 'l', version, 'n', state[2], 'x', 'deleted')
else
  redis.call('XADD', KEYS[3], '*', 't', ARGV[1], 'f', 0, 'l', version, 'x', 'deleted')
end
return version
