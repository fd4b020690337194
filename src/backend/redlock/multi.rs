//! Leases on several keys at once (Redisson's `MultiLock`, done the Redlock way): each
//! node checks and sets every key of the set in one Lua script, all or none, so one round
//! decides the set, with one quorum verdict and one validity.
//!
//! The script sets nothing while any key is held (answering the longest remaining TTL), so
//! two clients naming the same keys in opposite orders cannot each hold a part on a node
//! and wait for the rest: no deadlock. Extension acts only where every key holds our token;
//! release deletes key by key where they do.
//!
//! A Redis Cluster refuses a script over keys of several slots (`CROSSSLOT`), and a set's
//! keys hash to different slots: on a cluster node each script runs once per slot, in slot
//! order, all or none on the node though not atomically across its shards
//! ([`scripts::acquire_on`]).

pub(super) mod scripts;

use std::sync::Arc;

use super::Redlock;
use super::acquire::{Acquisition, CleanUp};
use super::keys::Keys;
use crate::error::LockError;
use crate::lease::Lease;
use scripts::acquire_on;

impl Redlock {
    /// One attempt on the sorted, distinct `keys`.
    pub(crate) async fn acquire_all(&self, keys: Arc<[Arc<str>]>) -> Result<Lease, LockError> {
        if let [key] = &keys[..] {
            return self.acquire(key.clone(), false).await;
        }
        let mut acquisition = Acquisition::new(self, Keys::Set(keys.clone()));
        let token = acquisition.token;
        let ttl_ms = self.inner.policy.ttl_ms();
        let fenced = self.inner.fence_ms.is_some();
        let round = acquisition
            .round(
                |conn| acquire_on(conn, keys.clone(), token, ttl_ms, fenced),
                CleanUp::Background,
                None,
            )
            .await?;
        acquisition.won(&round, self.inner.fence_ms).await
    }
}
