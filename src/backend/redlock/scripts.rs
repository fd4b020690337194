//! Running the Redlock's Lua scripts ([`crate::backend::lua`]): by `EVALSHA`, with a
//! fallback to loading them when a node answers `NOSCRIPT` (after a restart, say), and
//! what their replies mean.

use std::sync::Arc;

use redis::{Cmd, ErrorKind, FromRedisValue, RedisResult, Script, ServerErrorKind, Value};

use super::keys::{Auxiliary, Beside};
use crate::backend::connection::Connection;
use crate::backend::lua::{ACQUIRE, ACQUIRE_FENCED, RELEASE};
use crate::backend::node::ReplicaAck;
use crate::backend::notify::released;
use crate::error::NodeFailureReason;
use crate::lease::Token;

/// A command named `name`, with room for this crate's arguments (up to sixteen, 512 bytes:
/// a script's keys, its arguments and a holder record), so that adding them does not
/// reallocate.
pub(super) fn command(name: &str) -> Cmd {
    let mut cmd = Cmd::with_capacity(16, 512);
    cmd.arg(name);
    cmd
}

/// `EVALSHA <hash> <numkeys>`, for the caller to add keys and arguments to.
pub(super) fn evalsha(script: &Script, numkeys: usize) -> Cmd {
    let mut cmd = command("EVALSHA");
    cmd.arg(script.get_hash()).arg(numkeys);
    cmd
}

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
/// whether it sets the key (and records `holder` beside it) or learns the holder's
/// remaining time. Each command is built apart and awaited here, one future deep (a
/// nested `async fn` would be built, then copied into this one's state).
pub(super) async fn acquire(
    mut conn: Connection,
    prefix: Arc<str>,
    key: Arc<str>,
    token: Token,
    attempt: Attempt,
    holder: Arc<str>,
) -> Result<Attempted, NodeFailureReason> {
    if !attempt.fenced {
        let cmd = unfenced(&prefix, &key, token, attempt, &holder);
        let set = |v: &Value| matches!(v, Value::Okay);
        let reply = run_acked(&mut conn, Some(&ACQUIRE), &cmd, set).await?;
        return unfenced_reply(reply);
    }
    let mut cmd = evalsha(&ACQUIRE_FENCED, 4);
    cmd.arg(&*key)
        .arg(Auxiliary::of(Beside::Fence, &prefix, &key))
        .arg(Auxiliary::of(Beside::Waiters, &prefix, &key))
        .arg(Auxiliary::of(Beside::Holder, &prefix, &key))
        .arg(token.as_bytes())
        .arg(attempt.ttl_ms)
        .arg(attempt.mark_ms.unwrap_or(0))
        .arg(if attempt.mark_ms.is_some() { "1" } else { "0" })
        .arg(attempt.raise_fence_ms.unwrap_or(0))
        .arg(&*holder);
    let slice = std::slice::from_ref(&key);
    run_attempt(&mut conn, &ACQUIRE_FENCED, &cmd, &prefix, slice).await
}

/// [`ACQUIRE`]: `+OK` when set, else the holder's `PTTL` as an integer, replies as cheap to
/// parse as `SET`'s; the waiters' mark is a key only of a waiter's attempt.
fn unfenced(prefix: &str, key: &str, token: Token, attempt: Attempt, holder: &str) -> Cmd {
    let mut cmd = evalsha(&ACQUIRE, if attempt.mark_ms.is_some() { 3 } else { 2 });
    cmd.arg(key).arg(Auxiliary::of(Beside::Holder, prefix, key));
    if attempt.mark_ms.is_some() {
        cmd.arg(Auxiliary::of(Beside::Waiters, prefix, key));
    }
    cmd.arg(token.as_bytes())
        .arg(attempt.ttl_ms)
        .arg(attempt.mark_ms.unwrap_or(0))
        .arg(holder);
    cmd
}

/// What [`ACQUIRE`]'s reply says.
fn unfenced_reply(reply: Value) -> Result<Attempted, NodeFailureReason> {
    match reply {
        Value::Okay => Ok(Attempted::Set(0)),
        Value::Int(pttl_ms) => Ok(Attempted::Held { pttl_ms }),
        other => Err(NodeFailureReason::from(redis::RedisError::from((
            ErrorKind::UnexpectedReturnType,
            "an acquisition script answered neither OK nor an integer",
            format!("{other:?}"),
        )))),
    }
}

/// The error of a node whose fencing counter of `key` is not an integer below 2^53.
pub(super) fn invalid_counter(prefix: &str, key: &str) -> NodeFailureReason {
    NodeFailureReason::InvalidFencingCounter {
        key: Auxiliary::of(Beside::Fence, prefix, key).to_string(),
    }
}

/// Deletes the key where it holds `token`, and the lease's holder record; `publish` wakes
/// the waiters that marked it.
pub(super) async fn release(
    mut conn: Connection,
    prefix: Arc<str>,
    key: Arc<str>,
    token: Token,
    publish: bool,
) -> Result<ReleaseReply, NodeFailureReason> {
    let mut cmd = evalsha(&RELEASE, if publish { 3 } else { 2 });
    cmd.arg(&*key)
        .arg(Auxiliary::of(Beside::Holder, &prefix, &key));
    if publish {
        cmd.arg(Auxiliary::of(Beside::Waiters, &prefix, &key));
    }
    cmd.arg(token.as_bytes());
    if publish {
        cmd.arg(released(&prefix, &key));
    }
    Ok(ReleaseReply::of(run(&mut conn, &RELEASE, &cmd).await?))
}

/// Connects to the node, which loads every script
/// ([`REDLOCK`](crate::backend::lua::REDLOCK)), and checks that it answers `PING`.
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
