//! [`RedisRateLimiter`]: fixed-window counters on one Redis node.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::quota::{Quota, Usage};
use super::{RateLimitError, rate_verdict};
use crate::backend::lua::{RATE_FIXED, RATE_GCRA};
use crate::backend::node::Node;
use crate::backend::settings::check_resource;
use crate::backend::store::{NodeStore, StoreSettings};
use crate::error::ConfigError;

/// Default key prefix of [`RedisRateLimiter`]: `"tower-redlock-rate:"`.
///
/// It is not inside the lock backends' default prefix (`"tower-redlock:"`), so that no
/// lock key (whatever its scope) can be a rate-limit key: the two differ at the 14th byte.
pub const DEFAULT_RATE_PREFIX: &str = "tower-redlock-rate:";
/// Default bound on one Redis call of [`RedisRateLimiter`]: 100 ms.
pub const DEFAULT_RATE_TIMEOUT: Duration = Duration::from_millis(100);

/// Rate-limit counters on one Redis node, shared by every replica that uses that node:
/// a fixed window, or GCRA's arrival time ([`Quota::gcra`]), per key.
///
/// A rate limit needs no quorum: a count lost in a failover only lets a few extra requests
/// through. Each request is one script round trip (the Redis `INCR` documentation's rate
/// limiter pattern, or GCRA on the server's clock, so skewed replicas share one limit).
///
/// The connection is multiplexed, and replaced after any failure (one that goes silent is
/// found by a `PING` probe), so that the limit comes back within about a second of Redis;
/// every call is bounded by the [timeout](RedisRateLimiterBuilder::timeout), so a dead
/// Redis costs at most that long per request. Cloning is cheap and shares the connection.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_redlock::{Quota, RateLimiter, RedisRateLimiter};
///
/// let redis = RedisRateLimiter::builder("redis://127.0.0.1:6379").build().await?;
/// let usage = redis.hit("ip:203.0.113.7", "100/60".parse::<Quota>()?).await?;
/// println!("{} left for {:?}", usage.remaining(), usage.reset_after());
/// let limiter = RateLimiter::from(redis); // for RateLimitLayer::backend
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisRateLimiter {
    store: Arc<NodeStore>,
}

impl fmt::Debug for RedisRateLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisRateLimiter")
            .field("node", &self.store.label)
            .field("timeout", &self.store.timeout)
            .field("prefix", &self.store.prefix)
            .finish()
    }
}

/// Builds a [`RedisRateLimiter`]; see [`RedisRateLimiter::builder`].
#[derive(Debug)]
#[must_use]
pub struct RedisRateLimiterBuilder {
    settings: StoreSettings,
}

impl RedisRateLimiter {
    crate::backend::store::node_store_methods! {
        RedisRateLimiterBuilder,
        /// Starts a builder from a [`Node`]: one server, a Redis Cluster (the counters are
        /// spread over its shards, each script touching one key) or a Sentinel service.
    }

    /// The store's connection and settings.
    fn store(&self) -> &NodeStore {
        &self.store
    }

    /// Whether the node answers `PING` within the [timeout](RedisRateLimiterBuilder::timeout)
    /// now: for a readiness probe, cheap enough to call every few seconds (one `PING`; a
    /// node that is down is connected again in the background, and a later call finds it
    /// back). [`RateLimiter::ready`](crate::RateLimiter::ready) asks the same through the
    /// handle.
    pub async fn ready(&self) -> bool {
        self.store.ping().await.is_ok()
    }

    /// Counts one request on `resource` (stored as `{prefix}{resource}`) under `quota`,
    /// in one atomic script: the count after this request, and the time until the window
    /// resets. The first request of a window starts it; it lasts `quota.window()`.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::Unavailable`] when Redis does not answer within the timeout or
    /// fails; [`RateLimitError::InvalidKey`] for an empty key, one over
    /// [`MAX_RESOURCE_LEN`](crate::key::MAX_RESOURCE_LEN) bytes, or one with control
    /// characters.
    pub async fn hit(&self, resource: &str, quota: Quota) -> Result<Usage, RateLimitError> {
        let span = crate::observe::op_span!("tower_redlock.rate_limit", resource, "", 1);
        crate::observe::traced(span, self.hit_untraced(resource, quota), rate_verdict).await
    }

    async fn hit_untraced(&self, resource: &str, quota: Quota) -> Result<Usage, RateLimitError> {
        check_resource(resource)?;
        let store = &*self.store;
        let mut key = String::with_capacity(store.prefix.len() + resource.len());
        key.push_str(&store.prefix);
        key.push_str(resource);
        let mut conn = store.conn();
        if quota.burst().is_some() {
            let mut invocation = RATE_GCRA.key(key);
            invocation
                .arg(quota.emission_us())
                .arg(quota.tolerance_us());
            let call = invocation.invoke_async::<(i64, i64, i64)>(&mut conn);
            let (allowed, micros, reset_us) = store.bounded(call).await.map_err(unavailable)?;
            crate::observe::nodes_answered(1);
            // `micros`: what is left of the burst when allowed, the retry delay when not.
            let us = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
            let remaining = u64::try_from(micros).unwrap_or(0);
            return Ok(Usage::gcra(
                &quota,
                allowed == 1,
                remaining,
                us(reset_us),
                us(micros),
            ));
        }
        let mut invocation = RATE_FIXED.key(key);
        invocation.arg(quota.window_ms());
        let call = invocation.invoke_async::<(i64, i64)>(&mut conn);
        let (count, pttl_ms) = store.bounded(call).await.map_err(unavailable)?;
        crate::observe::nodes_answered(1);
        Ok(Usage::fixed(
            u64::try_from(count).unwrap_or(0),
            quota.limit(),
            Duration::from_millis(u64::try_from(pttl_ms).unwrap_or(0)),
        ))
    }
}

/// A store failure, counted.
fn unavailable(failure: crate::error::NodeFailure) -> RateLimitError {
    crate::observe::node_error(&failure.node);
    crate::observe::nodes_answered(0);
    RateLimitError::Unavailable(failure)
}

impl RedisRateLimiterBuilder {
    fn new(node: Node) -> Self {
        Self {
            settings: StoreSettings::new(node, DEFAULT_RATE_TIMEOUT, DEFAULT_RATE_PREFIX),
        }
    }

    crate::backend::store::node_store_setters! {
        /// The prefix put before every key, so that several applications can share Redis.
        /// Default `"tower-redlock-rate:"` ([`DEFAULT_RATE_PREFIX`]); at most 128 bytes, no
        /// control characters, no `{` or `}` (a Redis Cluster hash tag). Keep it apart from
        /// the lock backends' prefix: a prefix that starts with theirs lets a lock key equal
        /// a counter's key.
        prefix;

        /// The bound on one call to Redis, connecting included. Default 100 ms; values
        /// under 1 ms are raised to 1 ms. When it passes, the request is let through or
        /// answered 503, as the layer is configured.
        timeout;
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
    pub async fn build(self) -> Result<RedisRateLimiter, ConfigError> {
        let store = self.settings.connect().await?;
        // From now on, a layer left on the in-process fallback refuses rather than count
        // per replica.
        crate::backend::fallback::RATE_LIMITER.redis_built();
        Ok(RedisRateLimiter {
            store: Arc::new(store),
        })
    }
}
