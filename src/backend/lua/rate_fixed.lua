-- The fixed-window counter, atomically: `INCR` the key, set its expiry on the first hit
-- only. This is the Redis `INCR` documentation's "Pattern: Rate limiter 2"
-- (https://redis.io/docs/latest/commands/incr/) as one script, so that no client can
-- crash between `INCR` and `PEXPIRE` and leave a counter without expiry. A value this
-- crate did not write (another type, not a decimal count, or without expiry) is left as it
-- is, and the script answers an error.
--
-- KEYS[1]  the counter
-- ARGV[1]  the window, in ms
--
-- Reply: {count, pttl}: the count after this hit, and ms until the window resets.
local v = redis.pcall('GET', KEYS[1])
if v and (type(v) ~= 'string' or not string.match(v, '^%d+$') or redis.call('PTTL', KEYS[1]) < 0) then
  return redis.error_reply('ERR the rate limit key holds a value tower-redlock did not write')
end
local count = redis.call('INCR', KEYS[1])
if count == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  return {count, tonumber(ARGV[1])}
end
return {count, redis.call('PTTL', KEYS[1])}
