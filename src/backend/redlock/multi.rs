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
//! (braces in resource names are percent-encoded, so no hash tag joins them): on a cluster
//! node, each script runs once per slot, in slot order, all or none on the node (see
//! [`scripts::acquire_on`]; not atomic across its shards).

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
}
