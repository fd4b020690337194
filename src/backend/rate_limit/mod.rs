//! Where the counts live: one Redis node ([`RedisRateLimiter`]) or this process's memory
//! ([`MemoryRateLimiter`]), behind one cheap handle ([`RateLimiter`]).

use std::collections::HashMap;
use std::fmt;
#[cfg(feature = "redis")]
use std::sync::LazyLock;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
#[cfg(feature = "redis")]
use std::time::Duration;
use std::time::Instant;

#[cfg(feature = "redis")]
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
#[cfg(feature = "redis")]
use redis::{Client, Script};

pub(crate) mod quota;

use crate::backend::settings::check_resource;
use crate::error::NodeFailure;
#[cfg(feature = "redis")]
use crate::error::{ConfigError, NodeFailureReason};
use crate::key::KeyError;
#[cfg(test)]
use crate::key::MAX_RESOURCE_LEN;
use quota::{Quota, Usage};

/// Default key prefix of [`RedisRateLimiter`]: `"tower-redlock:rate:"`.
#[cfg(feature = "redis")]
pub const DEFAULT_RATE_PREFIX: &str = "tower-redlock:rate:";
/// Default bound on one Redis call of [`RedisRateLimiter`]: 100 ms.
#[cfg(feature = "redis")]
pub const DEFAULT_RATE_TIMEOUT: Duration = Duration::from_millis(100);

/// The fixed-window counter, atomically: `INCR` the key, set its expiry on the first hit
/// only, answer `{count, pttl_ms}`.
///
/// This is the Redis `INCR` documentation's "Pattern: Rate limiter 2"
/// (<https://redis.io/docs/latest/commands/incr/>) as one script, so that no client can
/// crash between `INCR` and `PEXPIRE` and leave a counter without expiry. A key found
/// without expiry anyway (written by something else) is given one window, rather than
/// blocking its client forever.
#[cfg(feature = "redis")]
static HIT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local count = redis.call('INCR', KEYS[1])
if count == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  return {count, tonumber(ARGV[1])}
end
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  ttl = tonumber(ARGV[1])
end
return {count, ttl}
",
    )
});

/// Why a request could not be counted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RateLimitError {
    /// The store did not answer in time, or failed (connection refused, Redis error).
    /// The [`RateLimitLayer`](crate::RateLimitLayer) then lets the request through or
    /// answers 503, as configured ([`fail_open`](crate::RateLimitLayer::fail_open)).
    #[error("the rate limit store is unavailable: {0}")]
    Unavailable(NodeFailure),
    /// The key cannot be used: empty, longer than
    /// [`MAX_RESOURCE_LEN`](crate::key::MAX_RESOURCE_LEN) bytes, or with control
    /// characters. The layer answers 400.
    #[error(transparent)]
    InvalidKey(#[from] KeyError),
}

/// A handle to a rate-limit store, [`RedisRateLimiter`] or [`MemoryRateLimiter`], with one
/// contract: a fixed window per key, counted atomically.
///
/// The layer and your state hold a `RateLimiter`; cloning it is cheap and shares the
/// store. Build one with `RateLimiter::from(redis_rate_limiter)` or
/// `RateLimiter::from(memory_rate_limiter)`; [`RateLimiter::default`] is the process-wide
/// in-process store.
#[derive(Clone, Debug)]
pub struct RateLimiter {
    backend: Backend,
}

#[derive(Clone, Debug)]
enum Backend {
    #[cfg(feature = "redis")]
    Redis(RedisRateLimiter),
    Memory(MemoryRateLimiter),
}

impl Default for RateLimiter {
    /// The process-wide [`MemoryRateLimiter`], shared by every layer that was given no
    /// backend. It counts per process: with several replicas, each allows the full limit;
    /// use [`RedisRateLimiter`] to share one limit.
    fn default() -> Self {
        static SHARED: OnceLock<MemoryRateLimiter> = OnceLock::new();
        RateLimiter::from(SHARED.get_or_init(MemoryRateLimiter::new).clone())
    }
}

#[cfg(feature = "redis")]
impl From<RedisRateLimiter> for RateLimiter {
    fn from(redis: RedisRateLimiter) -> Self {
        Self {
            backend: Backend::Redis(redis),
        }
    }
}

