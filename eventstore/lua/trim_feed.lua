--[[ threadlog trim_feed: drop a feed's entries below an id, and say so in the stream itself.

KEYS[1] feed stream      ARGV[1] the id to trim below (XTRIM MINID: entries before it go)

XTRIM leaves the stream's max-deleted-entry-id where it was (only XDEL moves it on Redis 7.0),
so a reader whose position lies among the trimmed entries could not tell it lost changes. The
script moves it to the newest entry removed (XSETID MAXDELETEDID, Redis 7.0+), in the same
atomic step as the trim. Returns the number of entries removed.
]]

local key, point = KEYS[1], ARGV[1]
local newest_removed = redis.call('XREVRANGE', key, '(' .. point, '-', 'COUNT', 1)[1]
local removed = redis.call('XTRIM', key, 'MINID', point)
if removed == 0 or not newest_removed then return removed end

local function parse(id)
  local ms, n = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(n)
end
local info = redis.call('XINFO', 'STREAM', key)
local last, deleted
for i = 1, #info, 2 do
  if info[i] == 'last-generated-id' then last = info[i + 1] end
  if info[i] == 'max-deleted-entry-id' then deleted = info[i + 1] end
end
-- Ids' parts reach 2^64 - 1: compared as numbers they could tie where they differ, so a tie
-- keeps the stored id (never moves it backwards).
local ms, n = parse(newest_removed[1])
local dms, dn = parse(deleted or '0-0')
if ms > dms or (ms == dms and n > dn) then
  redis.call('XSETID', key, last, 'MAXDELETEDID', newest_removed[1])
end
return removed
