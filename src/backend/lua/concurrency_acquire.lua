-- Takes a permit, atomically: drops the expired permits, counts the live ones, and under
-- the limit adds ours (scored by its expiry in ms on the server's `TIME`, so the replicas'
-- clocks do not matter) and keeps the set alive as long as its newest permit. A waiter's
-- try also sets the waiters' mark when it gets none, so that the next release publishes
-- (concurrency_release.lua). A key of another type is not touched: the script answers an
-- error (a mark this crate did not write is left as it is, and waiters fall back to their
-- timer). This is Redisson's `RPermitExpirableSemaphore`.
--
-- KEYS[1]  the permit set
-- KEYS[2]  optional, a waiter's try: the waiters' mark
-- ARGV[1]  the limit
-- ARGV[2]  the permit's TTL, in ms
-- ARGV[3]  the permit's token
-- ARGV[4]  the mark's TTL, in ms
--
-- Reply: {1, held} with the permit, {0, held} without; `held` counts the live permits,
-- ours included.
--
-- Uses lib/mark.lua.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
-- On a key of another type the command fails with WRONGTYPE and changes nothing: no
-- `TYPE` needed before it.
local swept = redis.pcall('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if type(swept) == 'table' and swept.err then
  return redis.error_reply('WRONGTYPE the permit key holds a value tower-redlock did not write')
end
local held = redis.call('ZCARD', KEYS[1])
if held >= tonumber(ARGV[1]) then
  if KEYS[2] then
    mark(KEYS[2], ARGV[4])
  end
  return {0, held}
end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[3])
if redis.call('PTTL', KEYS[1]) < ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return {1, held + 1}
