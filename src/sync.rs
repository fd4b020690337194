//! The synchronisation the in-process stores are built on: the lock table's `Mutex`, the
//! waiters' counter and `Notify`, and the fallback timer of a wait.
//!
//! In every build a user makes these are std's and tokio's. A build with `--cfg shuttle`
//! (RUSTFLAGS; `verify/shuttle` and VERIFICATION.md) swaps them for the schedule explorer
//! [shuttle](https://docs.rs/shuttle)'s, so that it can run the stores' own code (the
//! in-process lock table, `Waiters`, the waiting loops and the in-process concurrency
//! permits) under many thousands of schedules: a `Mutex` and atomics it controls, a
//! `Notify` with tokio's `notify_waiters` contract over them, and a fallback timer that
//! never fires (a wake-up the waiting loop relies on must come from a notification, so a
//! lost one shows as a deadlock instead of a delay).

#[cfg(not(shuttle))]
pub(crate) use std::sync::atomic::AtomicUsize;
#[cfg(not(shuttle))]
pub(crate) use std::sync::{Mutex, MutexGuard};
#[cfg(not(shuttle))]
pub(crate) use tokio::sync::Notify;
#[cfg(not(shuttle))]
pub(crate) use tokio::time::sleep;
#[cfg(all(not(shuttle), feature = "lock"))]
pub(crate) use tokio::time::timeout;

#[cfg(all(shuttle, feature = "lock"))]
pub(crate) use explored::timeout;
#[cfg(shuttle)]
pub(crate) use explored::{Notify, sleep};
#[cfg(shuttle)]
pub(crate) use shuttle::sync::atomic::AtomicUsize;
#[cfg(shuttle)]
pub(crate) use shuttle::sync::{Mutex, MutexGuard};

/// What shuttle lacks: tokio's `Notify` (its `notify_waiters` part, the only one the stores
/// use) and the timers.
#[cfg(shuttle)]
mod explored {
    use std::future::Future;
    use std::pin::Pin;
    use std::sync::PoisonError;
    use std::task::{Context, Poll, Waker};
    use std::time::Duration;

    use shuttle::sync::Mutex;

    /// tokio's `Notify::notify_waiters` contract: a `Notified` future completes once
    /// `notify_waiters` is called after the future was created (polled or not); no permit
    /// is stored for a later one.
    #[derive(Debug, Default)]
    pub(crate) struct Notify {
        state: Mutex<NotifyState>,
    }

    #[derive(Debug, Default)]
    struct NotifyState {
        /// How many times `notify_waiters` was called.
        calls: u64,
        wakers: Vec<Waker>,
    }

    impl Notify {
        pub(crate) fn new() -> Self {
            Self::default()
        }

        fn state(&self) -> shuttle::sync::MutexGuard<'_, NotifyState> {
            self.state.lock().unwrap_or_else(PoisonError::into_inner)
        }

        pub(crate) fn notified(&self) -> Notified<'_> {
            Notified {
                notify: self,
                calls: self.state().calls,
            }
        }

        pub(crate) fn notify_waiters(&self) {
            let wakers = {
                let mut state = self.state();
                state.calls += 1;
                std::mem::take(&mut state.wakers)
            };
            wakers.into_iter().for_each(Waker::wake);
        }
    }

    /// Completes at the first `notify_waiters` after its creation.
    #[derive(Debug)]
    pub(crate) struct Notified<'a> {
        notify: &'a Notify,
        calls: u64,
    }

    impl Notified<'_> {
        /// tokio's `enable`: nothing to do, a `Notified` counts from its creation.
        pub(crate) fn enable(self: Pin<&mut Self>) -> bool {
            self.notify.state().calls != self.calls
        }
    }

    impl Future for Notified<'_> {
        type Output = ();

        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            let mut state = self.notify.state();
            if state.calls != self.calls {
                return Poll::Ready(());
            }
            state.wakers.push(cx.waker().clone());
            Poll::Pending
        }
    }

    /// A timer that never fires.
    pub(crate) fn sleep(_: Duration) -> std::future::Pending<()> {
        std::future::pending()
    }

    /// No time passes: `future`'s own outcome.
    #[cfg(feature = "lock")]
    pub(crate) async fn timeout<F: Future>(_: Duration, future: F) -> Result<F::Output, ()> {
        Ok(future.await)
    }
}
