-- A writer's attempt: admitted where the lock key is free and no reader is left (its
-- holder recorded beside the lock). A waiting
-- writer that finds readers sets the writer intent, so that no new reader is admitted
-- meanwhile. A readers' set of another type holds the lock; a writer intent that is not a
-- token is neither replaced nor deleted; either is left as it is.
--
-- KEYS[1]  the readers' set (tokens scored by their expiry, ms on the node's clock)
-- KEYS[2]  the lock key
-- KEYS[3]  the writer intent
-- KEYS[4]  the waiters' mark
-- KEYS[5]  the fencing counter
-- KEYS[6]  the holder record
-- ARGV[1]  the token
-- ARGV[2]  the lease TTL, in ms
-- ARGV[3]  the TTL of the mark and the intent, in ms; `0`: not a waiter, neither is set
-- ARGV[4]  `1`: read the fencing counter
-- ARGV[5]  the holder's fields (see lib/set_holder.lua)
--
-- Reply, as every acquisition script's:
--   {1, counter}  set; the counter as it stood (0 when unset or not read)
--   {0, pttl}     held, for `pttl` ms more (-1: no expiry); with readers, until the last
--                 one expires
--   {-1, 1}       the counter is not an integer below 2^53 (nothing written)
--
-- Uses lib/now.lua, lib/mark.lua, lib/foreign.lua, lib/is_token.lua,
-- lib/counter_valid.lua, lib/set_holder.lua.
local now = now_ms()
if foreign(KEYS[1], 'zset') then
  return {0, redis.call('PTTL', KEYS[1])}
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
local waiting = ARGV[3] ~= '0'
if last[2] then
  if waiting then
    local intent = redis.pcall('GET', KEYS[3])
    if not intent or is_token(intent) then
      redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[3])
    end
    mark(KEYS[4], ARGV[3])
  end
  return {0, math.max(0, math.ceil(tonumber(last[2]) - now))}
end
local c = false
if ARGV[4] == '1' then
  c = redis.pcall('GET', KEYS[5])
  if not counter_valid(c) then return {-1, 1} end
end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  set_holder(KEYS[6], ARGV[1], ARGV[5], ARGV[2])
  if is_token(redis.pcall('GET', KEYS[3])) then redis.call('DEL', KEYS[3]) end
  return {1, tonumber(c or '0')}
end
if waiting then mark(KEYS[4], ARGV[3]) end
return {0, redis.call('PTTL', KEYS[2])}