impl From<MemoryRateLimiter> for RateLimiter {
    fn from(memory: MemoryRateLimiter) -> Self {
        Self {
            backend: Backend::Memory(memory),
        }
    }
}

impl RateLimiter {
    /// Whether this is the in-process store.
    pub fn is_in_process(&self) -> bool {
        matches!(self.backend, Backend::Memory(_))
    }

    /// Counts one request on `resource` under `quota`; see [`RedisRateLimiter::hit`] and
    /// [`MemoryRateLimiter::hit`].
    ///
    /// # Errors
    ///
    /// [`RateLimitError::Unavailable`] when Redis does not answer in time or fails,
    /// [`RateLimitError::InvalidKey`] for an unusable key.
    pub async fn hit(&self, resource: &str, quota: Quota) -> Result<Usage, RateLimitError> {
        match &self.backend {
            #[cfg(feature = "redis")]
            Backend::Redis(r) => r.hit(resource, quota).await,
            Backend::Memory(m) => m.hit(resource, quota),
        }
    }

    /// The in-process store, when this is one: it answers without `.await`.
    pub(crate) fn as_memory(&self) -> Option<&MemoryRateLimiter> {
        match &self.backend {
            Backend::Memory(m) => Some(m),
            #[cfg(feature = "redis")]
            Backend::Redis(_) => None,
        }
    }
}

/// Fixed-window counters on one Redis node, shared by every replica that uses that node.
///
/// A rate limit needs no quorum: one node (or a replicated primary) is enough, and a
/// count lost in a failover only lets a few extra requests through. Each request is one
/// round trip: the script of the Redis `INCR` documentation's rate limiter pattern
/// (`INCR`, `PEXPIRE` on the first hit, `PTTL`), run with `EVALSHA`.
///
/// The connection is multiplexed and reconnects by itself (redis-rs `ConnectionManager`);
/// every call is bounded by the [timeout](RedisRateLimiterBuilder::timeout), so a dead
/// Redis costs at most that long per request, never a hang. Cloning is cheap and shares the
/// connection.
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
#[cfg(feature = "redis")]
#[derive(Clone)]
pub struct RedisRateLimiter {
    inner: Arc<RedisInner>,
}

#[cfg(feature = "redis")]
struct RedisInner {
    label: String,
    conn: ConnectionManager,
    timeout: Duration,
    prefix: Arc<str>,
}

#[cfg(feature = "redis")]
impl fmt::Debug for RedisRateLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisRateLimiter")
            .field("node", &self.inner.label)
            .field("timeout", &self.inner.timeout)
            .field("prefix", &self.inner.prefix)
            .finish()
    }
}

/// Builds a [`RedisRateLimiter`]; see [`RedisRateLimiter::builder`].
#[cfg(feature = "redis")]
#[derive(Debug)]
#[must_use]
pub struct RedisRateLimiterBuilder {
    client: Result<Client, ConfigError>,
    timeout: Duration,
    prefix: String,
}

#[cfg(feature = "redis")]
impl RedisRateLimiter {
    /// Starts a builder from a Redis URL (`redis://[:password@]host:port[/db]`).
    pub fn builder(url: impl AsRef<str>) -> RedisRateLimiterBuilder {
        let client = Client::open(url.as_ref())
            .map_err(|source| ConfigError::InvalidUrl { index: 0, source });
        RedisRateLimiterBuilder::new(client)
    }

    /// Starts a builder from a ready redis-rs client.
    pub fn from_client(client: Client) -> RedisRateLimiterBuilder {
        RedisRateLimiterBuilder::new(Ok(client))
    }

    /// The prefix put before every key.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// The bound on one call.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
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
        check_resource(resource)?;
        let inner = &*self.inner;
        let mut key = String::with_capacity(inner.prefix.len() + resource.len());
        key.push_str(&inner.prefix);
        key.push_str(resource);
        let mut conn = inner.conn.clone();
        let mut invocation = HIT.key(key);
        invocation.arg(quota.window_ms());
        let call = invocation.invoke_async::<(i64, i64)>(&mut conn);
        let failure = |reason| {
            RateLimitError::Unavailable(NodeFailure {
                node: inner.label.clone(),
                reason,
            })
        };
        let (count, pttl_ms) = match tokio::time::timeout(inner.timeout, call).await {
            Ok(Ok(reply)) => reply,
            Ok(Err(e)) => return Err(failure(NodeFailureReason::Redis(e))),
            Err(_) => return Err(failure(NodeFailureReason::Timeout(inner.timeout))),
        };
        Ok(Usage {
            count: u64::try_from(count).unwrap_or(0),
            limit: quota.limit(),
            reset_after: Duration::from_millis(u64::try_from(pttl_ms).unwrap_or(0)),
        })
    }
}

