-- mark(key, ms): sets the waiters' mark `key` (`1`) for `ms` ms, unless it holds a value
-- this crate did not write, which is left as it is (a release then does not publish, and
-- the waiters fall back to their timer).
local function mark(key, ms)
  local m = redis.pcall('GET', key)
  if not m or m == '1' then redis.call('SET', key, '1', 'PX', ms) end
end
