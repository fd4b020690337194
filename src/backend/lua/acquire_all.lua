-- Takes every key of a set, or none: while any key is held it sets nothing and answers
-- the longest time a holder has left, so two clients naming the same keys in opposite
-- orders cannot each hold a part.
--
-- KEYS[1..N]       the lock keys
-- KEYS[N+1..2N]    their holder records
-- KEYS[2N+1..3N]   fenced only: their fencing counters
-- ARGV[1]          the token
-- ARGV[2]          the lease TTL, in ms
-- ARGV[3]          N
-- ARGV[4]          `1`: fenced, read the counters
-- ARGV[5]          the holder's fields (see lib/set_holder.lua), recorded beside each key
--
-- Reply, as every acquisition script's:
--   {1, counter}  set; the highest counter as it stood (0 when unset or not read)
--   {0, pttl}     held, for `pttl` ms more at the longest (-1: a key has no expiry)
--   {-1, i}       the counter of the i-th key is not an integer below 2^53 (nothing set)
--
-- Uses lib/counter_valid.lua, lib/set_holder.lua.
local n = tonumber(ARGV[3])
local held, longest = false, 0
for i = 1, n do
  local p = redis.call('PTTL', KEYS[i])
  if p == -1 then
    held, longest = true, -1
  elseif p >= 0 then
    held = true
    if longest ~= -1 and p > longest then longest = p end
  end
end
if held then
  return {0, longest}
end
local top = 0
if ARGV[4] == '1' then
  for i = 1, n do
    local c = redis.pcall('GET', KEYS[2 * n + i])
    if not counter_valid(c) then
      return {-1, i}
    end
    if c and tonumber(c) > top then top = tonumber(c) end
  end
end
for i = 1, n do
  redis.call('SET', KEYS[i], ARGV[1], 'PX', ARGV[2])
  set_holder(KEYS[n + i], ARGV[1], ARGV[5], ARGV[2])
end
return {1, top}
