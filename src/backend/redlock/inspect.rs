//! [`Locks::inspect`](crate::Locks::inspect) and
//! [`Locks::force_unlock`](crate::Locks::force_unlock) over the Redlock nodes.

use std::sync::Arc;
use std::time::Duration;

use super::Redlock;
use super::keys::{Auxiliary, Beside};
use super::scripts::{evalsha, run};
use crate::backend::connection::Connection;
use crate::backend::inspect::LockInspection;
use crate::backend::lua::{FORCE_RELEASE, INSPECT};
use crate::backend::notify::released;
use crate::error::{LockError, LockOperation, NodeFailureReason};
use crate::holder::LockHolder;

/// One node's view of a lock.
struct NodeView {
    pttl_ms: i64,
    fence: String,
    readers: u64,
    waiters: bool,
    /// The holder's fields, when the record beside the lock names its token; else empty.
    holder: String,
}

async fn view(
    mut conn: Connection,
    prefix: Arc<str>,
    key: Arc<str>,
) -> Result<NodeView, NodeFailureReason> {
    let mut cmd = evalsha(&INSPECT, 6);
    cmd.arg(&*key)
        .arg(Auxiliary::of(Beside::Fence, &prefix, &key))
        .arg(Auxiliary::of(Beside::Readers, &prefix, &key))
        .arg(Auxiliary::of(Beside::Waiters, &prefix, &key))
        .arg(Auxiliary::of(Beside::Queue, &prefix, &key))
        .arg(Auxiliary::of(Beside::Holder, &prefix, &key));
    let (pttl_ms, fence, readers, waiters, holder): (i64, String, u64, u64, String) =
        run(&mut conn, &INSPECT, &cmd).await?;
    Ok(NodeView {
        pttl_ms,
        fence,
        readers,
        waiters: waiters > 0,
        holder,
    })
}

async fn force_release(
    mut conn: Connection,
    prefix: Arc<str>,
    key: Arc<str>,
) -> Result<i64, NodeFailureReason> {
    let mut cmd = evalsha(&FORCE_RELEASE, 3);
    cmd.arg(&*key)
        .arg(Auxiliary::of(Beside::Waiters, &prefix, &key))
        .arg(Auxiliary::of(Beside::Holder, &prefix, &key))
        .arg(released(&prefix, &key));
    Ok(run(&mut conn, &FORCE_RELEASE, &cmd).await?)
}

/// The record most nodes hold (the first of those tied), ignoring nodes with none.
fn most_named<'a>(records: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let mut counted: Vec<(&str, usize)> = Vec::new();
    for record in records.filter(|r| !r.is_empty()) {
        match counted.iter_mut().find(|(seen, _)| *seen == record) {
            Some((_, count)) => *count = count.saturating_add(1),
            None => counted.push((record, 1)),
        }
    }
    let most = counted.iter().map(|(_, count)| *count).max()?;
    counted
        .into_iter()
        .find(|(_, count)| *count == most)
        .map(|(record, _)| record)
}

impl Redlock {
    /// [`Locks::inspect`](crate::Locks::inspect) for a full key.
    pub(crate) async fn inspect_key(&self, key: &Arc<str>) -> Result<LockInspection, LockError> {
        let prefix = &self.inner.policy.prefix;
        let round = self
            .on_every_node(|conn| view(conn, prefix.clone(), key.clone()))
            .await;
        let views: Vec<&NodeView> = round.values().collect();
        if views.is_empty() {
            return Err(self.no_quorum(round, LockOperation::Inspect));
        }
        let quorum = self.quorum();
        let mut ttls: Vec<i64> = views
            .iter()
            .map(|v| v.pttl_ms)
            .filter(|t| *t != -2)
            .collect();
        ttls.sort_unstable_by(|a, b| b.cmp(a));
        // The quorum-th longest: how long a quorum still holds it (-1, no expiry: None).
        let remaining = ttls
            .get(quorum - 1)
            .and_then(|ms| u64::try_from(*ms).ok())
            .filter(|_| !ttls.contains(&-1))
            .map(Duration::from_millis);
        Ok(LockInspection {
            key: key.to_string(),
            nodes_answered: views.len(),
            nodes_holding: ttls.len(),
            quorum,
            remaining,
            fencing_token: views.iter().filter_map(|v| v.fence.parse().ok()).max(),
            readers: views.iter().map(|v| v.readers).max().unwrap_or(0),
            waiters: views.iter().any(|v| v.waiters),
            holder: most_named(views.iter().map(|v| v.holder.as_str())).map(LockHolder::parse),
        })
    }

    /// [`Locks::force_unlock`](crate::Locks::force_unlock) for a full key: on how many
    /// nodes it was there.
    pub(crate) async fn force_unlock_key(&self, key: &Arc<str>) -> Result<usize, LockError> {
        let prefix = &self.inner.policy.prefix;
        let round = self
            .on_every_node(|conn| force_release(conn, prefix.clone(), key.clone()))
            .await;
        self.inner.local.forget(key);
        self.inner.waiters.wake(key);
        let answered = round.values().count();
        if answered == 0 {
            return Err(self.no_quorum(round, LockOperation::ForceUnlock));
        }
        Ok(round.values().filter(|deleted| **deleted == 1).count())
    }
}
