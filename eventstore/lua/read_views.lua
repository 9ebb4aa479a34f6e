#!lua flags=no-writes
--[[ threadlog read_views: several view reads in one atomic step.

KEYS[1] meta hash      KEYS[2..] view keys named by the reads
ARGV[1] R reads, then per read: kind, key index, operands:
  "lr" key start stop            list range
  "ha" key                       every field of a hash
  "hg" key n f1..fn              some fields of a hash
  "hl" key listkey start stop    hash fields named by a list range

Returns {version, r1, ..., rR, incarnation}; list results are arrays of values, hash results
are flat field/value arrays; the incarnation (meta "n") is nil without a thread (no version).
]]

-- A key holding the other kind of view reads as empty (as in the memory backend), not WRONGTYPE.
local function is_a(key, kind)
  return redis.call('TYPE', key).ok == kind
end
-- Field/value pairs of the named fields that exist, in the given order. HMGET goes in chunks:
-- Lua's unpack cannot spread more than a few thousand values.
local function pick(key, fields)
  local flat = {}
  if #fields == 0 or not is_a(key, 'hash') then return flat end
  for first = 1, #fields, 1000 do
    local chunk = {}
    for i = first, math.min(first + 999, #fields) do chunk[#chunk + 1] = fields[i] end
    local values = redis.call('HMGET', key, unpack(chunk))
    for i = 1, #chunk do
      if values[i] then
        flat[#flat + 1] = chunk[i]
        flat[#flat + 1] = values[i]
      end
    end
  end
  return flat
end
-- The version as stored: the client parses it (a damaged one is reported, not nil here). The
-- life comes in the same call: a writer that loads views to write after them names the life it
-- read (an expected version alone matches a thread deleted and written again to that version).
local meta = redis.call('HMGET', KEYS[1], 'v', 'n')
local out = {meta[1] or '0'}
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
    out[#out + 1] = pick(key, fields)
    pos = pos + 3 + n
  elseif kind == 'hl' then
    local list = KEYS[tonumber(ARGV[pos + 2])]
    local fields = {}
    if is_a(list, 'list') then
      for i, raw in ipairs(redis.call('LRANGE', list, ARGV[pos + 3], ARGV[pos + 4])) do
        fields[i] = string.match(raw, '^%d+:(.*)$') or raw
      end
    end
    out[#out + 1] = pick(key, fields)
    pos = pos + 5
  else
    return redis.error_reply('ERR threadlog: unknown view read ' .. tostring(kind))
  end
end
out[#out + 1] = meta[1] and meta[2] or false
return out
