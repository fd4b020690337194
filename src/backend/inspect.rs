//! The operator's view of one lock: [`Locks::inspect`] and [`Locks::force_unlock`].

use std::time::Duration;

use crate::backend::handle::Locks;
use crate::error::LockError;
use crate::redact::LogKey;

/// What the backend holds for one lock key, as [`Locks::inspect`] found it.
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
}

impl LockInspection {
    /// Whether a quorum of the nodes hold the lock: someone holds it.
    pub fn is_held(&self) -> bool {
        self.nodes_holding >= self.quorum
    }
}

impl Locks {
    /// What the backend holds for `resource`, for an operator: whether it is held, for
    /// how long, the fencing token, readers and waiters. Read-only; on Redlock one
    /// pipeline per node, every node awaited up to the node timeout.
    ///
    /// ```
    /// # async fn demo() -> Result<(), tower_redlock::LockError> {
    /// use tower_redlock::Locks;
    ///
    /// let locks = Locks::default();
    /// let lease = locks.try_lock("report:7").await?;
    /// let seen = locks.inspect("report:7").await?;
    /// assert!(seen.is_held() && seen.remaining.is_some());
    /// locks.unlock(lease).await?;
    /// assert!(!locks.inspect("report:7").await?.is_held());
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidKey`] for an unusable resource name; on Redlock,
    /// [`LockError::NoQuorum`] when no node answered.
    pub async fn inspect(&self, resource: &str) -> Result<LockInspection, LockError> {
        let key = self.full_key(resource)?;
        #[cfg(feature = "redis")]
        if let Some(redlock) = self.as_redlock() {
            return redlock.inspect_key(&key).await;
        }
        let memory = self.as_memory().expect("one of the two backends");
        Ok(memory.inspect_key(&key))
    }

    /// Deletes the lock on `resource` whoever holds it, on every node that answers: for
    /// a lock that a dead job left behind and that will not expire soon enough. Returns
    /// on how many nodes it was held.
    ///
    /// **Dangerous**: the holder, if it is alive, goes on believing it holds the lock
    /// until its next renewal or release finds it gone (then `LockError::Expired`), and
    /// a second holder may take it meanwhile. Only the lock key is deleted (readers,
    /// waiters and the fencing counter are left): a holder that fences its writes is
    /// still refused by the storage once the new holder has written. Every call is
    /// logged at `warn` level.
    ///
    /// # Errors
    ///
    /// [`LockError::InvalidKey`] for an unusable resource name; on Redlock,
    /// [`LockError::NoQuorum`] when no node answered.
    pub async fn force_unlock(&self, resource: &str) -> Result<usize, LockError> {
        let key = self.full_key(resource)?;
        #[cfg(feature = "redis")]
        let deleted = match self.as_redlock() {
            Some(redlock) => redlock.force_unlock_key(&key).await?,
            None => self
                .as_memory()
                .expect("one of the two backends")
                .force_unlock_key(&key),
        };
        #[cfg(not(feature = "redis"))]
        let deleted = self
            .as_memory()
            .expect("one of the two backends")
            .force_unlock_key(&key);
        tracing::warn!(key = %LogKey(&key), nodes = deleted, "force_unlock: the lock was deleted whoever held it");
        Ok(deleted)
    }
}
