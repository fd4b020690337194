//! Where the counts live: one Redis node ([`RedisRateLimiter`]) or this process's memory
//! ([`MemoryRateLimiter`]), behind one cheap handle ([`RateLimiter`]).

use std::sync::OnceLock;

mod memory;
pub(crate) mod quota;
#[cfg(feature = "redis")]
mod redis;

use crate::error::NodeFailure;
use crate::key::KeyError;
pub use memory::MemoryRateLimiter;
use quota::{Quota, Usage};
#[cfg(feature = "redis")]
pub use redis::{
    DEFAULT_RATE_PREFIX, DEFAULT_RATE_TIMEOUT, RedisRateLimiter, RedisRateLimiterBuilder,
};

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
    /// The in-process store ([`MemoryRateLimiter`]) holds its maximum of live windows,
    /// and this key has none: the request cannot be counted. The layer treats it as an
    /// unavailable store ([`fail_open`](crate::RateLimitLayer::fail_open)). See
    /// [`MemoryRateLimiter`]'s "Bounded memory".
    #[error(
        "the in-process rate limit store holds its maximum of {max_keys} live windows; a new key cannot be counted until one ends"
    )]
    StoreFull {
        /// The store's bound on live windows.
        max_keys: usize,
    },
}

/// The verdict of a count, for its span.
fn rate_verdict(counted: &Result<Usage, RateLimitError>) -> &'static str {
    match counted {
        Ok(usage) if usage.is_exceeded() => "limited",
        Ok(_) => "allowed",
        Err(RateLimitError::Unavailable(_)) => "unavailable",
        Err(RateLimitError::InvalidKey(_)) => "invalid_key",
        Err(RateLimitError::StoreFull { .. }) => "store_full",
    }
}

/// A handle to a rate-limit store, [`RedisRateLimiter`] or [`MemoryRateLimiter`], with
/// one contract: a fixed window or GCRA per key ([`Quota`]), counted atomically.
///
/// The layer and your state hold a `RateLimiter`; cloning it is cheap and shares the
/// store. Build one with `RateLimiter::from(redis_rate_limiter)` or
/// `RateLimiter::from(memory_rate_limiter)`; [`RateLimiter::default`] is the
/// process-wide in-process store.
#[derive(Clone, Debug)]
pub struct RateLimiter {
    backend: RateStore,
}

#[derive(Clone, Debug)]
enum RateStore {
    #[cfg(feature = "redis")]
    Redis(RedisRateLimiter),
    Memory(MemoryRateLimiter),
}

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
impl From<RedisRateLimiter> for RateLimiter {
    fn from(redis: RedisRateLimiter) -> Self {
        Self {
            backend: RateStore::Redis(redis),
        }
    }
}

impl From<MemoryRateLimiter> for RateLimiter {
    fn from(memory: MemoryRateLimiter) -> Self {
        Self {
            backend: RateStore::Memory(memory),
        }
    }
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

impl RateLimiter {
    /// Whether this is the in-process store.
    pub fn is_in_process(&self) -> bool {
        matches!(self.backend, RateStore::Memory(_))
    }

    /// The in-process store, when this is one: it answers without `.await`.
    pub(crate) fn as_memory(&self) -> Option<&MemoryRateLimiter> {
        match &self.backend {
            RateStore::Memory(memory) => Some(memory),
            #[cfg(feature = "redis")]
            RateStore::Redis(_) => None,
        }
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
            RateStore::Redis(r) => r.hit(resource, quota).await,
            RateStore::Memory(m) => m.hit(resource, quota),
        }
    }
}
