-- Stores the idempotency record, then deletes the lock if it holds our token (and our
-- lease's holder record beside it), publishing on the lock's release channel when a
-- waiter set the mark. A node where the lock is gone stores the record too, so that it
-- lives on every node that can take it; a node where another holder has the lock is left
-- alone. A value at the record key that is not a record (one that does not begin with
-- the record format's magic, `TRI1`: see `MAGIC` in src/idempotency/record.rs) is left as
-- it is: the lock is released all the same, and the script answers an error.
--
-- KEYS[1]  the lock key
-- KEYS[2]  the idempotency record
-- KEYS[3]  the waiters' mark
-- KEYS[4]  the holder record
-- ARGV[1]  the token
-- ARGV[2]  the record
-- ARGV[3]  the record's TTL, in ms
-- ARGV[4]  the lock's release channel
--
-- Reply: 1 stored, -1 another holder has the lock (nothing written), or an error when
-- the record key holds a value this crate did not write.
--
-- Uses lib/unmark.lua, lib/is_holder.lua.
local v = redis.pcall('GET', KEYS[1])
if v and v ~= ARGV[1] then
  return -1
end
local r = redis.pcall('GET', KEYS[2])
local ours = not r or (type(r) == 'string' and string.sub(r, 1, 4) == 'TRI1')
if ours then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
end
if is_holder(KEYS[4], ARGV[1]) then
  redis.call('DEL', KEYS[4])
end
if v then
  redis.call('DEL', KEYS[1])
  if unmark(KEYS[3]) then
    redis.call('PUBLISH', ARGV[4], '')
  end
end
if not ours then
  return redis.error_reply('ERR the idempotency record key holds a value tower-redlock did not write; it was left as it is')
end
return 1
