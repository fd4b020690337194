//! [`Locks`]: one cheap handle over either backend.

use std::sync::OnceLock;
use std::time::Duration;

use crate::backend::memory::MemoryLocks;
#[cfg(feature = "redis")]
use crate::backend::redlock::Redlock;
use crate::error::LockError;
use crate::lease::Lease;

/// One call on whichever backend a [`Locks`] holds, written once: `b` is bound to the
/// [`Redlock`] or the [`MemoryLocks`], and `$call` is the same method call on either
/// (they share the method's name and arguments).
///
/// - `on_backend!(locks, b => b.lock(resource).await)`: the call as written, on both.
/// - `on_backend!(locks, b => b.try_lock(resource), awaited on Redlock)`: the in-process
///   backend answers at once, so only the Redlock's call is awaited.
macro_rules! on_backend {
    ($locks:expr, $b:ident => $call:expr) => {
        match &$locks.backend {
            #[cfg(feature = "redis")]
            $crate::backend::handle::Backend::Redlock($b) => $call,
            $crate::backend::handle::Backend::Memory($b) => $call,
        }
    };
    ($locks:expr, $b:ident => $call:expr, awaited on Redlock) => {
        match &$locks.backend {
            #[cfg(feature = "redis")]
            $crate::backend::handle::Backend::Redlock($b) => $call.await,
            $crate::backend::handle::Backend::Memory($b) => $call,
        }
    };
}

mod modes;

/// A handle to a lock backend, [`Redlock`] or [`MemoryLocks`], with one contract.
///
/// The layer, the extractor and your axum state hold a `Locks`; cloning it is cheap and
/// shares the backend. Build one with `Locks::from(redlock)` or `Locks::from(memory_locks)`;
/// [`Locks::default`] is the process-wide in-process backend.
#[derive(Clone, Debug)]
pub struct Locks {
    backend: Backend,
}

#[derive(Clone, Debug)]
enum Backend {
    #[cfg(feature = "redis")]
    Redlock(Redlock),
    Memory(MemoryLocks),
}

impl Default for Locks {
    /// The process-wide [`MemoryLocks`] with default settings, shared by every layer and
    /// extractor that was given no backend, so they all see the same locks.
    fn default() -> Self {
        static SHARED: OnceLock<MemoryLocks> = OnceLock::new();
        Locks::from(SHARED.get_or_init(MemoryLocks::new).clone())
    }
}

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
impl From<Redlock> for Locks {
    fn from(redlock: Redlock) -> Self {
        Self {
            backend: Backend::Redlock(redlock),
        }
    }
}

impl From<MemoryLocks> for Locks {
    fn from(memory: MemoryLocks) -> Self {
        Self {
            backend: Backend::Memory(memory),
        }
    }
}

impl Locks {
    /// Whether this is the in-process backend.
    pub fn is_in_process(&self) -> bool {
        matches!(self.backend, Backend::Memory(_))
    }

    /// The lease TTL of the backend.
    pub fn ttl(&self) -> Duration {
        on_backend!(self, b => b.ttl())
    }

    /// One acquisition attempt; see [`Redlock::try_lock`] and [`MemoryLocks::try_lock`].
    ///
    /// # Errors
    ///
    /// [`LockError::Taken`], [`LockError::NoQuorum`], [`LockError::TooSlow`] or
    /// [`LockError::InvalidKey`].
    pub async fn try_lock(&self, resource: &str) -> Result<Lease, LockError> {
        on_backend!(self, b => b.try_lock(resource), awaited on Redlock)
    }

    /// Acquisition with retries; see [`Redlock::lock`] and [`MemoryLocks::lock`].
    ///
    /// # Errors
    ///
    /// The error of the last attempt.
    pub async fn lock(&self, resource: &str) -> Result<Lease, LockError> {
        on_backend!(self, b => b.lock(resource).await)
    }

