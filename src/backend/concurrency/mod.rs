//! Where the permits of a concurrency limit live: one Redis node
//! ([`RedisConcurrencyLimiter`]) or this process's memory ([`MemoryConcurrencyLimiter`]),
//! behind one cheap handle ([`ConcurrencyLimiter`]).

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

mod memory;
#[cfg(feature = "redis")]
mod redis;

use crate::backend::fallback::{self, User};
use crate::backend::wait::Waiters;
use crate::error::{ConfigError, NodeFailure};
use crate::key::KeyError;
pub use memory::MemoryConcurrencyLimiter;
#[cfg(feature = "redis")]
pub use redis::{
    DEFAULT_CONCURRENCY_PREFIX, DEFAULT_CONCURRENCY_TIMEOUT, DEFAULT_PERMIT_TTL,
    RedisConcurrencyLimiter, RedisConcurrencyLimiterBuilder,
};

pub(crate) use crate::future::BoxFuture;

/// Why a request got no permit.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConcurrencyError {
    /// `limit` permits of the key are held: the request is over the limit. The
    /// [`ConcurrencyLimitLayer`](crate::ConcurrencyLimitLayer) answers 503 with
    /// `Retry-After`.
    #[error("{limit} requests are in flight on this key, the limit")]
    LimitReached {
        /// The limit that was reached.
        limit: u32,
    },
    /// The store did not answer in time, or failed (connection refused, Redis error, a key
    /// that holds a value this crate did not write). The layer answers 503, or lets the
    /// request through when it fails open.
    #[error("the concurrency limit store is unavailable: {0}")]
    Unavailable(NodeFailure),
    /// The key cannot be used: empty, longer than
    /// [`MAX_RESOURCE_LEN`](crate::key::MAX_RESOURCE_LEN) bytes, or with control
    /// characters. The layer answers 400.
    #[error(transparent)]
    InvalidKey(#[from] KeyError),
    /// The in-process store ([`MemoryConcurrencyLimiter`]) holds permits on its maximum
    /// of keys, and this key has none. The layer treats it as an unavailable store.
    #[error(
        "the in-process concurrency limit store holds permits on its maximum of {max_keys} keys; a new key gets none until one is released"
    )]
    StoreFull {
        /// The store's bound on keys with permits.
        max_keys: usize,
    },
    /// A renewal found the permit gone: it expired (its holder was paused longer than the
    /// TTL, or Redis lost it), and another request may hold its place.
    #[error(
        "the permit on {} expired before it was renewed",
        crate::redact::LogKey(key)
    )]
    Expired {
        /// The permit's key, as stored.
        key: String,
    },
    /// The handle is the in-process fallback ([`ConcurrencyLimiter::default`] with no
    /// default chosen), and this process built a
    /// [`RedisConcurrencyLimiter`](crate::RedisConcurrencyLimiter): limiting in process
    /// would let each replica allow the whole limit, so it refuses. Give the layer the
    /// Redis store, or call [`ConcurrencyLimiter::set_default`] once at start-up; for an
    /// in-process limit beside Redis, use
    /// `ConcurrencyLimiter::from(MemoryConcurrencyLimiter::new())`. The layer answers 500.
    #[error(
        "no concurrency limit store was chosen (ConcurrencyLimiter::default() is the in-process fallback) and this process built a RedisConcurrencyLimiter, with which each replica would limit on its own; use the RedisConcurrencyLimiter, or call ConcurrencyLimiter::set_default(..) once at start-up"
    )]
    NoBackendChosen,
}

/// A renewal that found the permit gone loses it; others are retried.
impl crate::renewal::RenewError for ConcurrencyError {
    fn is_gone(&self) -> bool {
        matches!(self, ConcurrencyError::Expired { .. })
    }
}

