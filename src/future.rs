//! Boxed futures and errors, shared by every layer above: the backends' rounds, the
//! handles, the renewal schedule and the keyed core.

use std::future::Future;
use std::pin::Pin;
#[cfg(any(feature = "lock", feature = "concurrency-limit"))]
use std::task::{Context, Poll, ready};

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
