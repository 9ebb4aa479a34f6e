#!lua flags=no-writes
--[[ threadlog seq_at: the seq of the last event recorded at or before a time.

KEYS[1] log stream     KEYS[2] meta hash
ARGV[1] time in ms

Times are non-decreasing along a thread, so a binary search over seq finds the answer in
O(log n) XRANGE lookups inside one round trip. Returns 0 when no event is that old,
{'meta', v} when the meta's version v is not a number, and {'entry', id, s} when an entry the
search looks at has a time s (false: none) that is not a number (damaged, as `read` reports it).
]]

local target = tonumber(ARGV[1])
local v = redis.call('HGET', KEYS[2], 'v') or '0'
-- Digits only, as every other reader of the version accepts: anything else is a damaged meta,
-- answered as {'meta', v} for the client to raise as such (a bare compare with nil would fail).
if not string.match(v, '^%d+$') or #v > 20 then return {'meta', v} end
local hi = tonumber(v)
local lo = 0  -- invariant: time(lo) <= target (seq 0 stands for "before everything")
-- The time of the first entry at or after seq (nil: none), or the entry's id and raw time
-- when that time is no number: digits only, as `decode_entry` reads it (tonumber would take
-- '1e3' or '0x10', or skip a missing field and answer silently from the wrong events).
local function time_at(seq)
  local entries = redis.call('XRANGE', KEYS[1], seq .. '-0', '+', 'COUNT', 1)
  if #entries == 0 then return nil end
  local fields = entries[1][2]
  local s = false
  for i = 1, #fields, 2 do
    if fields[i] == 's' then s = fields[i + 1] break end
  end
  if not s or not string.match(s, '^%d+$') or #s > 20 then return nil, {entries[1][1], s} end
  return tonumber(s)
end
while lo < hi do
  local mid = math.floor((lo + hi + 1) / 2)
  local t, damaged = time_at(mid)
  if damaged then return {'entry', damaged[1], damaged[2]} end
  if t ~= nil and t <= target then lo = mid else hi = mid - 1 end
end
return lo
