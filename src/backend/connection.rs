//! One Redis node's connection, replaced after every kind of failure.
//!
//! redis-rs's `ConnectionManager` reconnects only after an I/O error: an attempt that
//! fails another way (a port answering something that is not Redis, a refused handshake)
//! stays stored until the process restarts, and a connection whose peer vanished without
//! a reset makes its commands wait for ever.
//!
//! [`Connection`] keeps redis-rs's multiplexed connection and replaces it when an attempt
//! fails; when a command fails with anything but the server's reply, or with `READONLY`
//! (a demoted primary); and when a command given up by its caller with nothing answered
//! since is followed by a `PING` probe that gets no answer within [`PROBE_TIMEOUT`].
//!
//! Attempts start at most once per [`RETRY_INTERVAL`] (commands get the last attempt's
//! error meanwhile); while they fail, new ones start in the background, pauses doubling up
//! to [`RECONNECT_MAX_PAUSE`]. Replaced connections close when their last command ends.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use futures_util::future::{BoxFuture, FutureExt, Shared};
use redis::aio::ConnectionLike;
use redis::{
    AsyncConnectionConfig, Cmd, FromRedisValue, Pipeline, RedisFuture, RedisResult, Value,
};

use crate::backend::lua::Scripts;
use crate::backend::node::{Conn, Connector};

/// The shortest time between two connection attempts to one node: 100 ms.
pub(crate) const RETRY_INTERVAL: Duration = Duration::from_millis(100);
/// The longest pause between two background connection attempts to a node that stays
/// down: 1 s.
pub(crate) const RECONNECT_MAX_PAUSE: Duration = Duration::from_secs(1);

/// Drives the connection attempt `connecting` of `generation`, and while attempts fail,
/// starts new ones after a pause that doubles from [`RETRY_INTERVAL`] to
/// [`RECONNECT_MAX_PAUSE`]; stops at the first connection, when a command started a
/// newer attempt meanwhile, or when the node's handle is dropped.
async fn reconnect(
    core: std::sync::Weak<ConnectionCore>,
    mut connecting: Connecting,
    mut generation: u64,
) {
    let mut pause = RETRY_INTERVAL;
    loop {
        let result = connecting.await;
        let Some(inner) = core.upgrade() else {
            return;
        };
        if let Ok(conn) = result {
            inner.connected(generation, &conn);
            return;
        }
        drop(inner);
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(RECONNECT_MAX_PAUSE);
        let Some(inner) = core.upgrade() else {
            return;
        };
        let mut state = inner.state();
        if state.generation != generation || state.ready.is_some() {
            return;
        }
        inner.restart(&mut state);
        generation = state.generation;
        connecting = state.connecting.clone();
    }
}
/// How long a probe of a silent connection waits for `PONG`: 1 s; also the least time
/// between two probes of one connection.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

type Connecting = Shared<BoxFuture<'static, RedisResult<Conn>>>;

/// A cheap handle to one node's connection; clones share it. See the module docs.
#[derive(Clone)]
pub(crate) struct Connection {
    shared: Arc<ConnectionCore>,
}

struct ConnectionCore {
    connector: Connector,
    config: AsyncConnectionConfig,
    scripts: Scripts,
    connect_timeout: Duration,
    label: Arc<str>,
    db: i64,
    state: Mutex<Link>,
    /// Replies received (any reply, errors of the server included), for telling a silent
    /// connection from a busy one.
    replies: AtomicU64,
    /// Whether the last outcome was a failure (for logging the recovery once).
    failing: AtomicBool,
    /// Fails commands at once while the node keeps failing.
    breaker: Breaker,
    /// For a node whose granting writes wait for acknowledgements: their own connection,
    /// so that a blocking `WAIT` holds up no other command.
    #[cfg(feature = "lock")]
    acked: Option<Connection>,
}

