#!lua flags=no-writes
--[[ threadlog seq_at: the seq of the last event recorded at or before a time.

KEYS[1] log stream     KEYS[2] meta hash
ARGV[1] time in ms

Times are non-decreasing along a thread, so a binary search over seq finds the answer in
O(log n) XRANGE lookups inside one round trip. Returns 0 when no event is that old (or there is
no thread). Damage the search meets is answered for the client to raise, never searched past:
{'meta', v} when the meta's version v is not a number; {'nometa'} when the log holds events but
no meta hash records a version (deleted, or 0); {'missing', seq, v} when the entry of a seq the
version holds is not in the log; {'entry', id, s} when an entry's time s (false: none) is not a
number (as `read` reports it); {'twice', id} when an entry holds its time field twice (every
other reader, the integrity chain's check too, takes the last: a first one written from outside
must not steer the search).
]]

local target = tonumber(ARGV[1])
local v = redis.call('HGET', KEYS[2], 'v') or '0'
-- Digits only, as every other reader of the version accepts: anything else is a damaged meta,
-- answered as {'meta', v} for the client to raise as such (a bare compare with nil would fail).
if not string.match(v, '^%d+$') or #v > 20 then return {'meta', v} end
local hi = tonumber(v)
-- No thread reaches 2^53 events; past it a seq is no longer exact (and no longer formats as
-- digits: 1e+15), so such a version is damage too.
if hi >= 9007199254740992 then return {'meta', v} end
if hi == 0 then
  -- No version: no thread, unless its log holds events (then its meta hash was lost, and a 0
  -- would read as "no event that old" for a log full of them).
  if #redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1) > 0 then return {'nometa'} end
  return 0
end
local lo = 0  -- invariant: time(lo) <= target (seq 0 stands for "before everything")
-- The time of the entry of seq, or nil and what is wrong with it: missing (the first entry
-- after it would answer for it, or none for a log cut short), or a time that is no number:
-- digits only, as `decode_entry` reads it (tonumber would take '1e3' or '0x10', or skip a
-- missing field and answer silently from the wrong events).
local function time_at(seq)
  local id = string.format('%.0f-0', seq)  -- digits, where seq .. '-0' would write 1e+15-0
  local entries = redis.call('XRANGE', KEYS[1], id, id)
  if #entries == 0 then return nil, {'missing', string.format('%.0f', seq), v} end
  local fields = entries[1][2]
  local s = false
  for i = 1, #fields, 2 do
    if fields[i] == 's' then
      if s then return nil, {'twice', id} end
      s = fields[i + 1]
    end
  end
  if not s or not string.match(s, '^%d+$') or #s > 20 then return nil, {'entry', id, s} end
  return tonumber(s)
end
while lo < hi do
  local mid = math.floor((lo + hi + 1) / 2)
  local t, damaged = time_at(mid)
  if damaged then return damaged end
  if t <= target then lo = mid else hi = mid - 1 end
end
return lo
