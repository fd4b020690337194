//! What [`ConcurrencyLimitLayer`](super::ConcurrencyLimitLayer) does with a key: take a
//! permit (503 when `limit` are held), renew it while the request runs, release it when done.

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{Request, Response, StatusCode, response};

use crate::backend::concurrency::{ConcurrencyError, ConcurrencyLimiter, PermitSlot};
use crate::backend::fallback::User;
use crate::future::Watch;
use crate::future::{BoxError, boxed};
use crate::keyed::policy::Sealed;
use crate::keyed::policy::{Decision, End, Hold, Permit, Policy, Release, Releasing, Verdict};
use crate::observe::ConcurrencyResult;
use crate::rejection::{RejectedBy, Rejection, RejectionKind};
use crate::renewal::{Renewal, Schedule};

/// The policy of [`ConcurrencyLimitLayer`](super::ConcurrencyLimitLayer): its store, limit,
/// wait for a permit and renewals. Set through the layer's builder methods.
#[derive(Clone, Debug)]
pub struct ConcurrencyPolicy {
    pub(crate) limiter: ConcurrencyLimiter,
    pub(crate) limit: u32,
    pub(crate) max_wait: Duration,
    pub(crate) renewal: Renewal,
    pub(crate) retry_after: Duration,
    /// The 503 detail over the limit, built once.
    detail: Arc<str>,
}

impl ConcurrencyPolicy {
    /// The defaults: the process-wide store, no wait, default renewals, `Retry-After: 1`.
    pub(crate) fn new(limit: u32) -> Self {
        Self {
            limiter: ConcurrencyLimiter::default(),
            limit,
            max_wait: Duration::ZERO,
            renewal: Renewal::default(),
            retry_after: Duration::from_secs(1),
            detail: Arc::from(format!(
                "At most {limit} such requests run at once, and that many are in flight; retry after the Retry-After delay."
            )),
        }
    }

    fn verdict(
        &self,
        acquired: Result<PermitSlot, ConcurrencyError>,
    ) -> Verdict<ConcurrencyPermit> {
        ConcurrencyResult::count(match &acquired {
            Ok(_) => ConcurrencyResult::Admitted,
            Err(ConcurrencyError::LimitReached { .. }) => ConcurrencyResult::Limited,
            Err(ConcurrencyError::InvalidKey(_)) => ConcurrencyResult::Invalid,
            Err(_) => ConcurrencyResult::Unavailable,
        });
        match acquired {
            Ok(slot) => Verdict::Admit(ConcurrencyPermit::new(slot, self.renewal)),
            // 503 with `Retry-After` (RFC 9110, sections 15.6.4 and 10.2.3).
            Err(ConcurrencyError::LimitReached { .. }) => Verdict::answer(
                Rejection::new(
                    Self::REJECTED_BY,
                    RejectionKind::Limited,
                    self.detail.to_string(),
                )
                .with_status(StatusCode::SERVICE_UNAVAILABLE)
                .retry_after(self.retry_after)
                .into(),
            ),
            Err(ConcurrencyError::InvalidKey(e)) => Verdict::answer(
                Rejection::invalid_key(Self::REJECTED_BY, Self::REJECTED_BY.key_noun(), &e).into(),
            ),
            // The fallback that refuses has logged the fix once (`Policy::refuses`).
            Err(ConcurrencyError::NoBackendChosen) => {
                Verdict::answer(Rejection::misconfigured(Self::REJECTED_BY).into())
            }
            Err(e) => {
                let answer = Rejection::unavailable(Self::REJECTED_BY).into();
                Verdict::unavailable(Box::new(e), answer, None)
            }
        }
    }
}

impl Sealed for ConcurrencyPolicy {}

impl Policy for ConcurrencyPolicy {
    type Permit = ConcurrencyPermit;
    const REJECTED_BY: RejectedBy = RejectedBy::ConcurrencyLimit;
    const FAIL_OPEN: bool = true;

    fn bad_key(&self, _missing: bool) {
        ConcurrencyResult::Invalid.count();
    }

    #[inline]
    fn refuses(&self) -> bool {
        self.limiter.refuses(User::ConcurrencyLimitLayer)
    }

    fn decide(&self, key: &str, _parts: &Parts) -> Decision<ConcurrencyPermit> {
        if let Some(memory) = self.limiter.as_memory().filter(|_| self.max_wait.is_zero()) {
            return Decision::Ready(self.verdict(memory.acquire_key(key, self.limit)));
        }
        let key = key.to_owned();
        let policy = self.clone();
        Decision::Pending(boxed(|| async move {
            let acquired = policy
                .limiter
                .acquire_within(&key, policy.limit, policy.max_wait)
                .await;
            policy.verdict(acquired)
        }))
    }
}

/// A permit, renewed on Redis until the response is done, then released (in the
/// background when dropped unreleased).
#[doc(hidden)]
pub struct ConcurrencyPermit {
    slot: PermitSlot,
    /// The renewals of a Redis permit (boxed: the permit moves with every response
    /// future and body, and an in-process one has none).
    schedule: Option<Box<Schedule<ConcurrencyError>>>,
}

impl fmt::Debug for ConcurrencyPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConcurrencyPermit")
            .field("key", &self.slot.key())
            .field("schedule", &self.schedule)
            .finish()
    }
}

impl ConcurrencyPermit {
    #[cfg_attr(not(feature = "redis"), allow(unused_variables))]
    fn new(slot: PermitSlot, renewal: Renewal) -> Self {
        #[cfg(feature = "redis")]
        let schedule = slot.as_redis().map(|r| {
            Box::new(Schedule::new(
                r.valid_until,
                r.limiter.permit_ttl(),
                renewal,
            ))
        });
        #[cfg(not(feature = "redis"))]
        let schedule = None;
        Self { slot, schedule }
    }
}

/// Only a Redis permit can be lost: a renewal finds it gone, or its validity ends.
impl Watch for ConcurrencyPermit {
    fn lost_before_poll(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(schedule) = &self.schedule else {
            return false;
        };
        (schedule.is_renewing() || !schedule.is_valid())
            && (Watch::poll_lost(self, cx).is_ready()
                || self.schedule.as_ref().is_some_and(|s| !s.is_valid()))
    }

    fn poll_lost(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        #[cfg(feature = "redis")]
        if let (Some(schedule), Some(slot)) = (self.schedule.as_mut(), self.slot.as_redis()) {
            return schedule.poll_lost(
                cx,
                &slot.key,
                |_| {
                    let (limiter, key, token) =
                        (slot.limiter.clone(), slot.key.clone(), slot.token.clone());
                    Box::pin(async move { limiter.renew(&key, &token).await })
                },
                |_| {},
            );
        }
        let _ = cx;
        Poll::Pending
    }
}

impl Permit for ConcurrencyPermit {
    fn admit<B>(&mut self, _request: &mut Request<B>) {}

    /// A lost permit lets the request run on: the limit bounds load, it guards no work.
    fn abort_on_loss(&self) -> bool {
        false
    }

    fn lost_response(self) -> Response<Bytes> {
        unreachable!("a concurrency permit never aborts its request")
    }

    fn lost_error(self) -> BoxError {
        unreachable!("a concurrency permit never aborts its request")
    }

    fn on_response(&mut self, _head: &mut response::Parts) -> Hold {
        Hold::BodyEnd
    }

    fn release(self, _end: End) -> Release {
        let finishing = |release| Release::Pending(Releasing::finishing(release));
        self.slot.release().map_or(Release::Done, finishing)
    }
}
