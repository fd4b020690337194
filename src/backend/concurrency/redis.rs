//! [`RedisConcurrencyLimiter`]: expiring permits in a sorted set per key, on one Redis node.

use crate::backend::notify::{Channels, Joined, Notifier, UnsubscribeOnDrop};
use crate::backend::wait::Waiters;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ConcurrencyError;
use crate::backend::lua::{CONCURRENCY_ACQUIRE, CONCURRENCY_RELEASE, CONCURRENCY_RENEW};
use crate::backend::node::Node;
use crate::backend::settings::check_resource;
use crate::backend::store::{NodeStore, StoreSettings};
use crate::error::{ConfigError, NodeFailureReason};

/// Default key prefix of [`RedisConcurrencyLimiter`]: `"tower-redlock-concurrency:"`.
///
/// It is not inside the lock backends' default prefix (`"tower-redlock:"`) nor the rate
/// limiter's (`"tower-redlock-rate:"`), so no lock key or counter can be a permit set.
pub const DEFAULT_CONCURRENCY_PREFIX: &str = "tower-redlock-concurrency:";
/// Default bound on one Redis call of [`RedisConcurrencyLimiter`]: 100 ms.
pub const DEFAULT_CONCURRENCY_TIMEOUT: Duration = Duration::from_millis(100);
/// Default time a permit lives without renewal: 10 s. The layer renews it while the
/// request runs (every TTL/3); a replica that dies frees its permits within this long.
pub const DEFAULT_PERMIT_TTL: Duration = Duration::from_secs(10);

/// The longest permit TTL: `u32::MAX` ms (about 49.7 days), so that expiries stay exact in
/// a Lua number.
const MAX_PERMIT_TTL: Duration = Duration::from_millis(u32::MAX as u64);

/// How long a waiter's mark lives: past the longest pause between two of its tries.
const MARK_MS: u64 = 1_000;

/// Expiring permits on one Redis node, shared by every replica that uses that node: the
/// distributed form of tower's `ConcurrencyLimit` (Redisson's `RPermitExpirableSemaphore`).
///
/// Each key's permits are one sorted set, `{prefix}{<key>}` (the key in a Redis Cluster
/// hash tag), of random tokens scored by their expiry on the server's clock. Taking a
/// permit is one script (drop the expired, count, add ours under the limit), releasing one
/// another (`ZREM`, and a `PUBLISH` when waiters of any replica marked the set). A permit
/// lives [`permit_ttl`](RedisConcurrencyLimiterBuilder::permit_ttl) (default 10 s) unless
/// renewed: the [`ConcurrencyLimitLayer`](crate::ConcurrencyLimitLayer) renews it while
/// the request runs ([`Renewal`](crate::Renewal)), so a replica that dies frees its
/// permits within one TTL.
///
/// # Why one node and no quorum
///
/// A limit of in-flight requests protects capacity; it does not make a request correct as
/// a lock does. If Redis loses the set in a failover, replicas admit up to `limit` more
/// requests until the old ones end: a brief overshoot, never a wrong answer.
///
/// The connection is multiplexed and replaced after any failure, as the rate limiter's;
/// every call is bounded by the [timeout](RedisConcurrencyLimiterBuilder::timeout).
/// Cloning is cheap and shares the connection.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tower_redlock::{ConcurrencyLimiter, RedisConcurrencyLimiter};
///
/// let redis = RedisConcurrencyLimiter::builder("redis://127.0.0.1:6379")
///     .permit_ttl(Duration::from_secs(5))
///     .build()
///     .await?;
/// let limiter = ConcurrencyLimiter::from(redis); // for ConcurrencyLimitLayer::backend
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisConcurrencyLimiter {
    inner: Arc<RedisInner>,
}

struct RedisInner {
    store: NodeStore,
    ttl: Duration,
    /// The requests of this process waiting for a permit, woken by the releases of every
    /// replica (those of this process directly, the others' through `notifier`).
    waiters: Arc<Waiters>,
    notifier: Arc<Notifier>,
}

impl fmt::Debug for RedisConcurrencyLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConcurrencyLimiter")
            .field("node", &self.inner.store.label)
            .field("timeout", &self.inner.store.timeout)
            .field("permit_ttl", &self.inner.ttl)
            .field("prefix", &self.inner.store.prefix)
            .finish()
    }
}

/// Builds a [`RedisConcurrencyLimiter`]; see [`RedisConcurrencyLimiter::builder`].
#[derive(Debug)]
#[must_use]
pub struct RedisConcurrencyLimiterBuilder {
    settings: StoreSettings,
    ttl: Duration,
}

/// A permit held on Redis: our token in the key's set.
pub(crate) struct RedisSlot {
    pub(crate) limiter: RedisConcurrencyLimiter,
    /// The set's key, as stored.
    pub(crate) key: Arc<str>,
    pub(crate) token: Arc<str>,
    /// The validity at acquisition, on this process's clock: a little short of the
    /// server's expiry.
    pub(crate) valid_until: Instant,
}

