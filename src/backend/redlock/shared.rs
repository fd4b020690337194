//! Shared and exclusive access to one key (a readers-writer lock) over the Redlock nodes.
//!
//! Beside the lock key `K` (the exclusive holder), each node keeps, in `K`'s slot:
//! - `<prefix>{K}:readers`, the readers' tokens scored by their expiry (ms on the node's
//!   clock): every script prunes the expired ones, and the set expires with its last
//!   reader;
//! - `<prefix>{K}:writer-waiting`, the intent of a waiting writer that found readers
//!   (living as the waiters' mark, renewed by its attempts): no new reader is admitted
//!   meanwhile, so readers cannot starve a writer.
//!
//! A reader is admitted where `K` is free and no writer waits; a writer where `K` is free
//! and no reader is left. Both follow the plain lock's quorum and validity rules; the last
//! reader's release wakes the waiters that marked `K`.

use std::sync::{Arc, LazyLock};

use redis::Script;

use super::Redlock;
use super::acquire::{Acquisition, CleanUp, Fence};
use super::keys::{Auxiliary, Keys};
use super::scripts::{
    Attempt, Attempted, COUNTER_VALID, FOREIGN, ReleaseReply, evalsha, run, run_acked, run_attempt,
};
use crate::backend::connection::Connection;
use crate::backend::notify::{MARK, UNMARK, released};
use crate::error::{LockError, NodeFailureReason};
use crate::lease::{Access, Lease, Token, readers_key};

/// The node's clock in ms, as `now`.
pub(super) const NOW: &str = "local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)";

/// Makes the sorted set KEYS[1] expire with its latest score (ms on the node's clock).
const KEEP_UNTIL_LAST: &str = "local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if last[2] then redis.call('PEXPIREAT', KEYS[1], math.ceil(tonumber(last[2]))) end";

/// Lua that defines `is_token(v)`: whether `v` (read with `redis.pcall('GET', ..)`) is a
/// token as this crate writes them, 32 lowercase hex digits.
const IS_TOKEN: &str = "local function is_token(v)
  return type(v) == 'string' and #v == 32 and not string.find(v, '[^0-9a-f]')
end";

/// A reader's attempt. KEYS: the readers' set, the lock key, the writer intent, the
/// waiters' mark. ARGV: token, TTL (ms), the mark's TTL (ms; `0`: not a waiter). Answers
/// as every acquisition script ([`Attempted::decode`]). Anything at the lock key or the
/// writer intent, and a readers' set of another type than a sorted set, hold the lock
/// (for their `PTTL`) and are left as they are.
pub(in crate::backend::redlock) static SHARED_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
{NOW}
{MARK}
{FOREIGN}
local held = redis.call('PTTL', KEYS[2])
if held == -2 then held = redis.call('PTTL', KEYS[3]) end
if held == -2 and foreign(KEYS[1], 'zset') then held = redis.call('PTTL', KEYS[1]) end
if held ~= -2 then
  if ARGV[3] ~= '0' then mark(KEYS[4], ARGV[3]) end
  return {{0, held}}
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
{KEEP_UNTIL_LAST}
return {{1, 0}}
"
    ))
});

/// A writer's attempt. KEYS: as [`SHARED_ACQUIRE`]'s, then the fencing counter. ARGV: as
/// its, then `1` to read the fencing counter. Answers as every acquisition script. A
/// readers' set of another type holds the lock; a writer intent that is not a token is
/// neither replaced nor deleted; either is left as it is.
pub(in crate::backend::redlock) static EXCLUSIVE_ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
{NOW}
{MARK}
{FOREIGN}
{IS_TOKEN}
if foreign(KEYS[1], 'zset') then
  return {{0, redis.call('PTTL', KEYS[1])}}
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
local waiting = ARGV[3] ~= '0'
if last[2] then
  if waiting then
    local intent = redis.pcall('GET', KEYS[3])
    if not intent or is_token(intent) then
      redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[3])
    end
    mark(KEYS[4], ARGV[3])
  end
  return {{0, math.max(0, math.ceil(tonumber(last[2]) - now))}}
end
local c = false
if ARGV[4] == '1' then
  c = redis.pcall('GET', KEYS[5])
  if not {COUNTER_VALID} then return {{-1, 1}} end
end
if redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then
  if is_token(redis.pcall('GET', KEYS[3])) then redis.call('DEL', KEYS[3]) end
  return {{1, tonumber(c or '0')}}
end
if waiting then mark(KEYS[4], ARGV[3]) end
return {{0, redis.call('PTTL', KEYS[2])}}
"
    ))
});

