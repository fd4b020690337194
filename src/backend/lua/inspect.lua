-- Reads what one node holds for a lock, writing nothing. Values of another type read as
-- absent.
--
-- KEYS[1]  the lock key
-- KEYS[2]  the fencing counter
-- KEYS[3]  the readers' set
-- KEYS[4]  the waiters' mark
-- KEYS[5]  the fair queue
-- KEYS[6]  the holder record
--
-- Reply: {pttl, counter, readers, marks, holder}: the lock key's `PTTL`; the counter
-- (`''` when unset); the readers' set's size; how many of the mark and the queue exist
-- (0 to 2); the holder's fields when the record names the token the lock key holds, else
-- `''`.
--
-- Uses lib/is_holder.lua.
local c = redis.pcall('GET', KEYS[2])
if type(c) ~= 'string' then c = '' end
local r = redis.pcall('ZCARD', KEYS[3])
if type(r) ~= 'number' then r = 0 end
local v = redis.pcall('GET', KEYS[1])
local h = ''
if type(v) == 'string' and is_holder(KEYS[6], v) then
  h = string.sub(redis.call('GET', KEYS[6]), #v + 2)
end
return {redis.call('PTTL', KEYS[1]), c, r, redis.call('EXISTS', KEYS[4], KEYS[5]), h}
