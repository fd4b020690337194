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
//! ([`acquire_on`]).

use std::future::Future;
use std::sync::Arc;

use futures_util::future::join_all;
use redis::Script;

use super::Redlock;
use super::acquire::{Acquisition, CleanUp, Fence};
use super::keys::{Auxiliary, Beside, Keys};
use super::scripts::{Attempted, evalsha, invalid_counter, run, run_acked, run_attempt};
use crate::backend::connection::Connection;
use crate::backend::lua::{ACQUIRE_ALL, EXTEND_ALL, FENCE_ALL, RELEASE_ALL};
use crate::backend::notify::released;
use crate::error::{LockError, NodeFailureReason};
use crate::lease::{Lease, Token};

impl Redlock {
    /// One attempt on the sorted, distinct `keys`, each recording `holder`.
    pub(crate) async fn acquire_all(
        &self,
        keys: Arc<[Arc<str>]>,
        holder: Arc<str>,
    ) -> Result<Lease, LockError> {
        if let [key] = &keys[..] {
            return self.acquire(key.clone(), false, holder).await;
        }
        let mut acquisition = Acquisition::new(self, Keys::Set(keys.clone()));
        let attempt = SetAttempt {
            prefix: self.inner.policy.prefix.clone(),
            token: acquisition.token,
            ttl_ms: self.inner.policy.ttl_ms(),
            fenced: self.inner.fence_ms.is_some(),
            holder,
        };
        let round = acquisition
            .round(
                |conn| acquire_on(conn, keys.clone(), attempt.clone()),
                CleanUp::Background,
                None,
            )
            .await?;
        acquisition
            .won(&round, Fence::in_rounds(self.inner.fence_ms))
            .await
    }
}

/// The holder's record, and the fencing counter when `fenced`: what acquiring and
/// extending a set also write.
fn holder_and_fence(fenced: bool) -> &'static [Beside] {
    if fenced {
        &[Beside::Holder, Beside::Fence]
    } else {
        &[Beside::Holder]
    }
}

/// What one attempt on a set sends every node besides its keys.
#[derive(Clone)]
struct SetAttempt {
    prefix: Arc<str>,
    token: Token,
    ttl_ms: u64,
    fenced: bool,
    holder: Arc<str>,
}

/// The lock keys, then, for each role of `beside` in turn, one auxiliary key per lock key.
fn set_command(script: &Script, prefix: &str, keys: &[Arc<str>], beside: &[Beside]) -> redis::Cmd {
    let mut cmd = evalsha(script, keys.len().saturating_mul(beside.len() + 1));
    for key in keys {
        cmd.arg(&**key);
    }
    for role in beside {
        for key in keys {
            cmd.arg(Auxiliary::of(*role, prefix, key));
        }
    }
    cmd
}

async fn acquire_group(
    mut conn: Connection,
    keys: &[Arc<str>],
    attempt: &SetAttempt,
) -> Result<Attempted, NodeFailureReason> {
    let SetAttempt {
        prefix,
        token,
        ttl_ms,
        fenced,
        holder,
    } = attempt;
    let mut cmd = set_command(&ACQUIRE_ALL, prefix, keys, holder_and_fence(*fenced));
    cmd.arg(token.as_bytes())
        .arg(ttl_ms)
        .arg(keys.len())
        .arg(if *fenced { "1" } else { "0" })
        .arg(&**holder);
    run_attempt(&mut conn, &ACQUIRE_ALL, &cmd, prefix, keys).await
}

/// [`RELEASE_ALL`] on one slot's keys: its reply code (see [`ReleaseReply::of`](super::scripts::ReleaseReply::of)).
pub(in crate::backend::redlock) async fn release_group(
    mut conn: Connection,
    prefix: Arc<str>,
    keys: Arc<[Arc<str>]>,
    token: Token,
    publish: bool,
) -> Result<i64, NodeFailureReason> {
    let beside = [Beside::Waiters, Beside::Holder];
    let mut cmd = set_command(&RELEASE_ALL, &prefix, &keys, &beside);
    cmd.arg(token.as_bytes())
        .arg(if publish { "1" } else { "0" })
        .arg(keys.len());
    if publish {
        for key in keys.iter() {
            cmd.arg(released(&prefix, key));
        }
    }
    Ok(run(&mut conn, &RELEASE_ALL, &cmd).await?)
}

/// The set's keys by Redis Cluster hash slot, in slot order (the same for every set), on
/// a cluster node when they lie in several slots; `None` where one script takes them all.
#[cfg_attr(not(feature = "cluster-async"), allow(unused_variables))]
fn by_slot(conn: &Connection, keys: &Arc<[Arc<str>]>) -> Option<Vec<Arc<[Arc<str>]>>> {
    #[cfg(feature = "cluster-async")]
    if conn.connector().is_cluster() {
        let mut slotted: Vec<(u16, &Arc<str>)> = keys.iter().map(|key| (slot(key), key)).collect();
        let mut slots = slotted.iter().map(|(s, _)| *s);
        let first = slots.next();
        if slots.all(|s| Some(s) == first) {
            return None;
        }
        // Stable: within a slot the keys keep their (sorted) order.
        slotted.sort_by_key(|(s, _)| *s);
        let groups = slotted
            .chunk_by(|a, b| a.0 == b.0)
            .map(|group| group.iter().map(|(_, key)| Arc::clone(key)).collect())
            .collect();
        return Some(groups);
    }
    None
}

