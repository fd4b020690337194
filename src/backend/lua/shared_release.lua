-- Releases a reader; the last reader to leave wakes the waiters that marked the lock.
-- Values this crate did not write are left as they are.
--
-- KEYS[1]  the readers' set (tokens scored by their expiry, ms on the node's clock)
-- KEYS[2]  the waiters' mark
-- ARGV[1]  the token
-- ARGV[2]  `1`: wake the marked waiters when the last reader leaves
-- ARGV[3]  the lock's release channel
--
-- Reply: 1 removed, 0 gone or expired, -1 the set holds a value of another type.
--
-- Uses lib/now.lua, lib/unmark.lua.
local now = now_ms()
local s = redis.pcall('ZSCORE', KEYS[1], ARGV[1])
if type(s) == 'table' then return -1 end
if not s then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[2] == '1' and redis.call('ZCARD', KEYS[1]) == 0 and unmark(KEYS[2]) then
  redis.call('PUBLISH', ARGV[3], '')
end
if tonumber(s) <= now then return 0 end
return 1
