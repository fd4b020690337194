//! [`NodeStore`]: what the limiters' stores on one Redis node share (the connection, the
//! bound on every call, the key prefix), and the public methods they all have,
//! [`node_store_methods!`] and [`node_store_setters!`].

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::connection::Connection;
use crate::backend::node::Node;
use crate::backend::settings::check_prefix;
use crate::error::{ConfigError, NodeFailure, NodeFailureReason};

/// One node's connection with the settings of the store that uses it.
pub(crate) struct NodeStore {
    /// The node's address (`host:port`), without credentials.
    pub(crate) label: String,
    conn: Connection,
    /// The bound on one call, connecting included.
    pub(crate) timeout: Duration,
    /// The prefix put before every key.
    pub(crate) prefix: Arc<str>,
}

/// What a store's builder collects for its [`NodeStore`].
#[derive(Debug)]
pub(crate) struct StoreSettings {
    node: Node,
    pub(crate) timeout: Duration,
    pub(crate) prefix: String,
    /// Whether `connect` fails when the node does not answer.
    pub(crate) require_node: bool,
}

impl StoreSettings {
    /// The store's defaults for `node`.
    pub(crate) fn new(node: Node, timeout: Duration, prefix: &str) -> Self {
        Self {
            node,
            timeout,
            prefix: prefix.to_owned(),
            require_node: false,
        }
    }

    /// Checks the prefix, sets up the connection and pings the node, bounded by the
    /// timeout; a node that does not answer now is only a warning, or, with
    /// `require_node`, [`ConfigError::NodesUnreachable`]. Errors: as the public `build()`
    /// methods'.
    pub(crate) async fn connect(self) -> Result<NodeStore, ConfigError> {
        check_prefix(&self.prefix)?;
        let (label, conn) = Connection::for_store(self.node, self.timeout)?;
        let store = NodeStore {
            label,
            conn,
            timeout: self.timeout,
            prefix: Arc::from(self.prefix),
        };
        if let Err(failure) = store.ping().await {
            if self.require_node {
                return Err(ConfigError::NodesUnreachable {
                    nodes: 1,
                    needed: 1,
                    failures: vec![failure],
                });
            }
            tracing::warn!(%failure, "Redis not reachable yet; it will be retried");
        }
        Ok(store)
    }
}

impl NodeStore {
    /// A handle to the connection, for one call (clones share the connection).
    pub(crate) fn conn(&self) -> Connection {
        self.conn.clone()
    }

    /// `PING`, bounded by the timeout: whether the node answers now, or why not.
    pub(crate) async fn ping(&self) -> Result<(), NodeFailure> {
        let mut conn = self.conn();
        let ping = redis::cmd("PING");
        self.bounded(ping.query_async::<()>(&mut conn)).await
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

/// The public methods every store on one node has: `builder`, `from_client` and
/// `from_node` (with the doc comment the call gives it), which start a `$builder` with its
/// `new(Node)`, and `prefix` and `timeout`, read from the store's `fn store(&self)`.
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

/// The builder methods `prefix` and `timeout` over the builder's `settings:
/// StoreSettings`, each with the doc comment the call gives it.
macro_rules! node_store_setters {
    (
        $(#[$prefix:meta])* prefix;
        $(#[$timeout:meta])* timeout;
    ) => {
        $(#[$prefix])*
        pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
            self.settings.prefix = prefix.into();
            self
        }

        $(#[$timeout])*
        pub fn timeout(mut self, timeout: std::time::Duration) -> Self {
            // At least 1 ms; the prefix is checked by `StoreSettings::connect`.
            self.settings.timeout = timeout.max(std::time::Duration::from_millis(1));
            self
        }
    };
}
pub(crate) use node_store_setters;
