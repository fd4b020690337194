//! Boxed futures and errors, shared by every layer above: the backends' rounds, the
//! handles, the renewal schedule and the keyed core.

use std::future::Future;
use std::pin::Pin;

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
