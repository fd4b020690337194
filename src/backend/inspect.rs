//! The operator's view of one lock, as [`Locks::inspect`](crate::Locks::inspect) finds it.

use std::time::Duration;

use crate::holder::LockHolder;

/// What the backend holds for one lock key, as [`Locks::inspect`](crate::Locks::inspect)
/// found it.
///
/// On Redlock, each field gathers every node that answered within the node timeout; a
/// node that did not answer is left out of the counts (see
/// [`nodes_answered`](Self::nodes_answered)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockInspection {
    /// The full key, prefix included.
    pub key: String,
    /// How many nodes answered (1 in process).
    pub nodes_answered: usize,
    /// How many nodes hold the lock key (an exclusive holder: a plain lock, a writer, or
    /// a member of a set).
    pub nodes_holding: usize,
    /// How many nodes a holder needs: the quorum (1 in process).
    pub quorum: usize,
    /// How long the lock is still held by a quorum of the nodes that answered: the
    /// quorum-th longest remaining TTL. `None` when fewer than a quorum hold it, or when
    /// a node holds it without expiry (a key another client wrote).
    pub remaining: Option<Duration>,
    /// The last fencing token issued for the key, the highest counter of the nodes (only
    /// with fencing tokens on, on Redis; `None` in process, whose tokens are not per key).
    pub fencing_token: Option<u64>,
    /// Readers holding shared access, the most any node counts (expired ones that no
    /// script has pruned yet included).
    pub readers: u64,
    /// Whether anyone waits: a waiters' mark or a fair queue on some node (a waiting
    /// request of this process, in process).
    pub waiters: bool,
    /// Who holds the lock: the replica, and the method, route and request id of the
    /// request that took it (see [`LockHolder`] for which leases record one). On Redlock,
    /// the record that most of the nodes holding the lock keep beside it, read only where
    /// it names the lease whose token the lock key holds. `None` when nobody holds the
    /// lock, for readers, and for a lock that another client (redis-py, say) took.
    pub holder: Option<LockHolder>,
}

impl LockInspection {
    /// Whether a quorum of the nodes hold the lock: someone holds it.
    pub fn is_held(&self) -> bool {
        self.nodes_holding >= self.quorum
    }
}