    /// One attempt on several resources at once, all of them or none, with one token,
    /// one validity and one quorum verdict for the set; see [`Redlock::try_lock_all`] and
    /// [`MemoryLocks::try_lock_all`]. The order of `resources` does not matter (they are
    /// sorted, duplicates dropped), so callers that name the same keys in other orders
    /// never deadlock. [`extend`](Self::extend), [`unlock`](Self::unlock) and the
    /// renewals act on every key of the lease; [`Lease::keys`] lists them.
    ///
    /// ```
    /// # async fn demo() -> Result<(), tower_redlock::LockError> {
    /// use tower_redlock::Locks;
    ///
    /// let locks = Locks::default();
    /// // A transfer holds both accounts, whichever way round it names them.
    /// let lease = locks.try_lock_all(["account:bob", "account:alice"]).await?;
    /// assert_eq!(lease.keys().count(), 2);
    /// assert!(locks.try_lock_all(["account:alice", "account:bob"]).await.is_err());
    /// locks.unlock(lease).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`try_lock`](Self::try_lock), [`LockError::Taken`] when any key is held (with
    /// the time until its longest holder frees it); [`LockError::InvalidKey`] also for
    /// none or more than [`MAX_KEYS_PER_LEASE`](crate::key::MAX_KEYS_PER_LEASE) distinct
    /// resources.
    pub async fn try_lock_all<I>(&self, resources: I) -> Result<Lease, LockError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        on_backend!(self, b => b.try_lock_all(resources), awaited on Redlock)
    }

    /// [`try_lock_all`](Self::try_lock_all) with retries; see [`Redlock::lock_all`] and
    /// [`MemoryLocks::lock_all`].
    ///
    /// # Errors
    ///
    /// The error of the last attempt.
    pub async fn lock_all<I>(&self, resources: I) -> Result<Lease, LockError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        on_backend!(self, b => b.lock_all(resources).await)
    }

    /// One attempt on keys that already have the prefix, sorted and distinct.
    pub(crate) async fn acquire_keys(
        &self,
        keys: Vec<std::sync::Arc<str>>,
    ) -> Result<Lease, LockError> {
        match &self.backend {
            #[cfg(feature = "redis")]
            Backend::Redlock(r) => r.acquire_all(keys.into()).await,
            Backend::Memory(m) => m.acquire_all(keys),
        }
    }

    /// Waits up to `max_wait` for a held lock, woken when the holder releases; see
    /// [`Redlock::lock_within`] and [`MemoryLocks::lock_within`].
    ///
    /// # Errors
    ///
    /// [`LockError::Taken`] when still held at the deadline; the other errors of
    /// [`try_lock`](Self::try_lock) at once.
    pub async fn lock_within(
        &self,
        resource: &str,
        max_wait: Duration,
    ) -> Result<Lease, LockError> {
        on_backend!(self, b => b.lock_within(resource, max_wait).await)
    }

    /// [`lock_within`](Self::lock_within) for a key that already has the prefix.
    pub(crate) async fn lock_key_within(
        &self,
        key: std::sync::Arc<str>,
        max_wait: Duration,
    ) -> Result<Lease, LockError> {
        on_backend!(self, b => b.lock_key_within(key, max_wait).await)
    }

    /// The prefix the backend puts before every key.
    pub fn prefix(&self) -> &str {
        on_backend!(self, b => b.prefix())
    }

    /// Extends the lease to a full TTL from now; see [`Redlock::extend`].
    ///
    /// # Errors
    ///
    /// [`LockError::Expired`], [`LockError::NoQuorum`] or [`LockError::TooSlow`].
    pub async fn extend(&self, lease: &mut Lease) -> Result<(), LockError> {
        on_backend!(self, b => b.extend(lease), awaited on Redlock)
    }

    /// Releases the lease; see [`Redlock::unlock`].
    ///
    /// # Errors
    ///
    /// [`LockError::Expired`] when it had already run out, [`LockError::NoQuorum`] when
    /// too few nodes answered.
    pub async fn unlock(&self, lease: Lease) -> Result<(), LockError> {
        on_backend!(self, b => b.unlock(lease), awaited on Redlock)
    }

    /// Looks for the idempotency record of `key` and, when there is none, acquires `key`;
    /// waits up to `max_wait` for a holder to finish.
    #[cfg(feature = "idempotency")]
    pub(crate) async fn begin_idempotent(
        &self,
        key: std::sync::Arc<str>,
        max_wait: Duration,
    ) -> Result<crate::backend::records::Begin, LockError> {
        match &self.backend {
            #[cfg(feature = "redis")]
            Backend::Redlock(r) => r.begin_idempotent(key, max_wait).await,
            Backend::Memory(m) => m.begin_idempotent_within(key, max_wait).await,
        }
    }

    /// Stores an idempotency record (when given) for `ttl` and releases the lease.
    ///
    /// # Errors
    ///
    /// [`LockError::NoQuorum`] when too few nodes took the record (a retry may then run
    /// the request again), [`LockError::Expired`] when the lease had run out.
    #[cfg(feature = "idempotency")]
    pub(crate) async fn finish_idempotent(
        &self,
        lease: Lease,
        record: Option<bytes::Bytes>,
        ttl: Duration,
    ) -> Result<(), LockError> {
        match &self.backend {
            #[cfg(feature = "redis")]
            Backend::Redlock(r) => match record {
                Some(record) => r.finish_idempotent(lease, record, ttl).await,
                None => r.unlock(lease).await,
            },
            Backend::Memory(m) => {
                m.finish_idempotent(lease, record, ttl);
                Ok(())
            }
        }
    }

    /// The `Retry-After` for a request that found `key` (with the prefix) held, the
    /// holder having `holder_left` of its TTL: the moving average of the hold times this
    /// backend observed for the key's scope, bounded by `holder_left`; `holder_left`
    /// without an observation (see [`HoldTimes`](crate::backend::hold::HoldTimes)).
    pub(crate) fn retry_estimate(&self, key: &str, holder_left: Duration) -> Duration {
        on_backend!(self, b => b.retry_estimate(key, holder_left))
    }

    /// A lock error with the `Retry-After` of a contended `key` estimated from the hold
    /// times (see [`retry_estimate`](Self::retry_estimate)).
    pub(crate) fn estimated(&self, key: &str, error: LockError) -> LockError {
        match error {
            LockError::Taken { retry_after } => LockError::Taken {
                retry_after: self.retry_estimate(key, retry_after),
            },
            other => other,
        }
    }

    /// The in-process backend, when this is one: its operations need no `.await`.
    pub(crate) fn as_memory(&self) -> Option<&MemoryLocks> {
        match &self.backend {
            Backend::Memory(m) => Some(m),
            #[cfg(feature = "redis")]
            Backend::Redlock(_) => None,
        }
    }

    /// Whether `lease` is the lock on `resource` in this backend: the key that
    /// [`lock`](Self::lock) would take for it (prefixed, escaped).
    #[cfg(feature = "axum")]
    pub(crate) fn names(&self, lease: &Lease, resource: &str) -> bool {
        let id = on_backend!(self, b => b.id());
        lease.backend == id
            && crate::key::with_scratch(|key| {
                key.push_str(self.prefix());
                crate::key::push_escaped(key, resource);
                lease.keys().any(|held| held == key.as_str())
            })
    }

    /// Releases without waiting: at once for the in-process backend, on a spawned task for
    /// Redis (the TTL is the backstop when there is no runtime).
    pub(crate) fn release_detached(&self, lease: Lease) {
        match &self.backend {
            #[cfg(feature = "redis")]
            Backend::Redlock(r) => match lease.set {
                Some(keys) => r.release_all_detached(keys, lease.token, true),
                None => r.release_detached(lease.key, lease.token, true),
            },
            Backend::Memory(m) => {
                let _ = m.unlock(lease);
            }
        }
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

    /// A copy of what is held, leaving the guard armed.
    pub(crate) fn cloned(&self) -> Option<(Locks, Lease)> {
        self.held.clone()
    }

    /// Forgets the lease: someone else released it.
    pub(crate) fn disarm(&mut self) {
        self.held = None;
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if let Some((locks, lease)) = self.held.take() {
            locks.release_detached(lease);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Renewal;

    #[tokio::test]
    async fn with_lock_gives_the_work_its_lease_and_fencing_token() {
        let locks = Locks::from(MemoryLocks::new());
        let (key, token, fence) = locks
            .with_lock("fenced", Renewal::default(), |status| async move {
                let lease = status.lease();
                (
                    lease.key().to_owned(),
                    lease.token().to_string(),
                    lease.fencing_token(),
                )
            })
            .await
            .unwrap();
        assert_eq!(key, "tower-redlock:fenced");
        assert_eq!(token.len(), 32);
        assert!(fence.is_some());
        // Released at the end: the next holder gets a greater fencing token.
        let next = locks.try_lock("fenced").await.unwrap();
        assert!(next.fencing_token() > fence);
    }

    #[test]
    fn names_compares_the_escaped_key() {
        let memory = MemoryLocks::new();
        let locks = Locks::from(memory.clone());
        let lease = memory.try_lock("order:{7}").unwrap();
        assert!(locks.names(&lease, "order:{7}"));
        assert!(!locks.names(&lease, "order:7"));
        let other = Locks::from(MemoryLocks::new());
        assert!(!other.names(&lease, "order:{7}"), "another backend's lease");
    }
}
