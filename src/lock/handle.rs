//! [`Locks`]: one cheap handle over either backend.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::backend::contract::{Answer, Claim, LockBackend, LockMode, LockResult};
use crate::backend::fallback::{self, User};
use crate::backend::inspect::LockInspection;
use crate::backend::memory::MemoryLocks;
#[cfg(feature = "redis")]
use crate::backend::redlock::Redlock;
use crate::backend::settings::Settings;
use crate::error::{ConfigError, LockError};
use crate::holder::HolderRef;
use crate::lease::Lease;
use crate::lock::reentry;
use crate::lock::request::{self, Decided, LockRequest, Options, Wait};
use crate::redact::LogKey;

/// A handle to a lock backend, [`Redlock`] or [`MemoryLocks`], with one contract.
///
/// The layer, the extractor and your axum state hold a `Locks`; cloning it is cheap and
/// shares the backend. Build one with `Locks::from(redlock)` or
/// `Locks::from(memory_locks)`; [`Locks::default`] is the app's default backend.
#[derive(Clone, Debug)]
pub struct Locks {
    backend: Arc<dyn LockBackend>,
    /// Whether this is the in-process fallback ([`Locks::default`] with no default
    /// chosen), which refuses in a process that built a `Redlock` ([`fallback`]).
    fallback: bool,
}

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
impl From<Redlock> for Locks {
    fn from(redis: Redlock) -> Self {
        Self {
            backend: Arc::new(redis),
            fallback: false,
        }
    }
}

impl From<MemoryLocks> for Locks {
    fn from(memory: MemoryLocks) -> Self {
        Self {
            backend: Arc::new(memory),
            fallback: false,
        }
    }
}

/// The app's default backend: set once by [`Locks::set_default`], or the in-process
/// fallback from its first use on.
static DEFAULT: OnceLock<Locks> = OnceLock::new();

impl Default for Locks {
    /// The app's default backend, used by every layer built without
    /// [`backend`](crate::LockLayer::backend): the one given to [`Locks::set_default`], or,
    /// when none was, the in-process fallback, one process-wide [`MemoryLocks`] with
    /// default settings (so that they all see the same locks). The first call fixes it: a
    /// later `set_default` fails.
    ///
    /// The fallback works only in a process that builds no [`Redlock`]: once one is built
    /// (before or after), it refuses every acquisition ([`LockError::NoBackendChosen`];
    /// the layers answer 500 and log the fix once), since each replica would lock on its
    /// own. For in-process locks in an app that also uses Redis, choose them:
    /// `Locks::from(MemoryLocks::new())`.
    fn default() -> Self {
        DEFAULT
            .get_or_init(|| Locks {
                backend: Arc::new(MemoryLocks::new()),
                fallback: true,
            })
            .clone()
    }
}

impl Locks {
    /// A handle over a backend made by a test.
    #[cfg(test)]
    pub(crate) fn from_backend(backend: Arc<dyn LockBackend>) -> Self {
        Self {
            backend,
            fallback: false,
        }
    }

    /// Whether this is the in-process backend.
    pub fn is_in_process(&self) -> bool {
        self.backend.in_process()
    }

