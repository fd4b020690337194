-- Gives back a permit; when waiters marked the set, deletes the mark and publishes on the
-- release channel. A key of another type, and a mark this crate did not write, are left
-- as they are.
--
-- KEYS[1]  the permit set
-- KEYS[2]  the waiters' mark
-- ARGV[1]  the permit's token
-- ARGV[2]  the set's release channel
--
-- Reply: how many permits it removed (0 or 1).
--
-- Uses lib/unmark.lua.
-- On a key of another type `ZREM` fails with WRONGTYPE and changes nothing.
local removed = redis.pcall('ZREM', KEYS[1], ARGV[1])
if type(removed) ~= 'number' then return 0 end
if unmark(KEYS[2]) then
  redis.call('PUBLISH', ARGV[2], '')
end
return removed
