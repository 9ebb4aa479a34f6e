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

-- A key holding the other kind of view reads as empty (as in the memory backend), not WRONGTYPE
-- (view ops may turn a view from one kind into the other). A key of a type no view ever is (a
-- string, a set: written from outside threadlog) is damage, named by its index in KEYS: read
-- as empty, a transcript would read as no messages, without a word.
local VIEW_TYPES = {list = true, hash = true, none = true}
local function is_a(k, kind)
  local t = redis.call('TYPE', KEYS[k]).ok
  if t == kind then return true end
  if not VIEW_TYPES[t] then
    error({err = 'WRONGTYPE threadlog view key ' .. k .. ' holds a ' .. t .. ','})
  end
  return false
end
-- Field/value pairs of the named fields that exist, in the given order. HMGET goes in chunks:
-- Lua's unpack cannot spread more than a few thousand values.
local function pick(k, fields)
  local key = KEYS[k]
  local flat = {}
  if #fields == 0 or not is_a(k, 'hash') then return flat end
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
  local kind, k = ARGV[pos], tonumber(ARGV[pos + 1])
  local key = KEYS[k]
  if kind == 'lr' then
    out[#out + 1] = is_a(k, 'list') and redis.call('LRANGE', key, ARGV[pos + 2], ARGV[pos + 3])
      or {}
    pos = pos + 4
  elseif kind == 'ha' then
    out[#out + 1] = is_a(k, 'hash') and redis.call('HGETALL', key) or {}
    pos = pos + 2
  elseif kind == 'hg' then
    local n = tonumber(ARGV[pos + 2])
    local fields = {}
    for i = 1, n do fields[i] = ARGV[pos + 2 + i] end
    out[#out + 1] = pick(k, fields)
    pos = pos + 3 + n
  elseif kind == 'hl' then
    local lk = tonumber(ARGV[pos + 2])
    local list = KEYS[lk]
    local fields = {}
    if is_a(lk, 'list') then
      for i, raw in ipairs(redis.call('LRANGE', list, ARGV[pos + 3], ARGV[pos + 4])) do
        fields[i] = string.match(raw, '^%d+:(.*)$') or raw
      end
    end
    out[#out + 1] = pick(k, fields)
    pos = pos + 5
  else
    return redis.error_reply('ERR threadlog: unknown view read ' .. tostring(kind))
  end
end
out[#out + 1] = meta[1] and meta[2] or false
return out
