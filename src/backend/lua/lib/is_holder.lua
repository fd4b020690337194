-- is_holder(key, token): whether `key` holds the holder record of the lease `token`
-- (`token .. ' ' .. fields`, see lib/set_holder.lua): the only one a renewal extends and
-- a release deletes.
local function is_holder(key, token)
  local h = redis.pcall('GET', key)
  return type(h) == 'string' and string.sub(h, 1, #token + 1) == token .. ' '
end
