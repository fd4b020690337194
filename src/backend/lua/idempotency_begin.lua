-- A first request of an idempotency key: the stored record when there is one, else an
-- attempt on the lock (`SET NX PX`, its holder recorded beside it with the same TTL). A value of another type at the record key is left as
-- it is and answers as a record that does not parse (the layer answers 500).
--
-- KEYS[1]  the lock key
-- KEYS[2]  the idempotency record
-- KEYS[3]  the holder record
-- ARGV[1]  the token
-- ARGV[2]  the lease TTL, in ms
-- ARGV[3]  the holder's fields (see lib/set_holder.lua)
--
-- Reply:
--   {2, record}  the record (`''` for a value of another type)
--   {1}          the lock is set
--   {0, pttl}    the lock is held, for `pttl` ms more (-1: no expiry)
--
-- Uses lib/set_holder.lua.
local r = redis.pcall('GET', KEYS[2])
if type(r) == 'string' then
  return {2, r}
elseif r then
  return {2, ''}
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  set_holder(KEYS[3], ARGV[1], ARGV[3], ARGV[2])
  return {1}
end
return {0, redis.call('PTTL', KEYS[1])}
