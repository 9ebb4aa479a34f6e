#!lua flags=no-writes
--[[ threadlog seq_at: the seq of the last event recorded at or before a time.

KEYS[1] log stream     KEYS[2] meta hash
ARGV[1] time in ms

Times are non-decreasing along a thread, so a binary search over seq finds the answer in
O(log n) XRANGE lookups inside one round trip. Returns 0 when no event is that old, and
{'meta', v} when the meta's version v is not a number (damaged).
]]

local target = tonumber(ARGV[1])
local v = redis.call('HGET', KEYS[2], 'v') or '0'
-- Digits only, as every other reader of the version accepts: anything else is a damaged meta,
-- answered as {'meta', v} for the client to raise as such (a bare compare with nil would fail).
if not string.match(v, '^%d+$') or #v > 20 then return {'meta', v} end
local hi = tonumber(v)
local lo = 0  -- invariant: time(lo) <= target (seq 0 stands for "before everything")
local function time_at(seq)
  local entries = redis.call('XRANGE', KEYS[1], seq .. '-0', '+', 'COUNT', 1)
  if #entries == 0 then return nil end
  local fields = entries[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == 's' then return tonumber(fields[i + 1]) end
  end
  return nil
end
while lo < hi do
  local mid = math.floor((lo + hi + 1) / 2)
  local t = time_at(mid)
  if t ~= nil and t <= target then lo = mid else hi = mid - 1 end
end
return lo
