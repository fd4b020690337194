//! Shared and exclusive access, and fair waiting, in process: the models of the Redis
//! scripts (`redlock/shared.rs`, `redlock/fair.rs`), with the semantics of tokio's
//! `RwLock` (writer-preferring: no new reader while a writer waits) and a FIFO queue of
//! waiters per key.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{MemoryLocks, Table};
use crate::backend::KeyMap;
use crate::backend::contract::{LockBackend as _, LockResult};
use crate::backend::wait::bounded_wait;
use crate::error::LockError;
use crate::holder::{Holder, HolderRef};
use crate::lease::{Access, Lease, Shape, Token, readers_key};

/// How long a waiter that is not the head sleeps, at most, when the lock is free.
pub(super) const TURN: Duration = Duration::from_millis(100);

/// A key's readers, waiting writers and fair queue ([`KeyState::modes`]).
#[derive(Default)]
pub(super) struct KeyModes {
    /// The readers' tokens and their expiry.
    pub(super) readers: KeyMap<Token, Instant>,
    /// Exclusive requests waiting: no new reader meanwhile.
    pub(super) writers_waiting: usize,
    /// Fair waiters in arrival order, with their deadlines.
    pub(super) queue: VecDeque<(Token, Option<Instant>)>,
}

impl KeyModes {
    fn prune(&mut self, now: Instant) {
        self.readers.retain(|_, expires_at| *expires_at > now);
        self.queue
            .retain(|(_, deadline)| deadline.is_none_or(|d| d > now));
    }

    fn is_empty(&self) -> bool {
        self.readers.is_empty() && self.writers_waiting == 0 && self.queue.is_empty()
    }

    /// The readers whose lease has not run out at `now`.
    pub(super) fn live_readers(&self, now: Instant) -> u64 {
        self.readers.values().filter(|at| **at > now).count() as u64
    }

    /// Whether a writer or a fair waiter waits.
    pub(super) fn has_waiters(&self) -> bool {
        self.writers_waiting > 0 || !self.queue.is_empty()
    }

    /// How long the last reader still holds at `now`, if any does.
    pub(super) fn last_reader(&self, now: Instant) -> Option<Duration> {
        let last = self.readers.values().max().copied()?;
        (last > now).then(|| last - now)
    }
}

/// Prunes a key's modes at `now`, and drops them when nothing is left in them.
pub(super) fn prune(modes: &mut Option<Box<KeyModes>>, now: Instant) {
    if let Some(entry) = modes {
        entry.prune(now);
        if entry.is_empty() {
            *modes = None;
        }
    }
}

impl Table {
    /// Runs `f` on the modes of `key`, pruned at `now`; drops them, and the key, when
    /// nothing is left.
    pub(super) fn modes<R>(
        &mut self,
        key: &Arc<str>,
        now: Instant,
        f: impl FnOnce(&mut KeyModes) -> R,
    ) -> R {
        let state = self.keys.entry(key.clone()).or_default();
        let modes = state.modes.get_or_insert_default();
        modes.prune(now);
        let result = f(modes);
        if modes.is_empty() {
            state.modes = None;
            if state.holder.is_none() {
                self.keys.remove(key);
            }
        }
        result
    }
}

impl MemoryLocks {
    /// One attempt at shared or exclusive access, at once; a writer's lease records
    /// `holder` (a reader's none).
    pub(crate) fn acquire_access(
        &self,
        key: Arc<str>,
        access: Access,
        holder: HolderRef<'_>,
    ) -> LockResult {
        let now = Instant::now();
        let ttl = self.inner.policy.ttl;
        let mut state = self.state();
        match access {
            Access::Shared => {
                if let Some(retry_after) = state.held_for(&key, now) {
                    return Err(LockError::Taken { retry_after });
                }
                let token = Token::unique();
                state.modes(&key, now, |entry| {
                    if entry.writers_waiting > 0 {
                        let last = entry.last_reader(now).unwrap_or(ttl);
                        return Err(LockError::Taken { retry_after: last });
                    }
                    entry.readers.insert(token, now + ttl);
                    Ok(())
                })?;
                Ok(Lease {
                    key: readers_key(self.prefix(), &key),
                    shape: Shape::Reader { lock: key.clone() },
                    token,
                    ttl,
                    valid_until: now + ttl,
                    fencing_token: None,
                    backend: self.inner.id,
                    reentered: false,
                })
            }
            Access::Exclusive => {
                let modes = state.keys.get(&key).and_then(|k| k.modes.as_deref());
                if let Some(retry_after) = modes.and_then(|m| m.last_reader(now)) {
                    return Err(LockError::Taken { retry_after });
                }
                self.acquire_in(&mut state, key, Instant::now(), holder)
            }
        }
    }