#[cfg(feature = "redis")]
impl RedisRateLimiterBuilder {
    fn new(client: Result<Client, ConfigError>) -> Self {
        Self {
            client,
            timeout: DEFAULT_RATE_TIMEOUT,
            prefix: DEFAULT_RATE_PREFIX.to_owned(),
        }
    }

    /// The prefix put before every key, so that several applications can share Redis.
    /// Default `"tower-redlock:rate:"`; at most 128 bytes, no control characters.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The bound on one call to Redis, connecting included. Default 100 ms; values under
    /// 1 ms are raised to 1 ms. When it passes, the request is let through or answered
    /// 503, as the layer is configured.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Checks the configuration and connects, bounded by the timeout. A node that cannot
    /// be reached now is not an error: it is retried on every later call (which fails,
    /// within the timeout, until it answers).
    ///
    /// Needs a Tokio runtime with the time driver.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidUrl`] for a URL redis-rs cannot use,
    /// [`ConfigError::InvalidPrefix`] for a prefix over 128 bytes or with control
    /// characters.
    pub async fn build(self) -> Result<RedisRateLimiter, ConfigError> {
        crate::backend::settings::check_prefix(&self.prefix)?;
        let client = self.client?;
        let label = client.get_connection_info().addr().to_string();
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.timeout.max(Duration::from_millis(500))))
            .set_response_timeout(None)
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(500));
        let conn = ConnectionManager::new_lazy_with_config(client, config)
            .map_err(|source| ConfigError::InvalidUrl { index: 0, source })?;
        let limiter = RedisRateLimiter {
            inner: Arc::new(RedisInner {
                label,
                conn,
                timeout: self.timeout,
                prefix: Arc::from(self.prefix),
            }),
        };
        let mut conn = limiter.inner.conn.clone();
        let ping_cmd = redis::cmd("PING");
        let ping = ping_cmd.query_async::<()>(&mut conn);
        match tokio::time::timeout(limiter.inner.timeout, ping).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(node = %limiter.inner.label, error = %e, "Redis not reachable yet; it will be retried")
            }
            Err(_) => {
                tracing::warn!(node = %limiter.inner.label, timeout = ?limiter.inner.timeout, "Redis not reachable yet; it will be retried")
            }
        }
        Ok(limiter)
    }
}

/// Fixed-window counters in this process's memory, with the same semantics as
/// [`RedisRateLimiter`]: a window per key that starts with its first request and lasts the
/// quota's window, refused requests counted too, the time to reset reported.
///
/// It is the embedded default ([`RateLimiter::default`]): for examples, single-replica
/// services and tests. It does not share counts across processes. Counting takes a short
/// mutex, no `.await`; expired windows are swept as the map grows.
///
/// Cloning is cheap and shares the counters.
///
/// ```
/// use tower_redlock::{MemoryRateLimiter, Quota};
///
/// let limiter = MemoryRateLimiter::new();
/// let quota: Quota = "2/60".parse()?;
/// assert_eq!(limiter.hit("ip:203.0.113.7", quota)?.remaining(), 1);
/// assert_eq!(limiter.hit("ip:203.0.113.7", quota)?.remaining(), 0);
/// assert!(limiter.hit("ip:203.0.113.7", quota)?.is_exceeded());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Default)]
pub struct MemoryRateLimiter {
    inner: Arc<Mutex<Windows>>,
}

#[derive(Default)]
struct Windows {
    counts: HashMap<Box<str>, Window>,
    /// Expired windows are swept when the map grows past this size.
    sweep_at: usize,
}

struct Window {
    count: u64,
    resets_at: Instant,
}

const MIN_SWEEP: usize = 1024;

impl fmt::Debug for MemoryRateLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRateLimiter")
            .field("keys", &self.windows().counts.len())
            .finish()
    }
}

impl MemoryRateLimiter {
    /// New, empty counters.
    pub fn new() -> Self {
        Self::default()
    }

