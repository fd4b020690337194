//! The Lua scripts, hashed once (SHA-1 in `redis::Script::new`) and run by `EVALSHA`,
//! with a fallback to loading them when a node answers `NOSCRIPT` (after a restart, say).

use std::sync::{Arc, LazyLock};

use redis::{Cmd, ErrorKind, FromRedisValue, RedisResult, Script, ServerErrorKind, Value};

use super::keys::Auxiliary;
use crate::backend::connection::Connection;
use crate::backend::node::ReplicaAck;
use crate::backend::notify::{MARK, UNMARK, released};
use crate::error::NodeFailureReason;
use crate::lease::Token;

/// A command named `name`, with room for this crate's arguments (up to ten, 256 bytes), so
/// that adding them does not reallocate.
pub(super) fn command(name: &str) -> Cmd {
    let mut cmd = Cmd::with_capacity(10, 256);
    cmd.arg(name);
    cmd
}

/// `EVALSHA <hash> <numkeys>`, for the caller to add keys and arguments to.
pub(super) fn evalsha(script: &Script, numkeys: usize) -> Cmd {
    let mut cmd = command("EVALSHA");
    cmd.arg(script.get_hash()).arg(numkeys);
    cmd
}

/// Every script, to load on each node when the client is built.
pub(super) static ALL: &[&LazyLock<Script>] = &[
    &RELEASE,
    &ACQUIRE,
    &ACQUIRE_FENCED,
    &super::shared::SHARED_ACQUIRE,
    &super::shared::EXCLUSIVE_ACQUIRE,
    &super::shared::SHARED_EXTEND,
    &super::shared::SHARED_RELEASE,
    &super::fair::FAIR_ACQUIRE,
    &super::fair::FAIR_LEAVE,
    &super::multi::ACQUIRE_ALL,
    &super::multi::FENCE_ALL,
    &super::multi::EXTEND_ALL,
    &super::multi::RELEASE_ALL,
    &super::inspect::INSPECT,
    &super::inspect::FORCE_RELEASE,
    #[cfg(feature = "idempotency")]
    &super::idempotency::BEGIN,
    #[cfg(feature = "idempotency")]
    &super::idempotency::FINISH,
];
/// Runs an [`evalsha`] command; loads the script and runs it again on `NOSCRIPT`.
pub(super) async fn run<T: FromRedisValue>(
    conn: &mut Connection,
    script: &Script,
    cmd: &Cmd,
) -> RedisResult<T> {
    match conn.query(cmd).await {
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            script.load_async(conn).await?;
            conn.query(cmd).await
        }
        result => result,
    }
}

/// Deletes the lock key KEYS[1] only if it holds our token ARGV[1] (the Redis docs'
/// release script). A release that wakes waiters passes the waiters' mark as KEYS[2] and
/// the lock's release channel as ARGV[2]: when the mark is there, it deletes it and
/// publishes on the channel. The cleanup of an attempt that fell short passes no mark: two
/// waiters that split the nodes would otherwise wake each other in a loop while the holder
/// keeps the lock. A value this crate did not write (at either key) is left as it is.
///
/// Returns 1 when deleted, 0 when the key is gone, and -1 when it holds anything else.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
{UNMARK}
local v = redis.pcall('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if KEYS[2] and unmark(KEYS[2]) then
    redis.call('PUBLISH', ARGV[2], '')
  end
  return 1
elseif not v then
  return 0
end
return -1
"
    ))
});

/// An attempt: `SET KEYS[1] ARGV[1] NX PX ARGV[2]` when the key is free, else the holder's
/// `PTTL`, in the same reply, so that a refusal costs one round trip; a waiter's attempt
/// (ARGV[3] not `0`) also sets the waiters' mark KEYS[2] for ARGV[3] ms, atomically with
/// the check. Answers as every acquisition script ([`Attempted::decode`]). A lock key
/// holding anything (another client's token, or a value of another type) is held.
static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(&set_or_pttl("", "0", "ARGV[3] ~= '0'")));

/// Holds for the fencing counter `c` (read with `redis.pcall('GET', ..)`) when it is unset
/// or a decimal integer below 2^53 (exact as a Lua number).
pub(super) const COUNTER_VALID: &str = "(not c or (type(c) == 'string' and #c <= 16 and string.match(c, '^%d+$') and tonumber(c) < 9007199254740992))";

/// Lua that defines `foreign(key, kind)`: whether `key` holds a value of another type than
/// `kind` (a Redis `TYPE` name), which this crate did not write and leaves as it is.
pub(super) const FOREIGN: &str = "local function foreign(key, kind)
  local t = redis.call('TYPE', key).ok
  return t ~= kind and t ~= 'none'
end";