/// A handle to a store of concurrency permits, [`RedisConcurrencyLimiter`] or
/// [`MemoryConcurrencyLimiter`], with one contract: at most `limit` permits per key at
/// once; a permit is released when its request is done, and (on Redis) expires when
/// its holder dies.
///
/// The layer and your state hold a `ConcurrencyLimiter`; cloning it is cheap and shares
/// the store. Build one with `ConcurrencyLimiter::from(redis_limiter)` or
/// `ConcurrencyLimiter::from(memory_limiter)`; [`ConcurrencyLimiter::default`] is the
/// app's default store.
#[derive(Clone, Debug)]
pub struct ConcurrencyLimiter {
    backend: PermitStore,
    /// Whether this is the in-process fallback ([`ConcurrencyLimiter::default`] with no
    /// default chosen), which refuses in a process that built a `RedisConcurrencyLimiter`.
    fallback: bool,
}

#[derive(Clone, Debug)]
enum PermitStore {
    #[cfg(feature = "redis")]
    Redis(RedisConcurrencyLimiter),
    Memory(MemoryConcurrencyLimiter),
}

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
impl From<RedisConcurrencyLimiter> for ConcurrencyLimiter {
    fn from(redis: RedisConcurrencyLimiter) -> Self {
        Self {
            backend: PermitStore::Redis(redis),
            fallback: false,
        }
    }
}

impl From<MemoryConcurrencyLimiter> for ConcurrencyLimiter {
    fn from(memory: MemoryConcurrencyLimiter) -> Self {
        Self {
            backend: PermitStore::Memory(memory),
            fallback: false,
        }
    }
}

/// The app's default store: set once by [`ConcurrencyLimiter::set_default`], or the
/// in-process fallback from its first use on.
static DEFAULT: OnceLock<ConcurrencyLimiter> = OnceLock::new();

impl Default for ConcurrencyLimiter {
    /// The app's default store, used by every
    /// [`ConcurrencyLimitLayer`](crate::ConcurrencyLimitLayer) built without
    /// [`backend`](crate::ConcurrencyLimitLayer::backend): the one given to
    /// [`ConcurrencyLimiter::set_default`], or, when none was, the in-process fallback,
    /// one process-wide [`MemoryConcurrencyLimiter`] (so that the layers share its
    /// permits). The first call fixes it: a later `set_default` fails.
    ///
    /// The fallback limits per process, so it works only in a process that builds no
    /// [`RedisConcurrencyLimiter`]: once one is built (before or after), it refuses every
    /// request ([`ConcurrencyError::NoBackendChosen`]; the layer answers 500 and logs the
    /// fix once), since each replica would allow the whole limit. For an in-process limit
    /// in an app that also uses Redis, choose it:
    /// `ConcurrencyLimiter::from(MemoryConcurrencyLimiter::new())`.
    fn default() -> Self {
        DEFAULT
            .get_or_init(|| ConcurrencyLimiter {
                backend: PermitStore::Memory(MemoryConcurrencyLimiter::new()),
                fallback: true,
            })
            .clone()
    }
}

/// A permit held on one key; released in the background if dropped unreleased.
pub(crate) struct PermitSlot(Option<HeldPermit>);

enum HeldPermit {
    /// In process: a count, which never expires (a dead holder takes the store with it).
    Memory {
        store: MemoryConcurrencyLimiter,
        key: Arc<str>,
        /// The key's hash in the store's table.
        hash: u64,
    },
    /// On Redis: a token in the key's sorted set, expiring unless renewed.
    #[cfg(feature = "redis")]
    Redis(redis::RedisSlot),
}

impl PermitSlot {
    /// A permit just taken (counted in the permits gauge until the slot is dropped).
    fn held(permit: HeldPermit) -> Self {
        crate::observe::Held::Permit.start();
        Self(Some(permit))
    }

    pub(crate) fn memory(store: MemoryConcurrencyLimiter, key: Arc<str>, hash: u64) -> Self {
        Self::held(HeldPermit::Memory { store, key, hash })
    }

    /// The key, as the store keeps it.
    pub(crate) fn key(&self) -> &str {
        match &self.0 {
            Some(HeldPermit::Memory { key, .. }) => key,
            #[cfg(feature = "redis")]
            Some(HeldPermit::Redis(slot)) => &slot.key,
            None => "",
        }
    }

