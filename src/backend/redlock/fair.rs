//! Fair waiting over the Redlock nodes: the waiters of one key, across all clients,
//! acquire in arrival order.
//!
//! Each node keeps, in the lock key `K`'s slot:
//! - `<prefix>{K}:queue`, waiter ids scored by arrival (µs since the Unix epoch, stamped
//!   once by the waiter: every node orders them alike);
//! - `<prefix>{K}:queue-deadlines`, the same ids scored by their entry's deadline (ms on
//!   the node's clock): an entry lives as the waiters' mark, renewed by each attempt, never
//!   past the waiter's `max_wait`. Attempts prune expired entries, so a crashed waiter
//!   drops out; one that gives up removes its entry at once and wakes the next.
//!
//! Only the head of the queue (or anyone, when it is empty) may take the lock, with the
//! plain lock's `SET NX`, quorum and validity rules, woken by its release notifications.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::Redlock;
use super::acquire::{Acquisition, CleanUp, Fence};
use super::keys::{Auxiliary, Beside, Keys};
use super::scripts::{Attempted, evalsha, run, run_attempt};
use crate::backend::connection::Connection;
use crate::backend::lua::{FAIR_ACQUIRE, FAIR_LEAVE};
use crate::backend::notify::released;
use crate::error::{LockError, NodeFailureReason};
use crate::lease::{Lease, Token};

/// How long a waiter that is not the head sleeps, at most, when the lock is free.
const TURN: Duration = Duration::from_millis(100);

/// One waiter of a fair wait.
#[derive(Clone, Copy)]
struct Waiter {
    id: Token,
    /// µs since the Unix epoch, stamped once.
    arrival_us: u64,
    /// When the wait ends.
    deadline: Option<Instant>,
}

#[derive(Clone, Copy)]
struct FairAttempt {
    waiter: Waiter,
    token: Token,
    ttl_ms: u64,
    mark_ms: u64,
    entry_ms: u64,
    fenced: bool,
}

/// A fair attempt on one node; it records `holder` beside the lock when it takes it.
async fn attempt(
    mut conn: Connection,
    prefix: Arc<str>,
    key: Arc<str>,
    a: FairAttempt,
    holder: Arc<str>,
) -> Result<Attempted, NodeFailureReason> {
    let mut cmd = evalsha(&FAIR_ACQUIRE, 6);
    cmd.arg(&*key)
        .arg(Auxiliary::of(Beside::Queue, &prefix, &key))
        .arg(Auxiliary::of(Beside::QueueDeadlines, &prefix, &key))
        .arg(Auxiliary::of(Beside::Waiters, &prefix, &key))
        .arg(Auxiliary::of(Beside::Fence, &prefix, &key))
        .arg(Auxiliary::of(Beside::Holder, &prefix, &key))
        .arg(a.waiter.id.as_bytes())
        .arg(a.token.as_bytes())
        .arg(a.ttl_ms)
        .arg(a.mark_ms)
        .arg(a.waiter.arrival_us)
        .arg(a.entry_ms)
        .arg(if a.fenced { "1" } else { "0" })
        .arg(&*holder);
    let keys = std::slice::from_ref(&key);
    run_attempt(&mut conn, &FAIR_ACQUIRE, &cmd, &prefix, keys).await
}

async fn leave(
    mut conn: Connection,
    prefix: Arc<str>,
    key: Arc<str>,
    id: Token,
) -> Result<(), NodeFailureReason> {
    let mut cmd = evalsha(&FAIR_LEAVE, 2);
    cmd.arg(Auxiliary::of(Beside::Queue, &prefix, &key))
        .arg(Auxiliary::of(Beside::QueueDeadlines, &prefix, &key))
        .arg(id.as_bytes())
        .arg(released(&prefix, &key));
    let _: i64 = run(&mut conn, &FAIR_LEAVE, &cmd).await?;
    Ok(())
}

/// Takes the waiter out of the queue on every node when dropped, in the background.
struct LeaveOnDrop {
    redlock: Redlock,
    key: Arc<str>,
    id: Token,
    /// Whether an entry may be left anywhere.
    armed: bool,
}

impl Drop for LeaveOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (redlock, key, id) = (self.redlock.clone(), self.key.clone(), self.id);
        handle.spawn(async move {
            let prefix = &redlock.inner.policy.prefix;
            redlock
                .on_every_node(|conn| leave(conn, prefix.clone(), key.clone(), id))
                .await;
        });
    }
}

impl Redlock {
    /// A fair wait on a prefixed key, up to `max_wait` (zero: one attempt, granted only
    /// when nobody waits); the lease records `holder`.
    pub(crate) async fn lock_fair_key_within(
        &self,
        key: Arc<str>,
        max_wait: Duration,
        holder: Arc<str>,
    ) -> Result<Lease, LockError> {
        let arrival_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        let waiter = Waiter {
            id: Token::random(),
            arrival_us,
            deadline: Instant::now().checked_add(max_wait),
        };
        let queued = !max_wait.is_zero();
        let mut left = LeaveOnDrop {
            redlock: self.clone(),
            key: key.clone(),
            id: waiter.id,
            armed: queued,
        };
        let everywhere = AtomicBool::new(false);
        let result = self
            .wait_with(key.clone(), max_wait, |waiting| {
                let (key, holder) = (key.clone(), holder.clone());
                let everywhere = &everywhere;
                async move {
                    let attempt = self.acquire_fair(key, waiter, queued, waiting, holder);
                    let (lease, all) = attempt.await?;
                    everywhere.store(all, Ordering::Relaxed);
                    Ok(lease)
                }
            })
            .await;
        // Acquired on every node: the entry is gone everywhere.
        if result.is_ok() && everywhere.load(Ordering::Relaxed) {
            left.armed = false;
        }
        result
    }

    /// One fair attempt of `waiter` (`queued` in the queue, `waiting` to be woken): the
    /// lease, recording `holder`, and whether every node granted it.
    async fn acquire_fair(
        &self,
        key: Arc<str>,
        waiter: Waiter,
        queued: bool,
        waiting: bool,
        holder: Arc<str>,
    ) -> Result<(Lease, bool), LockError> {
        let mut acquisition = Acquisition::new(self, Keys::Lock(key.clone()));
        let (token, start) = (acquisition.token, acquisition.start);
        let entry_ms = if queued {
            let left = waiter
                .deadline
                .map_or(Duration::MAX, |d| d.saturating_duration_since(start));
            super::builder::millis(left).clamp(1, self.inner.mark_ms)
        } else {
            0
        };
        let a = FairAttempt {
            waiter,
            token,
            ttl_ms: self.inner.policy.ttl_ms(),
            mark_ms: if waiting { self.inner.mark_ms } else { 0 },
            entry_ms,
            fenced: self.inner.fence_ms.is_some(),
        };
        let round = acquisition
            .round(
                |conn| {
                    let prefix = self.inner.policy.prefix.clone();
                    attempt(conn, prefix, key.clone(), a, holder.clone())
                },
                CleanUp::Awaited,
                Some(TURN),
            )
            .await?;
        let everywhere = round
            .answers
            .iter()
            .all(|a| matches!(a, Some(Ok(Attempted::Set(_)))));
        let fence = Fence::in_rounds(self.inner.fence_ms);
        let lease = acquisition.won(&round, fence).await?;
        Ok((lease, everywhere))
    }
}
