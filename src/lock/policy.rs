//! What [`LockLayer`](super::LockLayer) does with a key: take a lease, hold it while the
//! request runs (renewed, never past its validity), release it when the response is done.

use super::body::BodyRule;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode, response};

use crate::backend::contract::{Answer, Claim, LockMode};
use crate::backend::fallback::User;
use crate::error::LockError;
use crate::future::Watch;
use crate::future::{BoxError, boxed};
use crate::holder::HolderRef;
use crate::keyed::policy::Sealed;
use crate::keyed::policy::{Decision, End, Hold, Permit, Policy, Release, Releasing, Verdict};
use crate::lease::Lease;
use crate::lock::handle::Locks;
use crate::lock::request::{Decided, Options, Wait};
use crate::lock::watchdog::{OnLockLoss, Renewal, Watchdog};
use crate::observe;
use crate::rejection::{RejectedBy, Rejection, RejectionKind};

/// The policy of [`LockLayer`](super::LockLayer): its backend and how it holds a lease.
/// Set through the layer's builder methods.
#[derive(Clone, Debug)]
pub struct LockPolicy {
    pub(crate) locks: Locks,
    pub(crate) taken_status: StatusCode,
    pub(crate) renewal: Renewal,
    pub(crate) on_loss: OnLockLoss,
    pub(crate) fencing_header: Option<HeaderName>,
    pub(crate) release_at_head: bool,
    /// The mode and the wait of every acquisition.
    pub(crate) options: Options,
    /// How the request body is read before the lock.
    pub(crate) body: BodyRule,
}

impl LockPolicy {
    /// The defaults: the process-wide in-process backend, 423 on contention, fail closed.
    pub(crate) fn new(taken_status: StatusCode) -> Self {
        Self {
            locks: Locks::default(),
            taken_status,
            renewal: Renewal::default(),
            on_loss: OnLockLoss::default(),
            fencing_header: None,
            release_at_head: false,
            options: Options::default(),
            body: BodyRule::default(),
        }
    }

    /// The verdict on an acquisition of `key`. Contention's `Retry-After` is the scope's
    /// moving average hold time, bounded by the holder's remaining TTL.
    fn verdict(
        &self,
        key: &str,
        acquired: Result<Lease, LockError>,
        started: Instant,
    ) -> Verdict<LockPermit> {
        observe::lock_outcome(&acquired, started);
        match acquired.map_err(|e| self.locks.estimated(key, e)) {
            Ok(lease) => Verdict::Admit(LockPermit::new(self, lease)),
            Err(e) => refused::<Self>(e, self.taken_status),
        }
    }
}

/// The verdict on a lock error for `P`: unavailable (503, or failing open) without a
/// quorum or too slow, else `P`'s refusal; an outage is logged for errors not the client's.
pub(crate) fn refused<P: Policy>(e: LockError, taken_status: StatusCode) -> Verdict<P::Permit> {
    let answer = Rejection::of_lock_error(P::REJECTED_BY, &e, taken_status).into();
    if let LockError::NoQuorum { .. } | LockError::TooSlow { .. } = e {
        return Verdict::unavailable(Box::new(e), answer, None);
    }
    // The in-process fallback that refuses has logged the fix once (`Policy::refuses`).
    if !matches!(
        e,
        LockError::Taken { .. } | LockError::InvalidKey(_) | LockError::NoBackendChosen
    ) {
        crate::keyed::outage::outage::<P>(&e, false);
    }
    Verdict::answer(answer)
}

impl Sealed for LockPolicy {}

impl Policy for LockPolicy {
    type Permit = LockPermit;
    const REJECTED_BY: RejectedBy = RejectedBy::Lock;
    const FAIL_OPEN: bool = false;

    fn prefix(&self) -> &str {
        self.locks.prefix()
    }

    fn prepare(&self, parts: &mut Parts) {
        if let Some(name) = &self.fencing_header {
            // Only the layer sets this header, never the client.
            parts.headers.remove(name);
        }
    }

    fn bad_key(&self, _missing: bool) {
        observe::LockResult::Invalid.count();
    }

    #[inline]
    fn refuses(&self) -> bool {
        self.locks.refuses(User::LockLayer)
    }

    fn decide(&self, key: &str, parts: &Parts) -> Decision<LockPermit> {
        let claim = Claim::one(Arc::from(key), self.options.mode);
        self.decide_claim(claim, self.options, parts)
    }

    const SEVERAL_KEYS: bool = true;

