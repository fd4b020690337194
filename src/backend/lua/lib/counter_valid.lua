-- counter_valid(c): whether the fencing counter `c` (as read with
-- `redis.pcall('GET', ..)`) is unset or a decimal integer below 2^53 (exact as a Lua
-- number).
local function counter_valid(c)
  return not c or (type(c) == 'string' and #c <= 16 and string.match(c, '^%d+$') and tonumber(c) < 9007199254740992)
end
