--[[ threadlog append: one atomic step for one append to one thread.

KEYS[1] log stream     KEYS[2] meta hash (with the idempotency ledger)
KEYS[3] feed stream    KEYS[4] thread index   KEYS[5..] view keys named by the ops (and the
partition's set of view names, when a "vn" op names it)

ARGV[1] thread id              ARGV[2] the writer's chain key fingerprint ("-": no key)
ARGV[3] expected version: "any" | "no_thread" | "exists" | decimal exact version
ARGV[4] idempotency key (ledger field)    ARGV[5] request digest (8 raw bytes)
ARGV[6] N events                 ARGV[7] M view ops
ARGV[8] expected incarnation: "-" (none) | decimal "n" of the life the writer read
ARGV[9 ..] per event, 5 values: id (16 bytes), schema version, data, meta, content digest
then per op: opcode, view key index (into KEYS), operands:
  "lp" key event n v1..vn      push stamped values to a list
  "lr" key event n v1..vn      replace a list with stamped values
  "lo" key count               pop values from the end of a list
  "hs" key field value event expected    set a hash field, bump its version
  "hd" key field expected                delete a hash field
  "vc" key                               delete a view
  "vn" key name                          record a view name in the partition's set of them
                                         (what delete_thread deletes; not a view op)

Returns {"ok", first, last, time, incarnation} | {"dup", first, last, incarnation}
      | {"conflict", actual} | {"life", actual incarnation or nil, actual version} | {"reused"} | {"view", key index, field, expected, actual} | {"key", recorded fingerprint}
      | {"meta", the stored version that is not a number} | {"lost"} (a log without its meta)
Every check runs before the first write: Redis does not roll a script back.

Meta fields: "v" version, "h" chain head, "s" last time (ms), "c" creation time (ms), "n" the
incarnation (creation time in us: tells a thread from one deleted and recreated under its id;
every feed entry carries it), "f" the fingerprint of the chain key the thread was created
with (a thread from before fingerprints were recorded adopts its next writer's); and the
ledger, one field per append: the idempotency key ("k:<caller's key>", or "e" + the first event
id's 16 bytes: never one letter) -> "<first>[ <last>]" (last only when it differs) followed by
the first 6 bytes of the request digest. One hash for both: each append reads and writes it
once, and every call a script makes costs about a microsecond on top of the command.
Field "x" only makes the hash a hashtable (below).
]]

local log, meta, feed, index = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local thread, fingerprint, expected = ARGV[1], ARGV[2], ARGV[3]
local ikey, rdigest = ARGV[4], ARGV[5]
local n_events, n_ops = tonumber(ARGV[6]), tonumber(ARGV[7])
local life = ARGV[8]
local FIRST_EVENT = 9
local LEDGER_AS_HASHTABLE = 'a value over 64 bytes: this hash is a hashtable, its ledger never scanned'

-- 1. idempotency: a known key returns the original result and writes nothing
local state = redis.call('HMGET', meta, 'v', 'h', 's', ikey, 'n', 'f')
local prior = state[4]
if prior then
  if string.sub(prior, -6) ~= string.sub(rdigest, 1, 6) then return {'reused'} end
  local first, last = string.match(string.sub(prior, 1, -7), '^(%d+) ?(%d*)$')
  if last == '' then last = first end
  return {'dup', tonumber(first), tonumber(last), state[5]}
end

-- 2. one chain key per thread: links made with another key would never verify under its own
if state[6] and state[6] ~= fingerprint then return {'key', state[6]} end

-- 3. expected version
-- Digits only, as every other reader of the version accepts (seq_at.lua, the client): tonumber
-- would also take '1e1', ' 10' or '0x0a' and append after a version no reader agrees with.
-- Damaged: reported, nothing written.
local v = state[1] or '0'
if not string.match(v, '^%d+$') or #v > 20 then return {'meta', v} end
local version = tonumber(v)
-- No version recorded, yet events in the log: the meta hash (version, chain head, ledger) was
-- lost. Appending would reuse seq 1; reported as damage instead (a new thread pays one call).
if not state[1] and redis.call('EXISTS', log) == 1 then return {'lost'} end
-- A version without a chain head: the head was removed. Appending would start the chain again
-- from nothing, unbound to the events before it; reported as damage instead.
if version > 0 and not state[2] then return {'nohead'} end
-- The life the writer read: versions restart at 1 when a thread is deleted and written again,
-- so only the life tells the thread it read from a later one at the same version (ABA). A
-- meta without a version is no thread (its life is gone), whatever "n" it still holds.
if life ~= '-' and (state[5] ~= life or not state[1]) then
  return {'life', state[1] and state[5] or false, version}
end
if expected == 'no_thread' then
  if version ~= 0 then return {'conflict', version} end
elseif expected == 'exists' then
  if version == 0 then return {'conflict', version} end
elseif expected ~= 'any' then
  if version ~= tonumber(expected) then return {'conflict', version} end
end

-- 4. parse ops and check their guards
local ops = {}
local pos = FIRST_EVENT + 5 * n_events
-- A view key may hold the other kind of view (a list where a hash op lands, or the reverse).
-- The ops then act as the memory backend does: a push or set replaces it, a pop or field
-- delete leaves it, a guard reads version 0. Never WRONGTYPE: that would abort the script
-- after its first write and leave the log ahead of the meta hash.
-- A key's type is asked once per script (TYPE is a call like any other) and then kept in step
-- with the script's own writes.
local kinds = {}
local function is_a(key, kind)
  local known = kinds[key]
  if not known then
    known = redis.call('TYPE', key).ok
    kinds[key] = known
  end
  return known == kind
end
local function field_version(key, field)
  if not is_a(key, 'hash') then return 0 end
  local cur = redis.call('HGET', key, field)
  if not cur then return 0 end
  return tonumber(string.match(cur, '^(%d+):')) or 0
end
-- Guards see the ops before them in the same append, as if the events came one by one: per
-- key and field, the sets since the version stored (or since a delete or clear reset it to 0).
-- Only a guard reads the stored version; an unguarded set is just counted.
local since = {}  -- key -> field -> {zero = reset to 0 by an earlier op, n = sets after}
local cleared = {}  -- key -> true: an earlier op deleted the view or made it a list
local function change(key, field)
  local fields = since[key]
  if not fields then
    fields = {}
    since[key] = fields
  end
  local c = fields[field]
  if not c then
    c = {zero = cleared[key] or false, n = 0}
    fields[field] = c
  end
  return c
end
for o = 1, n_ops do
  local code, k = ARGV[pos], tonumber(ARGV[pos + 1])
  -- Each op's table is built whole by one constructor (sized once, never grown).
  local op
  if code == 'lp' or code == 'lr' then
    local n = tonumber(ARGV[pos + 3])
    op = {code = code, key = KEYS[k], k = k, event = tonumber(ARGV[pos + 2]), first = pos + 4,
      n = n}
    pos = pos + 4 + n
  elseif code == 'lo' then
    op = {code = code, key = KEYS[k], k = k, count = tonumber(ARGV[pos + 2])}
    pos = pos + 3
  elseif code == 'hs' then
    op = {code = code, key = KEYS[k], k = k, field = ARGV[pos + 2], value = ARGV[pos + 3],
      event = tonumber(ARGV[pos + 4]), expected = ARGV[pos + 5]}
    pos = pos + 6
  elseif code == 'hd' then
    op = {code = code, key = KEYS[k], k = k, field = ARGV[pos + 2], expected = ARGV[pos + 3]}
    pos = pos + 4
  elseif code == 'vc' then
    op = {code = code, key = KEYS[k], k = k}
    pos = pos + 2
  elseif code == 'vn' then
    op = {code = code, key = KEYS[k], k = k, name = ARGV[pos + 2]}
    pos = pos + 3
  else
    return redis.error_reply('ERR threadlog: unknown view op ' .. tostring(code))
  end
  if code == 'hs' or code == 'hd' then
    local c = change(op.key, op.field)
    if op.expected ~= '' then
      local actual = (c.zero and 0 or field_version(op.key, op.field)) + c.n
      if actual ~= tonumber(op.expected) then
        return {'view', k, op.field, tonumber(op.expected), actual}
      end
    end
    if code == 'hs' then
      c.n = c.n + 1
    else
      c.zero, c.n = true, 0
    end
  elseif code == 'vc' or code == 'lp' or code == 'lr' then
    cleared[op.key] = true
    since[op.key] = nil
  end
  ops[o] = op
end

-- 5. writes: events first (the first XADD is the first write of the script)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- The last append's time: digits only (tonumber would take '1e15' and move every later
-- event's time there); a damaged value holds nothing back, and this append rewrites it.
local last_time = string.match(state[3] or '', '^%d+$') and tonumber(state[3]) or 0
if now < last_time then now = last_time end  -- time never runs backwards within a thread
local prev = state[2] or ''
local first, last = version + 1, version + n_events
-- Numbers are turned into strings once, here: Lua formats a number anew in every
-- concatenation and Redis formats a number argument anew in every call, which together cost
-- more than some of the calls below. The digits are the same either way (integers < 2^53).
local now_s, first_s = tostring(now), tostring(first)
local incarnation = state[5] or (t[1] .. string.format('%06d', tonumber(t[2])))
local last_s = n_events == 1 and first_s or tostring(last)
local a = FIRST_EVENT
for e = 1, n_events do
  local seq = e == 1 and first_s or tostring(version + e)
  prev = string.sub(redis.sha1hex(prev .. '|' .. seq .. '|' .. now_s .. '|' .. ARGV[a + 4]), 1, 32)
  redis.call('XADD', log, seq .. '-0',
    'i', ARGV[a], 'v', ARGV[a + 1], 's', now_s, 'd', ARGV[a + 2], 'm', ARGV[a + 3], 'h', prev)
  a = a + 5
end

for _, op in ipairs(ops) do
  local code = op.code
  if code == 'lp' or code == 'lr' then
    if code == 'lr' or not is_a(op.key, 'list') then redis.call('DEL', op.key) end
    kinds[op.key] = 'list'
    -- The first event's seq is formatted already (formatting a number costs more than
    -- the concatenation).
    local stamp = (op.event == 0 and first_s or tostring(version + 1 + op.event)) .. ':'
    local batch = {}
    for i = 0, op.n - 1 do
      batch[#batch + 1] = stamp .. ARGV[op.first + i]
      if #batch == 1000 then
        redis.call('RPUSH', op.key, unpack(batch))
        batch = {}
      end
    end
    if #batch > 0 then redis.call('RPUSH', op.key, unpack(batch)) end
  elseif code == 'lo' then
    if is_a(op.key, 'list') then
      redis.call('RPOP', op.key, op.count)
      kinds[op.key] = nil  -- popping the last value deletes the list
    end
  elseif code == 'hs' then
    if not is_a(op.key, 'hash') then
      redis.call('DEL', op.key)
      kinds[op.key] = 'none'
    end
    local v = field_version(op.key, op.field) + 1
    redis.call('HSET', op.key, op.field, v .. ':' .. (version + 1 + op.event) .. ':' .. op.value)
    kinds[op.key] = 'hash'
  elseif code == 'hd' then
    if is_a(op.key, 'hash') then
      redis.call('HDEL', op.key, op.field)
      kinds[op.key] = nil  -- deleting the last field deletes the hash
    end
  elseif code == 'vc' then
    redis.call('DEL', op.key)
    kinds[op.key] = 'none'
  elseif code == 'vn' then
    redis.call('SADD', op.key, op.name)
  end
end

local span = n_events == 1 and first_s or (first_s .. ' ' .. last_s)
local entry = span .. string.sub(rdigest, 1, 6)
if version == 0 then
  redis.call('HSET', meta, 'v', last_s, 'h', prev, 's', now_s, ikey, entry, 'c', now_s,
    'n', incarnation, 'f', fingerprint)
elseif state[5] and state[6] then
  redis.call('HSET', meta, 'v', last_s, 'h', prev, 's', now_s, ikey, entry)
else  -- a thread from before incarnations or key fingerprints were recorded gets them now
  -- (and a meta that lost its "n" gets one: every feed entry must name the life it is in)
  redis.call('HSET', meta, 'v', last_s, 'h', prev, 's', now_s, ikey, entry, 'n', incarnation,
    'f', fingerprint)
end
-- Redis keeps a hash of up to 512 fields (hash-max-listpack-entries) as a listpack, whose
-- lookups scan it: the ledger's new key, looked up by HMGET and again by HSET, is missed on
-- nearly every append, so a thread's appends 128 to 512 cost up to half again their server
-- time scanning it. A value longer than 64 bytes (hash-max-listpack-value) makes it a
-- hashtable for good, and RDB reloads keep it one. Set again at 256 and 384 for threads that
-- passed 128 before this was done; at 512 Redis converts the hash itself.
if version < 512 and math.floor(version / 128) < math.floor(last / 128) then
  redis.call('HSET', meta, 'x', LEDGER_AS_HASHTABLE)
end
redis.call('XADD', feed, '*', 't', thread, 'f', first_s, 'l', last_s, 'n', incarnation)
redis.call('ZADD', index, now_s, thread)
return {'ok', first, last, now, incarnation}
