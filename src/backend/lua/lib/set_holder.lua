-- set_holder(key, token, fields, ms): records the holder of the lease `token` at `key`
-- (`<prefix>{<lock key>}:holder`) as `token .. ' ' .. fields`, for `ms` ms (the lock
-- key's TTL). Only a holder record (32 lowercase hex digits and a space, then the fields:
-- this crate's, whatever its token) or nothing is replaced; any other value was not
-- written by this crate and is left as it is (the lease then records no holder).
local function set_holder(key, token, fields, ms)
  local h = redis.pcall('GET', key)
  local ours = not h or (type(h) == 'string' and string.sub(h, 33, 33) == ' '
    and not string.find(string.sub(h, 1, 32), '[^0-9a-f]'))
  if ours then
    redis.call('SET', key, token .. ' ' .. fields, 'PX', ms)
  end
end
