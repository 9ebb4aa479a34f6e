#!lua flags=no-writes
--[[ threadlog read_views: several view reads in one atomic step.

KEYS[1] meta hash      KEYS[2..] view keys named by the reads
ARGV[1] R reads, then per read: kind, key index, operands:
  "lr" key start stop            list range
  "ha" key                       every field of a hash
  "hg" key n f1..fn              some fields of a hash
  "hl" key listkey start stop    hash fields named by a list range

Returns {version, r1, ..., rR}; list results are arrays of values, hash results are flat
field/value arrays.
]]

-- A key holding the other kind of view reads as empty (as in the memory backend), not WRONGTYPE.
local function is_a(key, kind)
  return redis.call('TYPE', key).ok == kind
end
local out = {tonumber(redis.call('HGET', KEYS[1], 'v') or '0')}
local pos = 2
for r = 1, tonumber(ARGV[1]) do
  local kind, key = ARGV[pos], KEYS[tonumber(ARGV[pos + 1])]
  if kind == 'lr' then
    out[#out + 1] = is_a(key, 'list') and redis.call('LRANGE', key, ARGV[pos + 2], ARGV[pos + 3])
      or {}
    pos = pos + 4
  elseif kind == 'ha' then
    out[#out + 1] = is_a(key, 'hash') and redis.call('HGETALL', key) or {}
    pos = pos + 2
  elseif kind == 'hg' then
    local n = tonumber(ARGV[pos + 2])
    local fields = {}
    for i = 1, n do fields[i] = ARGV[pos + 2 + i] end
    local flat = {}
    if n > 0 and is_a(key, 'hash') then
      local values = redis.call('HMGET', key, unpack(fields))
      for i = 1, n do
        if values[i] then
          flat[#flat + 1] = fields[i]
          flat[#flat + 1] = values[i]
        end
      end
    end
    out[#out + 1] = flat
    pos = pos + 3 + n
  elseif kind == 'hl' then
    local list = KEYS[tonumber(ARGV[pos + 2])]
    local names = {}
    if is_a(list, 'list') then names = redis.call('LRANGE', list, ARGV[pos + 3], ARGV[pos + 4]) end
    local flat = {}
    if #names > 0 and is_a(key, 'hash') then
      local fields = {}
      for i, raw in ipairs(names) do fields[i] = string.match(raw, '^%d+:(.*)$') or raw end
      local values = redis.call('HMGET', key, unpack(fields))
      for i = 1, #fields do
        if values[i] then
          flat[#flat + 1] = fields[i]
          flat[#flat + 1] = values[i]
        end
      end
    end
    out[#out + 1] = flat
    pos = pos + 5
  else
    return redis.error_reply('ERR threadlog: unknown view read ' .. tostring(kind))
  end
end
return out