/// The Redis Cluster hash slot of `key`: CRC16 (XMODEM) of its hash tag (the first
/// non-empty `{...}`), or of the whole key, modulo 16384 (the Redis Cluster
/// specification, "Key distribution model").
#[cfg(feature = "cluster-async")]
fn slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tag = bytes.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = bytes.get(open + 1..)?;
        let close = rest.iter().position(|&b| b == b'}')?;
        rest.get(..close).filter(|tag| !tag.is_empty())
    });
    crc16::State::<crc16::XMODEM>::calculate(tag.unwrap_or(bytes)) % 16384
}

/// Takes every key of the set on one node, or none: on a cluster whose slots the set
/// spans, one script per slot in slot order, a refusal releasing the slots already taken.
async fn acquire_on(
    conn: Connection,
    keys: Arc<[Arc<str>]>,
    attempt: SetAttempt,
) -> Result<Attempted, NodeFailureReason> {
    let Some(groups) = by_slot(&conn, &keys) else {
        return acquire_group(conn, &keys, &attempt).await;
    };
    let mut highest = 0;
    for (i, group) in groups.iter().enumerate() {
        match acquire_group(conn.clone(), group, &attempt).await {
            Ok(Attempted::Set(counter)) => highest = highest.max(counter),
            refused => {
                // The slots taken are ours to delete; the caller deletes the rest.
                let (prefix, token) = (&attempt.prefix, attempt.token);
                join_all(groups.iter().take(i).map(|taken| {
                    release_group(conn.clone(), prefix.clone(), taken.clone(), token, false)
                }))
                .await;
                return refused;
            }
        }
    }
    Ok(Attempted::Set(highest))
}

/// `op` on the set's keys, on a cluster on every slot's at once: the lowest answer of
/// the slots' (1 done, 0 or -1 short), or the failure of any.
pub(in crate::backend::redlock) async fn on_every_slot<Fut>(
    conn: Connection,
    keys: Arc<[Arc<str>]>,
    op: impl Fn(Connection, Arc<[Arc<str>]>) -> Fut,
) -> Result<i64, NodeFailureReason>
where
    Fut: Future<Output = Result<i64, NodeFailureReason>>,
{
    let Some(groups) = by_slot(&conn, &keys) else {
        return op(conn, keys).await;
    };
    let answers = join_all(groups.into_iter().map(|group| op(conn.clone(), group))).await;
    answers
        .into_iter()
        .try_fold(1, |worst, answer| Ok(worst.min(answer?)))
}

/// [`FENCE_ALL`] on keys of one slot (one lock key, too).
pub(in crate::backend::redlock) async fn fence_group(
    mut conn: Connection,
    prefix: &str,
    keys: &[Arc<str>],
    token: Token,
    fencing_token: u64,
    fence_ms: u64,
) -> Result<i64, NodeFailureReason> {
    let mut cmd = set_command(&FENCE_ALL, prefix, keys, &[Beside::Fence]);
    cmd.arg(token.as_bytes())
        .arg(fencing_token)
        .arg(fence_ms)
        .arg(keys.len());
    let reply = run_acked(&mut conn, Some(&FENCE_ALL), &cmd, |&written| written == 1).await?;
    if reply == -2 {
        return Err(invalid_counter(
            prefix,
            keys.first().map_or("", |key| &**key),
        ));
    }
    Ok(reply)
}

/// [`EXTEND_ALL`] on keys of one slot (one lock key, too).
pub(in crate::backend::redlock) async fn extend_group(
    mut conn: Connection,
    prefix: &str,
    keys: &[Arc<str>],
    token: Token,
    ttl_ms: u64,
    fence_ms: Option<u64>,
) -> Result<i64, NodeFailureReason> {
    let beside = holder_and_fence(fence_ms.is_some());
    let mut cmd = set_command(&EXTEND_ALL, prefix, keys, beside);
    cmd.arg(token.as_bytes()).arg(ttl_ms).arg(keys.len());
    if let Some(fence_ms) = fence_ms {
        cmd.arg(fence_ms);
    }
    run_acked(&mut conn, Some(&EXTEND_ALL), &cmd, |&done| done == 1).await
}

#[cfg(all(test, feature = "cluster-async"))]
mod tests {
    use super::slot;

    #[test]
    fn slots_are_the_cluster_specifications() {
        // The CRC16 check value of the specification, and redis-rs's own routing.
        assert_eq!(slot("123456789"), 0x31C3);
        for key in [
            "foo",
            "{user1000}.following",
            "foo{}{bar}",
            "foo{{bar}}zap",
            "foo{bar}{zap}",
            "tower-redlock:/transfers:account:1",
            "",
        ] {
            let theirs = redis::cluster_routing::Slot::for_key(key);
            assert_eq!(
                format!("{theirs:?}"),
                format!("Slot({})", slot(key)),
                "{key}"
            );
        }
        assert_eq!(slot("{user1000}.following"), slot("user1000"));
    }
}
