//! Where the counts live: one Redis node ([`RedisRateLimiter`]) or this process's memory
//! ([`MemoryRateLimiter`]), behind one cheap handle ([`RateLimiter`]).

use std::sync::OnceLock;

mod memory;
pub(crate) mod quota;
#[cfg(feature = "redis")]
mod redis;

use crate::backend::fallback::{self, User};
use crate::error::{ConfigError, NodeFailure};
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
    /// The handle is the in-process fallback ([`RateLimiter::default`] with no default
    /// chosen), and this process built a [`RedisRateLimiter`](crate::RedisRateLimiter):
    /// counting in process would let each replica allow the whole limit, so it refuses.
    /// Give the layer the Redis store, or call [`RateLimiter::set_default`] once at
    /// start-up; for an in-process limit beside Redis, use
    /// `RateLimiter::from(MemoryRateLimiter::new())`. The layer answers 500.
    #[error(
        "no rate limit store was chosen (RateLimiter::default() is the in-process fallback) and this process built a RedisRateLimiter, with which each replica would count on its own; use the RedisRateLimiter, or call RateLimiter::set_default(..) once at start-up"
    )]
    NoBackendChosen,
}

/// The verdict of a count, for its span.
fn rate_verdict(counted: &Result<Usage, RateLimitError>) -> &'static str {
    match counted {
        Ok(usage) if usage.is_exceeded() => "limited",
        Ok(_) => "allowed",
        Err(RateLimitError::Unavailable(_)) => "unavailable",
        Err(RateLimitError::InvalidKey(_)) => "invalid_key",
        Err(RateLimitError::StoreFull { .. }) => "store_full",
        Err(RateLimitError::NoBackendChosen) => "no_backend_chosen",
    }
}

/// A handle to a rate-limit store, [`RedisRateLimiter`] or [`MemoryRateLimiter`], with
/// one contract: a fixed window or GCRA per key ([`Quota`]), counted atomically.
///
/// The layer and your state hold a `RateLimiter`; cloning it is cheap and shares the
/// store. Build one with `RateLimiter::from(redis_rate_limiter)` or
/// `RateLimiter::from(memory_rate_limiter)`; [`RateLimiter::default`] is the app's
/// default store.
#[derive(Clone, Debug)]
pub struct RateLimiter {
    backend: RateStore,
    /// Whether this is the in-process fallback ([`RateLimiter::default`] with no default
    /// chosen), which refuses in a process that built a `RedisRateLimiter`.
    fallback: bool,
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
            fallback: false,
        }
    }
}

impl From<MemoryRateLimiter> for RateLimiter {
    fn from(memory: MemoryRateLimiter) -> Self {
        Self {
            backend: RateStore::Memory(memory),
            fallback: false,
        }
    }
}

/// The app's default store: set once by [`RateLimiter::set_default`], or the in-process
/// fallback from its first use on.
static DEFAULT: OnceLock<RateLimiter> = OnceLock::new();

impl Default for RateLimiter {
    /// The app's default store, used by every [`RateLimitLayer`](crate::RateLimitLayer)
    /// built without [`backend`](crate::RateLimitLayer::backend): the one given to
    /// [`RateLimiter::set_default`], or, when none was, the in-process fallback, one
    /// process-wide [`MemoryRateLimiter`] (so that the layers share its counts). The first
    /// call fixes it: a later `set_default` fails.
    ///
    /// The fallback counts per process, so it works only in a process that builds no
    /// [`RedisRateLimiter`]: once one is built (before or after), it refuses every request
    /// ([`RateLimitError::NoBackendChosen`]; the layer answers 500 and logs the fix once),
    /// since each replica would allow the whole limit. For an in-process limit in an app
    /// that also uses Redis, choose it: `RateLimiter::from(MemoryRateLimiter::new())`.
    fn default() -> Self {
        DEFAULT
            .get_or_init(|| RateLimiter {
                backend: RateStore::Memory(MemoryRateLimiter::new()),
                fallback: true,
            })
            .clone()
    }
}

impl RateLimiter {
    /// Makes `limiter` the app's default store: every
    /// [`RateLimitLayer`](crate::RateLimitLayer) built afterwards without `.backend(..)`,
    /// and [`RateLimiter::default`], use it. Call it once at start-up, before building any
    /// rate limit layer: a layer takes the default as it is built (even one given
    /// `.backend(..)` afterwards), so a layer built earlier has already fixed the
    /// in-process fallback, and this call then fails rather than leave that layer counting
    /// per process.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_redlock::{Quota, RateLimitLayer, RateLimiter, RedisRateLimiter};
    ///
    /// RateLimiter::set_default(RedisRateLimiter::builder("redis://10.0.0.1").build().await?)?;
    /// // On Redis, shared by every replica, with no `.backend(..)`:
    /// let layer = RateLimitLayer::by_header("x-api-key", "100/60".parse::<Quota>()?);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigError::DefaultAlreadyChosen`] when a default was set before, or was already
    /// used (a rate limit layer built, a call of [`RateLimiter::default`]).
    pub fn set_default(limiter: impl Into<RateLimiter>) -> Result<(), ConfigError> {
        DEFAULT
            .set(limiter.into())
            .map_err(|_| ConfigError::DefaultAlreadyChosen {
                handle: "RateLimiter",
            })
    }

    /// For a request of `user`: whether this is the in-process fallback and it refuses
    /// (a `RedisRateLimiter` was built in this process). The first time, `user` logs
    /// which.
    #[inline]
    pub(crate) fn refuses(&self, user: User) -> bool {
        self.fallback && fallback::RATE_LIMITER.refuses_for(user)
    }

    /// Whether this is the in-process store.
    pub fn is_in_process(&self) -> bool {
        matches!(self.backend, RateStore::Memory(_))
    }

    /// Whether the store can count now, for a readiness probe: in process always; on
    /// Redis, whether its node answers `PING` within the timeout
    /// ([`RedisRateLimiter::ready`]). `false` for the in-process fallback that refuses
    /// every request ([`RateLimitError::NoBackendChosen`]).
    pub async fn ready(&self) -> bool {
        if self.fallback && fallback::RATE_LIMITER.refuses() {
            return false;
        }
        match &self.backend {
            #[cfg(feature = "redis")]
            RateStore::Redis(r) => r.ready().await,
            RateStore::Memory(_) => true,
        }
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
    /// [`RateLimitError::InvalidKey`] for an unusable key,
    /// [`RateLimitError::NoBackendChosen`] on the in-process fallback in a process that
    /// built a [`RedisRateLimiter`].
    pub async fn hit(&self, resource: &str, quota: Quota) -> Result<Usage, RateLimitError> {
        if self.fallback && fallback::RATE_LIMITER.refuses() {
            return Err(RateLimitError::NoBackendChosen);
        }
        match &self.backend {
            #[cfg(feature = "redis")]
            RateStore::Redis(r) => r.hit(resource, quota).await,
            RateStore::Memory(m) => m.hit(resource, quota),
        }
    }
}
