//! What sets one keyed middleware apart from another: its [`Policy`], which decides for a
//! key, and the [`Permit`] an admitted request holds until its response is done.

use std::pin::Pin;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response, response};

use crate::future::Watch;

pub(crate) use crate::future::{BoxError, BoxFuture};

mod sealed {
    pub trait Sealed {}
}
pub(crate) use sealed::Sealed;

/// What a keyed middleware does with a request's key. Implemented by the policies of this
/// crate's layers ([`LockPolicy`](crate::lock::LockPolicy),
/// [`RateLimitPolicy`](crate::rate_limit::RateLimitPolicy)); sealed.
pub trait Policy: Sealed + Send + Sync + 'static {
    /// What an admitted request holds until its response is done.
    #[doc(hidden)]
    type Permit: Permit;

    /// Who refuses, in this layer's rejections; it names the layer in logs and metrics,
    /// and its key in answers.
    #[doc(hidden)]
    const REJECTED_BY: crate::rejection::RejectedBy;

    /// Whether the layer runs the inner service when its backend cannot decide, by
    /// default.
    #[doc(hidden)]
    const FAIL_OPEN: bool;

    /// The prefix before `{scope}:{value}`: the backend's own for lock keys; none by default
    /// (a limiter's store puts its own before the key).
    #[doc(hidden)]
    fn prefix(&self) -> &str {
        ""
    }

    /// Runs first, before the key is read: the lock layer takes a client's own fencing
    /// header off the request here.
    #[doc(hidden)]
    fn prepare(&self, parts: &mut Parts) {
        let _ = parts;
    }

    /// The core answered 400 before asking: the key was `missing` (required and absent),
    /// or unusable. For the layer's metrics.
    #[doc(hidden)]
    fn bad_key(&self, missing: bool) {
        let _ = missing;
    }

    /// Whether the backend refuses to decide: the in-process fallback, in a process that
    /// built a Redis store of its kind (a forgotten `.backend(..)`). The layer then answers
    /// 500; the fallback logs the fix once. Asked before each decision.
    #[doc(hidden)]
    fn refuses(&self) -> bool {
        false
    }

    /// The decision for `key` (prefix, scope and value, escaped), at once when the backend
    /// can answer without waiting, else as a future.
    #[doc(hidden)]
    fn decide(&self, key: &str, parts: &Parts) -> Decision<Self::Permit>;

    /// Whether the policy takes several keys at once ([`decide_all`](Self::decide_all)):
    /// a layer of one that is given an extractor of several does not compile.
    #[doc(hidden)]
    const SEVERAL_KEYS: bool = false;

    /// The decision for several keys at once (each prefixed, scoped and escaped; sorted,
    /// without duplicates, at least two), from a key extractor that names several
    /// ([`KeyExtractor::SEVERAL`](crate::key::KeyExtractor::SEVERAL)). Called only when
    /// [`SEVERAL_KEYS`](Self::SEVERAL_KEYS) is `true`.
    #[doc(hidden)]
    fn decide_all(&self, keys: Vec<std::sync::Arc<str>>, parts: &Parts) -> Decision<Self::Permit> {
        let _ = (keys, parts);
        unreachable!(
            "{}: several keys are refused when the layer is built",
            Self::REJECTED_BY.layer()
        )
    }
}

/// A decision, ready or on its way.
#[doc(hidden)]
#[allow(missing_debug_implementations)]
pub enum Decision<P> {
    /// The backend answered without waiting (in-process): no task, no boxed future.
    Ready(Verdict<P>),
    /// The backend is asked over the network.
    Pending(BoxFuture<Verdict<P>>),
}

/// What a policy decided for one request. It moves by value from the backend to the
/// response future: the answers, rarer than an admission, are boxed so that it stays the
/// size of a permit.
#[doc(hidden)]
#[allow(missing_debug_implementations)]
pub enum Verdict<P> {
    /// Run the inner service holding the permit until the response is done.
    Admit(P),
    /// Answer without running the inner service (a problem, a stored response).
    Answer(Box<Response<Bytes>>),
    /// The backend could not decide (down, or too slow).
    Unavailable(Box<Unavailable<P>>),
}

impl<P> Verdict<P> {
    /// Answer `response` without running the inner service.
    pub(crate) fn answer(response: Response<Bytes>) -> Self {
        Self::Answer(Box::new(response))
    }

    /// The backend could not decide: see [`Unavailable`].
    pub(crate) fn unavailable(error: BoxError, answer: Response<Bytes>, open: Option<P>) -> Self {
        Self::Unavailable(Box::new(Unavailable {
            error,
            answer,
            open,
        }))
    }
}

