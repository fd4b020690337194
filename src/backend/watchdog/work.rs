//! Work run under a lease taken beforehand, or on several keys at once.

use std::future::Future;

use super::{Renewal, Watchdog};
use crate::backend::handle::{LeaseGuard, Locks};
use crate::backend::request::LockRequest;
use crate::backend::status::LeaseStatus;
use crate::error::LockError;
use crate::lease::Lease;
use crate::protect::{Lost, Protected};

impl Locks {
    /// Takes what `request` asks for (as [`acquire`](Self::acquire)), runs `work` while the
    /// lease is renewed (every TTL/3 by default, see [`Renewal`]), and releases it at the
    /// end. `work` gets a [`LeaseStatus`]: the lease itself ([`LeaseStatus::lease`], with
    /// its token and fencing token), its validity, and its loss.
    ///
    /// The lock-loss guarantee: `work` is never polled once the lease is lost (a renewal
    /// found the token gone, or the validity ended without a successful renewal); it is
    /// dropped and the call returns [`LockError::Lost`]. Dropping the returned future
    /// releases the lease in the background.
    ///
    /// ```
    /// # async fn demo() -> Result<(), tower_redlock::LockError> {
    /// use tower_redlock::{LockRequest, Locks, Renewal};
    ///
    /// let locks = Locks::default();
    /// let rows = locks
    ///     .with_lock(LockRequest::new("nightly-report").retry(), Renewal::default(), |status| async move {
    ///         // ... long work; status.remaining() says how much validity is left ...
    ///         let _fence = status.lease().fencing_token();
    ///         42
    ///     })
    ///     .await?;
    /// assert_eq!(rows, 42);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// The acquisition's error (see [`acquire`](Self::acquire)), or [`LockError::Lost`]
    /// when the lease was lost while `work` ran.
    pub async fn with_lock<'a, Fut: Future>(
        &self,
        request: impl Into<LockRequest<'a>>,
        renewal: Renewal,
        work: impl FnOnce(LeaseStatus) -> Fut,
    ) -> Result<Fut::Output, LockError> {
        let lease = self.acquire(request).await?;
        self.with_lease(lease, renewal, work).await
    }

    /// Runs `work` under a lease already taken from this backend, as
    /// [`with_lock`](Self::with_lock) does (renewed while `work` runs, `work` never polled
    /// once it is lost, released at the end).
    ///
    /// ```
    /// # async fn demo() -> Result<(), tower_redlock::LockError> {
    /// use tower_redlock::{LockRequest, Locks, Renewal};
    ///
    /// let locks = Locks::default();
    /// // One attempt (answer "locked" at once rather than wait), then the work under it.
    /// let lease = locks.acquire(&LockRequest::all(["account:alice", "account:bob"])).await?;
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
    pub async fn with_lease<Fut: Future>(
        &self,
        lease: Lease,
        renewal: Renewal,
        work: impl FnOnce(LeaseStatus) -> Fut,
    ) -> Result<Fut::Output, LockError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::memory::MemoryLocks;

    #[tokio::test]
    async fn with_lock_gives_the_work_its_lease_and_fencing_token() {
        let locks = Locks::from(MemoryLocks::builder().fencing_tokens(true).build().unwrap());
        let (key, token, fence) = locks
            .with_lock(
                LockRequest::new("fenced").retry(),
                Renewal::default(),
                |status| async move {
                    let lease = status.lease();
                    (
                        lease.key().to_owned(),
                        lease.token().to_string(),
                        lease.fencing_token(),
                    )
                },
            )
            .await
            .unwrap();
        assert_eq!(key, "tower-redlock:fenced");
        assert_eq!(token.len(), 32);
        assert!(fence.is_some());
        // Released at the end: the next holder gets a greater fencing token.
        let next = locks.try_lock("fenced").await.unwrap();
        assert!(next.fencing_token() > fence);
    }
}
