-- Deletes the lock key whoever holds it, waking the waiters that marked it as a release
-- does. Only a string is a lock (any client's token): a value of another type is left as
-- it is, as is a mark this crate did not write.
--
-- KEYS[1]  the lock key
-- KEYS[2]  the waiters' mark
-- ARGV[1]  the lock's release channel
--
-- Reply: 1 a lock was there (deleted), 0 none.
--
-- Uses lib/unmark.lua.
if redis.call('TYPE', KEYS[1]).ok ~= 'string' then return 0 end
redis.call('DEL', KEYS[1])
if unmark(KEYS[2]) then
  redis.call('PUBLISH', ARGV[1], '')
end
return 1
