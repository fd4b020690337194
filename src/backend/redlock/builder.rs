//! The builder of a [`Redlock`]: configuration checks, connections, script loading.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::connection::Connection;
use crate::backend::lua::REDLOCK;
use crate::backend::node::Node;

use super::local::LocalHolders;
use super::{Redlock, RedlockCore, failure, scripts};
use crate::backend::notify::{Channels, Notifier};
use crate::backend::settings::{Settings, policy_setters};
use crate::backend::wait::{MAX_FALLBACK, Waiters};
use crate::error::ConfigError;
use crate::holder::HolderRef;

/// Default node timeout, as a fraction of the TTL: 5% (go-redsync's timeout factor).
const DEFAULT_NODE_TIMEOUT_FACTOR: u32 = 20;
/// Default clock drift factor, as the Redis docs and go-redsync: 0.01.
const DEFAULT_DRIFT_FACTOR: f64 = 0.01;
/// The fixed part of the drift allowance: 2 ms.
const DRIFT_FLOOR: Duration = Duration::from_millis(2);

/// Builds a [`Redlock`]; see [`Redlock::builder`].
#[derive(Debug)]
#[must_use]
pub struct RedlockBuilder {
    nodes: Vec<Node>,
    node_timeout: Option<Duration>,
    drift_factor: f64,
    notify_waiters: bool,
    require_nodes: bool,
    policy: Settings,
}

/// The shortest life of a fencing counter after its last write-back or renewal: 24 h.
const FENCE_LIFETIME_MIN: Duration = Duration::from_secs(24 * 3600);
/// A fencing counter lives at least this many TTLs after its last write-back or renewal.
const FENCE_LIFETIME_TTLS: u32 = 100;

impl RedlockBuilder {
    pub(super) fn new(nodes: Vec<Node>) -> Self {
        Self {
            nodes,
            node_timeout: None,
            drift_factor: DEFAULT_DRIFT_FACTOR,
            notify_waiters: true,
            require_nodes: false,
            policy: Settings::default(),
        }
    }

    policy_setters!();

