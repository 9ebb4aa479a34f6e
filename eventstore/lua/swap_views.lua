--[[ threadlog swap_views: the last step of a chunked view load (the rebuild of a large thread).

The new contents went beforehand, in bounded chunks, to staging keys in the thread's slot, each
with a TTL (a load that dies half way leaves nothing behind for long). This step checks that
the thread is still at the version the contents were folded at and that every staging key holds
all that was sent to it (a staging key that expired meanwhile must not pass for a full view),
then renames the staging keys over the views. Otherwise it deletes them and loads nothing.

KEYS[1] meta hash      KEYS[2..] view keys and staging keys named by the ops, then (last) the
                       partition's thread index
ARGV[1] expected version
ARGV[2] expected incarnation: "-" (none) | decimal "n" of the life the contents were folded in
ARGV[3] M ops, then per op: view key index, staging key index (0: none, the view is emptied),
        the number of values (list) or fields (hash) the staging key must hold
ARGV[last] the thread id

Returns {"ok"} | {"conflict", actual} | {"lost", view key index}
      | {"life", actual incarnation or false, actual version}
      | {"meta", the stored version that is not a number}
]]

--#include list_in_index

local m = tonumber(ARGV[3])
local function drop()
  for o = 0, m - 1 do
    local s = tonumber(ARGV[5 + o * 3])
    if s > 0 then redis.call('UNLINK', KEYS[s]) end
  end
end

local meta = redis.call('HMGET', KEYS[1], 'v', 'n')
local v = meta[1] or '0'
-- Digits only, as every other reader of the version accepts (tonumber would take '1e1').
if not string.match(v, '^%d+$') or #v > 20 then
  drop()
  return {'meta', v}
end
local version = tonumber(v)
-- Another life at the same version must not get these contents (ABA; as in load_views).
if ARGV[2] ~= '-' and (meta[2] ~= ARGV[2] or not meta[1]) then
  drop()
  return {'life', meta[1] and meta[2] or false, version}
end
if version ~= tonumber(ARGV[1]) then
  drop()
  return {'conflict', version}
end
for o = 0, m - 1 do
  local s = tonumber(ARGV[5 + o * 3])
  if s > 0 then
    local kind = redis.call('TYPE', KEYS[s])['ok']
    local have = 0
    if kind == 'list' then
      have = redis.call('LLEN', KEYS[s])
    elseif kind == 'hash' then
      have = redis.call('HLEN', KEYS[s])
    end
    if have ~= tonumber(ARGV[6 + o * 3]) then
      drop()
      return {'lost', tonumber(ARGV[4 + o * 3])}
    end
  end
end
for o = 0, m - 1 do
  local key, s = KEYS[tonumber(ARGV[4 + o * 3])], tonumber(ARGV[5 + o * 3])
  -- UNLINK: a big view's memory is freed off the main thread (DEL of a million-value list
  -- blocks the server for a fraction of a second).
  redis.call('UNLINK', key)
  if s > 0 then
    -- A thread without events has empty views by definition (as in load_views).
    if version == 0 then
      redis.call('UNLINK', KEYS[s])
    else
      redis.call('RENAME', KEYS[s], key)
      redis.call('PERSIST', key)  -- RENAME carries the staging TTL over
    end
  end
end
list_in_index(KEYS[1], KEYS[#KEYS], ARGV[#ARGV], version)
return {'ok'}
