-- Raises the fencing counters of a set (one lock key, too) to the lease's fencing token,
-- while every lock key holds our token: the write-back round of a fenced acquisition on
-- several nodes. A counter already at or above it keeps its value and gets the new TTL.
--
-- KEYS[1..N]     the lock keys
-- KEYS[N+1..2N]  their fencing counters
-- ARGV[1]        the token
-- ARGV[2]        the fencing token
-- ARGV[3]        the counters' TTL, in ms
-- ARGV[4]        N
--
-- Reply: 1 done, 0 a key does not hold the token, -2 a counter is not an integer below
-- 2^53 (none written).
--
-- Uses lib/counter_valid.lua.
local n = tonumber(ARGV[4])
for i = 1, n do
  if redis.pcall('GET', KEYS[i]) ~= ARGV[1] then return 0 end
end
for i = 1, n do
  local c = redis.pcall('GET', KEYS[n + i])
  if not counter_valid(c) then return -2 end
end
for i = 1, n do
  local c = redis.call('GET', KEYS[n + i])
  if tonumber(c or '0') < tonumber(ARGV[2]) then
    redis.call('SET', KEYS[n + i], ARGV[2], 'PX', ARGV[3])
  else
    redis.call('PEXPIRE', KEYS[n + i], ARGV[3])
  end
end
return 1