impl RedisSlot {
    /// Gives the permit back, logging a failure (its TTL then frees it).
    pub(crate) async fn release(&self) {
        if let Err(e) = self.limiter.release(&self.key, &self.token).await {
            tracing::debug!(error = %e, "concurrency permit release");
        }
    }
}

/// Gives back, in the background, the permit `token` on `key` that an acquisition may
/// have taken, when dropped `armed`: the acquisition was dropped or timed out before its
/// answer came.
struct TakeBack<'a> {
    limiter: &'a RedisConcurrencyLimiter,
    key: &'a str,
    token: &'a Arc<str>,
    armed: bool,
}

impl Drop for TakeBack<'_> {
    fn drop(&mut self) {
        // No runtime (it is shutting down): the permit's TTL frees it.
        if let (true, Ok(runtime)) = (self.armed, tokio::runtime::Handle::try_current()) {
            let (limiter, key, token) = (
                self.limiter.clone(),
                self.key.to_owned(),
                self.token.clone(),
            );
            runtime.spawn(async move {
                let _ = limiter.release(&key, &token).await;
            });
        }
    }
}

/// A 128-bit random token, in hex.
fn token() -> Arc<str> {
    Arc::from(format!("{:032x}", rand::random::<u128>()))
}

/// The validity of a permit taken at `start`: its TTL less 1 % and 2 ms, as a lease's.
fn validity(start: Instant, ttl: Duration) -> Instant {
    let drift = ttl / 100 + Duration::from_millis(2);
    start
        .checked_add(ttl.saturating_sub(drift))
        .unwrap_or(start)
}

impl RedisConcurrencyLimiter {
    crate::backend::store::node_store_methods! {
        RedisConcurrencyLimiterBuilder,
        /// Starts a builder from a [`Node`]: one server, a Redis Cluster (each key's set is
        /// one key, in its own hash slot) or a Sentinel service.
    }

    /// The store's connection and settings.
    fn store(&self) -> &NodeStore {
        &self.inner.store
    }

    /// Whether the node answers `PING` within the
    /// [timeout](RedisConcurrencyLimiterBuilder::timeout) now: for a readiness probe, cheap
    /// enough to call every few seconds (one `PING`; a node that is down is connected again
    /// in the background, and a later call finds it back).
    /// [`ConcurrencyLimiter::ready`](crate::ConcurrencyLimiter::ready) asks the same
    /// through the handle.
    pub async fn ready(&self) -> bool {
        self.inner.store.ping().await.is_ok()
    }

    /// How long a permit lives without renewal.
    pub fn permit_ttl(&self) -> Duration {
        self.inner.ttl
    }

    /// The key of `resource`'s permit set: `{prefix}{<resource>}`.
    pub(crate) fn key(&self, resource: &str) -> String {
        let prefix = &self.inner.store.prefix;
        let mut key = String::with_capacity(prefix.len() + resource.len() + 2);
        key.push_str(prefix);
        key.push('{');
        key.push_str(resource);
        key.push('}');
        key
    }

    /// Takes a permit on `resource` if fewer than `limit` are live: one round trip. A
    /// `waiting` try (subscribed to the set's release channel) marks the set when it gets
    /// none.
    pub(crate) async fn acquire(
        &self,
        resource: &str,
        limit: u32,
        waiting: bool,
    ) -> Result<RedisSlot, ConcurrencyError> {
        check_resource(resource)?;
        let inner = &*self.inner;
        let key = self.key(resource);
        let token = token();
        let mut conn = inner.store.conn();
        let mut invocation = CONCURRENCY_ACQUIRE.key(&key);
        if waiting {
            invocation.key(Joined([&key, ":waiters"]));
        }
        invocation
            .arg(limit)
            .arg(inner.ttl.as_millis() as u64)
            .arg(&*token)
            .arg(MARK_MS);
        let start = Instant::now();
        let call = invocation.invoke_async::<(i64, i64)>(&mut conn);
        // Dropped while the script is on its way (the request went away), the attempt may
        // have taken a permit: it is taken back rather than left to its TTL.
        let mut take_back = TakeBack {
            limiter: self,
            key: &key,
            token: &token,
            armed: true,
        };
        let (taken, _held) = match inner.store.bounded(call).await {
            Ok(reply) => reply,
            Err(failure) => {
                // Timed out, the script may have run without its answer arriving in time;
                // any other failure took nothing.
                take_back.armed = matches!(failure.reason, NodeFailureReason::Timeout(_));
                return Err(ConcurrencyError::Unavailable(failure));
            }
        };
        take_back.armed = false;
        drop(take_back);
        if taken != 1 {
            return Err(ConcurrencyError::LimitReached { limit });
        }
        Ok(RedisSlot {
            limiter: self.clone(),
            key: Arc::from(key),
            token,
            valid_until: validity(start, inner.ttl),
        })
    }

