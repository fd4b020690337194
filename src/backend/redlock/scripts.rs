//! The Lua scripts, hashed once (SHA-1 in `redis::Script::new`) and run by `EVALSHA`,
//! with a fallback to loading them when a node answers `NOSCRIPT` (after a restart, say).

use std::sync::{Arc, LazyLock};

use redis::aio::ConnectionManager;
use redis::{Cmd, ErrorKind, FromRedisValue, RedisResult, Script, ServerErrorKind, Value};

use crate::error::NodeFailureReason;
use crate::lease::Token;

/// `EVALSHA <hash> <numkeys>`, for the caller to add keys and arguments to. The hash is
/// computed once, when the script is first used.
fn evalsha(script: &Script, numkeys: usize) -> Cmd {
    let mut cmd = redis::cmd("EVALSHA");
    cmd.arg(script.get_hash()).arg(numkeys);
    cmd
}

/// Every script, to load on each node when the client is built.
pub(super) static ALL: [&LazyLock<Script>; 5] =
    [&RELEASE, &EXTEND, &ACQUIRE_WAITING, &ACQUIRE_FENCED, &FENCE];

/// Runs an [`evalsha`] command; loads the script and runs it again when the node answers
/// `NOSCRIPT` (a node restarted, or one that never saw it).
async fn run<T: FromRedisValue>(
    conn: &mut ConnectionManager,
    script: &Script,
    cmd: &Cmd,
) -> RedisResult<T> {
    match cmd.query_async(conn).await {
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            script.load_async(conn).await?;
            cmd.query_async(conn).await
        }
        result => result,
    }
}

/// Deletes the key only if it holds our token (the Redis docs' release script), and tells
/// apart "it had expired" from "another holder has it".
///
/// Waking waiters: a waiter that subscribed to the key's channel marks the holder's value
/// with a `+` after the token ([`ACQUIRE_WAITING`]). When the key holds `{token}+` and
/// ARGV[2] is `1`, the release publishes on the channel named after the key. A key nobody
/// waits for is released without a `PUBLISH`, at the cost of the bare compare-and-delete.
/// The cleanup of an attempt that fell short of a quorum passes `0`: two waiters that split
/// the nodes between them would otherwise wake each other in a loop while the holder
/// keeps the lock.
///
/// Returns 1 when deleted, 0 when the key is gone, and `-3 - pttl` when it holds another
/// token, where `pttl` is the holder's remaining TTL in ms (-1: no expiry); one integer,
/// the cheapest reply to build and parse.
pub(super) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
elseif not v then
  return 0
elseif v == ARGV[1] .. '+' then
  redis.call('DEL', KEYS[1])
  if ARGV[2] == '1' then
    redis.call('PUBLISH', KEYS[1], '')
  end
  return 1
end
return -3 - redis.call('PTTL', KEYS[1])
",
    )
});

/// Sets a new TTL (ARGV[2], ms) only if the key holds our token (ARGV[1]), marked by a
/// waiter or not.
///
/// Returns 1 when extended, 0 when the key is gone, -1 when it holds another token.
pub(super) static EXTEND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] or (v and v == ARGV[1] .. '+') then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
elseif not v then
  return 0
end
return -1
",
    )
});

/// A waiter's attempt: `SET KEYS[1] ARGV[1] NX PX ARGV[2]`, and when the key is held,
/// the waiter's mark on the holder's value (once; `APPEND` keeps the TTL), so that the
/// holder's release publishes. Only this crate's 32-digit tokens are marked (`pcall`: a key
/// of another type is just held, not an error).
///
/// Returns 0 when set, -1 when the key is held.
pub(super) static ACQUIRE_WAITING: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 0
end
{MARK}
return -1
"
    ))
});

/// Marks the holder's value of KEYS[1] for a waiter: one `+` after a 32-digit token.
const MARK: &str = r"if redis.pcall('STRLEN', KEYS[1]) == 32 then
  redis.call('APPEND', KEYS[1], '+')
end";

/// `SET KEYS[1] ARGV[1] NX PX ARGV[2]`, and on success the fencing counter KEYS[2] as it
/// stands (0 when unset), read atomically with the SET. Returns -1 when the key is held,
/// after marking it as [`ACQUIRE_WAITING`] does when ARGV[3] is `1` (a waiter's attempt).
pub(super) static ACQUIRE_FENCED: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return tonumber(redis.call('GET', KEYS[2]) or '0')
end
if ARGV[3] == '1' then
  {MARK}
end
return -1
"
    ))
});