    /// Makes `locks` the app's default backend: every [`LockLayer`](crate::LockLayer) and
    /// [`IdempotencyLayer`](crate::IdempotencyLayer) built afterwards without
    /// `.backend(..)`, and [`Locks::default`], use it. Call it once at start-up, before
    /// building any layer: a layer takes the default as it is built (even one given
    /// `.backend(..)` afterwards), so a layer built earlier has already fixed the
    /// in-process fallback, and this call then fails rather than leave that layer locking
    /// per process.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use tower_redlock::{LockLayer, Locks, Redlock};
    ///
    /// let redlock = Redlock::builder(["redis://10.0.0.1", "redis://10.0.0.2", "redis://10.0.0.3"])
    ///     .build()
    ///     .await?;
    /// Locks::set_default(redlock)?;
    /// // On Redis, with no `.backend(..)`:
    /// let layer = LockLayer::by_header("Idempotency-Key");
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigError::DefaultAlreadyChosen`] when a default was set before, or was already
    /// used (a layer built, a call of [`Locks::default`]).
    pub fn set_default(locks: impl Into<Locks>) -> Result<(), ConfigError> {
        DEFAULT
            .set(locks.into())
            .map_err(|_| ConfigError::DefaultAlreadyChosen { handle: "Locks" })
    }

    /// For a request of `user`: whether this is the in-process fallback and it refuses
    /// (a `Redlock` was built in this process). The first time, `user` logs which.
    #[inline]
    pub(crate) fn refuses(&self, user: User) -> bool {
        self.fallback && fallback::LOCKS.refuses_for(user)
    }

    /// [`LockError::NoBackendChosen`] when this is the in-process fallback and it refuses.
    fn check_chosen(&self) -> Result<(), LockError> {
        if self.fallback && fallback::LOCKS.refuses() {
            return Err(LockError::NoBackendChosen);
        }
        Ok(())
    }

    /// The lease TTL of the backend.
    pub fn ttl(&self) -> Duration {
        self.policy().ttl
    }

    /// The prefix the backend puts before every key (default `"tower-redlock:"`).
    pub fn prefix(&self) -> &str {
        &self.policy().prefix
    }

    /// The replica id every lease of this backend records as its holder's (see
    /// [`LockHolder`](crate::LockHolder)): the one given to the builder's `replica_id`
    /// ([`RedlockBuilder::replica_id`](crate::RedlockBuilder::replica_id),
    /// [`MemoryLocksBuilder::replica_id`](crate::MemoryLocksBuilder::replica_id)), by
    /// default `<hostname>-<pid>`.
    pub fn replica_id(&self) -> &str {
        &self.policy().replica
    }

    /// Whether the backend can take locks now, for a readiness probe: in process always;
    /// on Redis, whether a quorum of the nodes answers `PING` within the node timeout
    /// (see [`Redlock::ready`]). It takes no lock and writes nothing, and costs one `PING`
    /// per node: cheap enough for a probe every few seconds. `false` for the in-process
    /// fallback that refuses every acquisition ([`LockError::NoBackendChosen`]).
    ///
    /// ```
    /// # async fn demo() {
    /// use tower_redlock::{Locks, MemoryLocks};
    ///
    /// assert!(Locks::from(MemoryLocks::new()).ready().await);
    /// # }
    /// ```
    pub async fn ready(&self) -> bool {
        if self.check_chosen().is_err() {
            return false;
        }
        self.backend.ready().get().await
    }

    /// Which backend instance this is (see `backend::next_backend_id`).
    fn id(&self) -> u64 {
        self.backend.id()
    }

    fn policy(&self) -> &Settings {
        self.backend.settings()
    }

    /// The backend, for the lock domain's own use (the layers' decisions and releases).
    pub(crate) fn backend(&self) -> &dyn LockBackend {
        &*self.backend
    }