    fn decide_all(&self, keys: Vec<Arc<str>>, parts: &Parts) -> Decision<LockPermit> {
        // One attempt: a set does not wait (`LockRequest::resolve`).
        let options = Options {
            wait: Wait::Once,
            mode: LockMode::Plain,
        };
        self.decide_claim(Claim::Set(keys.into()), options, parts)
    }
}

impl LockPolicy {
    /// Acquires at once on the in-process backend when not waiting, else as a future;
    /// the lease records the request of `parts` as its holder.
    fn decide_claim(&self, claim: Claim, options: Options, parts: &Parts) -> Decision<LockPermit> {
        let started = Instant::now();
        let first = claim.first().clone();
        let holder = HolderRef::Request(parts);
        match self.locks.decide(claim, options, started, holder) {
            Decided::Now(acquired) => Decision::Ready(self.verdict(&first, acquired, started)),
            Decided::Later(acquiring) => {
                let policy = self.clone();
                let acquiring = acquiring.boxed();
                Decision::Pending(boxed(|| async move {
                    policy.verdict(&first, acquiring.await, started)
                }))
            }
        }
    }
}

/// A held lease, renewed until the response is done, then released (in the background
/// if dropped still held).
#[doc(hidden)]
#[derive(Debug)]
pub struct LockPermit {
    watchdog: Watchdog,
    /// Still to be released.
    armed: bool,
    abort: bool,
    release_at_head: bool,
    fencing_header: Option<HeaderName>,
}

impl LockPermit {
    fn new(policy: &LockPolicy, lease: Lease) -> Self {
        Self {
            watchdog: Watchdog::new(policy.locks.clone(), lease, policy.renewal),
            armed: true,
            abort: policy.on_loss == OnLockLoss::Abort,
            release_at_head: policy.release_at_head,
            fencing_header: policy.fencing_header.clone(),
        }
    }

    /// A permit for the idempotency layer's lease: renewed, aborting on loss, held until
    /// the body ends.
    #[cfg(feature = "idempotency")]
    pub(crate) fn for_lease(locks: Locks, lease: Lease, renewal: Renewal) -> Self {
        Self {
            watchdog: Watchdog::new(locks, lease, renewal),
            armed: true,
            abort: true,
            release_at_head: false,
            fencing_header: None,
        }
    }

    #[cfg(feature = "idempotency")]
    pub(crate) fn is_valid(&self) -> bool {
        self.watchdog.is_valid()
    }

    /// Disarms the permit and hands back what to release (dropping it stops the renewals).
    #[cfg(feature = "idempotency")]
    pub(crate) fn disarm(mut self) -> (Locks, Lease) {
        self.armed = false;
        (self.watchdog.locks().clone(), self.watchdog.lease().clone())
    }
}

impl Drop for LockPermit {
    fn drop(&mut self) {
        if self.armed {
            self.watchdog
                .locks()
                .release_detached(self.watchdog.lease());
        }
    }
}

impl Watch for LockPermit {
    fn lost_before_poll(&mut self, cx: &mut Context<'_>) -> bool {
        self.watchdog.lost_before_poll(cx)
    }

    fn poll_lost(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        Watch::poll_lost(&mut self.watchdog, cx)
    }
}

impl Permit for LockPermit {
    fn scoped<R>(&mut self, poll: impl FnOnce(&mut Self) -> R) -> R {
        crate::lock::reentry::scoped(self.watchdog.status(), || poll(self))
    }

    fn admit<B>(&mut self, request: &mut Request<B>) {
        let status = self.watchdog.status();
        if let (Some(name), Some(token)) = (&self.fencing_header, status.lease().fencing_token()) {
            request
                .headers_mut()
                .insert(name.clone(), HeaderValue::from(token));
        }
        request.extensions_mut().insert(status);
    }

    fn abort_on_loss(&self) -> bool {
        self.abort
    }

    fn shadowed(&mut self) {
        self.abort = false;
    }

    fn lost_response(self) -> Response<Bytes> {
        Rejection::new(
            RejectedBy::Lock,
            RejectionKind::Lost,
            "The lock was lost while the request ran, so its work was stopped; retry the request.",
        )
        .retry_after(Duration::from_secs(1))
        .into()
    }

    fn lost_error(self) -> BoxError {
        Box::new(LockError::Lost)
    }

    fn on_response(&mut self, _head: &mut response::Parts) -> Hold {
        if self.release_at_head {
            Hold::Head
        } else {
            Hold::BodyEnd
        }
    }

    fn release(mut self, _end: End) -> Release {
        self.armed = false;
        match self.watchdog.locks().backend().end(self.watchdog.lease()) {
            Answer::Now(()) => Release::Done,
            Answer::Later(release) => Release::Pending(Releasing::finishing(release)),
        }
    }
}
