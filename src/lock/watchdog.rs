//! The lease lifecycle: a [`Watchdog`] renews a lease on its [`Schedule`] while the
//! protected work runs, and reports it lost. Renewal uses the token-checked extend, which
//! never creates a key, so a renewal racing a release cannot resurrect the lock. Also
//! [`Locks::with_lock`] and [`Locks::with_lease`]: work run under a lease.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Instant;

use crate::error::LockError;
use crate::future::{Lost, Protected, Watch};
use crate::lease::Lease;
use crate::lock::handle::{LeaseGuard, Locks};
use crate::lock::request::LockRequest;
use crate::lock::status::{LeaseState, LeaseStatus};
pub use crate::renewal::Renewal;
use crate::renewal::{RenewError, Schedule};

/// What the [`LockLayer`](crate::LockLayer) does when the lease is lost while the inner
/// service runs (a renewal found the token gone, or the validity ran out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnLockLoss {
    /// Drop the inner future at once, so it is never polled past the lease's validity,
    /// and answer **503** with a problem+json body saying the lock was lost. The default:
    /// work that is no longer exclusive stops at its next `.await`. Whatever it did
    /// before stays done; make the steps idempotent or fence them (see
    /// [`Lease::fencing_token`]).
    #[default]
    Abort,
    /// Let the inner future run on unprotected. The loss is flagged in the
    /// [`LeaseStatus`] (in the request extensions) and logged; the response is the inner
    /// service's. Use it when stopping half-way is worse than running unprotected.
    Continue,
}

/// Renews a lease while it is polled, and says when it is lost. The lease, its backend and
/// its [`Renewal`] live in the state shared with its [`LeaseStatus`] handles; the
/// [`Schedule`] is made the first time the work waits, so work that answers at once needs
/// no timer.
pub(crate) struct Watchdog {
    status: Arc<LeaseState>,
    schedule: Option<Box<Schedule<LockError>>>,
}

impl fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watchdog")
            .field("key", &self.lease().key())
            .field("renewal", &self.status.renewal)
            .field("lost", &self.schedule.as_ref().is_some_and(|s| s.is_lost()))
            .finish()
    }
}

/// A renewal that found the token gone loses the lease; others are retried.
impl RenewError for LockError {
    fn is_gone(&self) -> bool {
        matches!(self, LockError::Expired { .. })
    }
}

impl Watchdog {
    pub(crate) fn new(locks: Locks, lease: Lease, renewal: Renewal) -> Self {
        crate::observe::Held::Lease.start();
        Self {
            status: Arc::new(LeaseState::new(locks, lease, renewal)),
            schedule: None,
        }
    }

    /// The lease, as acquired.
    pub(crate) fn lease(&self) -> &Lease {
        &self.status.lease
    }

    /// Its backend.
    pub(crate) fn locks(&self) -> &Locks {
        &self.status.locks
    }

    pub(crate) fn status(&self) -> LeaseStatus {
        LeaseStatus::new(self.status.clone())
    }

    /// Whether an extension is in flight.
    pub(crate) fn is_renewing(&self) -> bool {
        self.schedule.as_ref().is_some_and(|s| s.is_renewing())
    }

    /// Whether the validity is still running, checked on the clock now.
    pub(crate) fn is_valid(&self) -> bool {
        match &self.schedule {
            Some(schedule) => schedule.is_valid(),
            // Nothing renewed it yet: the validity is the lease's own.
            None => Instant::now() < self.lease().valid_until(),
        }
    }

    /// Drives renewals; `Ready` once the lease is lost (and on every poll after that).
    pub(crate) fn poll_lost(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let status = &self.status;
        let schedule = self.schedule.get_or_insert_with(|| {
            let lease = &status.lease;
            Box::new(Schedule::new(
                lease.valid_until(),
                lease.ttl(),
                status.renewal,
            ))
        });
        if schedule.is_lost() {
            return Poll::Ready(());
        }
        let polled = schedule.poll_lost(
            cx,
            status.lease.key(),
            |valid_until| {
                let locks = status.locks.clone();
                let mut lease = status.lease.clone();
                lease.valid_until = valid_until;
                Box::pin(async move { locks.extend(&mut lease).await.map(|()| lease.valid_until) })
            },
            |renewed| {
                status.set_valid_until(renewed);
                notify(status);
            },
        );
        if polled.is_ready() {
            crate::observe::LockResult::Lost.count();
            self.status.lost.store(true, Ordering::Release);
            notify(&self.status);
        }
        polled
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        // From about when the acquisition started (see `Schedule::new`) to the release or
        // loss.
        let lease = self.lease();
        let acquired = lease.valid_until().checked_sub(lease.ttl());
        if let Some(acquired) = acquired {
            crate::observe::lock_held_since(acquired);
        }
        crate::observe::Held::Lease.end();
        self.status.closed.store(true, Ordering::Release);
        notify(&self.status);
    }
}

/// Wakes whoever awaits [`LeaseStatus::lost`]; nobody can while no status handle exists
/// besides the watchdog's own.
fn notify(status: &Arc<LeaseState>) {
    if Arc::strong_count(status) > 1 {
        status.changed.notify_waiters();
    }
}

impl Watch for Watchdog {
    fn lost_before_poll(&mut self, cx: &mut Context<'_>) -> bool {
        // A renewal that completed since the last poll is taken in first, and so is a
        // renewal that found the token gone; otherwise the clock alone decides, and no
        // timer is touched.
        (self.is_renewing() || !self.is_valid())
            && (self.poll_lost(cx).is_ready() || !self.is_valid())
    }

    fn poll_lost(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        Watchdog::poll_lost(self, cx)
    }
}

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
mod tests;