    /// How long to wait for one node's answer before counting it as failed. Default 5% of
    /// the TTL (500 ms for the default 10 s), as go-redsync; it must be shorter than the
    /// TTL, and should be much shorter (the Redis docs suggest 5 to 50 ms for 10 s).
    /// Operations return as soon as the answers in hand decide the verdict, so a hung node
    /// costs nothing while the others agree; this bounds the wait when it is needed.
    ///
    /// Recovery: a node's connection that fails in any way is replaced at once when the
    /// release subscriber sees the node drop it ([`notify_waiters`](Self::notify_waiters)),
    /// else by the next operation: at most one attempt per 100 ms, each bounded by the node
    /// timeout or 500 ms, whichever is longer. A connection gone silent is probed with
    /// `PING` when an operation gives up on it, and replaced when the probe gets no answer
    /// within 1 s.
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.node_timeout = Some(timeout);
        self
    }

    /// The replica id each lease records as its holder's, so that
    /// [`Locks::inspect`](crate::Locks::inspect) can say which replica holds a lock
    /// ([`LockHolder`](crate::LockHolder)): the pod's or the host's name, say
    /// (`std::env::var("HOSTNAME")` in Kubernetes). Default `<hostname>-<pid>`, worked out
    /// once per process from `/proc/sys/kernel/hostname` or `/etc/hostname` (`unknown`
    /// without either), so that two processes on one host differ. Bytes outside printable
    /// ASCII, spaces included, become `_`, and it is cut to 64 bytes.
    pub fn replica_id(mut self, id: impl AsRef<str>) -> Self {
        self.policy.replica = crate::holder::replica_id(id.as_ref());
        self
    }

    /// The clock drift factor: the validity is reduced by `ttl * factor + 2 ms` to allow for
    /// clocks that run at different rates. Default 0.01 (the Redis docs, go-redsync); a
    /// finite number in `[0, 0.5)`.
    pub fn drift_factor(mut self, factor: f64) -> Self {
        self.drift_factor = factor;
        self
    }

    /// Whether [`LockRequest::wait`](crate::LockRequest::wait) waiters subscribe to release
    /// notifications (Redis pub/sub on `<prefix>{<lock key>}:released`, one subscriber
    /// connection per node, opened by `build`). A subscriber dropped by its node also has
    /// the node's command connection replaced at once, and is itself reopened in the
    /// background (pauses doubling from 100 ms to 1 s). A release publishes only when a
    /// subscribed waiter set the mark `<prefix>{<lock key>}:waiters`. Default on; off,
    /// waiters re-try on their fallback timer only (the holder's remaining TTL, at most 1
    /// s).
    pub fn notify_waiters(mut self, enabled: bool) -> Self {
        self.notify_waiters = enabled;
        self
    }

    /// Whether [`build`](Self::build) fails when fewer than a quorum of the nodes answer
    /// while it connects ([`ConfigError::NodesUnreachable`], naming each node that did not
    /// and why), rather than start and retry them. Default off: a node down at start-up is
    /// logged and connected again later, and the app answers 503 until a quorum is back.
    /// On, a deployment whose nodes are all down or misnamed stops at start-up, with the
    /// reason, instead of running unable to lock; [`Redlock::ready`] answers the same
    /// question later.
    pub fn require_nodes_at_start(mut self, required: bool) -> Self {
        self.require_nodes = required;
        self
    }

    /// Checks the configuration, connects to every node and loads the Lua scripts, each
    /// node bounded by the node timeout. An unreachable node is not an error (it is
    /// retried later) unless [`require_nodes_at_start`](Self::require_nodes_at_start) is
    /// on and fewer than a quorum answer. Needs a Tokio runtime with the time driver.
    ///
    /// # Errors
    ///
    /// A [`ConfigError`]: no nodes, an invalid URL, a TTL out of range or leaving no
    /// validity after the drift allowance, a node timeout not shorter than the TTL, a
    /// drift factor out of range, an empty retry delay range, a bad prefix, a replica
    /// timeout that does not fit in the node timeout with 100 ms to spare per waiting
    /// command ([`ConfigError::InvalidReplicaTimeout`], see
    /// [`Node::replica_timeout`](crate::Node::replica_timeout)), or, with
    /// [`require_nodes_at_start`](Self::require_nodes_at_start), fewer than a quorum of
    /// the nodes answering ([`ConfigError::NodesUnreachable`]).
    ///
    /// An even number of nodes is logged as a warning: a quorum of `N/2 + 1` tolerates no
    /// more failed nodes than `N - 1` nodes do (2 nodes need both).
    pub async fn build(self) -> Result<Redlock, ConfigError> {
        self.policy.validate()?;
        if !(self.drift_factor.is_finite() && (0.0..0.5).contains(&self.drift_factor)) {
            return Err(ConfigError::InvalidDriftFactor(self.drift_factor));
        }
        let ttl = self.policy.ttl;
        let drift = ttl.mul_f64(self.drift_factor).saturating_add(DRIFT_FLOOR);
        if ttl <= drift {
            return Err(ConfigError::InvalidTtl {
                ttl,
                reason: "it leaves no validity after the clock drift allowance (ttl * drift_factor + 2 ms)",
            });
        }
        let node_timeout = self
            .node_timeout
            .unwrap_or(ttl / DEFAULT_NODE_TIMEOUT_FACTOR);
        if node_timeout.is_zero() || node_timeout >= ttl {
            return Err(ConfigError::InvalidNodeTimeout {
                timeout: node_timeout,
                ttl,
            });
        }
        if self.nodes.is_empty() {
            return Err(ConfigError::NoNodes);
        }
        let connect_timeout = node_timeout.max(Duration::from_millis(500));
        let mut nodes = Vec::with_capacity(self.nodes.len());
        let mut connectors = Vec::with_capacity(self.nodes.len());
        for (index, node) in self.nodes.into_iter().enumerate() {
            let mut connector = node
                .connector(connect_timeout)
                .map_err(|source| ConfigError::InvalidUrl { index, source })?;
            if let Some(ack) = &mut connector.ack {
                ack.resolve(node_timeout).map_err(|(timeout, margin)| {
                    ConfigError::InvalidReplicaTimeout {
                        index,
                        timeout,
                        node_timeout,
                        margin,
                    }
                })?;
            }
            connectors.push(connector.clone());
            nodes.push(Connection::new(connector, connect_timeout, REDLOCK));
        }
        let quorum = nodes.len() / 2 + 1;
        if nodes.len() % 2 == 0 {
            tracing::warn!(
                nodes = nodes.len(),
                quorum,
                "an even number of Redlock nodes: a quorum of {quorum} of {} tolerates {} \
                 failed nodes, no more than one node fewer would; use an odd number of nodes \
                 (1, 3 or 5)",
                nodes.len(),
                nodes.len() - quorum,
            );
        }
        let conns = nodes.clone();
        let waiters = Arc::new(Waiters::default());
        let redlock = Redlock {
            inner: Arc::new(RedlockCore {
                id: crate::backend::next_backend_id(),
                nodes,
                notifier: self.notify_waiters.then(|| {
                    Arc::new(Notifier::new(
                        connectors,
                        conns,
                        waiters.clone(),
                        Channels::Tagged(self.policy.prefix.clone()),
                        node_timeout.max(Duration::from_millis(100)),
                    ))
                }),
                waiters,
                local: LocalHolders::default(),
                fence_ms: self.policy.fencing.then(|| {
                    millis(FENCE_LIFETIME_MIN.max(ttl.saturating_mul(FENCE_LIFETIME_TTLS)))
                }),
                mark_ms: millis(MAX_FALLBACK.saturating_mul(2).saturating_add(node_timeout)),
                quorum,
                node_timeout,
                drift,
                direct_holder: HolderRef::Direct.encode(&self.policy.replica),
                policy: self.policy,
            }),
        };
        // Connecting now loads every script and checks that the nodes answer.
        let loads = redlock.on_every_node(scripts::connect).await;
        let mut failures = Vec::new();
        for (node, load) in redlock.inner.nodes.iter().zip(loads.answers) {
            if let Some(Err(reason)) = load {
                failures.push(failure(node, reason));
            }
        }
        let answered = redlock.inner.nodes.len().saturating_sub(failures.len());
        if self.require_nodes && answered < quorum {
            return Err(ConfigError::NodesUnreachable {
                nodes: redlock.inner.nodes.len(),
                needed: quorum,
                failures,
            });
        }
        for failure in failures {
            tracing::warn!(%failure, "Redis node not reachable yet; it will be retried");
        }
        if let Some(notifier) = &redlock.inner.notifier {
            notifier.watch();
        }
        // From now on, a layer left on the in-process fallback refuses rather than lock
        // per replica.
        crate::backend::fallback::LOCKS.redis_built();
        Ok(redlock)
    }
}

/// A duration in whole milliseconds, saturating.
pub(super) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
