-- An attempt on one lock key that reads its fencing counter atomically with the `SET`
-- (acquire.lua otherwise), recording the holder beside the lock as acquire.lua does.
-- When ARGV[5] is not `0`, the attempt that sets the lock also raises the counter by one:
-- a client of one node needs no second round for its fencing token, which is the counter
-- as it stood plus one.
--
-- KEYS[1]  the lock key
-- KEYS[2]  the fencing counter
-- KEYS[3]  the waiters' mark
-- KEYS[4]  the holder record
-- ARGV[1]  the token
-- ARGV[2]  the lease TTL, in ms
-- ARGV[3]  the mark's TTL, in ms
-- ARGV[4]  `1`: a waiter's attempt, which sets the mark when the lock is held
-- ARGV[5]  `0`, or the TTL in ms of the counter raised with the `SET`
-- ARGV[6]  the holder's fields (see lib/set_holder.lua)
--
-- Reply, as every acquisition script's:
--   {1, counter}  set; the counter as it stood (0 when unset)
--   {0, pttl}     held, for `pttl` ms more (-1: no expiry)
--   {-1, 1}       the counter is not an integer below 2^53 (nothing written)
--
-- Uses lib/counter_valid.lua, lib/mark.lua, lib/set_holder.lua.
local c = redis.pcall('GET', KEYS[2])
if not counter_valid(c) then
  return {-1, 1}
end
local t = redis.call('PTTL', KEYS[1])
if t == -2 then
  redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
  set_holder(KEYS[4], ARGV[1], ARGV[6], ARGV[2])
  if ARGV[5] ~= '0' then redis.call('SET', KEYS[2], string.format('%d', tonumber(c or '0') + 1), 'PX', ARGV[5]) end
  return {1, tonumber(c or '0')}
end
if ARGV[4] == '1' then
  mark(KEYS[3], ARGV[3])
end
return {0, t}
