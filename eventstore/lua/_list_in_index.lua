-- Shared by load_views and swap_views (included where `--#include list_in_index` stands).
-- A thread with events is listed in its partition's thread index (as every append leaves it):
-- a view load, the end of a rebuild, lists one that the index lost, by its last append time.
local function list_in_index(meta, index, thread, version)
  if version == 0 then return end
  local last = redis.call('HGET', meta, 's')
  if not (last and string.match(last, '^%d+$')) then
    local now = redis.call('TIME')
    last = now[1] .. string.format('%03d', math.floor(tonumber(now[2]) / 1000))
  end
  redis.call('ZADD', index, 'NX', last, thread)
end
