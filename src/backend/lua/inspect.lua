-- Reads what one node holds for a lock, writing nothing. Values of another type read as
-- absent.
--
-- KEYS[1]  the lock key
-- KEYS[2]  the fencing counter
-- KEYS[3]  the readers' set
-- KEYS[4]  the waiters' mark
-- KEYS[5]  the fair queue
--
-- Reply: {pttl, counter, readers, marks}: the lock key's `PTTL`; the counter (`''` when
-- unset); the readers' set's size; how many of the mark and the queue exist (0 to 2).
local c = redis.pcall('GET', KEYS[2])
if type(c) ~= 'string' then c = '' end
local r = redis.pcall('ZCARD', KEYS[3])
if type(r) ~= 'number' then r = 0 end
return {redis.call('PTTL', KEYS[1]), c, r, redis.call('EXISTS', KEYS[4], KEYS[5])}