    fn windows(&self) -> MutexGuard<'_, Windows> {
        // No code panics while holding the lock; recover the map if a panic ever did.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts one request on `resource` under `quota`: the count after this request, and
    /// the time until the window resets. The first request of a window starts it.
    ///
    /// # Errors
    ///
    /// [`RateLimitError::InvalidKey`] for an empty key, one over
    /// [`MAX_RESOURCE_LEN`](crate::key::MAX_RESOURCE_LEN) bytes, or one with control
    /// characters. It never answers [`RateLimitError::Unavailable`].
    pub fn hit(&self, resource: &str, quota: Quota) -> Result<Usage, RateLimitError> {
        check_resource(resource)?;
        let now = Instant::now();
        let mut windows = self.windows();
        let (count, resets_at) = match windows.counts.get_mut(resource) {
            Some(window) if window.resets_at > now => {
                window.count = window.count.saturating_add(1);
                (window.count, window.resets_at)
            }
            Some(window) => {
                *window = Window {
                    count: 1,
                    resets_at: now + quota.window(),
                };
                (1, window.resets_at)
            }
            None => {
                if windows.counts.len() >= windows.sweep_at.max(MIN_SWEEP) {
                    windows.counts.retain(|_, w| w.resets_at > now);
                    windows.sweep_at = windows.counts.len().saturating_mul(2);
                }
                let resets_at = now + quota.window();
                windows.counts.insert(
                    resource.into(),
                    Window {
                        count: 1,
                        resets_at,
                    },
                );
                (1, resets_at)
            }
        };
        Ok(Usage {
            count,
            limit: quota.limit(),
            reset_after: resets_at - now,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(text: &str) -> Quota {
        text.parse().unwrap()
    }

    #[test]
    fn memory_counts_a_fixed_window_per_key() {
        let limiter = MemoryRateLimiter::new();
        let q = quota("3/60");
        let counts: Vec<u64> = (0..5)
            .map(|_| limiter.hit("a", q).unwrap().count())
            .collect();
        assert_eq!(counts, [1, 2, 3, 4, 5]);
        assert_eq!(limiter.hit("b", q).unwrap().count(), 1);
        let usage = limiter.hit("a", q).unwrap();
        assert!(usage.is_exceeded());
        assert!(usage.reset_after() <= Duration::from_secs(60));
        assert!(usage.reset_after() > Duration::from_secs(59));
    }

    #[test]
    fn memory_window_does_not_move_with_later_hits() {
        let limiter = MemoryRateLimiter::new();
        let q = quota("10/200ms");
        let first = limiter.hit("a", q).unwrap().reset_after();
        std::thread::sleep(Duration::from_millis(20));
        let later = limiter.hit("a", q).unwrap().reset_after();
        assert!(later < first, "{later:?} < {first:?}");
    }

    #[test]
    fn memory_window_resets_after_it_ends() {
        let limiter = MemoryRateLimiter::new();
        let q = quota("1/30ms");
        assert!(!limiter.hit("a", q).unwrap().is_exceeded());
        assert!(limiter.hit("a", q).unwrap().is_exceeded());
        std::thread::sleep(Duration::from_millis(40));
        let usage = limiter.hit("a", q).unwrap();
        assert_eq!(usage.count(), 1);
        assert!(usage.reset_after() <= Duration::from_millis(30));
    }

    #[test]
    fn memory_sweeps_expired_windows() {
        let limiter = MemoryRateLimiter::new();
        let q = quota("1/1ms");
        for i in 0..MIN_SWEEP {
            limiter.hit(&format!("k{i}"), q).unwrap();
        }
        std::thread::sleep(Duration::from_millis(5));
        limiter.hit("last", q).unwrap();
        assert_eq!(limiter.windows().counts.len(), 1);
    }

    #[test]
    fn invalid_keys_are_refused() {
        let limiter = MemoryRateLimiter::new();
        let q = quota("1/1");
        assert!(matches!(
            limiter.hit("", q),
            Err(RateLimitError::InvalidKey(KeyError::Empty))
        ));
        assert!(matches!(
            limiter.hit("a\nb", q),
            Err(RateLimitError::InvalidKey(KeyError::ControlCharacter))
        ));
        assert!(matches!(
            limiter.hit(&"a".repeat(MAX_RESOURCE_LEN + 1), q),
            Err(RateLimitError::InvalidKey(KeyError::TooLong { .. }))
        ));
    }
}
