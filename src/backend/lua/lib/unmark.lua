-- unmark(key): deletes the waiters' mark `key` if it is one (`1`), and answers whether it
-- did; a value this crate did not write is left as it is.
local function unmark(key)
  if redis.pcall('GET', key) ~= '1' then return false end
  redis.call('DEL', key)
  return true
end
