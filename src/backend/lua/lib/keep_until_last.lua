-- keep_until_last(key): makes the sorted set `key` expire with its latest score (ms on the
-- node's clock).
local function keep_until_last(key)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] then redis.call('PEXPIREAT', key, math.ceil(tonumber(last[2]))) end
end
