//! Shared and exclusive access to one key (a readers-writer lock) over the Redlock nodes.
//!
//! Beside the lock key `K` (the exclusive holder), each node keeps, in `K`'s slot:
//! - `<prefix>{K}:readers`, the readers' tokens scored by their expiry (ms on the node's
//!   clock): every script prunes the expired ones, and the set expires with its last
//!   reader;
//! - `<prefix>{K}:writer-waiting`, the intent of a waiting writer that found readers
//!   (living as the waiters' mark, renewed by its attempts): no new reader is admitted
//!   meanwhile, so readers cannot starve a writer.
//!
//! A reader is admitted where `K` is free and no writer waits; a writer where `K` is free
//! and no reader is left. Both follow the plain lock's quorum and validity rules; the last
//! reader's release wakes the waiters that marked `K`.

use std::sync::Arc;

use super::Redlock;
use super::acquire::{Acquisition, CleanUp, Fence};
use super::keys::{Auxiliary, Beside, Keys};
use super::scripts::{Attempt, Attempted, ReleaseReply, evalsha, run, run_acked, run_attempt};
use crate::backend::connection::Connection;
use crate::backend::lua::{EXCLUSIVE_ACQUIRE, SHARED_ACQUIRE, SHARED_EXTEND, SHARED_RELEASE};
use crate::backend::notify::released;
use crate::error::{LockError, NodeFailureReason};
use crate::lease::{Access, Lease, Token, readers_key};

/// A reader's or a writer's attempt on one node; a writer that takes the lock records
/// `holder` beside it.
async fn attempt(
    mut conn: Connection,
    prefix: Arc<str>,
    key: Arc<str>,
    token: Token,
    access: Access,
    a: Attempt,
    holder: Arc<str>,
) -> Result<Attempted, NodeFailureReason> {
    let (script, numkeys) = match access {
        Access::Shared => (&*SHARED_ACQUIRE, 4),
        Access::Exclusive => (&*EXCLUSIVE_ACQUIRE, 6),
    };
    let mut cmd = evalsha(script, numkeys);
    cmd.arg(Auxiliary::of(Beside::Readers, &prefix, &key))
        .arg(&*key)
        .arg(Auxiliary::of(Beside::WriterWaiting, &prefix, &key))
        .arg(Auxiliary::of(Beside::Waiters, &prefix, &key));
    if access == Access::Exclusive {
        cmd.arg(Auxiliary::of(Beside::Fence, &prefix, &key))
            .arg(Auxiliary::of(Beside::Holder, &prefix, &key));
    }
    cmd.arg(token.as_bytes())
        .arg(a.ttl_ms)
        .arg(a.mark_ms.unwrap_or(0));
    if access == Access::Exclusive {
        cmd.arg(if a.fenced { "1" } else { "0" }).arg(&*holder);
    }
    run_attempt(&mut conn, script, &cmd, &prefix, std::slice::from_ref(&key)).await
}

/// [`SHARED_EXTEND`] on one node (`key` is the readers' set).
pub(super) async fn extend_reader(
    mut conn: Connection,
    key: Arc<str>,
    token: Token,
    ttl_ms: u64,
) -> Result<i64, NodeFailureReason> {
    let mut cmd = evalsha(&SHARED_EXTEND, 1);
    cmd.arg(&*key).arg(token.as_bytes()).arg(ttl_ms);
    run_acked(&mut conn, Some(&SHARED_EXTEND), &cmd, |&extended| {
        extended == 1
    })
    .await
}

/// [`SHARED_RELEASE`] on one node (`key` is the readers' set).
pub(super) async fn release_reader(
    mut conn: Connection,
    prefix: Arc<str>,
    key: Arc<str>,
    lock_key: Arc<str>,
    token: Token,
    publish: bool,
) -> Result<ReleaseReply, NodeFailureReason> {
    let mut cmd = evalsha(&SHARED_RELEASE, 2);
    cmd.arg(&*key)
        .arg(Auxiliary::of(Beside::Waiters, &prefix, &lock_key))
        .arg(token.as_bytes())
        .arg(if publish { "1" } else { "0" })
        .arg(released(&prefix, &lock_key));
    Ok(ReleaseReply::of(
        run(&mut conn, &SHARED_RELEASE, &cmd).await?,
    ))
}

impl Redlock {
    /// One attempt at shared or exclusive access to a prefixed key; a writer's lease
    /// records `holder` (a reader's none).
    pub(super) async fn acquire_access(
        &self,
        key: Arc<str>,
        access: Access,
        waiting: bool,
        holder: Arc<str>,
    ) -> Result<Lease, LockError> {
        let prefix = &self.inner.policy.prefix;
        let lease_keys = match access {
            Access::Shared => Keys::Readers {
                set: readers_key(prefix, &key),
                lock: key.clone(),
            },
            Access::Exclusive => Keys::Lock(key.clone()),
        };
        let mut acquisition = Acquisition::new(self, lease_keys);
        let token = acquisition.token;
        let fence_ms = self.inner.fence_ms.filter(|_| access == Access::Exclusive);
        let a = Attempt {
            ttl_ms: self.inner.policy.ttl_ms(),
            fenced: fence_ms.is_some(),
            mark_ms: waiting.then_some(self.inner.mark_ms),
            raise_fence_ms: None,
        };
        let round = acquisition
            .round(
                |conn| {
                    let (prefix, key, holder) = (prefix.clone(), key.clone(), holder.clone());
                    attempt(conn, prefix, key, token, access, a, holder)
                },
                CleanUp::Awaited,
                None,
            )
            .await?;
        acquisition.won(&round, Fence::in_rounds(fence_ms)).await
    }
}
