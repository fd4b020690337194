//! Telling the server's replies from failures of the connection.

use redis::{ErrorKind, RedisError, ServerError, ServerErrorKind, Value};

/// Whether `error` is the server's reply to a command, which says nothing against the
/// connection. Except `READONLY`: the server is (now) a replica, as a primary demoted by
/// a failover, and a new connection finds the new primary.
pub(super) fn is_reply(error: &RedisError) -> bool {
    match error.kind() {
        ErrorKind::Server(kind) => !is_read_only(kind, error.detail()),
        ErrorKind::Extension => true,
        _ => false,
    }
}

/// Whether an error reply of `kind` with `detail` says the server is a replica:
/// `-READONLY ...`, or on Redis before 7 a script's write refused that way, which comes
/// back wrapped as `-ERR Error running script (...): ... -READONLY You can't write against
/// a read only replica.`
fn is_read_only(kind: ServerErrorKind, detail: Option<&str>) -> bool {
    match kind {
        ServerErrorKind::ReadOnly => true,
        ServerErrorKind::ResponseError => detail
            .is_some_and(|d| d.starts_with("Error running script") && d.contains("-READONLY ")),
        _ => false,
    }
}

/// What a command got back, which may hold the server's error replies as values (redis-rs
/// hands a single command's `-ERR` back as [`Value::ServerError`], and `query_async`
/// turns it into an error only later).
pub(super) trait Replies {
    /// The `READONLY` error among the replies, if any.
    fn read_only(&self) -> Option<&ServerError>;
}

impl Replies for Value {
    fn read_only(&self) -> Option<&ServerError> {
        match self {
            Value::ServerError(e)
                if e.kind().is_some_and(|kind| is_read_only(kind, e.details())) =>
            {
                Some(e)
            }
            _ => None,
        }
    }
}

impl Replies for Vec<Value> {
    fn read_only(&self) -> Option<&ServerError> {
        self.iter().find_map(Replies::read_only)
    }
}
