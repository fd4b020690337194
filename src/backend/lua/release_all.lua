-- Deletes every lock key of a set that holds our token, and our lease's holder records
-- beside them; when asked, wakes the waiters that marked a deleted key. A value this crate
-- did not write (at a lock key, a holder record or a mark) is left as it is.
--
-- KEYS[1..N]       the lock keys
-- KEYS[N+1..2N]    their waiters' marks
-- KEYS[2N+1..3N]   their holder records
-- ARGV[1]          the token
-- ARGV[2]          `1`: wake the marked waiters
-- ARGV[3]          N
-- ARGV[3+i]        with ARGV[2] `1`: the release channel of the i-th key
--
-- Reply, as the single-key release's (release.lua): 1 all deleted, 0 some gone, -1 any
-- held by another.
--
-- Uses lib/unmark.lua, lib/is_holder.lua.
local n = tonumber(ARGV[3])
local deleted, other = 0, false
for i = 1, n do
  if is_holder(KEYS[2 * n + i], ARGV[1]) then
    redis.call('DEL', KEYS[2 * n + i])
  end
  local v = redis.pcall('GET', KEYS[i])
  if v == ARGV[1] then
    redis.call('DEL', KEYS[i])
    deleted = deleted + 1
    if ARGV[2] == '1' and unmark(KEYS[n + i]) then
      redis.call('PUBLISH', ARGV[3 + i], '')
    end
  elseif v then
    other = true
  end
end
if other then return -1 end
if deleted == n then return 1 end
return 0
