//! The in-process store behind the lock domain's contract ([`LockBackend`]): every answer
//! at once, but waits.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::MemoryLocks;
use crate::backend::contract::{Answer, Claim, LockBackend, LockMode, LockResult, OneKey};
use crate::backend::inspect::LockInspection;
use crate::backend::settings::Settings;
#[cfg(feature = "idempotency")]
use crate::backend::{contract::Begun, records::NewRecord};
use crate::error::LockError;
use crate::future::{BoxFuture, boxed};
use crate::holder::{Holder, HolderRef};
use crate::lease::{Access, Lease};

impl LockBackend for MemoryLocks {
    fn settings(&self) -> &Settings {
        &self.inner.policy
    }

    fn id(&self) -> u64 {
        self.inner.id
    }

    fn in_process(&self) -> bool {
        true
    }

    fn attempt(&self, claim: Claim, started: Instant, holder: HolderRef<'_>) -> Answer<LockResult> {
        let OneKey { key, mode } = match claim {
            Claim::One(one) => one,
            Claim::Set(keys) => return Answer::Now(self.acquire_all(&keys, holder)),
        };
        Answer::Now(match mode {
            LockMode::Plain => self.acquire_from(key, started, holder),
            LockMode::Shared => self.acquire_access(key, Access::Shared, holder),
            LockMode::Exclusive => self.acquire_access(key, Access::Exclusive, holder),
            LockMode::Fair => self.acquire_fair(key, None, holder),
        })
    }

    fn wait(&self, one: OneKey, max_wait: Duration, holder: Holder) -> BoxFuture<LockResult> {
        let this = self.clone();
        let OneKey { key, mode } = one;
        boxed(|| async move {
            if mode == LockMode::Fair {
                this.lock_fair_key_within(key, max_wait, &holder).await
            } else {
                this.lock_within(key, mode.access(), max_wait, &holder)
                    .await
            }
        })
    }

    fn extend(&self, mut lease: Lease) -> Answer<LockResult> {
        Answer::Now(self.extend_lease(&mut lease).map(|()| lease))
    }

    fn unlock(&self, lease: Lease) -> Answer<Result<(), LockError>> {
        Answer::Now(self.release(&lease))
    }

    fn end(&self, lease: &Lease) -> Answer<()> {
        let _ = self.release(lease);
        Answer::Now(())
    }

    fn release_detached(&self, lease: &Lease) {
        let _ = self.release(lease);
    }

    fn retry_estimate(&self, key: &str, holder_left: Duration) -> Duration {
        self.state()
            .holds
            .retry_after(key, self.prefix(), holder_left)
    }

    fn inspect(&self, key: Arc<str>) -> Answer<Result<LockInspection, LockError>> {
        Answer::Now(Ok(self.inspect_key(&key)))
    }

    fn ready(&self) -> Answer<bool> {
        Answer::Now(true)
    }

    fn force_unlock(&self, key: Arc<str>) -> Answer<Result<usize, LockError>> {
        Answer::Now(Ok(self.force_unlock_key(&key)))
    }

    #[cfg(feature = "idempotency")]
    fn begin_idempotent(&self, key: Arc<str>, wait: Duration, holder: HolderRef<'_>) -> Begun {
        if wait.is_zero() {
            return Answer::Now(self.begin_idempotent_now(key, holder));
        }
        let this = self.clone();
        let holder = holder.to_holder();
        Answer::later(|| async move { this.begin_idempotent_within(key, wait, &holder).await })
    }

    #[cfg(feature = "idempotency")]
    fn finish_idempotent(&self, lease: Lease, record: Option<NewRecord>) -> Answer<()> {
        self.store_and_release(lease, record);
        Answer::Now(())
    }
}

/// Requests by resource name, for the in-process store's tests.
#[cfg(test)]
impl MemoryLocks {
    pub(crate) fn try_lock(&self, resource: &str) -> LockResult {
        let key = self.inner.policy.full_key(resource)?;
        self.acquire(key)
    }

    pub(crate) fn try_lock_all<'a, I>(&self, resources: I) -> LockResult
    where
        I: IntoIterator,
        I::Item: Into<std::borrow::Cow<'a, str>>,
    {
        let request = crate::lock::request::LockRequest::from(
            crate::lock::request::LockRequest::all(resources),
        );
        let (claim, _) = request.resolve(&self.inner.policy)?;
        match self.attempt(claim, Instant::now(), HolderRef::Direct) {
            Answer::Now(result) => result,
            Answer::Later(_) => unreachable!("the in-process store answers at once"),
        }
    }

    pub(crate) async fn take(&self, request: crate::lock::request::LockRequest<'_>) -> LockResult {
        let (claim, options) = request.resolve(&self.inner.policy)?;
        crate::lock::request::acquire(self, claim, options, Holder::default()).await
    }
}
