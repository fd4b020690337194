//! [`NodeStore`]: what the stores on one Redis node share, the rate limiter's counters and
//! the concurrency limiter's permits: the node's connection, the bound on every call, and
//! the key prefix; and [`node_store_methods!`], the constructors and accessors they
//! both have.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::connection::Connection;
use crate::backend::node::Node;
use crate::backend::settings::check_prefix;
use crate::error::{ConfigError, NodeFailure, NodeFailureReason};

/// One node's connection with the settings of the store that uses it. Each store holds
/// it behind its own `Arc`.
pub(crate) struct NodeStore {
    /// The node's address (`host:port`), without credentials.
    pub(crate) label: String,
    conn: Connection,
    /// The bound on one call, connecting included.
    pub(crate) timeout: Duration,
    /// The prefix put before every key.
    pub(crate) prefix: Arc<str>,
}

impl NodeStore {
    /// Checks `prefix`, sets up the connection to `node` and pings it, bounded by
    /// `timeout`. A node that does not answer now is not an error, only a warning: every
    /// later call tries it again.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidUrl`] for a node redis-rs cannot use,
    /// [`ConfigError::InvalidPrefix`] or [`ConfigError::BraceInPrefix`] for a prefix that
    /// [`check_prefix`] refuses.
    pub(crate) async fn connect(
        node: Node,
        timeout: Duration,
        prefix: String,
    ) -> Result<Self, ConfigError> {
        check_prefix(&prefix)?;
        let (label, conn) = Connection::for_store(node, timeout)?;
        let store = Self {
            label,
            conn,
            timeout,
            prefix: Arc::from(prefix),
        };
        let mut conn = store.conn();
        let ping = redis::cmd("PING");
        if let Err(failure) = store.bounded(ping.query_async::<()>(&mut conn)).await {
            tracing::warn!(%failure, "Redis not reachable yet; it will be retried");
        }
        Ok(store)
    }

    /// A handle to the connection, for one call (clones share the connection).
    pub(crate) fn conn(&self) -> Connection {
        self.conn.clone()
    }

    /// Runs `call` bounded by the timeout: its reply, or the failure of this node (the
    /// Redis error, or the timeout).
    pub(crate) async fn bounded<T>(
        &self,
        call: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, NodeFailure> {
        let reason = match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok(reply)) => return Ok(reply),
            Ok(Err(e)) => NodeFailureReason::Redis(e),
            Err(_) => NodeFailureReason::Timeout(self.timeout),
        };
        Err(NodeFailure {
            node: self.label.clone(),
            reason,
        })
    }
}

/// The public methods every store on one node has, written once (as tower-http's
/// `define_inner_service_accessors!`): `builder`, `from_client` and `from_node`, which
/// start a `$builder` with its `new(Node)`, and `prefix` and `timeout`, which read the
/// [`NodeStore`] that the store's `fn store(&self) -> &NodeStore` returns. The doc
/// comment of `from_node` comes with the call: it says how the store spreads over a
/// Redis Cluster.
macro_rules! node_store_methods {
    ($builder:ident, $(#[$from_node:meta])*) => {
        /// Starts a builder from a Redis URL (`redis://[:password@]host:port[/db]`).
        pub fn builder(url: impl AsRef<str>) -> $builder {
            $builder::new($crate::backend::node::Node::url(url))
        }

        /// Starts a builder from a ready redis-rs client.
        pub fn from_client(client: ::redis::Client) -> $builder {
            $builder::new($crate::backend::node::Node::client(client))
        }

        $(#[$from_node])*
        pub fn from_node(node: $crate::backend::node::Node) -> $builder {
            $builder::new(node)
        }

        /// The prefix put before every key.
        pub fn prefix(&self) -> &str {
            &self.store().prefix
        }

        /// The bound on one call.
        pub fn timeout(&self) -> std::time::Duration {
            self.store().timeout
        }
    };
}
pub(crate) use node_store_methods;
