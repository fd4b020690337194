//! What [`LockLayer`](super::LockLayer) does with a key: take a lease, hold it while the
//! request runs (renewed, never past its validity), release it when the response is done.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode, response};

use crate::backend::handle::{LeaseGuard, Locks};
use crate::backend::request::{Claim, Options, Wait};
use crate::backend::watchdog::{OnLockLoss, Renewal, Watchdog};
use crate::error::LockError;
use crate::keyed::policy::{
    BoxError, Decision, End, Hold, Permit, Policy, Release, Sealed, Verdict,
};
use crate::lease::Lease;
use crate::observe;
use crate::protect::Watch;
use crate::rejection::{RejectedBy, Rejection, RejectionKind};

/// The policy of [`LockLayer`](super::LockLayer): its backend and how it holds a lease.
/// Set through the layer's builder methods.
#[derive(Clone)]
pub struct LockPolicy {
    pub(crate) locks: Locks,
    pub(crate) taken_status: StatusCode,
    pub(crate) renewal: Renewal,
    pub(crate) on_loss: OnLockLoss,
    pub(crate) fencing_header: Option<HeaderName>,
    pub(crate) release_at_head: bool,
    /// The mode and the wait of every acquisition.
    pub(crate) options: Options,
}

impl fmt::Debug for LockPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockPolicy")
            .field("locks", &self.locks)
            .field("taken_status", &self.taken_status)
            .field("renewal", &self.renewal)
            .field("on_loss", &self.on_loss)
            .field("fencing_header", &self.fencing_header)
            .field("release_at_head", &self.release_at_head)
            .field("options", &self.options)
            .finish()
    }
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
        }
    }

    /// The verdict on an acquisition of `key`. A `Retry-After` for contention is the
    /// moving average of the hold times observed for the key's scope, bounded by the
    /// holder's remaining TTL (see [`Locks`]' backends); the header rounds it up to
    /// whole seconds, at least 1.
    fn verdict(
        &self,
        key: &str,
        acquired: Result<Lease, LockError>,
        started: Instant,
    ) -> Verdict<LockPermit> {
        observe::lock_outcome(&acquired, started);
        let acquired = acquired.map_err(|e| self.locks.estimated(key, e));
        match acquired {
            Ok(lease) => Verdict::Admit(LockPermit::new(self, lease)),
            Err(e @ (LockError::NoQuorum { .. } | LockError::TooSlow { .. })) => {
                let answer = Rejection::from_lock_error(&e, self.taken_status).into();
                Verdict::unavailable(Box::new(e), answer, None)
            }
            Err(e) => {
                if !matches!(e, LockError::Taken { .. } | LockError::InvalidKey(_)) {
                    crate::keyed::future::outage::<Self>(&e, false);
                }
                Verdict::answer(Rejection::from_lock_error(&e, self.taken_status).into())
            }
        }
    }
}

impl Sealed for LockPolicy {}

impl Policy for LockPolicy {
    type Permit = LockPermit;
    const LAYER: &'static str = "LockLayer";
    const KEY_NOUN: &'static str = "lock key";
    const REJECTED_BY: RejectedBy = RejectedBy::Lock;
    const FAIL_OPEN: bool = false;

    fn prefix(&self) -> &str {
        self.locks.prefix()
    }

    fn prepare(&self, parts: &mut Parts) {
        if let Some(name) = &self.fencing_header {
            // Only the layer sets this header: a client's own value must never reach the
            // inner service, whatever happens next (no key, fail open, no token).
            parts.headers.remove(name);
        }
    }

    fn bad_key(&self, _missing: bool) {
        observe::lock_request(observe::LockResult::Invalid);
    }

    fn decide(&self, key: &str, _parts: &Parts) -> Decision<LockPermit> {
        self.decide_claim(Claim::One(Arc::from(key)), self.options)
    }

    const SEVERAL_KEYS: bool = true;

    fn decide_all(&self, keys: Vec<Arc<str>>, _parts: &Parts) -> Decision<LockPermit> {
        // One attempt: a set does not wait (`Claim::check`).
        let options = Options {
            wait: Wait::Once,
            ..self.options
        };
        self.decide_claim(Claim::Set(keys.into()), options)
    }
}

impl LockPolicy {
    /// Runs the acquisition: at once on the in-process backend when it does not wait,
    /// else as a future.
    fn decide_claim(&self, claim: Claim, options: Options) -> Decision<LockPermit> {
        let started = Instant::now();
        if options.wait == Wait::Once {
            if let Some(memory) = self.locks.as_memory() {
                let acquired = memory.attempt(&claim, options.mode, started);
                return Decision::Ready(self.verdict(claim.first(), acquired, started));
            }
        }
        let policy = self.clone();
        Decision::Pending(Box::pin(async move {
            let first = claim.first().clone();
            let acquired = policy.locks.acquire_claim(claim, options).await;
            policy.verdict(&first, acquired, started)
        }))
    }
}

/// A held lease: released when the response is done, renewed until then; released in
/// the background if dropped still held (the response future or body was dropped).
#[doc(hidden)]
pub struct LockPermit {
    /// The lease, its backend and its renewals.
    watchdog: Watchdog,
    /// Still to be released.
    armed: bool,
    abort: bool,
    release_at_head: bool,
    fencing_header: Option<HeaderName>,
}

impl fmt::Debug for LockPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockPermit")
            .field("watchdog", &self.watchdog)
            .field("armed", &self.armed)
            .field("abort", &self.abort)
            .finish_non_exhaustive()
    }
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

    /// A permit over `lease` for another keyed layer that holds a lease per request (the
    /// idempotency layer): renewed, aborting on loss, held until the body ends.
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

    /// Whether the lease is still valid.
    #[cfg(feature = "idempotency")]
    pub(crate) fn is_valid(&self) -> bool {
        self.watchdog.is_valid()
    }

    /// Disarms the permit and hands back what to release; dropping the permit then
    /// stops the renewals and tells the status the holder is done.
    pub(crate) fn disarm(mut self) -> (Locks, Lease) {
        self.armed = false;
        (self.watchdog.locks().clone(), self.watchdog.lease().clone())
    }
}

impl Drop for LockPermit {
    fn drop(&mut self) {
        if self.armed {
            let lease = self.watchdog.lease().clone();
            self.watchdog.locks().release_detached(lease);
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
        crate::backend::reentry::scoped(self.watchdog.status(), || poll(self))
    }

    fn admit<B>(&mut self, request: &mut Request<B>) {
        let status = self.watchdog.status();
        if let (Some(name), Some(token)) = (&self.fencing_header, status.lease().fencing_token()) {
            request
                .headers_mut()
                .insert(name.clone(), HeaderValue::from(token));
        }
        // One extension: the `Lease` extractor reads the lease from the status.
        request.extensions_mut().insert(status);
    }

    fn abort_on_loss(&self) -> bool {
        self.abort
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

    fn release(self, _end: End) -> Release {
        // Dropped here: the renewals stop, and the status says the holder is done.
        let (locks, lease) = self.disarm();
        if let Some(memory) = locks.as_memory() {
            let _ = memory.unlock(lease);
            return Release::Done;
        }
        // Released in place; should the future be dropped meanwhile, the guard (still
        // armed) releases in the background.
        let mut guard = LeaseGuard::new(locks, lease);
        Release::Pending(Box::pin(async move {
            if let Some((locks, lease)) = guard.cloned() {
                if let Err(e) = locks.unlock(lease).await {
                    tracing::debug!(error = %e, "lease release");
                }
            }
            guard.disarm();
        }))
    }
}
