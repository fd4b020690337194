-- GCRA (the generic cell rate algorithm; see `Quota::gcra`) on a key that holds the
-- theoretical arrival time (TAT) in µs on the server's clock (`TIME`: the replicas'
-- clocks never enter it). Integers throughout, below 2^53, so Lua's doubles hold them
-- exactly; written with `%d`, never in exponent form. A value this crate did not write
-- (another type, not digits, or without expiry) is left as it is, and the script answers
-- an error.
--
-- KEYS[1]  the TAT
-- ARGV[1]  the emission interval, in µs
-- ARGV[2]  the tolerance, in µs
--
-- Reply:
--   {1, remaining, reset}  allowed: the TAT moved on by one emission; what is left of
--                          the burst; µs until all of it is back
--   {0, retry, reset}      refused: µs until a request would pass; µs until all of the
--                          burst is back
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local emission = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])
local v = redis.pcall('GET', KEYS[1])
local tat = now
if v then
  if type(v) ~= 'string' or #v > 16 or not string.match(v, '^%d+$') or redis.call('PTTL', KEYS[1]) < 0 then
    return redis.error_reply('ERR the rate limit key holds a value tower-redlock did not write')
  end
  tat = math.max(tonumber(v), now)
end
if tat - now > tolerance then
  return {0, tat - now - tolerance, tat - now}
end
tat = tat + emission
redis.call('SET', KEYS[1], string.format('%d', tat), 'PX', math.ceil((tat - now) / 1000))
return {1, math.floor((tolerance + emission - (tat - now)) / emission), tat - now}
