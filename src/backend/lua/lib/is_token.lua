-- is_token(v): whether `v` (as read with `redis.pcall('GET', ..)`) is a token as this
-- crate writes them, 32 lowercase hex digits.
local function is_token(v)
  return type(v) == 'string' and #v == 32 and not string.find(v, '[^0-9a-f]')
end
