//! [`LeaseStatus`]: the live view of a held lease that a [`Watchdog`] shares with whoever
//! holds a status handle (the handler, `with_lock`'s work, `Locked`).
//!
//! [`Watchdog`]: super::watchdog::Watchdog

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::lease::Lease;
use crate::lock::handle::Locks;
use crate::renewal::Renewal;

/// What a [`Watchdog`](super::watchdog::Watchdog) shares with the [`LeaseStatus`]
/// handles: the lease, its validity (moved by renewals), the loss, and whether the holder
/// is done.
pub(crate) struct LeaseState {
    /// The lease as acquired.
    pub(crate) lease: Lease,
    /// Its backend.
    pub(crate) locks: Locks,
    /// How the watchdog renews it.
    pub(crate) renewal: Renewal,
    /// The validity at acquisition; `valid_until` is kept as a signed offset from it in
    /// nanoseconds (an `Instant` is not atomic).
    base: Instant,
    offset_nanos: AtomicI64,
    pub(crate) lost: AtomicBool,
    /// The watchdog is gone: the holder released the lease.
    pub(crate) closed: AtomicBool,
    pub(crate) changed: Notify,
}

impl LeaseState {
    pub(crate) fn new(locks: Locks, lease: Lease, renewal: Renewal) -> Self {
        Self {
            base: lease.valid_until(),
            lease,
            locks,
            renewal,
            offset_nanos: AtomicI64::new(0),
            lost: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            changed: Notify::new(),
        }
    }

    fn valid_until(&self) -> Instant {
        let offset = self.offset_nanos.load(Ordering::Acquire);
        let magnitude = Duration::from_nanos(offset.unsigned_abs());
        // Every offset stored came from a representable `Instant`: these cannot fail.
        if offset >= 0 {
            self.base.checked_add(magnitude)
        } else {
            self.base.checked_sub(magnitude)
        }
        .unwrap_or(self.base)
    }

    pub(crate) fn set_valid_until(&self, valid_until: Instant) {
        let nanos = |d: Duration| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX);
        let offset = match valid_until.checked_duration_since(self.base) {
            Some(later) => nanos(later),
            None => -nanos(self.base.duration_since(valid_until)),
        };
        self.offset_nanos.store(offset, Ordering::Release);
    }
}

/// A live view of a held lease: the lease itself (key, token, fencing token), its current
/// validity (moved by each renewal) and whether it was lost. Cloning is cheap; all clones
/// see the same lease.
///
/// The [`LockLayer`](crate::LockLayer) puts one in the request extensions (read it with
/// the `LeaseStatus` extractor, feature `axum`); [`Locked`] and [`Locks::with_lock`] hand
/// one out.
///
/// [`Locked`]: crate::Locked
#[derive(Clone)]
pub struct LeaseStatus {
    shared: Arc<LeaseState>,
}

impl fmt::Debug for LeaseStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseStatus")
            .field("valid_until", &self.valid_until())
            .field("lost", &self.shared.lost.load(Ordering::Acquire))
            .finish()
    }
}

impl LeaseStatus {
    /// A handle on `shared`.
    pub(crate) fn new(shared: Arc<LeaseState>) -> Self {
        Self { shared }
    }

    /// The lease as acquired: its key, its token and its fencing token (to pass on to
    /// storage that rejects stale writers). Its [`valid_until`](Lease::valid_until) is the
    /// one at acquisition; [`valid_until`](Self::valid_until) follows the renewals.
    pub fn lease(&self) -> &Lease {
        &self.shared.lease
    }

    /// The instant the validity ends now (monotonic clock); each renewal moves it.
    pub fn valid_until(&self) -> Instant {
        self.shared.valid_until()
    }

    /// The validity left; zero once it has ended.
    pub fn remaining(&self) -> Duration {
        self.valid_until().saturating_duration_since(Instant::now())
    }

    /// Whether the lease was lost: a renewal found the token gone, or the validity ended.
    pub fn is_lost(&self) -> bool {
        self.shared.lost.load(Ordering::Acquire) || Instant::now() >= self.valid_until()
    }

    /// Resolves when the lease is lost, or when the holder released it (the watchdog is
    /// gone); use [`is_lost`](Self::is_lost) to tell which.
    pub async fn lost(&self) {
        let shared = &*self.shared;
        loop {
            // Armed before the state is read, so that a change in between is not missed.
            let changed = shared.changed.notified();
            let mut changed = std::pin::pin!(changed);
            changed.as_mut().enable();
            if shared.lost.load(Ordering::Acquire) || shared.closed.load(Ordering::Acquire) {
                return;
            }
            let valid_until = shared.valid_until();
            tokio::select! {
                () = changed => {}
                () = tokio::time::sleep_until(valid_until.into()) => {
                    if Instant::now() >= shared.valid_until() {
                        return;
                    }
                }
            }
        }
    }
}
