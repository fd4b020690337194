//! What a lease holds on each node, and the node calls that act on it whatever it is:
//! one lock key, a shared lease's readers' set, or a set of lock keys taken together.
//! Each call is one script on the node. Also the names of a lock's own keys and channel
//! beside it ([`Auxiliary`]: the waiters' mark, the fencing counter, the readers' set, ...).

use std::sync::Arc;
use std::time::Instant;

use super::Redlock;
use super::multi::{extend_group, fence_group, on_every_slot, release_group};
use super::round::{Answers, Stragglers};
use super::scripts::{self, ReleaseReply};
use super::shared;
use super::tally::{Rule, Vote};
use crate::backend::connection::Connection;
use crate::backend::notify::Joined;
use crate::error::NodeFailureReason;
use crate::lease::{Lease, Shape, Token};

/// The keys of a lease (or of an attempt at one) on each node.
#[derive(Debug, Clone)]
pub(super) enum Keys {
    /// One lock key.
    Lock(Arc<str>),
    /// A reader of `lock`: its token in the readers' set `set`,
    /// `<prefix>{<lock key>}:readers`.
    Readers { set: Arc<str>, lock: Arc<str> },
    /// Several lock keys, sorted and distinct, held together (`LockRequest::all`).
    Set(Arc<[Arc<str>]>),
}

impl Keys {
    /// The keys `lease` holds, from its shape.
    pub(super) fn of(lease: &Lease) -> Self {
        match &lease.shape {
            Shape::Lock => Keys::Lock(lease.key.clone()),
            Shape::Reader { lock } => Keys::Readers {
                set: lease.key.clone(),
                lock: lock.clone(),
            },
            Shape::Set(keys) => Keys::Set(keys.clone()),
        }
    }

    /// The lease's [`key`](Lease::key): the readers' set of a reader, the first of a set.
    pub(super) fn lease_key(&self) -> Arc<str> {
        match self {
            Keys::Lock(key) | Keys::Readers { set: key, .. } => key.clone(),
            // A set has two keys or more (`LockRequest::resolve`); an empty one names none.
            Keys::Set(keys) => keys.first().map_or_else(|| Arc::from(""), Arc::clone),
        }
    }

    /// The lease's shape.
    pub(super) fn shape(&self) -> Shape {
        match self {
            Keys::Lock(_) => Shape::Lock,
            Keys::Readers { lock, .. } => Shape::Reader { lock: lock.clone() },
            Keys::Set(keys) => Shape::Set(keys.clone()),
        }
    }

    /// Extends the keys on one node where they hold `token`: 1 done, 0 gone, -1 held by
    /// something else.
    pub(super) async fn extend(
        self,
        conn: Connection,
        prefix: Arc<str>,
        token: Token,
        ttl_ms: u64,
        fence_ms: Option<u64>,
    ) -> Result<i64, NodeFailureReason> {
        match self {
            Keys::Lock(key) => {
                let key = std::slice::from_ref(&key);
                extend_group(conn, &prefix, key, token, ttl_ms, fence_ms).await
            }
            Keys::Readers { set, .. } => shared::extend_reader(conn, set, token, ttl_ms).await,
            Keys::Set(keys) => {
                on_every_slot(conn, keys, |conn, keys| {
                    let prefix = prefix.clone();
                    async move { extend_group(conn, &prefix, &keys, token, ttl_ms, fence_ms).await }
                })
                .await
            }
        }
    }

    /// Deletes the keys on one node where they hold `token` (a set key by key);
    /// `publish` wakes the waiters that marked them.
    pub(super) async fn release(
        self,
        conn: Connection,
        prefix: Arc<str>,
        token: Token,
        publish: bool,
    ) -> Result<ReleaseReply, NodeFailureReason> {
        // The other shapes boxed: the future of every release is then the size of a
        // single key's, which each level of the release moves once.
        match self {
            Keys::Lock(key) => scripts::release(conn, prefix, key, token, publish).await,
            Keys::Readers { set, lock } => {
                let release = shared::release_reader(conn, prefix, set, lock, token, publish);
                Box::pin(release).await
            }
            Keys::Set(keys) => {
                let release = on_every_slot(conn, keys, move |conn, keys| {
                    release_group(conn, prefix.clone(), keys, token, publish)
                });
                Box::pin(release).await.map(ReleaseReply::of)
            }
        }
    }

