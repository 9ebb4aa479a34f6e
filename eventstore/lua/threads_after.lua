#!lua flags=no-writes
--[[ threadlog threads_after: one page of a partition's thread index, after a cursor.

KEYS[1] thread index (sorted set: thread id -> last activity in ms)
ARGV[1] cursor time (ms)     ARGV[2] cursor thread id     ARGV[3] most members (-1: all)

The index is listed as ZREVRANGE lists it: time descending, then thread id descending (bytes).
Returns, flat with their scores, the members after the cursor in that order: those at the
cursor's time whose id sorts below the cursor's, then every older one. The cursor need not be a
member (its thread may have moved on or gone): the start is found by a binary search over the
ranks of the members at the cursor's time, O(log^2 n) in one round trip, however many share it.
]]

local key, ms, id, count = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
-- Byte order, as Redis orders members. (Lua's '<' on strings follows the server's locale.)
local function below(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end
local lo = redis.call('ZCOUNT', key, '(' .. ms, '+inf')  -- the reverse rank of the first at ms
local hi = lo + redis.call('ZCOUNT', key, ms, ms)         -- just past the last at ms
while lo < hi do  -- the first rank in [lo, hi) whose member sorts below the cursor's id
  local mid = math.floor((lo + hi) / 2)
  if below(redis.call('ZREVRANGE', key, mid, mid)[1], id) then hi = mid else lo = mid + 1 end
end
local stop = -1
if count > 0 then stop = lo + count - 1 end
return redis.call('ZREVRANGE', key, lo, stop, 'WITHSCORES')
