//! The lock-loss guarantee, written once: work guarded by a lease is never polled once the
//! lease is lost. The lock layer, [`Locks::with_lock`](crate::Locks::with_lock) and
//! [`Locked::protect`](crate::Locked::protect) poll their work through [`poll_guarded`],
//! which checks its [`Watch`] (on the clock) before each poll, and after a `Pending` lets
//! it drive its renewals and arm its wake-ups.

use std::task::{Context, Poll};
#[cfg(feature = "lock")]
use std::{future::Future, pin::Pin};

/// What tells that the guarantee over some work is gone (a lease's watchdog or status).
/// The defaults are a guarantee that is never lost (a count).
#[doc(hidden)]
pub trait Watch {
    /// Before a poll of the work: whether the guarantee is gone now (timers may stay unarmed).
    fn lost_before_poll(&mut self, cx: &mut Context<'_>) -> bool {
        let _ = cx;
        false
    }

    /// After the work returned `Pending`: drives renewals, arms wake-ups; `Ready` once lost.
    fn poll_lost(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let _ = cx;
        Poll::Pending
    }
}

/// The guarantee was gone before the work completed; the work was not polled again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lost;

/// Polls `poll` under `watch`, never once the guarantee is gone.
pub(crate) fn poll_guarded<T, W>(
    watch: &mut W,
    cx: &mut Context<'_>,
    poll: impl FnOnce(&mut Context<'_>) -> Poll<T>,
) -> Poll<Result<T, Lost>>
where
    W: Watch + ?Sized,
{
    if watch.lost_before_poll(cx) {
        return Poll::Ready(Err(Lost));
    }
    match poll(cx) {
        Poll::Ready(output) => Poll::Ready(Ok(output)),
        // Timers are armed only once the work waits.
        Poll::Pending => watch.poll_lost(cx).map(|()| Err(Lost)),
    }
}

#[cfg(feature = "lock")]
pin_project_lite::pin_project! {
    /// Runs `work` under `watch`; resolves to [`Lost`] once the guarantee is gone.
    pub(crate) struct Protected<F, W> {
        #[pin]
        work: F,
        watch: W,
    }
}

#[cfg(feature = "lock")]
impl<F, W> Protected<F, W> {
    pub(crate) fn new(work: F, watch: W) -> Self {
        Self { work, watch }
    }
}

#[cfg(feature = "lock")]
impl<F: Future, W: Watch> Future for Protected<F, W> {
    type Output = Result<F::Output, Lost>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut work = this.work;
        poll_guarded(this.watch, cx, |cx| work.as_mut().poll(cx))
    }
}

#[cfg(all(test, feature = "lock"))]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A watch that is lost after as many checks as it holds.
    struct After(usize);

    impl Watch for After {
        fn lost_before_poll(&mut self, _: &mut Context<'_>) -> bool {
            let lost = self.0 == 0;
            self.0 = self.0.saturating_sub(1);
            lost
        }

        fn poll_lost(&mut self, _: &mut Context<'_>) -> Poll<()> {
            Poll::Pending
        }
    }

    /// Work that counts its polls and never completes.
    struct Counted(Arc<AtomicUsize>);

    impl Future for Counted {
        type Output = ();
        fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            self.0.fetch_add(1, Ordering::SeqCst);
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    #[tokio::test]
    async fn work_is_not_polled_once_lost() {
        let polls = Arc::new(AtomicUsize::new(0));
        let protected = Protected::new(Counted(polls.clone()), After(3));
        assert_eq!(protected.await, Err(Lost));
        assert_eq!(polls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn completed_work_passes_its_output() {
        let protected = Protected::new(async { 7 }, After(1));
        assert_eq!(protected.await, Ok(7));
    }
}
