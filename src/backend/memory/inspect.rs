//! [`Locks::inspect`](crate::Locks::inspect) and
//! [`Locks::force_unlock`](crate::Locks::force_unlock) in process.

use std::time::Instant;

use super::MemoryLocks;

impl MemoryLocks {
    /// [`Locks::inspect`](crate::Locks::inspect) for a full key.
    pub(crate) fn inspect_key(&self, key: &str) -> crate::backend::inspect::LockInspection {
        let now = Instant::now();
        let state = self.state();
        let entry = state.keys.get(key);
        let remaining = entry
            .and_then(|k| k.holder.as_ref())
            .and_then(|h| h.left(now));
        let modes = entry.and_then(|k| k.modes.as_deref());
        crate::backend::inspect::LockInspection {
            key: key.to_owned(),
            nodes_answered: 1,
            nodes_holding: usize::from(remaining.is_some()),
            quorum: 1,
            remaining,
            fencing_token: None,
            readers: modes.map_or(0, |m| m.live_readers(now)),
            waiters: modes.is_some_and(|m| m.has_waiters()) || self.inner.waiters.is_waited(key),
        }
    }

    /// [`Locks::force_unlock`](crate::Locks::force_unlock) for a full key: 1 when it was
    /// held.
    pub(crate) fn force_unlock_key(&self, key: &str) -> usize {
        let now = Instant::now();
        let mut state = self.state();
        let held = state
            .keys
            .get(key)
            .and_then(|k| k.holder.as_ref())
            .is_some_and(|h| h.expires_at > now);
        state.let_go(key);
        drop(state);
        self.inner.waiters.wake(key);
        usize::from(held)
    }
}
