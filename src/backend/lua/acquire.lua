-- An attempt on one lock key: `SET KEYS[1] ARGV[1] NX PX ARGV[2]` when the key is free,
-- recording the holder beside it with the same TTL, else the holder's `PTTL`, in the same
-- reply, so that a refusal costs one round trip (and writes nothing but a waiter's mark).
-- A lock key holding anything (another client's token, or a value of another type) is
-- held.
--
-- KEYS[1]  the lock key
-- KEYS[2]  the holder record
-- KEYS[3]  a waiter's attempt only: the waiters' mark
-- ARGV[1]  the token
-- ARGV[2]  the lease TTL, in ms
-- ARGV[3]  a waiter's attempt: the mark's TTL, in ms, set atomically with the check when
--          the lock is held; `0`: not a waiter, no mark (and no KEYS[3])
-- ARGV[4]  the holder's fields (see lib/set_holder.lua)
--
-- Reply, as short as `SET`'s, so that the client parses no array:
--   +OK   set
--   pttl  (an integer) held, for `pttl` ms more (-1: no expiry)
--
-- Uses lib/mark.lua, lib/set_holder.lua.
local t = redis.call('PTTL', KEYS[1])
if t == -2 then
  redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
  set_holder(KEYS[2], ARGV[1], ARGV[4], ARGV[2])
  return redis.status_reply('OK')
end
if ARGV[3] ~= '0' then
  mark(KEYS[3], ARGV[3])
end
return t
