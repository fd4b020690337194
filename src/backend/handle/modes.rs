//! [`Locks`]' shared, exclusive and fair acquisitions.

use std::sync::Arc;
use std::time::Duration;

use super::Locks;
use crate::error::LockError;
use crate::lease::{Access, Lease};

impl Locks {
    /// Takes `resource` shared, with other readers; see [`Redlock::lock_shared_within`]
    /// and [`MemoryLocks::lock_shared_within`](crate::MemoryLocks::lock_shared_within).
    /// Release or extend the lease as any other.
    ///
    /// # Errors
    ///
    /// [`LockError::Taken`] when a writer holds or waits for it at the deadline; the
    /// other errors of [`try_lock`](Self::try_lock) at once.
    ///
    /// [`Redlock::lock_shared_within`]: crate::Redlock::lock_shared_within
    pub async fn lock_shared_within(
        &self,
        resource: &str,
        max_wait: Duration,
    ) -> Result<Lease, LockError> {
        on_backend!(self, b => b.lock_shared_within(resource, max_wait).await)
    }

    /// Takes `resource` exclusively, excluding its readers (and keeping new readers out
    /// while it waits); see [`Redlock::lock_exclusive_within`].
    ///
    /// # Errors
    ///
    /// As [`lock_within`](Self::lock_within).
    ///
    /// [`Redlock::lock_exclusive_within`]: crate::Redlock::lock_exclusive_within
    pub async fn lock_exclusive_within(
        &self,
        resource: &str,
        max_wait: Duration,
    ) -> Result<Lease, LockError> {
        on_backend!(self, b => b.lock_exclusive_within(resource, max_wait).await)
    }

    /// Waits up to `max_wait` in arrival order with the other fair waiters of
    /// `resource`; see [`Redlock::lock_fair_within`].
    ///
    /// # Errors
    ///
    /// As [`lock_within`](Self::lock_within).
    ///
    /// [`Redlock::lock_fair_within`]: crate::Redlock::lock_fair_within
    pub async fn lock_fair_within(
        &self,
        resource: &str,
        max_wait: Duration,
    ) -> Result<Lease, LockError> {
        on_backend!(self, b => b.lock_fair_within(resource, max_wait).await)
    }

    /// Shared or exclusive access to a prefixed key.
    pub(crate) async fn lock_access_key_within(
        &self,
        key: Arc<str>,
        access: Access,
        max_wait: Duration,
    ) -> Result<Lease, LockError> {
        on_backend!(self, b => b.lock_access_within(key, access, max_wait).await)
    }

    /// A fair wait on a prefixed key.
    pub(crate) async fn lock_fair_key_within(
        &self,
        key: Arc<str>,
        max_wait: Duration,
    ) -> Result<Lease, LockError> {
        on_backend!(self, b => b.lock_fair_key_within(key, max_wait).await)
    }
}
