//! [`Locks`]: one cheap handle over either backend.

use std::sync::OnceLock;
use std::time::Duration;

use crate::error::LockError;
use crate::lease::Lease;
use crate::memory::MemoryLocks;
use crate::redlock::Redlock;

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
        match &self.backend {
            Backend::Redlock(r) => r.ttl(),
            Backend::Memory(m) => m.ttl(),
        }
    }

    /// One acquisition attempt; see [`Redlock::try_lock`] and [`MemoryLocks::try_lock`].
    ///
    /// # Errors
    ///
    /// [`LockError::Taken`], [`LockError::NoQuorum`], [`LockError::TooSlow`] or
    /// [`LockError::InvalidKey`].
    pub async fn try_lock(&self, resource: &str) -> Result<Lease, LockError> {
        match &self.backend {
            Backend::Redlock(r) => r.try_lock(resource).await,
            Backend::Memory(m) => m.try_lock(resource),
        }
    }

    /// Acquisition with retries; see [`Redlock::lock`] and [`MemoryLocks::lock`].
    ///
    /// # Errors
    ///
    /// The error of the last attempt.
    pub async fn lock(&self, resource: &str) -> Result<Lease, LockError> {
        match &self.backend {
            Backend::Redlock(r) => r.lock(resource).await,
            Backend::Memory(m) => m.lock(resource).await,
        }
    }

    /// Extends the lease to a full TTL from now; see [`Redlock::extend`].
    ///
    /// # Errors
    ///
    /// [`LockError::Expired`], [`LockError::NoQuorum`] or [`LockError::TooSlow`].
    pub async fn extend(&self, lease: &mut Lease) -> Result<(), LockError> {
        match &self.backend {
            Backend::Redlock(r) => r.extend(lease).await,
            Backend::Memory(m) => m.extend(lease),
        }
    }

    /// Releases the lease; see [`Redlock::unlock`].
    ///
    /// # Errors
    ///
    /// [`LockError::Expired`] when it had already run out, [`LockError::NoQuorum`] when
    /// too few nodes answered.
    pub async fn unlock(&self, lease: Lease) -> Result<(), LockError> {
        match &self.backend {
            Backend::Redlock(r) => r.unlock(lease).await,
            Backend::Memory(m) => m.unlock(lease),
        }
    }

    /// The in-process backend, when this is one: its operations need no `.await`.
    pub(crate) fn as_memory(&self) -> Option<&MemoryLocks> {
        match &self.backend {
            Backend::Memory(m) => Some(m),
            Backend::Redlock(_) => None,
        }
    }

    /// Whether `lease` is the lock on `resource` in this backend (same prefixed key).
    #[cfg(feature = "axum")]
    pub(crate) fn names(&self, lease: &Lease, resource: &str) -> bool {
        let prefix: &str = match &self.backend {
            Backend::Redlock(r) => r.prefix(),
            Backend::Memory(m) => m.prefix(),
        };
        lease.key().strip_prefix(prefix) == Some(resource)
    }

    /// Releases without waiting: at once for the in-process backend, on a spawned task for
    /// Redis (the TTL is the backstop when there is no runtime).
    pub(crate) fn release_detached(&self, lease: Lease) {
        match &self.backend {
            Backend::Redlock(r) => r.release_detached(lease.key, lease.token),
            Backend::Memory(m) => {
                let _ = m.unlock(lease);
            }
        }
    }
}
