--[[ threadlog load_views: replace views with pre-stamped contents, if the thread is unchanged.

KEYS[1] meta hash      KEYS[2..] view keys named by the ops, then (last) the partition's
                       thread index
ARGV[1] expected version (the version the caller folded the log up to)
ARGV[2] expected incarnation: "-" (none) | decimal "n" of the life the caller folded
ARGV[3] M ops, then per op: opcode, key index, operands:
  "ll" key n v1..vn          replace a list with stamped values
  "hl" key n f1 v1..fn vn    replace a hash with stamped fields
  "vc" key                   delete a view
ARGV[last] the thread id

Returns {"ok"} | {"conflict", actual} | {"life", actual incarnation or false, actual version}
      | {"meta", the stored version that is not a number}
A conflict, another life or a damaged version writes nothing.
]]

--#include list_in_index

local meta = redis.call('HMGET', KEYS[1], 'v', 'n')
local v = meta[1] or '0'
-- Digits only, as every other reader of the version accepts (tonumber would take '1e1').
if not string.match(v, '^%d+$') or #v > 20 then return {'meta', v} end
local version = tonumber(v)
-- The life before the version: a thread deleted and written again up to the same version
-- since the fold must not get the old life's views (ABA; as in append.lua).
if ARGV[2] ~= '-' and (meta[2] ~= ARGV[2] or not meta[1]) then
  return {'life', meta[1] and meta[2] or false, version}
end
if version ~= tonumber(ARGV[1]) then return {'conflict', version} end
local pos = 4
for o = 1, tonumber(ARGV[3]) do
  local code, key = ARGV[pos], KEYS[tonumber(ARGV[pos + 1])]
  redis.call('DEL', key)
  -- A thread without events has empty views by definition: at version 0 a load only empties
  -- (writing would create view keys for a thread that does not exist; memory does the same).
  if (code == 'll' or code == 'hl') and version == 0 then
    pos = pos + 3 + tonumber(ARGV[pos + 2]) * ((code == 'll') and 1 or 2)
  elseif code == 'll' or code == 'hl' then
    local n = tonumber(ARGV[pos + 2])
    local width = (code == 'll') and 1 or 2
    local cmd = (code == 'll') and 'RPUSH' or 'HSET'
    local batch = {}
    for i = 0, n * width - 1 do
      batch[#batch + 1] = ARGV[pos + 3 + i]
      if #batch >= 1000 then
        redis.call(cmd, key, unpack(batch))
        batch = {}
      end
    end
    if #batch > 0 then redis.call(cmd, key, unpack(batch)) end
    pos = pos + 3 + n * width
  elseif code == 'vc' then
    pos = pos + 2
  else
    return redis.error_reply('ERR threadlog: unknown load op ' .. tostring(code))
  end
end
list_in_index(KEYS[1], KEYS[#KEYS], ARGV[#ARGV], version)
return {'ok'}