    /// Moves the expiry of the permit `token` on `key` one TTL on, if it is still held:
    /// the new end of its validity.
    pub(crate) async fn renew(&self, key: &str, token: &str) -> Result<Instant, ConcurrencyError> {
        let mut conn = self.inner.store.conn();
        let mut invocation = CONCURRENCY_RENEW.key(key);
        invocation.arg(token).arg(self.inner.ttl.as_millis() as u64);
        let start = Instant::now();
        let renewed = self
            .inner
            .store
            .bounded(invocation.invoke_async::<i64>(&mut conn));
        let renewed = renewed.await.map_err(ConcurrencyError::Unavailable)?;
        if renewed != 1 {
            return Err(ConcurrencyError::Expired {
                key: key.to_owned(),
            });
        }
        Ok(validity(start, self.inner.ttl))
    }

    /// Gives back the permit `token` on `key` ([`CONCURRENCY_RELEASE`]), and wakes the
    /// requests of this process that wait on it.
    pub(crate) async fn release(&self, key: &str, token: &str) -> Result<(), ConcurrencyError> {
        let mut conn = self.inner.store.conn();
        let mut invocation = CONCURRENCY_RELEASE.key(key);
        invocation
            .key(Joined([key, ":waiters"]))
            .arg(token)
            .arg(Channels::Suffixed.released(key));
        let released = self
            .inner
            .store
            .bounded(invocation.invoke_async::<i64>(&mut conn));
        let released = released.await.map_err(ConcurrencyError::Unavailable);
        self.inner.waiters.wake(key);
        released.map(drop)
    }

    /// The requests of this process waiting for a permit, by the key of their set.
    pub(crate) fn waiters(&self) -> &Waiters {
        &self.inner.waiters
    }

    /// Subscribes a waiter to the release channel of the set `key` (done once confirmed or
    /// given up); the subscription ends with the returned guard.
    pub(crate) async fn subscribe(&self, key: &Arc<str>) -> UnsubscribeOnDrop {
        let notifier = &self.inner.notifier;
        notifier.subscribe(key).await;
        UnsubscribeOnDrop {
            notifier: notifier.clone(),
            key: key.clone(),
        }
    }
}

impl RedisConcurrencyLimiterBuilder {
    fn new(node: Node) -> Self {
        let (timeout, prefix) = (DEFAULT_CONCURRENCY_TIMEOUT, DEFAULT_CONCURRENCY_PREFIX);
        Self {
            settings: StoreSettings::new(node, timeout, prefix),
            ttl: DEFAULT_PERMIT_TTL,
        }
    }

    crate::backend::store::node_store_setters! {
        /// The prefix put before every key, so that several applications can share Redis.
        /// Default `"tower-redlock-concurrency:"` ([`DEFAULT_CONCURRENCY_PREFIX`]); at most
        /// 128 bytes, no control characters, no `{` or `}` (the key itself is the hash
        /// tag). Keep it apart from the lock backends' and the rate limiter's prefixes.
        prefix;

        /// The bound on one call to Redis, connecting included. Default 100 ms; values
        /// under 1 ms are raised to 1 ms. When it passes, the request is answered 503, or
        /// let through when the layer fails open.
        timeout;
    }

    /// How long a permit lives without renewal: the longest a dead replica's permits stay
    /// taken. Default 10 s ([`DEFAULT_PERMIT_TTL`]); at least 10 ms and at most
    /// `u32::MAX` ms (values outside are moved to the nearest bound). The layer renews
    /// permits every TTL/3 while their requests run.
    pub fn permit_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl.clamp(Duration::from_millis(10), MAX_PERMIT_TTL);
        self
    }

    /// Whether [`build`](Self::build) fails when the node does not answer `PING` within
    /// the timeout while it connects ([`ConfigError::NodesUnreachable`], naming the node
    /// and why), rather than start and retry it. Default off: the node is connected again
    /// later, and the layer fails open (or answers 503) meanwhile.
    pub fn require_nodes_at_start(mut self, required: bool) -> Self {
        self.settings.require_node = required;
        self
    }

    /// Checks the configuration and connects, bounded by the timeout; a node that cannot be
    /// reached now is retried on every later call (unless
    /// [`require_nodes_at_start`](Self::require_nodes_at_start)). Needs a Tokio runtime
    /// with the time driver.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidUrl`] for a URL redis-rs cannot use,
    /// [`ConfigError::InvalidPrefix`] for a prefix over 128 bytes or with control
    /// characters, [`ConfigError::BraceInPrefix`] for a prefix with `{` or `}`;
    /// [`ConfigError::NodesUnreachable`] for a node that does not answer, with
    /// [`require_nodes_at_start`](Self::require_nodes_at_start).
    pub async fn build(self) -> Result<RedisConcurrencyLimiter, ConfigError> {
        let store = self.settings.connect().await?;
        let waiters = Arc::new(Waiters::default());
        let conn = store.conn();
        let notifier = Arc::new(Notifier::new(
            vec![conn.connector().clone()],
            vec![conn],
            waiters.clone(),
            Channels::Suffixed,
            store.timeout.max(Duration::from_millis(100)),
        ));
        notifier.watch();
        // From now on, a layer left on the in-process fallback refuses rather than limit
        // per replica.
        crate::backend::fallback::CONCURRENCY_LIMITER.redis_built();
        Ok(RedisConcurrencyLimiter {
            inner: Arc::new(RedisInner {
                store,
                ttl: self.ttl,
                waiters,
                notifier,
            }),
        })
    }
}