/// The backend could not decide (down, or too slow). Failing closed, the layer sends
/// `answer`; failing open, it runs the inner service with `open` (a permit that guards
/// nothing but still adds its headers) or with none. Either way it logs `error`.
#[doc(hidden)]
#[allow(missing_debug_implementations)]
pub struct Unavailable<P> {
    /// What went wrong, for the log.
    pub(crate) error: BoxError,
    /// The answer when failing closed (503).
    pub(crate) answer: Response<Bytes>,
    /// The permit to run with when failing open.
    pub(crate) open: Option<P>,
}

/// How long a permit is kept once the inner service has answered.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Until the response body has ended (the lease covers the whole response).
    BodyEnd,
    /// Released before the response head is returned.
    Head,
}

/// How the guarded response ended.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// The inner service answered and its body ended normally.
    Complete,
    /// The inner service failed, or its body did.
    Failed,
}

/// A release, done or on its way.
#[doc(hidden)]
#[allow(missing_debug_implementations)]
pub enum Release {
    /// Nothing left to wait for.
    Done,
    /// Wait for this before the response (or its end) is handed on.
    Pending(Releasing),
}

/// A release on its way: its future, and, for one that must land once started (on
/// Redis), what finishes it in the background should it be dropped before it is done.
/// Held where the release waits, not boxed again.
#[doc(hidden)]
#[allow(missing_debug_implementations)]
pub struct Releasing(Work);

enum Work {
    /// A release that may stop half way (only the tests' permits have one: every release
    /// of this crate's must land once started).
    #[cfg_attr(not(test), allow(dead_code))]
    Plain(BoxFuture<()>),
    #[cfg(any(feature = "lock", feature = "concurrency-limit"))]
    Finishing(crate::future::FinishOnDrop),
}

impl Releasing {
    /// `release`, dropped as it is when the wait for it is.
    #[cfg(test)]
    pub(crate) fn plain(release: BoxFuture<()>) -> Self {
        Releasing(Work::Plain(release))
    }

    /// `release`, finished in the background if dropped before it is done
    /// ([`FinishOnDrop`](crate::future::FinishOnDrop)).
    #[cfg(any(feature = "lock", feature = "concurrency-limit"))]
    pub(crate) fn finishing(release: BoxFuture<()>) -> Self {
        Releasing(Work::Finishing(crate::future::FinishOnDrop::new(release)))
    }
}

impl std::future::Future for Releasing {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        match &mut self.get_mut().0 {
            Work::Plain(release) => release.as_mut().poll(cx),
            #[cfg(any(feature = "lock", feature = "concurrency-limit"))]
            Work::Finishing(release) => Pin::new(release).poll(cx),
        }
    }
}

/// What an admitted request holds. The [`Watch`] side says when its guarantee is lost
/// (a lease's validity); a permit that cannot be lost keeps the defaults. Dropping a
/// permit without [`release`](Permit::release) must release it in the background.
#[doc(hidden)]
pub trait Permit: Watch + Send + 'static {
    /// Puts what the inner service may read on its request (extensions, headers).
    fn admit<B>(&mut self, request: &mut Request<B>);

    /// Runs `poll`, a poll of the inner service's future, in the permit's scope: a lock
    /// permit makes its lease the request's own there (reentrancy). The default runs it
    /// as it is.
    fn scoped<R>(&mut self, poll: impl FnOnce(&mut Self) -> R) -> R
    where
        Self: Sized,
    {
        poll(self)
    }

    /// Whether a loss stops the work (`true`), or lets it run on unprotected.
    fn abort_on_loss(&self) -> bool {
        true
    }

    /// The layer is in shadow mode: a loss must let the work run on.
    fn shadowed(&mut self) {}

    /// The answer when the permit was lost while the inner service ran and
    /// [`abort_on_loss`](Self::abort_on_loss).
    fn lost_response(self) -> Response<Bytes>;

    /// The error that ends a response body whose permit was lost mid-body.
    fn lost_error(self) -> BoxError;

    /// The inner service answered: add headers to `head`, and say how long to hold.
    fn on_response(&mut self, head: &mut response::Parts) -> Hold;

    /// A data frame of a held body passes on to the client.
    fn on_data(&mut self, data: &Bytes) {
        let _ = data;
    }

    /// The trailers of a held body pass on to the client (a gRPC response's status).
    fn on_trailers(&mut self, trailers: &http::HeaderMap) {
        let _ = trailers;
    }

    /// Releases what the permit holds.
    fn release(self, end: End) -> Release;
}