    /// The Redis permit, which expires unless renewed.
    #[cfg(feature = "redis")]
    pub(crate) fn as_redis(&self) -> Option<&redis::RedisSlot> {
        match &self.0 {
            Some(HeldPermit::Redis(slot)) => Some(slot),
            _ => None,
        }
    }

    /// Releases the permit: in process at once (`None`), on Redis with one `ZREM`, the
    /// future of which is returned. Should that future be dropped before it is done, the
    /// caller finishes it in the background ([`FinishOnDrop`](crate::future::FinishOnDrop):
    /// the release in flight, not a second).
    pub(crate) fn release(self) -> Option<BoxFuture<()>> {
        match &self.0 {
            // In process, the drop releases it.
            Some(HeldPermit::Memory { .. }) | None => None,
            // Armed until the release is done: should it be dropped with no runtime to
            // finish it on, the drop releases what it can.
            #[cfg(feature = "redis")]
            Some(HeldPermit::Redis(_)) => {
                let release = crate::future::boxed(|| async move {
                    let mut held = self;
                    if let Some(HeldPermit::Redis(slot)) = &held.0 {
                        slot.release().await;
                    }
                    // Done: nothing left for the drop to release.
                    drop(held.0.take());
                });
                Some(release)
            }
        }
    }
}

impl Drop for PermitSlot {
    fn drop(&mut self) {
        crate::observe::Held::Permit.end();
        match self.0.take() {
            None => {}
            Some(HeldPermit::Memory { store, key, hash }) => store.release(&key, hash),
            #[cfg(feature = "redis")]
            Some(HeldPermit::Redis(slot)) => {
                // No runtime (it is shutting down): the permit's TTL frees it.
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    runtime.spawn(async move { slot.release().await });
                }
            }
        }
    }
}

/// The shortest and longest pause between two tries of a waiting request.
const WAIT_STEP: (Duration, Duration) = (Duration::from_millis(5), Duration::from_millis(100));

