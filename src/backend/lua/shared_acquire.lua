-- A reader's attempt: admitted where the lock key is free and no writer waits. Anything
-- at the lock key or the writer intent, and a readers' set of another type than a sorted
-- set, hold the lock (for their `PTTL`) and are left as they are.
--
-- KEYS[1]  the readers' set (tokens scored by their expiry, ms on the node's clock)
-- KEYS[2]  the lock key
-- KEYS[3]  the writer intent
-- KEYS[4]  the waiters' mark
-- ARGV[1]  the token
-- ARGV[2]  the lease TTL, in ms
-- ARGV[3]  the mark's TTL, in ms; `0`: not a waiter, no mark
--
-- Reply, as every acquisition script's:
--   {1, 0}     admitted
--   {0, pttl}  held, for `pttl` ms more (-1: no expiry)
--
-- Uses lib/now.lua, lib/mark.lua, lib/foreign.lua, lib/keep_until_last.lua.
local now = now_ms()
local held = redis.call('PTTL', KEYS[2])
if held == -2 then held = redis.call('PTTL', KEYS[3]) end
if held == -2 and foreign(KEYS[1], 'zset') then held = redis.call('PTTL', KEYS[1]) end
if held ~= -2 then
  if ARGV[3] ~= '0' then mark(KEYS[4], ARGV[3]) end
  return {0, held}
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
keep_until_last(KEYS[1])
return {1, 0}
