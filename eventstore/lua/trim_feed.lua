--[[ threadlog trim_feed: drop a feed's entries every consumer group has read (and, with a
maximum age, those older than it), and say so in the stream itself.

KEYS[1] feed stream      ARGV[1] the id of the age limit ("": none; entries before it go,
                                 read or not)

The groups are read here, in the same atomic step as the trim: read by the client before it,
a group registered in between (a runner registering its dropped group again, a projection's
first run) was not waited for, and lost the entries it needed. A group needs its oldest pending
entry and every entry after its last delivered one; without groups only the age limit trims.

XTRIM leaves the stream's max-deleted-entry-id where it was (only XDEL moves it on Redis 7.0),
so a reader whose position lies among the trimmed entries could not tell it lost changes. The
script moves it to the newest entry removed (XSETID MAXDELETEDID, Redis 7.0+), in the same
atomic step as the trim. Returns the number of entries removed.
]]

local key, aged = KEYS[1], ARGV[1]
if redis.call('EXISTS', key) == 0 then return 0 end

-- Ids' parts reach 2^64 - 1, past a Lua number's exact range: compared as decimal strings
-- (no leading zeros), by length first.
local function part_less(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local function parse(id)
  return string.match(id, '^(%d+)-(%d+)$')
end
local function less(a, b)
  local ams, an = parse(a)
  local bms, bn = parse(b)
  if ams ~= bms then return part_less(ams, bms) end
  return part_less(an, bn)
end

-- The lowest id some group still needs (nil: none of the entries held; NO_GROUP: no group).
local NO_GROUP = {}
local point = NO_GROUP
local function need(id)
  if point == NO_GROUP or point == nil or less(id, point) then point = id end
end
local groups = redis.call('XINFO', 'GROUPS', key)
if #groups > 0 then point = nil end
for _, g in ipairs(groups) do
  local name, delivered, pending
  for i = 1, #g, 2 do
    if g[i] == 'name' then name = g[i + 1] end
    if g[i] == 'last-delivered-id' then delivered = g[i + 1] end
    if g[i] == 'pending' then pending = g[i + 1] end
  end
  if pending > 0 then
    -- Its oldest pending entry the feed still holds: one trimmed before its consumer
    -- acknowledged it is needed by nobody (reading it raises FeedTrimmedError), and would
    -- hold trimming back for ever.
    local first = redis.call('XRANGE', key, '-', '+', 'COUNT', 1)[1]
    if first then
      local held = redis.call('XPENDING', key, name, first[1], '+', 1)[1]
      if held then need(held[1]) end
    end
  end
  -- The first entry after its last delivered one (none held: it needs nothing held).
  local after = redis.call('XRANGE', key, '(' .. delivered, '+', 'COUNT', 1)[1]
  if after then need(after[1]) end
end

local everything = false
if point == NO_GROUP then
  if aged == '' then return 0 end  -- no group, no age limit: nothing may go
  point = aged
elseif point == nil then
  everything = true  -- every group has read every entry held
elseif aged ~= '' and less(point, aged) then
  point = aged
end

local newest_removed
if everything then
  newest_removed = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)[1]
else
  if point == '0-0' then return 0 end  -- nothing lies below it ("(0-0" is no id)
  newest_removed = redis.call('XREVRANGE', key, '(' .. point, '-', 'COUNT', 1)[1]
end
if not newest_removed then return 0 end
local removed
if everything then
  removed = redis.call('XTRIM', key, 'MAXLEN', 0)
else
  removed = redis.call('XTRIM', key, 'MINID', point)
end
if removed == 0 then return removed end

local info = redis.call('XINFO', 'STREAM', key)
local last, deleted
for i = 1, #info, 2 do
  if info[i] == 'last-generated-id' then last = info[i + 1] end
  if info[i] == 'max-deleted-entry-id' then deleted = info[i + 1] end
end
-- Never moves it backwards.
if less(deleted or '0-0', newest_removed[1]) then
  redis.call('XSETID', key, last, 'MAXDELETEDID', newest_removed[1])
end
return removed
