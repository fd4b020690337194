//! The in-process fallback: the store that a layer built without `.backend(..)` uses when
//! the app chose no default ([`Locks::set_default`](crate::Locks::set_default) and the
//! limiters' own). It runs in process only in a process that built no Redis store of its
//! kind. Once one is built (before the layer or after it), it refuses every request, so
//! that a forgotten backend never splits a Redis app's locks or limits per replica; a
//! store chosen explicitly (a `MemoryLocks`, a `MemoryRateLimiter`) is never refused.
//!
//! Each kind of user says once per process what it does, with the fix: at `info` that it
//! runs in process (at `warn` when the process built a Redis store of another kind), or
//! at `error` that it refuses.

use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

/// What decides on a fallback, for the log lines: each says what it does once per
/// process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum User {
    #[cfg(feature = "lock")]
    LockLayer,
    #[cfg(feature = "idempotency")]
    IdempotencyLayer,
    #[cfg(all(feature = "lock", feature = "axum"))]
    Locked,
    #[cfg(feature = "rate-limit")]
    RateLimitLayer,
    #[cfg(feature = "concurrency-limit")]
    ConcurrencyLimitLayer,
}

impl User {
    /// The name in the log lines.
    fn name(self) -> &'static str {
        match self {
            #[cfg(feature = "lock")]
            User::LockLayer => "LockLayer",
            #[cfg(feature = "idempotency")]
            User::IdempotencyLayer => "IdempotencyLayer",
            #[cfg(all(feature = "lock", feature = "axum"))]
            User::Locked => "Locked",
            #[cfg(feature = "rate-limit")]
            User::RateLimitLayer => "RateLimitLayer",
            #[cfg(feature = "concurrency-limit")]
            User::ConcurrencyLimitLayer => "ConcurrencyLimitLayer",
        }
    }

    /// How it was given the fallback, and where the fix goes.
    fn given(self, handle: &str) -> (String, String) {
        #[cfg(all(feature = "lock", feature = "axum"))]
        if self == User::Locked {
            return (
                "Locked<T> takes its locks from Locks::default() in the state, and no default was chosen"
                    .to_owned(),
                format!("put Locks::from(redlock) in the state, or call {handle}::set_default(..)"),
            );
        }
        (
            format!(
                "{} was given no backend, and no default was chosen",
                self.name()
            ),
            format!("give it .backend(..), or call {handle}::set_default(..)"),
        )
    }

    /// Its bit in [`Fallback`]'s state for "said that it runs in process"; shifted by
    /// [`REFUSED_SHIFT`] for "said that it refuses".
    fn bit(self) -> u32 {
        1 << (self as u32)
    }
}

/// Set in the state once a Redis store of the kind was built.
const REDIS_BUILT: u32 = 1 << 31;
/// The users' "said that it refuses" bits are their [`User::bit`] shifted by this.
const REFUSED_SHIFT: u32 = 8;

/// One kind of store's fallback: whether a Redis store of the kind was built in this
/// process, and what each user has said.
#[derive(Debug)]
pub(crate) struct Fallback {
    state: AtomicU32,
    /// The handle with the default: `Locks`.
    handle: &'static str,
    /// The Redis store of the kind: `Redlock`.
    redis: &'static str,
    /// The in-process store (`in-process locks`), and what each replica would do on it
    /// (`take the same key`).
    store: &'static str,
    alone: &'static str,
}

/// The fallback of [`Locks`](crate::Locks).
#[cfg(feature = "lock")]
pub(crate) static LOCKS: Fallback =
    Fallback::new("Locks", "Redlock", "in-process locks", "take the same key");
/// The fallback of [`RateLimiter`](crate::RateLimiter).
#[cfg(feature = "rate-limit")]
pub(crate) static RATE_LIMITER: Fallback = Fallback::new(
    "RateLimiter",
    "RedisRateLimiter",
    "an in-process rate limit",
    "allow the whole limit",
);
/// The fallback of [`ConcurrencyLimiter`](crate::ConcurrencyLimiter).
#[cfg(feature = "concurrency-limit")]
pub(crate) static CONCURRENCY_LIMITER: Fallback = Fallback::new(
    "ConcurrencyLimiter",
    "RedisConcurrencyLimiter",
    "an in-process concurrency limit",
    "allow the whole limit",
);

impl Fallback {
    const fn new(
        handle: &'static str,
        redis: &'static str,
        store: &'static str,
        alone: &'static str,
    ) -> Self {
        Self {
            state: AtomicU32::new(0),
            handle,
            redis,
            store,
            alone,
        }
    }

    /// A Redis store of this kind was built: from now on the fallback refuses.
    #[cfg(feature = "redis")]
    pub(crate) fn redis_built(&self) {
        self.state.fetch_or(REDIS_BUILT, Relaxed);
    }

    /// Whether the fallback refuses: a Redis store of this kind was built in this process.
    pub(crate) fn refuses(&self) -> bool {
        self.state.load(Relaxed) & REDIS_BUILT != 0
    }

    /// Whether `user`'s request on the fallback must be refused; the first time either
    /// way, `user` says so. Once it has said that it runs in process, one relaxed load.
    #[inline]
    pub(crate) fn refuses_for(&self, user: User) -> bool {
        let state = self.state.load(Relaxed);
        if state & (REDIS_BUILT | user.bit()) == user.bit() {
            return false;
        }
        self.first_for(state, user)
    }

    /// [`refuses_for`](Self::refuses_for) when `user` has not said that it runs in
    /// process, or it refuses.
    #[cold]
    #[inline(never)]
    fn first_for(&self, state: u32, user: User) -> bool {
        let (given, fix) = user.given(self.handle);
        if state & REDIS_BUILT != 0 {
            let said = user.bit() << REFUSED_SHIFT;
            if state & said == 0 && self.state.fetch_or(said, Relaxed) & said == 0 {
                tracing::error!(
                    layer = user.name(),
                    "{given}, but this process built a {redis}: every request through it is \
                     answered 500 rather than run on {store}, with which each replica would \
                     {alone}; {fix} once at start-up, before building the app",
                    redis = self.redis,
                    store = self.store,
                    alone = self.alone,
                );
            }
            return true;
        }
        if self.state.fetch_or(user.bit(), Relaxed) & user.bit() == 0 {
            if any_redis_built() {
                // An app on Redis that may have forgotten this one.
                tracing::warn!(
                    layer = user.name(),
                    "{given}: it runs on {store}, each replica on its own, though this \
                     process uses Redis; with several replicas, {fix} at start-up",
                    store = self.store,
                );
            } else {
                tracing::info!(
                    layer = user.name(),
                    "{given}: it runs on {store}, each replica on its own; with several \
                     replicas, {fix} at start-up",
                    store = self.store,
                );
            }
        }
        false
    }
}

/// Whether this process built a Redis store of any kind.
fn any_redis_built() -> bool {
    [
        #[cfg(feature = "lock")]
        &LOCKS,
        #[cfg(feature = "rate-limit")]
        &RATE_LIMITER,
        #[cfg(feature = "concurrency-limit")]
        &CONCURRENCY_LIMITER,
    ]
    .iter()
    .any(|fallback| fallback.refuses())
}
