"""A Lua script that keeps a server busy (it runs nothing else meanwhile) for ``ARGV[1]`` ms."""

from __future__ import annotations

# Redis 7.0 has no `os` in scripts, and its TIME moves while a script runs; Valkey 8 freezes
# TIME for the whole script (as it does the clock keys expire by), so a loop on TIME alone
# never ends there, while its `os.clock()` (the server's CPU time: a busy loop spends it as
# fast as the wall clock) does move. Reading a missing global is an error in a script, hence
# the pcall.
BUSY_SCRIPT = """
local has_clock, clock = pcall(function() return os.clock end)
local function now()
  if has_clock then return clock() * 1000 end
  local t = redis.call('TIME')
  return t[1] * 1000 + t[2] / 1000
end
local stop = now() + tonumber(ARGV[1])
while now() < stop do end
return 1
"""
