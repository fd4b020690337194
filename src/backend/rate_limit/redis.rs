//! [`RedisRateLimiter`]: fixed-window counters on one Redis node.

use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::Script;

use super::quota::{Quota, Usage};
use super::{RateLimitError, rate_verdict};
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

/// The fixed-window counter, atomically: `INCR` the key, set its expiry on the first hit
/// only, answer `{count, pttl_ms}`.
///
/// This is the Redis `INCR` documentation's "Pattern: Rate limiter 2"
/// (<https://redis.io/docs/latest/commands/incr/>) as one script, so that no client can
/// crash between `INCR` and `PEXPIRE` and leave a counter without expiry. A value this
/// crate did not write (another type, not a decimal count, or without expiry) is left as
/// it is, and the script answers an error.
static HIT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local v = redis.pcall('GET', KEYS[1])
if v and (type(v) ~= 'string' or not string.match(v, '^%d+$') or redis.call('PTTL', KEYS[1]) < 0) then
  return redis.error_reply('ERR the rate limit key holds a value tower-redlock did not write')
end
local count = redis.call('INCR', KEYS[1])
if count == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  return {count, tonumber(ARGV[1])}
end
return {count, redis.call('PTTL', KEYS[1])}
",
    )
});

/// GCRA (see [`Quota::gcra`]) on the key KEYS[1], which holds the theoretical arrival
/// time (TAT) in µs on the server's clock (`TIME`: the replicas' clocks never enter it).
/// ARGV: the emission interval and the tolerance, in µs. Integers throughout, below 2^53,
/// so Lua's doubles hold them exactly; written with `%d`, never in exponent form.
///
/// Returns `{1, remaining, reset}` when allowed (the TAT moved on by one emission; what
/// is left of the burst; µs until all of it is back), `{0, retry, reset}` when refused
/// (µs until a request would pass). A value this crate did not write (another type, not
/// digits, or without expiry) is left as it is, and the script answers an error.
static GCRA: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local emission = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])
local v = redis.pcall('GET', KEYS[1])
local tat = now
if v then
  if type(v) ~= 'string' or #v > 16 or not string.match(v, '^%d+$') or redis.call('PTTL', KEYS[1]) < 0 then
    return redis.error_reply('ERR the rate limit key holds a value tower-redlock did not write')
  end
  tat = math.max(tonumber(v), now)
end
if tat - now > tolerance then
  return {0, tat - now - tolerance, tat - now}
end
tat = tat + emission
redis.call('SET', KEYS[1], string.format('%d', tat), 'PX', math.ceil((tat - now) / 1000))
return {1, math.floor((tolerance + emission - (tat - now)) / emission), tat - now}
",
    )
});

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
            let mut invocation = GCRA.key(key);
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
        let mut invocation = HIT.key(key);
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

    /// Checks the configuration and connects, bounded by the timeout; a node that cannot be
    /// reached now is retried on every later call. Needs a Tokio runtime with the time driver.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidUrl`] for a URL redis-rs cannot use,
    /// [`ConfigError::InvalidPrefix`] for a prefix over 128 bytes or with control
    /// characters, [`ConfigError::BraceInPrefix`] for a prefix with `{` or `}`.
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
