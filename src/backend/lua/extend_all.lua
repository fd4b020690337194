-- Sets a new TTL on every lock key of a set (one lock key, too) if every one holds our
-- token, and on the holder records of our lease beside them; fenced, also refreshes the
-- valid fencing counters' TTL.
--
-- KEYS[1..N]       the lock keys
-- KEYS[N+1..2N]    their holder records
-- KEYS[2N+1..3N]   fenced only: their fencing counters
-- ARGV[1]          the token
-- ARGV[2]          the lease TTL, in ms
-- ARGV[3]          N
-- ARGV[4]          fenced only: the counters' TTL, in ms
--
-- Reply: 1 extended; else nothing is extended, and -1 a key holds anything else, 0 a key
-- is gone.
--
-- Uses lib/counter_valid.lua, lib/is_holder.lua.
local n = tonumber(ARGV[3])
local gone = false
for i = 1, n do
  local v = redis.pcall('GET', KEYS[i])
  if not v then
    gone = true
  elseif v ~= ARGV[1] then
    return -1
  end
end
if gone then return 0 end
for i = 1, n do
  redis.call('PEXPIRE', KEYS[i], ARGV[2])
  if is_holder(KEYS[n + i], ARGV[1]) then
    redis.call('PEXPIRE', KEYS[n + i], ARGV[2])
  end
end
if #KEYS > 2 * n then
  for i = 1, n do
    local c = redis.pcall('GET', KEYS[2 * n + i])
    if c and counter_valid(c) then
      redis.call('PEXPIRE', KEYS[2 * n + i], ARGV[4])
    end
  end
end
return 1