    /// Takes what `request` asks for: the one way to take a lock, on either backend (the
    /// layers and extractors go through it too). A `&str` or a `String` is a request for
    /// that resource, one attempt, [`LockMode::Plain`](crate::LockMode::Plain).
    ///
    /// ```
    /// # async fn demo() -> Result<(), tower_redlock::LockError> {
    /// use std::time::Duration;
    /// use tower_redlock::{LockError, LockRequest, Locks};
    ///
    /// let locks = Locks::default();
    /// let lease = locks.acquire("order:42").await?;
    /// assert!(matches!(locks.acquire("order:42").await, Err(LockError::Taken { .. })));
    /// let wait = LockRequest::new("order:42").wait(Duration::from_millis(10));
    /// assert!(matches!(locks.acquire(&wait).await, Err(LockError::Taken { .. })));
    /// locks.unlock(lease).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// - [`LockError::Taken`] when the lock is held (after the wait or the retries), with
    ///   the time until the holder's lease runs out;
    /// - [`LockError::NoQuorum`] or [`LockError::TooSlow`] on Redis when too few nodes
    ///   answered in time (retry later);
    /// - [`LockError::InvalidKey`] for an empty resource, one with control bytes, one that
    ///   makes a key over [`MAX_KEY_LEN`](crate::key::MAX_KEY_LEN) bytes, or a set of none
    ///   or more than [`MAX_KEYS_PER_LEASE`](crate::key::MAX_KEYS_PER_LEASE) resources;
    /// - [`LockError::Unsupported`] for a set in another mode than plain, or a set that
    ///   waits;
    /// - [`LockError::NoBackendChosen`] on the in-process fallback ([`Locks::default`]
    ///   with no default chosen) in a process that built a [`Redlock`].
    pub async fn acquire<'a>(
        &self,
        request: impl Into<LockRequest<'a>>,
    ) -> Result<Lease, LockError> {
        let (claim, options) = request.into().resolve(self.policy())?;
        self.acquire_claim(claim, options).await
    }

    /// One attempt on `resource`: [`acquire`](Self::acquire) with a plain request.
    ///
    /// # Errors
    ///
    /// As [`acquire`](Self::acquire).
    pub async fn try_lock(&self, resource: &str) -> Result<Lease, LockError> {
        // `acquire_claim` for one plain attempt, one future fewer.
        self.check_chosen()?;
        let key = self.policy().full_key(resource)?;
        if let Some(lease) = reentry::held(self.id(), std::slice::from_ref(&key)) {
            return Ok(lease);
        }
        #[cfg(feature = "redis")]
        if let Some(redis) = self.backend.redlock() {
            let holder = redis.holder_record(HolderRef::Direct);
            return redis.acquire(key, false, holder).await;
        }
        let claim = Claim::one(key, LockMode::Plain);
        self.backend
            .attempt(claim, Instant::now(), HolderRef::Direct)
            .get()
            .await
    }

    /// `resource` with the backend's retries: [`acquire`](Self::acquire) with
    /// [`LockRequest::retry`].
    ///
    /// # Errors
    ///
    /// The error of the last attempt, as [`acquire`](Self::acquire).
    pub async fn lock(&self, resource: &str) -> Result<Lease, LockError> {
        self.acquire(LockRequest::new(resource).retry()).await
    }

    /// The one acquisition path: keys already prefixed and checked.
    pub(crate) async fn acquire_claim(&self, claim: Claim, options: Options) -> LockResult {
        let holder = HolderRef::Direct;
        self.decide(claim, options, Instant::now(), holder)
            .get()
            .await
    }

    /// [`acquire`](Self::acquire) for a request whose lease records `holder` (an
    /// extractor's request).
    #[cfg(feature = "axum")]
    pub(crate) async fn acquire_for<'a>(
        &self,
        request: impl Into<LockRequest<'a>>,
        holder: &crate::holder::Holder,
    ) -> LockResult {
        let (claim, options) = request.into().resolve(self.policy())?;
        let holder = HolderRef::Known(holder);
        self.decide(claim, options, Instant::now(), holder)
            .get()
            .await
    }

    /// [`acquire_claim`](Self::acquire_claim) as an answer: at once in process unless it
    /// waits. A request that holds the keys already gets its own lease back (reentrancy).
    /// The lease records `holder`, read only once it is taken in process.
    pub(crate) fn decide(
        &self,
        claim: Claim,
        options: Options,
        started: Instant,
        holder: HolderRef<'_>,
    ) -> Decided {
        if let Err(e) = self.check_chosen() {
            return Decided::Now(Err(e));
        }
        if let Some(lease) = reentry::held(self.id(), claim.keys()) {
            return Decided::Now(Ok(lease));
        }
        if options.wait == Wait::Once {
            #[cfg(feature = "redis")]
            if let Some(redis) = self.backend.redlock()
                && let Claim::One(crate::backend::contract::OneKey {
                    key,
                    mode: LockMode::Plain,
                }) = claim
            {
                let holder = redis.holder_record(holder);
                let redis = redis.clone();
                return Decided::Later(request::Pending::Attempt { redis, key, holder });
            }
            return self.backend.attempt(claim, started, holder).into();
        }
        let backend = self.backend.clone();
        let holder = holder.to_holder();
        Answer::later(|| async move { request::acquire(&*backend, claim, options, holder).await })
            .into()
    }

    /// Extends the lease to a full TTL from now (every key of a lease on several keys).
    ///
    /// # Errors
    ///
    /// [`LockError::Expired`] when the lease ran out (`taken_over` when another holder has
    /// the key now); on Redis, [`LockError::NoQuorum`] when the nodes that failed leave it
    /// undecided (retry: it may still hold) or [`LockError::TooSlow`] when the answers came
    /// too late. The lease is left as it was.
    pub async fn extend(&self, lease: &mut Lease) -> Result<(), LockError> {
        if lease.reentered {
            // The request's own lease: its holder renews it.
            return Ok(());
        }
        *lease = self.backend.extend(lease.clone()).get().await?;
        Ok(())
    }

    /// Releases the lease (every key of it that still holds its token; another holder's
    /// key is never touched).
    ///
    /// # Errors
    ///
    /// [`LockError::Expired`] when it had already run out (`taken_over` when another holder
    /// has the key now); on Redis, [`LockError::NoQuorum`] when the nodes that failed leave
    /// it undecided (the keys left behind expire by their TTL).
    pub async fn unlock(&self, lease: Lease) -> Result<(), LockError> {
        if lease.reentered {
            // The request's own lease: its holder releases it.
            return Ok(());
        }
        #[cfg(feature = "redis")]
        if let Some(redis) = self.backend.redlock() {
            return redis.release(lease).await;
        }
        self.backend.unlock(lease).get().await
    }

    /// A lock error with the `Retry-After` of a contended `key` estimated from the hold
    /// times and the holder's remaining TTL (see [`HoldTimes`](crate::backend::hold::HoldTimes)).
    pub(crate) fn estimated(&self, key: &str, error: LockError) -> LockError {
        let LockError::Taken { retry_after: left } = error else {
            return error;
        };
        LockError::Taken {
            retry_after: self.backend.retry_estimate(key, left),
        }
    }

    /// What the backend holds for `resource`, for an operator: whether it is held, for
    /// how long, by whom ([`LockInspection::holder`]: the replica, and the method, route
    /// and request id of the request that took it), the fencing token, readers and
    /// waiters. Read-only; on Redlock one script per node, every node awaited up to the
    /// node timeout.
    ///
    /// ```
    /// # async fn demo() -> Result<(), tower_redlock::LockError> {
    /// use tower_redlock::Locks;
    ///
    /// let locks = Locks::default();
    /// let lease = locks.try_lock("report:7").await?;
    /// let seen = locks.inspect("report:7").await?;
    /// assert!(seen.is_held() && seen.remaining.is_some());
    /// assert_eq!(seen.holder.map(|h| h.replica), Some(locks.replica_id().to_owned()));
    /// locks.unlock(lease).await?;
    /// assert!(!locks.inspect("report:7").await?.is_held());
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidKey`] for an unusable resource name; on Redlock,
    /// [`LockError::NoQuorum`] when no node answered; [`LockError::NoBackendChosen`] as for
    /// [`acquire`](Self::acquire).
    pub async fn inspect(&self, resource: &str) -> Result<LockInspection, LockError> {
        self.check_chosen()?;
        let key = self.policy().full_key(resource)?;
        self.backend.inspect(key).get().await
    }

    /// Deletes the lock on `resource` whoever holds it, on every node that answers: for
    /// a lock that a dead job left behind and that will not expire soon enough. Returns
    /// on how many nodes it was held.
    ///
    /// **Dangerous**: the holder, if it is alive, goes on believing it holds the lock
    /// until its next renewal or release finds it gone (then `LockError::Expired`), and
    /// a second holder may take it meanwhile. Only the lock key is deleted (readers,
    /// waiters and the fencing counter are left), and only where it holds a string (a
    /// token of any client; a value of another type is not a lock, and is left as it
    /// is): a holder that fences its writes is still refused by the storage once the new
    /// holder has written. Every call is logged at `warn` level.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidKey`] for an unusable resource name; on Redlock,
    /// [`LockError::NoQuorum`] when no node answered; [`LockError::NoBackendChosen`] as for
    /// [`acquire`](Self::acquire).
    pub async fn force_unlock(&self, resource: &str) -> Result<usize, LockError> {
        self.check_chosen()?;
        let key = self.policy().full_key(resource)?;
        let deleted = self.backend.force_unlock(key.clone()).get().await?;
        tracing::warn!(key = %LogKey(&key), nodes = deleted, "force_unlock: the lock was deleted whoever held it");
        Ok(deleted)
    }

    /// Whether `lease` is the lock on `resource` in this backend: the key that
    /// [`lock`](Self::lock) would take for it (prefixed, escaped).
    #[cfg(feature = "axum")]
    pub(crate) fn names(&self, lease: &Lease, resource: &str) -> bool {
        let id = self.id();
        lease.backend == id
            && crate::key::with_scratch(|key| {
                key.push_str(self.prefix());
                crate::key::push_escaped(key, resource);
                lease.keys().any(|held| held == key.as_str())
            })
    }

    /// Releases without waiting: at once for the in-process backend, on a spawned task for
    /// Redis (the TTL is the backstop when there is no runtime).
    pub(crate) fn release_detached(&self, lease: &Lease) {
        self.backend.release_detached(lease);
    }
}

/// Holds a lease; releases it in the background if dropped
/// still holding it.
pub(crate) struct LeaseGuard {
    held: Option<(Locks, Lease)>,
}

impl LeaseGuard {
    pub(crate) fn new(locks: Locks, lease: Lease) -> Self {
        Self {
            held: Some((locks, lease)),
        }
    }

    pub(crate) fn take(&mut self) -> Option<(Locks, Lease)> {
        self.held.take()
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if let Some((locks, lease)) = self.held.take() {
            locks.release_detached(&lease);
        }
    }
}
