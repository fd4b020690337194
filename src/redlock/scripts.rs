//! The Lua scripts, hashed once (SHA-1 in `redis::Script::new`) and run by `EVALSHA`,
//! with a fallback to loading them when a node answers `NOSCRIPT` (after a restart, say).

use std::sync::LazyLock;

use redis::Script;

/// Deletes the key only if it holds our token (the Redis docs' release script), and tells
/// apart "it had expired" from "another holder has it".
///
/// Returns `{1, 0}` when deleted, `{0, -2}` when the key is gone, and `{-1, pttl}` when it
/// holds another token, with the holder's remaining TTL in ms (-1: no expiry).
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return {1, 0}
elseif not v then
  return {0, -2}
end
return {-1, redis.call('PTTL', KEYS[1])}
",
    )
});

/// Sets a new TTL (ARGV[2], ms) only if the key holds our token (ARGV[1]).
///
/// Returns 1 when extended, 0 when the key is gone, -1 when it holds another token.
pub(crate) static EXTEND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
elseif not v then
  return 0
end
return -1
",
    )
});