impl ConcurrencyLimiter {
    /// Makes `limiter` the app's default store: every
    /// [`ConcurrencyLimitLayer`](crate::ConcurrencyLimitLayer) built afterwards without
    /// `.backend(..)`, and [`ConcurrencyLimiter::default`], use it. Call it once at
    /// start-up, before building any concurrency limit layer: a layer takes the default as
    /// it is built (even one given `.backend(..)` afterwards), so a layer built earlier has
    /// already fixed the in-process fallback, and this call then fails rather than leave
    /// that layer limiting per process.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_redlock::{ConcurrencyLimitLayer, ConcurrencyLimiter, RedisConcurrencyLimiter};
    ///
    /// let redis = RedisConcurrencyLimiter::builder("redis://10.0.0.1").build().await?;
    /// ConcurrencyLimiter::set_default(redis)?;
    /// // On Redis, shared by every replica, with no `.backend(..)`:
    /// let layer = ConcurrencyLimitLayer::global(20).scope("reports");
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigError::DefaultAlreadyChosen`] when a default was set before, or was already
    /// used (a concurrency limit layer built, a call of [`ConcurrencyLimiter::default`]).
    pub fn set_default(limiter: impl Into<ConcurrencyLimiter>) -> Result<(), ConfigError> {
        DEFAULT
            .set(limiter.into())
            .map_err(|_| ConfigError::DefaultAlreadyChosen {
                handle: "ConcurrencyLimiter",
            })
    }

    /// For a request of `user`: whether this is the in-process fallback and it refuses
    /// (a `RedisConcurrencyLimiter` was built in this process). The first time, `user`
    /// logs which.
    #[inline]
    pub(crate) fn refuses(&self, user: User) -> bool {
        self.fallback && fallback::CONCURRENCY_LIMITER.refuses_for(user)
    }

    /// Whether this is the in-process store.
    pub fn is_in_process(&self) -> bool {
        matches!(self.backend, PermitStore::Memory(_))
    }

    /// Whether the store can hand out permits now, for a readiness probe: in process
    /// always; on Redis, whether its node answers `PING` within the timeout
    /// ([`RedisConcurrencyLimiter::ready`]). `false` for the in-process fallback that
    /// refuses every request ([`ConcurrencyError::NoBackendChosen`]).
    pub async fn ready(&self) -> bool {
        if self.fallback && fallback::CONCURRENCY_LIMITER.refuses() {
            return false;
        }
        match &self.backend {
            #[cfg(feature = "redis")]
            PermitStore::Redis(r) => r.ready().await,
            PermitStore::Memory(_) => true,
        }
    }

    /// The in-process store, when this is one: it answers without `.await`.
    pub(crate) fn as_memory(&self) -> Option<&MemoryConcurrencyLimiter> {
        match &self.backend {
            PermitStore::Memory(memory) => Some(memory),
            #[cfg(feature = "redis")]
            PermitStore::Redis(_) => None,
        }
    }

    /// One try at a permit on `resource`; on Redis, a `waiting` one (subscribed to the
    /// set's release channel) marks the set when it gets none, so that releases publish.
    #[cfg_attr(not(feature = "redis"), allow(unused_variables))]
    async fn try_acquire(
        &self,
        resource: &str,
        limit: u32,
        waiting: bool,
    ) -> Result<PermitSlot, ConcurrencyError> {
        match &self.backend {
            #[cfg(feature = "redis")]
            PermitStore::Redis(r) => r
                .acquire(resource, limit, waiting)
                .await
                .map(|slot| PermitSlot::held(HeldPermit::Redis(slot))),
            PermitStore::Memory(m) => m.acquire_slot(resource, limit),
        }
    }

    /// A permit on `resource`, trying again while the limit is reached, until `max_wait`
    /// has passed. A waiter is woken by every release on `resource` (on Redis, any
    /// replica's, through pub/sub); an expired permit or a lost notification is found by
    /// the fallback timer (5 ms doubling up to 100 ms, with jitter).
    pub(crate) async fn acquire_within(
        &self,
        resource: &str,
        limit: u32,
        max_wait: Duration,
    ) -> Result<PermitSlot, ConcurrencyError> {
        if self.fallback && fallback::CONCURRENCY_LIMITER.refuses() {
            return Err(ConcurrencyError::NoBackendChosen);
        }
        let deadline = Instant::now().checked_add(max_wait);
        // A first try as anyone's: a request that gets its permit (or may not wait)
        // neither subscribes nor marks the set.
        match self.try_acquire(resource, limit, false).await {
            Err(ConcurrencyError::LimitReached { .. }) if !max_wait.is_zero() => {}
            other => return other,
        }
        // Waiters go by the key of their permits: the set's on Redis, the resource in process.
        let (key, waiters): (Arc<str>, &Waiters) = match &self.backend {
            #[cfg(feature = "redis")]
            PermitStore::Redis(r) => (Arc::from(r.key(resource)), r.waiters()),
            PermitStore::Memory(m) => (Arc::from(resource), m.waiters()),
        };
        let ticket = waiters.register(&key);
        // On Redis, subscribed before the first try, whose mark makes releases publish.
        #[cfg(feature = "redis")]
        let _subscription = match &self.backend {
            PermitStore::Redis(r) => Some(r.subscribe(&key).await),
            PermitStore::Memory(_) => None,
        };
        let mut step = WAIT_STEP.0;
        loop {
            // Armed before the try, so that a release during it is not missed.
            let notified = ticket.notify.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            match self.try_acquire(resource, limit, true).await {
                Err(ConcurrencyError::LimitReached { limit }) => {
                    let now = Instant::now();
                    let left = deadline.map_or(max_wait, |d| d.saturating_duration_since(now));
                    if left.is_zero() {
                        return Err(ConcurrencyError::LimitReached { limit });
                    }
                    // Jitter: between half and all of the step, so waiters spread out.
                    let jittered = step.mul_f64(rand::random_range(0.5..=1.0));
                    tokio::select! {
                        () = notified => {}
                        () = crate::sync::sleep(jittered.min(left)) => {
                            step = (step * 2).min(WAIT_STEP.1);
                        }
                    }
                }
                other => return other,
            }
        }
    }
}