struct Link {
    connecting: Connecting,
    /// The connection `connecting` made, once made (no polling of the shared future).
    ready: Option<Conn>,
    /// Counts replacements, so that a late failure of an old connection replaces nothing.
    generation: u64,
    /// When the current connection's attempt started.
    started: Instant,
    probing: bool,
    probed: Option<Instant>,
    /// Whether a replacement is scheduled for the end of [`RETRY_INTERVAL`].
    retry_scheduled: bool,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("node", &self.shared.label)
            .finish_non_exhaustive()
    }
}

fn connect(
    connector: &Connector,
    config: &AsyncConnectionConfig,
    scripts: Scripts,
    timeout: Duration,
) -> Connecting {
    let attempt = connector.connect(config);
    if scripts.is_empty() {
        return attempt.shared();
    }
    async move {
        let mut conn = attempt.await?;
        // A node restarted empty lacks them, and a round that stops listening at its
        // verdict might never load them there. A failure is left to `NOSCRIPT` fallbacks.
        let loads = async {
            for script in scripts {
                if conn.load(script).await.is_err() {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(timeout, loads).await;
        Ok(conn)
    }
    .boxed()
    .shared()
}

impl Connection {
    /// The connection of a limiter's store whose calls are bounded by `timeout`
    /// (connecting: by `timeout`, at least 500 ms), with the node's label.
    #[cfg(any(feature = "rate-limit", feature = "concurrency-limit"))]
    pub(crate) fn for_store(
        node: crate::backend::node::Node,
        timeout: Duration,
    ) -> Result<(String, Self), crate::error::ConfigError> {
        let connect_timeout = timeout.max(Duration::from_millis(500));
        let connector = node
            .connector(connect_timeout)
            .map_err(|source| crate::error::ConfigError::InvalidUrl { index: 0, source })?;
        let label = connector.label.clone();
        Ok((label, Self::new(connector, connect_timeout, &[])))
    }

    /// A connection to `connector`'s node. Each attempt, handshake and loading `scripts`
    /// included, is bounded by `connect_timeout`; commands are bounded by their callers.
    pub(crate) fn new(connector: Connector, connect_timeout: Duration, scripts: Scripts) -> Self {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(None);
        let label = connector.label.as_str().into();
        let db = connector.db();
        #[cfg(feature = "lock")]
        let acked = connector.ack.map(|_| {
            let mut own = connector.clone();
            own.ack = None;
            Connection::new(own, connect_timeout, scripts)
        });
        let connecting = connect(&connector, &config, scripts, connect_timeout);
        Self {
            shared: Arc::new(ConnectionCore {
                connector,
                config,
                scripts,
                connect_timeout,
                label,
                db,
                state: Mutex::new(Link {
                    connecting,
                    ready: None,
                    generation: 0,
                    started: Instant::now(),
                    probing: false,
                    probed: None,
                    retry_scheduled: false,
                }),
                replies: AtomicU64::new(0),
                failing: AtomicBool::new(false),
                breaker: Breaker::default(),
                #[cfg(feature = "lock")]
                acked,
            }),
        }
    }

    /// `Cmd::query_async` without the box of [`ConnectionLike`]: the command's future is
    /// held in the caller's. Errors: the connection's, an error reply, a wrong type.
    #[cfg_attr(not(feature = "lock"), allow(dead_code))]
    pub(crate) async fn query<T: FromRedisValue>(&mut self, cmd: &Cmd) -> RedisResult<T> {
        let reply = self
            .run(|mut conn| async move { conn.send(cmd).await })
            .await?;
        Ok(redis::from_redis_value(reply.extract_error()?)?)
    }

    /// The node's label (host:port), for logs, errors and the node-error metric.
    #[cfg(feature = "lock")]
    pub(crate) fn label(&self) -> &Arc<str> {
        &self.shared.label
    }

    /// The acknowledgements this node's granting writes wait for, if any
    /// ([`Node::wait_for_replicas`](crate::Node::wait_for_replicas)).
    #[cfg(feature = "lock")]
    pub(crate) fn ack(&self) -> Option<crate::backend::node::ReplicaAck> {
        self.shared.connector.ack
    }

    /// The connection for this node's acknowledged writes (see [`Connection::ack`]).
    #[cfg(feature = "lock")]
    pub(crate) fn acked(&self) -> Option<Connection> {
        self.shared.acked.clone()
    }

    /// The node this connection goes to.
    #[cfg(any(
        all(feature = "lock", feature = "cluster-async"),
        feature = "concurrency-limit"
    ))]
    pub(crate) fn connector(&self) -> &Connector {
        &self.shared.connector
    }

    /// The node closed the release subscriber's connection: replaces this one too.
    #[cfg(any(feature = "lock", feature = "concurrency-limit"))]
    pub(crate) fn node_dropped(&self) {
        let generation = self.shared.state().generation;
        self.shared.failed(
            generation,
            &"the node closed the release subscriber's connection",
        );
        #[cfg(feature = "lock")]
        if let Some(acked) = &self.shared.acked {
            acked.node_dropped();
        }
    }

    /// Runs `op` on the current connection, and replaces the connection after a failure.
    async fn run<T, F, Fut>(&self, op: F) -> RedisResult<T>
    where
        T: Replies,
        F: FnOnce(Conn) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let inner = &self.shared;
        if let Pass::Refused(left) = inner.breaker.pass() {
            return Err(breaker::refused(&inner.label, left));
        }
        let (current, generation) = {
            let state = inner.state();
            let current = match &state.ready {
                Some(conn) => Ok(conn.clone()),
                None => Err(state.connecting.clone()),
            };
            (current, state.generation)
        };
        let conn = match current {
            Ok(conn) => conn,
            Err(connecting) => match connecting.await {
                Ok(conn) => {
                    inner.connected(generation, &conn);
                    conn
                }
                Err(e) => {
                    inner.failed(generation, &e);
                    return Err(e);
                }
            },
        };
        let mut pending = SentCommand {
            shared: &self.shared,
            generation,
            replies: inner.replies.load(Ordering::Acquire),
            sent: Instant::now(),
            armed: true,
        };
        let result = op(conn).await;
        pending.armed = false;
        match &result {
            Err(e) if !is_reply(e) => inner.failed(generation, e),
            Ok(replies) => match replies.read_only() {
                Some(e) => inner.failed(generation, e),
                None => inner.replied(),
            },
            Err(_) => inner.replied(),
        }
        result
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(self.run(move |mut conn| async move { conn.send(cmd).await }))
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(
            self.run(
                move |mut conn| async move { conn.send_pipeline(pipeline, offset, count).await },
            ),
        )
    }

    fn get_db(&self) -> i64 {
        self.shared.db
    }
}

