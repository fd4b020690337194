-- foreign(key, kind): whether `key` holds a value of another type than `kind` (a Redis
-- `TYPE` name), which this crate did not write and leaves as it is.
local function foreign(key, kind)
  local t = redis.call('TYPE', key).ok
  return t ~= kind and t ~= 'none'
end
