-- A fair attempt: only the head of the queue (or anyone, when it is empty) may take the
-- lock. Prunes the expired entries, queues the waiter (or renews its entry), and sets the
-- lock key with `SET NX PX` when it is the waiter's turn (its holder recorded beside it). A queue or deadlines key of
-- another type than a sorted set holds the lock (for its `PTTL`) and is left as it is.
--
-- KEYS[1]  the lock key
-- KEYS[2]  the queue (waiter ids scored by arrival, µs since the Unix epoch)
-- KEYS[3]  the deadlines (waiter ids scored by their entry's deadline, ms on the node's
--          clock)
-- KEYS[4]  the waiters' mark
-- KEYS[5]  the fencing counter
-- KEYS[6]  the holder record
-- ARGV[1]  the waiter id
-- ARGV[2]  the token
-- ARGV[3]  the lease TTL, in ms
-- ARGV[4]  the mark's TTL, in ms; `0`: do not mark
-- ARGV[5]  the waiter's arrival, in µs since the Unix epoch
-- ARGV[6]  the entry's lifetime, in ms; `0`: do not queue
-- ARGV[7]  `1`: read the fencing counter
-- ARGV[8]  the holder's fields (see lib/set_holder.lua)
--
-- Reply, as every acquisition script's:
--   {1, counter}  set; the counter as it stood (0 when unset or not read)
--   {0, pttl}     held, for `pttl` ms more (-1: no expiry; -2: free, but another
--                 waiter's turn)
--   {-1, 1}       the counter is not an integer below 2^53 (nothing set)
--
-- Uses lib/now.lua, lib/mark.lua, lib/foreign.lua, lib/counter_valid.lua,
-- lib/set_holder.lua.
local now = now_ms()
for i = 2, 3 do
  if foreign(KEYS[i], 'zset') then return {0, redis.call('PTTL', KEYS[i])} end
end
local gone = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 100)
if #gone > 0 then
  redis.call('ZREM', KEYS[2], unpack(gone))
  redis.call('ZREM', KEYS[3], unpack(gone))
end
local entry = tonumber(ARGV[6])
if entry > 0 then
  redis.call('ZADD', KEYS[2], 'NX', ARGV[5], ARGV[1])
  redis.call('ZADD', KEYS[3], now + entry, ARGV[1])
  local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
  local at = math.ceil(tonumber(last[2]))
  redis.call('PEXPIREAT', KEYS[2], at)
  redis.call('PEXPIREAT', KEYS[3], at)
end
local head = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
if not head or head == ARGV[1] then
  local c = false
  if ARGV[7] == '1' then
    c = redis.pcall('GET', KEYS[5])
    if not counter_valid(c) then return {-1, 1} end
  end
  if redis.call('SET', KEYS[1], ARGV[2], 'NX', 'PX', ARGV[3]) then
    set_holder(KEYS[6], ARGV[2], ARGV[8], ARGV[3])
    if head then
      redis.call('ZREM', KEYS[2], ARGV[1])
      redis.call('ZREM', KEYS[3], ARGV[1])
    end
    return {1, tonumber(c or '0')}
  end
end
if ARGV[4] ~= '0' then mark(KEYS[4], ARGV[4]) end
return {0, redis.call('PTTL', KEYS[1])}
