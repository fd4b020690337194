-- Renews a permit, atomically: if our token is still live, moves its expiry to now + TTL
-- (`ZADD XX`, never re-adding it) and keeps the set alive that long. On a key of another
-- type `ZSCORE` fails before anything is written: the script answers that error.
--
-- KEYS[1]  the permit set
-- ARGV[1]  the permit's token
-- ARGV[2]  the permit's TTL, in ms
--
-- Reply: 1 renewed, 0 the permit is gone or expired.
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if not score or tonumber(score) <= now then
  return 0
end
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[1])
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return 1
