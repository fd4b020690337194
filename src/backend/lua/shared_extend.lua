-- Extends a reader: moves its token's expiry one TTL on, if it is still live, and keeps
-- the readers' set alive as long as its last reader.
--
-- KEYS[1]  the readers' set (tokens scored by their expiry, ms on the node's clock)
-- ARGV[1]  the token
-- ARGV[2]  the lease TTL, in ms
--
-- Reply: 1 extended, 0 the token is gone or expired, -1 the set holds a value of another
-- type (left as it is).
--
-- Uses lib/now.lua, lib/keep_until_last.lua.
local now = now_ms()
local s = redis.pcall('ZSCORE', KEYS[1], ARGV[1])
if type(s) == 'table' then return -1 end
if not s then return 0 end
if tonumber(s) <= now then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
keep_until_last(KEYS[1])
return 1