    /// Raises the keys' fencing counters on one node where they hold `token`: 1 when done,
    /// 0 when they do not hold it. (A shared lease is never fenced.)
    pub(super) async fn raise_fence(
        self,
        conn: Connection,
        prefix: Arc<str>,
        token: Token,
        fencing_token: u64,
        fence_ms: u64,
    ) -> Result<i64, NodeFailureReason> {
        match self {
            Keys::Lock(key) | Keys::Readers { set: key, .. } => {
                let key = std::slice::from_ref(&key);
                fence_group(conn, &prefix, key, token, fencing_token, fence_ms).await
            }
            Keys::Set(keys) => {
                on_every_slot(conn, keys, |conn, keys| {
                    let prefix = prefix.clone();
                    async move {
                        fence_group(conn, &prefix, &keys, token, fencing_token, fence_ms).await
                    }
                })
                .await
            }
        }
    }
}

impl Redlock {
    /// Deletes `keys` on every node where they hold `token`, counted by `vote` under
    /// [`Rule::Held`]; `publish` wakes the marked waiters (not for a failed attempt).
    #[inline(always)]
    pub(super) fn release_keys(
        &self,
        keys: Keys,
        token: Token,
        publish: bool,
        vote: fn(&ReleaseReply) -> Vote,
        stragglers: Stragglers,
    ) -> impl Future<Output = Answers<ReleaseReply>> {
        let prefix = self.inner.policy.prefix.clone();
        self.on_nodes(
            Instant::now(),
            move |conn| keys.clone().release(conn, prefix.clone(), token, publish),
            vote,
            Rule::Held,
            stragglers,
        )
    }
}

/// A lock's own key beside the lock key, `<prefix>{<lock key>}:<role>`, written in place
/// as one argument. It begins with the backend's prefix (a Redis ACL on the prefix covers
/// it), and the hash tag puts it in the lock key's Redis Cluster slot; lock keys never
/// contain `{` or `}` (the prefix is checked, names are percent-encoded), so it is never
/// a lock key itself.
pub(super) type Auxiliary<'a> = Joined<'a, 4>;

impl<'a> Auxiliary<'a> {
    /// The key of `role` beside `lock_key`.
    pub(super) fn of(role: Beside, prefix: &'a str, lock_key: &'a str) -> Self {
        Joined([prefix, "{", lock_key, role.suffix()])
    }
}

/// The role of a key beside a lock key: what [`Auxiliary::of`] names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Beside {
    /// The waiters' mark: present while a waiter subscribed to the release channel waits.
    Waiters,
    /// The lock's idempotency record.
    #[cfg(feature = "idempotency")]
    Record,
    /// The record of who holds the lock: `<token> <fields>`, written with the lock key by
    /// the script that sets it (see `lua/lib/set_holder.lua`).
    Holder,
    /// The lock's fencing counter.
    Fence,
    /// The readers' set of a shared lock.
    Readers,
    /// A waiting writer's intent, which keeps new readers out.
    WriterWaiting,
    /// The fair queue of waiters.
    Queue,
    /// The fair queue's per-entry deadlines.
    QueueDeadlines,
}

impl Beside {
    /// What follows the lock key: the hash tag's end, then the role's name.
    fn suffix(self) -> &'static str {
        match self {
            Beside::Waiters => "}:waiters",
            #[cfg(feature = "idempotency")]
            Beside::Record => "}:record",
            Beside::Holder => "}:holder",
            Beside::Fence => "}:fence",
            Beside::Readers => "}:readers",
            Beside::WriterWaiting => "}:writer-waiting",
            Beside::Queue => "}:queue",
            Beside::QueueDeadlines => "}:queue-deadlines",
        }
    }
}