/// Raises the fencing counter KEYS[2] to ARGV[2] while KEYS[1] holds our token ARGV[1]
/// (marked by a waiter or not).
/// Returns 1 when done (or already higher), 0 when the key does not hold our token.
pub(super) static FENCE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.call('GET', KEYS[1])
if v ~= ARGV[1] and v ~= ARGV[1] .. '+' then
  return 0
end
local current = tonumber(redis.call('GET', KEYS[2]) or '0')
if current < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[2])
end
return 1
",
    )
});

/// One node's answer to a release.
pub(super) enum Release {
    /// The key held our token and is deleted.
    Deleted,
    /// The key was gone.
    Absent,
    /// Another token holds the key, for `pttl_ms` more (-1: no expiry).
    HeldByOther { pttl_ms: i64 },
}

/// An acquisition attempt on one node: `Some(counter)` when the key is ours (the fencing
/// counter as it stood, 0 without fencing), `None` when it is held.
///
/// `fence_key`: read the fencing counter with the `SET`; `waiting`: mark the holder's
/// value for a waiter (see [`ACQUIRE_WAITING`]).
pub(super) async fn acquire(
    mut conn: ConnectionManager,
    key: Arc<str>,
    fence_key: Option<Arc<str>>,
    token: Token,
    ttl_ms: u64,
    waiting: bool,
) -> Result<Option<u64>, NodeFailureReason> {
    let reply = match fence_key {
        Some(fence_key) => {
            let mut cmd = evalsha(&ACQUIRE_FENCED, 2);
            cmd.arg(&*key)
                .arg(&*fence_key)
                .arg(token.as_bytes())
                .arg(ttl_ms)
                .arg(if waiting { "1" } else { "0" });
            let counter: i64 = run(&mut conn, &ACQUIRE_FENCED, &cmd).await?;
            u64::try_from(counter).ok()
        }
        None if waiting => {
            let mut cmd = evalsha(&ACQUIRE_WAITING, 1);
            cmd.arg(&*key).arg(token.as_bytes()).arg(ttl_ms);
            let set: i64 = run(&mut conn, &ACQUIRE_WAITING, &cmd).await?;
            u64::try_from(set).ok()
        }
        None => {
            let mut cmd = redis::cmd("SET");
            cmd.arg(&*key)
                .arg(token.as_bytes())
                .arg("NX")
                .arg("PX")
                .arg(ttl_ms);
            let reply = cmd.query_async::<Value>(&mut conn).await?;
            matches!(reply, Value::Okay).then_some(0)
        }
    };
    Ok(reply)
}

/// Extends the key's TTL to `ttl_ms` where it holds `token`: 1 when done, 0 when the
/// key is gone, -1 when another token holds it.
pub(super) async fn extend(
    mut conn: ConnectionManager,
    key: Arc<str>,
    token: Token,
    ttl_ms: u64,
) -> Result<i64, NodeFailureReason> {
    let mut cmd = evalsha(&EXTEND, 1);
    cmd.arg(&*key).arg(token.as_bytes()).arg(ttl_ms);
    Ok(run(&mut conn, &EXTEND, &cmd).await?)
}

/// Deletes the key where it holds `token`; `publish` wakes the waiters that marked it.
pub(super) async fn release(
    mut conn: ConnectionManager,
    key: Arc<str>,
    token: Token,
    publish: bool,
) -> Result<Release, NodeFailureReason> {
    let mut cmd = evalsha(&RELEASE, 1);
    cmd.arg(&*key)
        .arg(token.as_bytes())
        .arg(if publish { "1" } else { "0" });
    let code: i64 = run(&mut conn, &RELEASE, &cmd).await?;
    Ok(match code {
        1 => Release::Deleted,
        0 => Release::Absent,
        _ => Release::HeldByOther {
            pttl_ms: (-3i64).saturating_sub(code),
        },
    })
}

/// Raises the fencing counter to `fencing_token` where the key holds `token`: 1 when
/// done, 0 when the key does not hold the token.
pub(super) async fn raise_fence(
    mut conn: ConnectionManager,
    key: Arc<str>,
    fence_key: Arc<str>,
    token: Token,
    fencing_token: u64,
) -> Result<i64, NodeFailureReason> {
    let mut cmd = evalsha(&FENCE, 2);
    cmd.arg(&*key)
        .arg(&*fence_key)
        .arg(token.as_bytes())
        .arg(fencing_token);
    Ok(run(&mut conn, &FENCE, &cmd).await?)
}

/// Loads every script on the node.
pub(super) async fn load_all(mut conn: ConnectionManager) -> Result<(), NodeFailureReason> {
    for script in ALL {
        script.load_async(&mut conn).await?;
    }
    Ok(())
}
