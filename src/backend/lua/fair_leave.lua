-- Leaves the fair queue, waking the others when the leaver was the head. Keys of another
-- type than a sorted set are left as they are.
--
-- KEYS[1]  the queue
-- KEYS[2]  the deadlines
-- ARGV[1]  the waiter id
-- ARGV[2]  the lock's release channel
--
-- Reply: 1 done (whether or not the waiter was queued), 0 a key holds a value of another
-- type.
--
-- Uses lib/foreign.lua.
if foreign(KEYS[1], 'zset') or foreign(KEYS[2], 'zset') then return 0 end
local head = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if head == ARGV[1] and redis.call('ZCARD', KEYS[1]) > 0 then
  redis.call('PUBLISH', ARGV[2], '')
end
return 1