    /// Waits up to `max_wait` for `key` (zero: one attempt), woken by its releases: a
    /// plain lock when `access` is `None`, else shared or exclusive over readers (a
    /// writer waiting keeps new readers out). The lease records `holder`.
    pub(crate) async fn lock_within(
        &self,
        key: Arc<str>,
        access: Option<Access>,
        max_wait: Duration,
        holder: &Holder,
    ) -> LockResult {
        let attempt = || {
            let holder = HolderRef::Known(holder);
            std::future::ready(match access {
                None => self.acquire_from(key.clone(), Instant::now(), holder),
                Some(access) => self.acquire_access(key.clone(), access, holder),
            })
        };
        match attempt().await {
            Err(LockError::Taken { .. }) if !max_wait.is_zero() => {}
            first => return first,
        }
        let _intent = (access == Some(Access::Exclusive)).then(|| WriterIntent::new(self, &key));
        bounded_wait(&self.inner.waiters, &key, max_wait, attempt, async {}).await
    }

    pub(super) fn extend_shared(&self, lease: &mut Lease) -> Result<(), LockError> {
        let Shape::Reader { lock: lock_key } = &lease.shape else {
            return Err(LockError::Expired { taken_over: false });
        };
        let now = Instant::now();
        let mut state = self.state();
        let modes = state
            .keys
            .get_mut(lock_key)
            .and_then(|k| k.modes.as_deref_mut());
        match modes.and_then(|e| e.readers.get_mut(&lease.token)) {
            Some(expires_at) if *expires_at > now => {
                *expires_at = now + self.inner.policy.ttl;
                lease.valid_until = *expires_at;
                Ok(())
            }
            _ => Err(LockError::Expired { taken_over: false }),
        }
    }

    pub(super) fn unlock_shared(&self, lease: &Lease) -> Result<(), LockError> {
        let Shape::Reader { lock: lock_key } = &lease.shape else {
            return Err(LockError::Expired { taken_over: false });
        };
        let now = Instant::now();
        let mut state = self.state();
        let (expires_at, last) = state.modes(lock_key, now, |entry| {
            (entry.readers.remove(&lease.token), entry.readers.is_empty())
        });
        drop(state);
        if last {
            self.inner.waiters.wake(lock_key);
        }
        match expires_at {
            Some(at) if at > now => Ok(()),
            _ => Err(LockError::Expired { taken_over: false }),
        }
    }

    /// One fair attempt: only the head of the queue, or anyone when it is empty.
    pub(super) fn acquire_fair(
        &self,
        key: Arc<str>,
        id: Option<Token>,
        holder: HolderRef<'_>,
    ) -> LockResult {
        let now = Instant::now();
        let mut state = self.state();
        let turn = state.modes(&key, now, |entry| match entry.queue.front() {
            None => true,
            Some((head, _)) => Some(*head) == id,
        });
        if !turn {
            let retry_after = state.held_for(&key, now).unwrap_or(TURN);
            return Err(LockError::Taken { retry_after });
        }
        let lease = self.acquire_in(&mut state, key.clone(), Instant::now(), holder)?;
        if id.is_some() {
            state.modes(&key, now, |entry| {
                entry.queue.pop_front();
            });
        }
        Ok(lease)
    }

    /// A fair (first come, first served) acquisition of a prefixed key, waiting up to
    /// `max_wait`; the lease records `holder`.
    pub(crate) async fn lock_fair_key_within(
        &self,
        key: Arc<str>,
        max_wait: Duration,
        holder: &Holder,
    ) -> LockResult {
        let holder_ref = HolderRef::Known(holder);
        if max_wait.is_zero() {
            return self.acquire_fair(key, None, holder_ref);
        }
        let id = Token::unique();
        let now = Instant::now();
        let deadline = now.checked_add(max_wait);
        self.state()
            .modes(&key, now, |entry| entry.queue.push_back((id, deadline)));
        let _leave = LeaveQueue {
            locks: self,
            key: &key,
            id,
        };
        let attempt = || std::future::ready(self.acquire_fair(key.clone(), Some(id), holder_ref));
        bounded_wait(&self.inner.waiters, &key, max_wait, attempt, async {}).await
    }

    /// Whether `resource` has readers, writers waiting or queued waiters (for tests).
    #[cfg(test)]
    fn has_modes(&self, resource: &str) -> bool {
        let key = self.inner.policy.full_key(resource).unwrap();
        self.state()
            .keys
            .get(&key)
            .is_some_and(|k| k.modes.is_some())
    }
}

/// A waiting writer: keeps new readers out until dropped.
struct WriterIntent<'a> {
    locks: &'a MemoryLocks,
    key: &'a Arc<str>,
}

impl<'a> WriterIntent<'a> {
    fn new(locks: &'a MemoryLocks, key: &'a Arc<str>) -> Self {
        locks
            .state()
            .modes(key, Instant::now(), |entry| entry.writers_waiting += 1);
        Self { locks, key }
    }
}

impl Drop for WriterIntent<'_> {
    fn drop(&mut self) {
        let none_left = self.locks.state().modes(self.key, Instant::now(), |entry| {
            entry.writers_waiting = entry.writers_waiting.saturating_sub(1);
            entry.writers_waiting == 0
        });
        if none_left {
            // Readers held back by the intent may go now.
            self.locks.inner.waiters.wake(self.key);
        }
    }
}