/// Extends a reader. KEYS: the readers' set. ARGV: token, TTL (ms). Returns 1 when
/// extended, 0 when the token is gone or expired, -1 when the set holds a value of another
/// type (left as it is).
pub(in crate::backend::redlock) static SHARED_EXTEND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
{NOW}
local s = redis.pcall('ZSCORE', KEYS[1], ARGV[1])
if type(s) == 'table' then return -1 end
if not s then return 0 end
if tonumber(s) <= now then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
{KEEP_UNTIL_LAST}
return 1
"
    ))
});

/// Releases a reader. KEYS: the readers' set, the waiters' mark. ARGV: token, `1` to wake
/// the marked waiters when the last reader leaves, the lock's release channel. Returns 1
/// when removed, 0 when gone or expired, -1 when the set holds a value of another type;
/// values this crate did not write are left as they are.
pub(in crate::backend::redlock) static SHARED_RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
{NOW}
{UNMARK}
local s = redis.pcall('ZSCORE', KEYS[1], ARGV[1])
if type(s) == 'table' then return -1 end
if not s then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[2] == '1' and redis.call('ZCARD', KEYS[1]) == 0 and unmark(KEYS[2]) then
  redis.call('PUBLISH', ARGV[3], '')
end
if tonumber(s) <= now then return 0 end
return 1
"
    ))
});

async fn attempt(
    mut conn: Connection,
    prefix: Arc<str>,
    key: Arc<str>,
    token: Token,
    access: Access,
    a: Attempt,
) -> Result<Attempted, NodeFailureReason> {
    let (script, numkeys) = match access {
        Access::Shared => (&*SHARED_ACQUIRE, 4),
        Access::Exclusive => (&*EXCLUSIVE_ACQUIRE, 5),
    };
    let mut cmd = evalsha(script, numkeys);
    cmd.arg(Auxiliary::readers(&prefix, &key))
        .arg(&*key)
        .arg(Auxiliary::writer_waiting(&prefix, &key))
        .arg(Auxiliary::waiters(&prefix, &key));
    if access == Access::Exclusive {
        cmd.arg(Auxiliary::fence(&prefix, &key));
    }
    cmd.arg(token.as_bytes())
        .arg(a.ttl_ms)
        .arg(a.mark_ms.unwrap_or(0));
    if access == Access::Exclusive {
        cmd.arg(if a.fenced { "1" } else { "0" });
    }
    run_attempt(&mut conn, script, &cmd, &prefix, std::slice::from_ref(&key)).await
}

/// [`SHARED_EXTEND`] on one node (`key` is the readers' set).
pub(super) async fn extend_reader(
    mut conn: Connection,
    key: Arc<str>,
    token: Token,
    ttl_ms: u64,
) -> Result<i64, NodeFailureReason> {
    let mut cmd = evalsha(&SHARED_EXTEND, 1);
    cmd.arg(&*key).arg(token.as_bytes()).arg(ttl_ms);
    run_acked(&mut conn, Some(&SHARED_EXTEND), &cmd, |&extended| {
        extended == 1
    })
    .await
}

/// [`SHARED_RELEASE`] on one node (`key` is the readers' set).
pub(super) async fn release_reader(
    mut conn: Connection,
    prefix: Arc<str>,
    key: Arc<str>,
    lock_key: Arc<str>,
    token: Token,
    publish: bool,
) -> Result<ReleaseReply, NodeFailureReason> {
    let mut cmd = evalsha(&SHARED_RELEASE, 2);
    cmd.arg(&*key)
        .arg(Auxiliary::waiters(&prefix, &lock_key))
        .arg(token.as_bytes())
        .arg(if publish { "1" } else { "0" })
        .arg(released(&prefix, &lock_key));
    Ok(ReleaseReply::of(
        run(&mut conn, &SHARED_RELEASE, &cmd).await?,
    ))
}

impl Redlock {
    /// One attempt at shared or exclusive access to a prefixed key.
    pub(super) async fn acquire_access(
        &self,
        key: Arc<str>,
        access: Access,
        waiting: bool,
    ) -> Result<Lease, LockError> {
        let prefix = &self.inner.policy.prefix;
        let lease_keys = match access {
            Access::Shared => Keys::Readers {
                set: readers_key(prefix, &key),
                lock: key.clone(),
            },
            Access::Exclusive => Keys::Lock(key.clone()),
        };
        let mut acquisition = Acquisition::new(self, lease_keys);
        let token = acquisition.token;
        let fence_ms = self.inner.fence_ms.filter(|_| access == Access::Exclusive);
        let a = Attempt {
            ttl_ms: self.inner.policy.ttl_ms(),
            fenced: fence_ms.is_some(),
            mark_ms: waiting.then_some(self.inner.mark_ms),
            raise_fence_ms: None,
        };
        let round = acquisition
            .round(
                |conn| attempt(conn, prefix.clone(), key.clone(), token, access, a),
                CleanUp::Awaited,
                None,
            )
            .await?;
        acquisition.won(&round, Fence::in_rounds(fence_ms)).await
    }
}