/// [`ACQUIRE`] with the fencing counter KEYS[2], read atomically with the `SET`; the mark
/// is KEYS[3], set when ARGV[4] is `1`. When ARGV[5] is not `0`, the attempt that sets the
/// lock also raises the counter by one (expiring in ARGV[5] ms): a client of one node
/// needs no second round for its fencing token, which is the counter as it stood plus one.
static ACQUIRE_FENCED: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        r"
local c = redis.pcall('GET', KEYS[2])
if not {COUNTER_VALID} then
  return {{-1, 1}}
end{}",
        set_or_pttl(
            "if ARGV[5] ~= '0' then redis.call('SET', KEYS[2], string.format('%d', tonumber(c or '0') + 1), 'PX', ARGV[5]) end",
            "tonumber(c or '0')",
            "ARGV[4] == '1'"
        )
    ))
});

/// The body of both acquisition scripts: `{1, on_set}` when set (after running
/// `after_set`), else `{0, pttl}`, first setting the waiters' mark (the last key) for
/// ARGV[3] ms when `waiting` holds.
fn set_or_pttl(after_set: &str, on_set: &str, waiting: &str) -> String {
    format!(
        r"
{MARK}
local t = redis.call('PTTL', KEYS[1])
if t == -2 then
  redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
  {after_set}
  return {{1, {on_set}}}
end
if {waiting} then
  mark(KEYS[#KEYS], ARGV[3])
end
return {{0, t}}
"
    )
}

/// One node's answer to a release.
pub(super) enum ReleaseReply {
    /// The key held our token and is deleted.
    Deleted,
    /// The key was gone.
    Absent,
    /// Something else holds the key.
    HeldByOther,
}

impl ReleaseReply {
    /// Decodes a release script's reply: 1 deleted, 0 gone, -1 held by anything else.
    pub(super) fn of(code: i64) -> Self {
        match code {
            1 => ReleaseReply::Deleted,
            0 => ReleaseReply::Absent,
            _ => ReleaseReply::HeldByOther,
        }
    }
}

/// What an acquisition attempt sends besides the key and the token.
#[derive(Debug, Clone, Copy)]
pub(super) struct Attempt {
    /// The lease TTL, in ms.
    pub(super) ttl_ms: u64,
    /// Read the fencing counter atomically with the `SET`.
    pub(super) fenced: bool,
    /// A waiter's attempt: set the waiters' mark for this many ms when the lock is held.
    pub(super) mark_ms: Option<u64>,
    /// Fenced on one node: raise the counter with the `SET`, expiring in this many ms.
    pub(super) raise_fence_ms: Option<u64>,
}

/// One node's answer to an acquisition attempt (on one key, or on a set of keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Attempted {
    /// The keys are ours; the (highest) fencing counter as it stood, 0 unfenced.
    Set(u64),
    /// Another holder has a key, for `pttl_ms` more (-1: no expiry; -2: free but not ours
    /// to take, as when a fair queue's head goes first).
    Held { pttl_ms: i64 },
}

impl Attempted {
    /// The fencing counter where the attempt set the keys; `None` where they are held.
    pub(super) fn counter(&self) -> Option<u64> {
        match self {
            Attempted::Set(counter) => Some(*counter),
            Attempted::Held { .. } => None,
        }
    }

    /// Decodes the reply of every acquisition script: `{1, counter}` set, `{0, pttl}` held,
    /// `{-1, i}` the fencing counter of `keys[i - 1]` is not an integer below 2^53.
    pub(super) fn decode(
        (status, value): (i64, i64),
        prefix: &str,
        keys: &[Arc<str>],
    ) -> Result<Self, NodeFailureReason> {
        match status {
            1 => Ok(Attempted::Set(u64::try_from(value).unwrap_or(0))),
            0 => Ok(Attempted::Held { pttl_ms: value }),
            _ => {
                let key = usize::try_from(value.saturating_sub(1))
                    .ok()
                    .and_then(|i| keys.get(i))
                    .or(keys.first())
                    .map_or("", |key| &**key);
                Err(invalid_counter(prefix, key))
            }
        }
    }
}

/// Runs an acquisition script on `keys` and decodes its reply ([`Attempted::decode`]).
pub(super) async fn run_attempt(
    conn: &mut Connection,
    script: &Script,
    cmd: &Cmd,
    prefix: &str,
    keys: &[Arc<str>],
) -> Result<Attempted, NodeFailureReason> {
    let reply = run_acked(conn, Some(script), cmd, |&(status, _): &(i64, i64)| {
        status == 1
    })
    .await?;
    Attempted::decode(reply, prefix, keys)
}

/// An acquisition attempt on one node: [`ACQUIRE`] or [`ACQUIRE_FENCED`], one round trip
/// whether it sets the key or learns the holder's remaining time.
pub(super) async fn acquire(
    mut conn: Connection,
    prefix: Arc<str>,
    key: Arc<str>,
    token: Token,
    attempt: Attempt,
) -> Result<Attempted, NodeFailureReason> {
    let (script, numkeys) = if attempt.fenced {
        (&*ACQUIRE_FENCED, 3)
    } else {
        (&*ACQUIRE, 2)
    };
    let mut cmd = evalsha(script, numkeys);
    cmd.arg(&*key);
    if attempt.fenced {
        cmd.arg(Auxiliary::fence(&prefix, &key));
    }
    cmd.arg(Auxiliary::waiters(&prefix, &key))
        .arg(token.as_bytes())
        .arg(attempt.ttl_ms)
        .arg(attempt.mark_ms.unwrap_or(0));
    if attempt.fenced {
        cmd.arg(if attempt.mark_ms.is_some() { "1" } else { "0" })
            .arg(attempt.raise_fence_ms.unwrap_or(0));
    }
    run_attempt(&mut conn, script, &cmd, &prefix, std::slice::from_ref(&key)).await
}

/// The error of a node whose fencing counter of `key` is not an integer below 2^53.
pub(super) fn invalid_counter(prefix: &str, key: &str) -> NodeFailureReason {
    NodeFailureReason::InvalidFencingCounter {
        key: Auxiliary::fence(prefix, key).to_string(),
    }
}

/// Deletes the key where it holds `token`; `publish` wakes the waiters that marked it.
pub(super) async fn release(
    mut conn: Connection,
    prefix: Arc<str>,
    key: Arc<str>,
    token: Token,
    publish: bool,
) -> Result<ReleaseReply, NodeFailureReason> {
    let mut cmd = evalsha(&RELEASE, if publish { 2 } else { 1 });
    cmd.arg(&*key);
    if publish {
        cmd.arg(Auxiliary::waiters(&prefix, &key));
    }
    cmd.arg(token.as_bytes());
    if publish {
        cmd.arg(released(&prefix, &key));
    }
    Ok(ReleaseReply::of(run(&mut conn, &RELEASE, &cmd).await?))
}

/// Connects to the node, which loads every script ([`ALL`]), and checks that it answers.
pub(super) async fn connect(mut conn: Connection) -> Result<(), NodeFailureReason> {
    let _: Value = conn.query(&redis::cmd("PING")).await?;
    Ok(())
}

/// Runs a granting write as [`run`] does (`script` is `None` for a native command), or on
/// a node that asks for acknowledgements, with `WAIT`/`WAITAOF` in the same pipeline. A
/// reply that `granted` without them is the node's failure
/// ([`NodeFailureReason::NotAcknowledged`]).
pub(in crate::backend::redlock) async fn run_acked<T: FromRedisValue>(
    conn: &mut Connection,
    script: Option<&Script>,
    cmd: &Cmd,
    granted: impl FnOnce(&T) -> bool,
) -> Result<T, NodeFailureReason> {
    let (Some(ack), Some(mut acked)) = (conn.ack(), conn.acked()) else {
        return Ok(match script {
            Some(script) => run(conn, script, cmd).await?,
            None => conn.query(cmd).await?,
        });
    };
    // On the node's own connection for these (a `WAIT` holds up the commands after it);
    // boxed, to keep this path out of the size of every acquisition's future.
    let (reply, failure) = Box::pin(acknowledged::<T>(&mut acked, ack, script, cmd)).await?;
    match failure {
        Some(failure) if granted(&reply) => Err(failure),
        _ => Ok(reply),
    }
}

/// `cmd` and its acknowledgements in one pipeline (with the `NOSCRIPT` fallback): its
/// reply, and the node's failure when they fell short.
async fn acknowledged<T: FromRedisValue>(
    conn: &mut Connection,
    ack: ReplicaAck,
    script: Option<&Script>,
    cmd: &Cmd,
) -> RedisResult<(T, Option<NodeFailureReason>)> {
    use redis::aio::ConnectionLike as _;
    let pipe = ack.pipeline(cmd);
    let count = ack.replies();
    let mut replies = conn.req_packed_commands(&pipe, 0, count).await;
    let no_script = |replies: &RedisResult<Vec<Value>>| match replies {
        Ok(values) => {
            matches!(values.first(), Some(Value::ServerError(e)) if e.kind() == Some(ServerErrorKind::NoScript))
        }
        Err(e) => e.kind() == ErrorKind::Server(ServerErrorKind::NoScript),
    };
    if let Some(script) = script.filter(|_| no_script(&replies)) {
        script.load_async(conn).await?;
        replies = conn.req_packed_commands(&pipe, 0, count).await;
    }
    let mut replies = replies?.into_iter();
    let first = replies.next().unwrap_or(Value::Nil).extract_error()?;
    let rest = replies
        .map(Value::extract_error)
        .collect::<RedisResult<Vec<_>>>()?;
    Ok((redis::from_redis_value(first)?, ack.acknowledged(&rest)?))
}

#[cfg(test)]
mod tests;
