//! The crate's futures, shared by every layer above (the backends' rounds, the handles,
//! the renewal schedule and the keyed core): boxed futures and errors, work that finishes
//! in the background once started, and the lock-loss guarantee, written once: work guarded
//! by a lease is never polled once the lease is lost. The lock layer,
//! [`Locks::with_lock`](crate::Locks::with_lock) and
//! [`Locked::protect`](crate::Locked::protect) poll their work through [`poll_guarded`],
//! which checks its [`Watch`] (on the clock) before each poll, and after a `Pending` lets
//! it drive its renewals and arm its wake-ups.

use std::future::Future;
use std::pin::Pin;
#[cfg(any(feature = "lock", feature = "concurrency-limit"))]
use std::task::ready;
use std::task::{Context, Poll};

/// A boxed future, for decisions and releases that wait on a backend.
pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Boxes the future that `make` returns, written in place: the box is allocated first,
/// so that the future (an `async` block or `async fn` call, the size of its largest state
/// however little it holds at first) is not built on the stack and copied into the box
/// whole: a Redis acquisition's future is a few kilobytes, of which it holds a few hundred
/// bytes at first. Coerces to a [`BoxFuture`].
#[inline(always)]
pub(crate) fn boxed<F: Future>(make: impl FnOnce() -> F) -> Pin<Box<F>> {
    let uninit = Box::<F>::new_uninit();
    Box::into_pin(Box::write(uninit, make()))
}

/// A boxed error, as response bodies report them.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What one poll of a response or request body of this crate gives: a frame of [`Bytes`],
/// an error, the end, or nothing yet.
pub(crate) type PolledFrame =
    std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, BoxError>>>;

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
mod guarded_tests {
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

/// Work that must land once started, such as a release: dropped before it is done, it
/// finishes in the background (on the current Tokio runtime) rather than stopping half
/// way, where starting it again would repeat what was already sent. Without a runtime it
/// is dropped: its own guards then do what they can.
#[cfg(any(feature = "lock", feature = "concurrency-limit"))]
pub(crate) struct FinishOnDrop(Option<BoxFuture<()>>);

#[cfg(any(feature = "lock", feature = "concurrency-limit"))]
impl FinishOnDrop {
    /// `work`, finished in the background if dropped before it is done.
    pub(crate) fn new(work: BoxFuture<()>) -> Self {
        Self(Some(work))
    }
}

#[cfg(any(feature = "lock", feature = "concurrency-limit"))]
impl Future for FinishOnDrop {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if let Some(work) = self.0.as_mut() {
            ready!(work.as_mut().poll(cx));
            self.0 = None;
        }
        Poll::Ready(())
    }
}

#[cfg(any(feature = "lock", feature = "concurrency-limit"))]
impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        if let (Some(work), Ok(runtime)) = (self.0.take(), tokio::runtime::Handle::try_current()) {
            runtime.spawn(work);
        }
    }
}

#[cfg(all(
    test,
    feature = "redis",
    any(feature = "lock", feature = "concurrency-limit")
))]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::task::{Context, Poll, Waker};

    use super::*;

    /// Work that counts its starts and ends, and waits for `go` in between.
    fn work(
        counts: &Arc<(AtomicUsize, AtomicUsize)>,
        go: tokio::sync::oneshot::Receiver<()>,
    ) -> BoxFuture<()> {
        let counts = counts.clone();
        Box::pin(async move {
            counts.0.fetch_add(1, SeqCst);
            let _ = go.await;
            counts.1.fetch_add(1, SeqCst);
        })
    }

    async fn until_done(counts: &(AtomicUsize, AtomicUsize)) {
        while counts.1.load(SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn dropped_half_way_the_work_in_flight_finishes_in_the_background_once() {
        let counts = Arc::default();
        let (go, wait) = tokio::sync::oneshot::channel();
        let mut finishing = FinishOnDrop::new(work(&counts, wait));
        let mut cx = Context::from_waker(Waker::noop());
        assert_eq!(Pin::new(&mut finishing).poll(&mut cx), Poll::Pending);
        drop(finishing);
        go.send(()).unwrap();
        until_done(&counts).await;
        assert_eq!((counts.0.load(SeqCst), counts.1.load(SeqCst)), (1, 1));
    }

    #[tokio::test]
    async fn dropped_before_its_first_poll_the_work_runs_in_the_background_once() {
        let counts = Arc::default();
        let (go, wait) = tokio::sync::oneshot::channel();
        drop(FinishOnDrop::new(work(&counts, wait)));
        go.send(()).unwrap();
        until_done(&counts).await;
        assert_eq!((counts.0.load(SeqCst), counts.1.load(SeqCst)), (1, 1));
    }
}
