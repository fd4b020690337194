//! The Redlock behind the lock domain's contract ([`LockBackend`]): each operation as a
//! future over the nodes, the holder's record made once per request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Redlock;
use crate::backend::contract::{Answer, Claim, LockBackend, LockMode, LockResult, OneKey};
use crate::backend::inspect::LockInspection;
use crate::backend::settings::Settings;
#[cfg(feature = "idempotency")]
use crate::backend::{contract::Begun, records::NewRecord};
use crate::error::LockError;
use crate::future::{BoxFuture, boxed};
use crate::holder::{Holder, HolderRef};
use crate::lease::Lease;

impl LockBackend for Redlock {
    fn settings(&self) -> &Settings {
        &self.inner.policy
    }

    fn id(&self) -> u64 {
        self.inner.id
    }

    fn redlock(&self) -> Option<&Redlock> {
        Some(self)
    }

    fn attempt(
        &self,
        claim: Claim,
        _started: Instant,
        holder: HolderRef<'_>,
    ) -> Answer<LockResult> {
        // Sent with every attempt: the script that sets the lock records it beside.
        let holder = self.holder_record(holder);
        let this = self.clone();
        match claim {
            Claim::One(OneKey {
                key,
                mode: LockMode::Plain,
            }) => Answer::later(|| async move { this.acquire(key, false, holder).await }),
            Claim::Set(keys) => {
                Answer::later(|| async move { this.acquire_all(keys, holder).await })
            }
            Claim::One(one) => Answer::Later(self.wait_as(one, Duration::ZERO, holder)),
        }
    }

    fn wait(&self, one: OneKey, max_wait: Duration, holder: Holder) -> BoxFuture<LockResult> {
        let holder = self.holder_record(HolderRef::Known(&holder));
        self.wait_as(one, max_wait, holder)
    }

    fn extend(&self, mut lease: Lease) -> Answer<LockResult> {
        let this = self.clone();
        Answer::later(|| async move { this.extend_lease(&mut lease).await.map(|()| lease) })
    }

    fn unlock(&self, lease: Lease) -> Answer<Result<(), LockError>> {
        let this = self.clone();
        Answer::later(|| async move { this.release(lease).await })
    }

    fn end(&self, lease: &Lease) -> Answer<()> {
        let mut guard = ReleaseOnDrop(Some((self.clone(), lease.clone())));
        finish_on_drop(boxed(|| async move {
            if let Some((redlock, lease)) = guard.0.clone()
                && let Err(e) = redlock.release(lease).await
            {
                tracing::debug!(error = %e, "lease release");
            }
            guard.0.take();
        }))
    }

    fn release_detached(&self, lease: &Lease) {
        self.release_lease_detached(lease);
    }

    fn retry_estimate(&self, key: &str, holder_left: Duration) -> Duration {
        self.inner
            .local
            .retry_after(key, self.prefix(), holder_left)
    }

    fn inspect(&self, key: Arc<str>) -> Answer<Result<LockInspection, LockError>> {
        let this = self.clone();
        Answer::later(|| async move { this.inspect_key(&key).await })
    }

    fn ready(&self) -> Answer<bool> {
        let this = self.clone();
        Answer::later(|| async move { this.ready().await })
    }

    fn force_unlock(&self, key: Arc<str>) -> Answer<Result<usize, LockError>> {
        let this = self.clone();
        Answer::later(|| async move { this.force_unlock_key(&key).await })
    }

    #[cfg(feature = "idempotency")]
    fn begin_idempotent(&self, key: Arc<str>, wait: Duration, holder: HolderRef<'_>) -> Begun {
        let this = self.clone();
        let holder = self.holder_record(holder);
        Answer::later(|| async move { this.find_or_acquire(key, wait, holder).await })
    }

    #[cfg(feature = "idempotency")]
    fn finish_idempotent(&self, lease: Lease, record: Option<NewRecord>) -> Answer<()> {
        let Some(record) = record else {
            return self.end(&lease);
        };
        let mut guard = ReleaseOnDrop(Some((self.clone(), lease.clone())));
        finish_on_drop(boxed(|| async move {
            if let Some((redlock, lease)) = guard.0.clone()
                && let Err(e) = redlock
                    .store_and_release(lease, record.raw, record.ttl)
                    .await
            {
                tracing::warn!(error = %e, "the idempotency record was not stored on a quorum; a retry may run again");
            }
            guard.0.take();
        }))
    }
}

/// A lease's release, for the caller to finish in the background should it drop the
/// future before it is done (see [`LockBackend::end`]).
fn finish_on_drop(release: BoxFuture<()>) -> Answer<()> {
    Answer::Later(release)
}

/// Releases the lease in the background when dropped still holding it: a release that
/// could not finish (dropped with no runtime to finish it on).
struct ReleaseOnDrop(Option<(Redlock, Lease)>);

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if let Some((redlock, lease)) = self.0.take() {
            redlock.release_lease_detached(&lease);
        }
    }
}

impl Redlock {
    /// The record of `holder` on this replica, sent with its attempts.
    pub(crate) fn holder_record(&self, holder: HolderRef<'_>) -> Arc<str> {
        match holder {
            HolderRef::Direct => self.inner.direct_holder.clone(),
            holder => holder.encode_after(&self.inner.direct_holder),
        }
    }

    /// [`LockBackend::wait`] with the holder's record made.
    fn wait_as(&self, one: OneKey, max_wait: Duration, holder: Arc<str>) -> BoxFuture<LockResult> {
        let this = self.clone();
        let OneKey { key, mode } = one;
        boxed(|| async move {
            match (mode, mode.access()) {
                (LockMode::Fair, _) => this.lock_fair_key_within(key, max_wait, holder).await,
                (_, Some(access)) => {
                    let attempt =
                        |waiting| this.acquire_access(key.clone(), access, waiting, holder.clone());
                    this.wait_with(key.clone(), max_wait, attempt).await
                }
                (_, None) => this.lock_key_within(key, max_wait, holder).await,
            }
        })
    }
}
