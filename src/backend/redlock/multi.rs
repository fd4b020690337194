//! Leases on several keys at once (Redisson's `MultiLock`, done the Redlock way): each
//! node checks and sets every key of the set in one Lua script, all or none, so one round
//! decides the set, with one quorum verdict and one validity for it.
//!
//! Per node, the script first looks at every key (`PTTL`); if any is held, it sets
//! nothing and answers the longest remaining TTL among the holders; else it sets every key
//! to our token with the TTL. Since a script runs atomically on its node, two clients that
//! name the same keys in opposite orders cannot each take a part on one node and wait for
//! the rest: there is no partial state to wait on, so no deadlock. Across nodes, the
//! quorum decides as for one key, and an attempt that falls short releases its keys
//! everywhere, as for one key.
//!
//! Extension and release are one script per node too: the set is extended only where
//! every key still holds our token, and released key by key where it does (another
//! holder's key is never touched).
//!
//! Keys on one plain Redis node need no common hash slot. A Redis Cluster refuses a script
//! over keys of several slots (`CROSSSLOT`), and the keys of a set hash to different slots
//! (braces in resource names are percent-encoded, so no hash tag joins them): sets are for
//! independent nodes.

pub(super) mod scripts;

use std::sync::Arc;

use super::Redlock;
use super::acquire::{Acquisition, CleanUp};
use super::keys::Keys;
use super::round::Stragglers;
use super::scripts::Release;
use super::tally::Verdict;
use crate::error::LockError;
use crate::lease::{Lease, Token};
use scripts::acquire_on;

impl Redlock {
    /// One acquisition attempt on every resource in `resources` at once (each stored as
    /// `{prefix}{resource}`): the set is acquired, with one token, one validity and one
    /// quorum verdict, or none of it is held. One round trip per node, whatever the
    /// number of keys: every node checks and sets all of them in one Lua script.
    ///
    /// The order of `resources` does not matter and duplicates count once: two callers
    /// that name the same keys in opposite orders never deadlock, one of them gets the
    /// set and the other is told it is taken. A single distinct resource is the same as
    /// [`try_lock`](Self::try_lock). [`extend`](Self::extend), [`unlock`](Self::unlock)
    /// and the layers' renewals act on every key of the lease, each in one script per
    /// node.
    ///
    /// With [`fencing_tokens(true)`](crate::RedlockBuilder::fencing_tokens), the lease has
    /// one fencing token for the set: greater than every earlier token of each of its
    /// keys, and written back to each key's counter.
    ///
    /// On independent plain nodes any keys go together. A Redis Cluster node refuses the
    /// set's script (its keys hash to several slots: `CROSSSLOT`, reported as a node
    /// failure), so take sets on independent nodes.
    ///
    /// # Errors
    ///
    /// As [`try_lock`](Self::try_lock): [`LockError::Taken`] when any key is held by
    /// another holder, with `retry_after` from the longest holder of the set on each
    /// node; [`LockError::NoQuorum`]; [`LockError::TooSlow`]; [`LockError::InvalidKey`]
    /// for an invalid resource, or for none or more than
    /// [`MAX_KEYS_PER_LEASE`](crate::key::MAX_KEYS_PER_LEASE) distinct ones.
    pub async fn try_lock_all<I>(&self, resources: I) -> Result<Lease, LockError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let keys = self.inner.policy.key_set(resources)?;
        self.acquire_all(keys.into()).await
    }

    /// Like [`try_lock_all`](Self::try_lock_all), retrying up to the retry count after a
    /// random delay when any key is taken or no quorum answered.
    ///
    /// # Errors
    ///
    /// The error of the last attempt, as [`try_lock_all`](Self::try_lock_all).
    pub async fn lock_all<I>(&self, resources: I) -> Result<Lease, LockError>
    where
        I: IntoIterator,
        I::Item: AsRef<str>,
    {
        let keys: Arc<[Arc<str>]> = self.inner.policy.key_set(resources)?.into();
        self.inner
            .policy
            .with_retries(|| self.acquire_all(keys.clone()))
            .await
    }

    /// One attempt on the sorted, distinct `keys`.
    pub(crate) async fn acquire_all(&self, keys: Arc<[Arc<str>]>) -> Result<Lease, LockError> {
        if let [key] = &keys[..] {
            return self.acquire(key.clone(), false).await;
        }
        let mut acquisition = Acquisition::new(self, Keys::Set(keys.clone()));
        let token = acquisition.token;
        let ttl_ms = self.inner.policy.ttl_ms();
        let fenced = self.inner.fence_ms.is_some();
        // The nodes that refused set nothing; the others (and those not heard from) are
        // released in the background, so the answer costs one round.
        let round = acquisition
            .round(
                |conn| acquire_on(conn, keys.clone(), token, ttl_ms, fenced),
                CleanUp::Background,
                None,
            )
            .await?;
        acquisition.won(&round, self.inner.fence_ms).await
    }

    /// [`unlock`](Self::unlock) for a lease on several keys.
    pub(super) async fn unlock_all(
        &self,
        keys: Arc<[Arc<str>]>,
        token: Token,
    ) -> Result<(), LockError> {
        let round = self
            .release_keys(
                Keys::Set(keys),
                token,
                true,
                super::deleted,
                Stragglers::Finish,
            )
            .await;
        match round.verdict {
            Verdict::Won => Ok(()),
            Verdict::Lost => Err(LockError::Expired {
                taken_over: round.values().any(|r| matches!(r, Release::HeldByOther)),
            }),
            Verdict::NoQuorum => Err(self.no_quorum(round)),
        }
    }

    /// Releases a set in the background (see
    /// [`release_detached`](Self::release_detached)).
    pub(crate) fn release_all_detached(&self, keys: Arc<[Arc<str>]>, token: Token, publish: bool) {
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                let redlock = self.clone();
                handle.spawn(async move {
                    redlock
                        .release_keys(
                            Keys::Set(keys),
                            token,
                            publish,
                            super::deleted,
                            Stragglers::Await,
                        )
                        .await;
                });
            }
            Err(_) => tracing::warn!(
                key = &*keys[0],
                keys = keys.len(),
                "no Tokio runtime to release the locks on; they expire by their TTL"
            ),
        }
    }
}
