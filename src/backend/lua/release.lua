-- Deletes the lock key only if it holds our token (the Redis docs' release script), and
-- then our lease's holder record beside it (set and extended with the lock key, it expires
-- with it: where the key is no longer ours, the record is not either). The cleanup of an
-- attempt that fell short, on a node where nothing of ours was set, reads one key. A release that wakes waiters
-- passes the waiters' mark as KEYS[3] and the lock's release channel as ARGV[2]: when the
-- mark is there, it deletes it and publishes on the channel. The cleanup of an attempt
-- that fell short passes no mark: two waiters that split the nodes would otherwise wake
-- each other in a loop while the holder keeps the lock. A value this crate did not write
-- (at any key) is left as it is.
--
-- KEYS[1]  the lock key
-- KEYS[2]  the holder record
-- KEYS[3]  optional: the waiters' mark
-- ARGV[1]  the token
-- ARGV[2]  with KEYS[3]: the lock's release channel
--
-- Reply: 1 deleted, 0 the key is gone, -1 it holds anything else.
--
-- Uses lib/unmark.lua, lib/is_holder.lua.
local v = redis.pcall('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if is_holder(KEYS[2], ARGV[1]) then
    redis.call('DEL', KEYS[2])
  end
  if KEYS[3] and unmark(KEYS[3]) then
    redis.call('PUBLISH', ARGV[2], '')
  end
  return 1
elseif not v then
  return 0
end
return -1
