//! Telling the server's replies from failures of the connection.

use redis::{ErrorKind, RedisError, ServerError, ServerErrorKind, Value};

/// Whether `error` is the server's reply, which says nothing against the connection;
/// except `READONLY` (a demoted primary: a new connection finds the new one).
pub(super) fn is_reply(error: &RedisError) -> bool {
    match error.kind() {
        ErrorKind::Server(kind) => !is_read_only(kind, error.detail()),
        ErrorKind::Extension => true,
        _ => false,
    }
}

/// Whether an error reply says the server is a replica: `-READONLY ...`, or before Redis 7
/// a script's write refused that way, wrapped in `-ERR Error running script (...): ...`.
fn is_read_only(kind: ServerErrorKind, detail: Option<&str>) -> bool {
    match kind {
        ServerErrorKind::ReadOnly => true,
        ServerErrorKind::ResponseError => detail
            .is_some_and(|d| d.starts_with("Error running script") && d.contains("-READONLY ")),
        _ => false,
    }
}

/// What a command got back, which may hold error replies as [`Value::ServerError`].
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