/// A fair waiter's place; given up when dropped (acquired, timed out, or cancelled).
struct LeaveQueue<'a> {
    locks: &'a MemoryLocks,
    key: &'a Arc<str>,
    id: Token,
}

impl Drop for LeaveQueue<'_> {
    fn drop(&mut self) {
        let next = self.locks.state().modes(self.key, Instant::now(), |entry| {
            let was_head = entry
                .queue
                .front()
                .is_some_and(|(head, _)| *head == self.id);
            entry.queue.retain(|(id, _)| *id != self.id);
            was_head && !entry.queue.is_empty()
        });
        if next {
            self.locks.inner.waiters.wake(self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::contract::LockMode;
    use crate::lock::request::LockRequest;

    const ONCE: Duration = Duration::ZERO;
    const LONG: Duration = Duration::from_secs(10);

    fn read(key: &str, wait: Duration) -> LockRequest<'_> {
        LockRequest::new(key).mode(LockMode::Shared).wait(wait)
    }

    fn write(key: &str, wait: Duration) -> LockRequest<'_> {
        LockRequest::new(key).mode(LockMode::Exclusive).wait(wait)
    }

    fn fair(key: &str, wait: Duration) -> LockRequest<'_> {
        LockRequest::new(key).mode(LockMode::Fair).wait(wait)
    }

    /// Polls, every 10 ms for up to 5 s, whether the modes of some key satisfy `check`.
    async fn until(locks: &MemoryLocks, check: impl Fn(&KeyModes) -> bool) -> bool {
        for _ in 0..500 {
            let found = {
                let state = locks.state();
                state
                    .keys
                    .values()
                    .any(|k| k.modes.as_deref().is_some_and(&check))
            };
            if found {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    fn locks(ttl: Duration) -> MemoryLocks {
        MemoryLocks::builder().ttl(ttl).build().unwrap()
    }

    fn is_taken(result: LockResult) -> bool {
        matches!(result, Err(LockError::Taken { .. }))
    }

    #[tokio::test]
    async fn readers_share_and_a_writer_waits_for_them() {
        let locks = locks(LONG);
        let a = locks.take(read("doc", ONCE)).await.unwrap();
        let b = locks.take(read("doc", ONCE)).await.unwrap();
        assert!(a.is_shared() && b.is_shared());
        assert!(is_taken(locks.take(write("doc", ONCE)).await));
        locks.release(&a).unwrap();
        locks.release(&b).unwrap();
        let w = locks.take(write("doc", ONCE)).await.unwrap();
        assert!(!w.is_shared());
        assert!(is_taken(locks.take(read("doc", ONCE)).await));
        locks.release(&w).unwrap();
        assert!(!locks.has_modes("doc"), "nothing left behind");
    }

    #[tokio::test]
    async fn a_waiting_writer_keeps_new_readers_out() {
        let locks = locks(LONG);
        let reader = locks.take(read("doc", ONCE)).await.unwrap();
        let writer = tokio::spawn({
            let locks = locks.clone();
            async move { locks.take(write("doc", LONG)).await }
        });
        assert!(until(&locks, |e| e.writers_waiting > 0).await);
        assert!(is_taken(locks.take(read("doc", ONCE)).await));
        locks.release(&reader).unwrap();
        let lease = writer.await.unwrap().unwrap();
        locks.release(&lease).unwrap();
        assert!(locks.take(read("doc", ONCE)).await.is_ok());
    }

    #[tokio::test]
    async fn shared_leases_extend_and_expire() {
        let locks = locks(Duration::from_millis(50));
        let mut lease = locks.take(read("doc", ONCE)).await.unwrap();
        locks.extend_lease(&mut lease).unwrap();
        // The writer waits out the reader's TTL.
        let w = locks
            .take(write("doc", Duration::from_secs(5)))
            .await
            .unwrap();
        assert!(matches!(
            locks.extend_lease(&mut lease),
            Err(LockError::Expired { taken_over: false })
        ));
        assert!(locks.release(&lease).is_err());
        locks.release(&w).unwrap();
    }

    #[tokio::test]
    async fn fair_waiters_acquire_in_arrival_order_and_leave_when_dropped() {
        let locks = locks(LONG);
        let holder = locks.try_lock("q").unwrap();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for i in 0..4 {
            let (waiter, order) = (locks.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                let lease = waiter.take(fair("q", LONG)).await.unwrap();
                order.lock().unwrap().push(i);
                waiter.release(&lease).unwrap();
            }));
            // Each joins the queue before the next starts.
            assert!(until(&locks, |e| e.queue.len() == i + 1).await);
        }
        // A newcomer does not jump the queue, and leaves it when it gives up.
        assert!(locks.take(fair("q", ONCE)).await.is_err());
        locks.release(&holder).unwrap();
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), vec![0, 1, 2, 3]);
        assert!(!locks.has_modes("q"));
    }
}
