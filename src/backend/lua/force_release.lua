-- Deletes the lock key whoever holds it, and its holder's record beside it, waking the
-- waiters that marked it as a release does. Only a string is a lock (any client's token):
-- a value of another type is left as it is, as are a mark and a holder record this crate
-- did not write (a record is deleted only when it names the token the lock key held).
--
-- KEYS[1]  the lock key
-- KEYS[2]  the waiters' mark
-- KEYS[3]  the holder record
-- ARGV[1]  the lock's release channel
--
-- Reply: 1 a lock was there (deleted), 0 none.
--
-- Uses lib/unmark.lua, lib/is_holder.lua.
local v = redis.pcall('GET', KEYS[1])
if type(v) ~= 'string' then return 0 end
redis.call('DEL', KEYS[1])
if is_holder(KEYS[3], v) then
  redis.call('DEL', KEYS[3])
end
if unmark(KEYS[2]) then
  redis.call('PUBLISH', ARGV[1], '')
end
return 1