impl ConnectionCore {
    fn state(&self) -> MutexGuard<'_, Link> {
        // No code panics while holding the lock; recover the state if a panic ever did.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts the next generation's connection attempt.
    fn restart(&self, state: &mut Link) {
        state.generation += 1;
        state.retry_scheduled = false;
        state.started = Instant::now();
        state.connecting = connect(
            &self.connector,
            &self.config,
            self.scripts,
            self.connect_timeout,
        );
    }

    /// The attempt of `generation` made `conn`: later commands take it as it is.
    fn connected(&self, generation: u64, conn: &Conn) {
        // A new connection (after a failover, a restart) answered its handshake: commands
        // may go to it again at once.
        if self.breaker.succeeded() {
            breaker_changed(&self.label, "closed");
        }
        let mut state = self.state();
        if state.generation == generation && state.ready.is_none() {
            state.ready = Some(conn.clone());
        }
    }

    fn replied(&self) {
        self.replies.fetch_add(1, Ordering::AcqRel);
        if self.breaker.succeeded() {
            breaker_changed(&self.label, "closed");
        }
        if self.failing.load(Ordering::Relaxed) && self.failing.swap(false, Ordering::AcqRel) {
            tracing::info!(node = %self.label, "Redis node answers again");
        }
    }

    /// The connection of `generation` failed: start a new attempt (unless one started
    /// since), at the earliest [`RETRY_INTERVAL`] after the last one.
    fn failed(self: &Arc<Self>, generation: u64, error: &dyn std::fmt::Display) {
        if self.breaker.failed() {
            breaker_changed(&self.label, "open");
        }
        let mut state = self.state();
        if state.generation != generation {
            return;
        }
        let wait = RETRY_INTERVAL.saturating_sub(state.started.elapsed());
        if !wait.is_zero() {
            // One delayed retry per connection, however many commands fail meanwhile.
            if std::mem::replace(&mut state.retry_scheduled, true) {
                return;
            }
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let core = Arc::downgrade(self);
                runtime.spawn(async move {
                    tokio::time::sleep(wait).await;
                    if let Some(inner) = core.upgrade() {
                        inner.failed(generation, &"a failure less than 100 ms after connecting");
                    }
                });
            }
            return;
        }
        if self.failing.swap(true, Ordering::AcqRel) {
            tracing::debug!(node = %self.label, %error, "Redis node still failing; reconnecting");
        } else {
            tracing::warn!(node = %self.label, %error, "Redis node failed; reconnecting");
        }
        self.restart(&mut state);
        state.ready = None;
        // Connect now, and while the node stays down, again in the background, so that
        // the first command after it is back finds a connection.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(reconnect(
                Arc::downgrade(self),
                state.connecting.clone(),
                state.generation,
            ));
        }
    }

    /// A command of `generation` was given up with nothing answered since it was sent:
    /// probe with `PING`, unless a probe ran less than [`PROBE_TIMEOUT`] ago.
    fn suspect(self: &Arc<Self>, generation: u64) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let connecting = {
            let mut state = self.state();
            let recent = state.probed.is_some_and(|at| at.elapsed() < PROBE_TIMEOUT);
            if state.generation != generation || state.probing || recent {
                return;
            }
            state.probing = true;
            state.probed = Some(Instant::now());
            state.connecting.clone()
        };
        let inner = self.clone();
        runtime.spawn(async move {
            let replies = inner.replies.load(Ordering::Acquire);
            let ping = async {
                let mut conn = connecting.await?;
                conn.send(&redis::cmd("PING")).await
            };
            match tokio::time::timeout(PROBE_TIMEOUT, ping).await {
                Ok(Err(e)) if !is_reply(&e) => inner.failed(generation, &e),
                Ok(_) => inner.replied(),
                // Something else was answered meanwhile: busy, not gone.
                Err(_) if inner.replies.load(Ordering::Acquire) != replies => {}
                Err(_) => inner.failed(
                    generation,
                    &format_args!("no answer to PING within {PROBE_TIMEOUT:?}"),
                ),
            }
            inner.state().probing = false;
        });
    }
}

/// A command in flight; dropped with nothing answered since it was sent, it probes (and
/// counts against the node's outage breaker once it waited [`GIVEN_UP_AFTER`](breaker::GIVEN_UP_AFTER)).
struct SentCommand<'a> {
    shared: &'a Arc<ConnectionCore>,
    generation: u64,
    replies: u64,
    sent: Instant,
    armed: bool,
}

impl Drop for SentCommand<'_> {
    fn drop(&mut self) {
        if self.armed && self.shared.replies.load(Ordering::Acquire) == self.replies {
            if self.sent.elapsed() >= breaker::GIVEN_UP_AFTER && self.shared.breaker.failed() {
                breaker_changed(&self.shared.label, "open");
            }
            self.shared.suspect(self.generation);
        }
    }
}

mod breaker;
use breaker::{Breaker, Pass, breaker_changed};
mod replies;
use replies::{Replies, is_reply};

#[cfg(test)]
mod tests;
