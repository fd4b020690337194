//! Writes that wait for the node's replicas (`Node::wait_for_replicas`): the write and
//! `WAIT`/`WAITAOF` in one pipeline, on the node's connection for acknowledged writes.

use redis::{Cmd, ErrorKind, FromRedisValue, RedisResult, Script, ServerErrorKind, Value};

use super::run;
use crate::backend::connection::Connection;
use crate::backend::node::ReplicaAck;
use crate::error::NodeFailureReason;

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
