//! Work run under a lease taken beforehand, or on several keys at once.

use std::future::Future;

use super::{Renewal, Watchdog};
use crate::backend::handle::{LeaseGuard, Locks};
use crate::backend::status::LeaseStatus;
use crate::error::LockError;
use crate::lease::Lease;
use crate::protect::{Lost, Protected};

impl Locks {
    /// Like [`with_lock`](Self::with_lock), on several resources at once: acquires all of
    /// them or none ([`lock_all`](Self::lock_all), with retries), runs `work` while the
    /// lease on the set is renewed, and releases every key at the end.
    ///
    /// # Errors
    ///
    /// The acquisition's error (see [`try_lock_all`](Self::try_lock_all)), or
    /// [`LockError::Lost`] when the lease was lost while `work` ran.
    pub async fn with_lock_all<I, F, Fut>(
        &self,
        resources: I,
        renewal: Renewal,
        work: F,
    ) -> Result<Fut::Output, LockError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
        F: FnOnce(LeaseStatus) -> Fut,
        Fut: Future,
    {
        let lease = self.lock_all(resources).await?;
        self.with_lease(lease, renewal, work).await
    }

    /// Runs `work` under a lease already taken from this backend (by
    /// [`try_lock`](Self::try_lock), [`try_lock_all`](Self::try_lock_all), ...), as
    /// [`with_lock`](Self::with_lock) does: the lease is renewed while `work` runs, `work`
    /// is never polled once it is lost, and the lease is released at the end (in the
    /// background if the returned future is dropped).
    ///
    /// ```
    /// # async fn demo() -> Result<(), tower_redlock::LockError> {
    /// use tower_redlock::{Locks, Renewal};
    ///
    /// let locks = Locks::default();
    /// // One attempt (answer "locked" at once rather than wait), then the work under it.
    /// let lease = locks.try_lock_all(["account:alice", "account:bob"]).await?;
    /// let moved = locks
    ///     .with_lease(lease, Renewal::default(), |_status| async { 25 })
    ///     .await?;
    /// assert_eq!(moved, 25);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`LockError::Lost`] when the lease was lost while `work` ran.
    pub async fn with_lease<F, Fut>(
        &self,
        lease: Lease,
        renewal: Renewal,
        work: F,
    ) -> Result<Fut::Output, LockError>
    where
        F: FnOnce(LeaseStatus) -> Fut,
        Fut: Future,
    {
        let mut guard = LeaseGuard::new(self.clone(), lease.clone());
        let watchdog = Watchdog::new(self.clone(), lease, renewal);
        let status = watchdog.status();
        let result = Protected::new(work(status), watchdog)
            .await
            .map_err(|Lost| LockError::Lost);
        if let Some((locks, lease)) = guard.take() {
            if let Err(e) = locks.unlock(lease).await {
                if result.is_ok() {
                    tracing::warn!(error = %e, "the work completed, but releasing its lease failed");
                }
            }
        }
        result
    }
}
