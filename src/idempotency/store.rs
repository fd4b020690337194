//! Where records live: beside the lock, on the same backend.
//!
//! - In process: the bounded records kept by [`MemoryLocks`] beside its locks.
//! - Redis: each record is a string `{<lock key>}:record` on every Redlock node, in the
//!   lock key's Redis Cluster slot. A first request checks for a record and acquires the
//!   lock in one script per node; it stores its record and releases the lock in one
//!   script per node, acknowledged by a quorum. A retry reads a quorum and takes the
//!   record if any node that answered has it: every read quorum meets every write quorum.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use crate::backend::handle::Locks;
use crate::backend::memory::MemoryLocks;
use crate::error::LockError;
use crate::lease::Lease;

/// What a request with an idempotency key finds.
#[derive(Debug)]
pub(crate) enum Begin {
    /// A stored record (raw, as written): the first request completed.
    Found(Bytes),
    /// Nothing stored and the lock is ours: run the request.
    Acquired(Lease),
}

/// The record key of a lock key: `{<lock key>}:record`.
pub(crate) fn record_key(lock_key: &str) -> Arc<str> {
    crate::key::shared_key(|out| {
        out.push('{');
        out.push_str(lock_key);
        out.push_str("}:record");
    })
}

/// The lock backend, which keeps the records too.
#[derive(Debug, Clone)]
pub(crate) struct Store {
    pub(crate) locks: Locks,
}

impl Store {
    /// Looks for a record under `key` and, when there is none, takes the lock; waits up to
    /// `max_wait` for a holder to finish (and then finds its record).
    ///
    /// # Errors
    ///
    /// [`LockError::Taken`] while another request with the key runs (after `max_wait`);
    /// [`LockError::NoQuorum`] and the other backend errors.
    pub(crate) async fn begin(
        &self,
        key: Arc<str>,
        max_wait: Duration,
    ) -> Result<Begin, LockError> {
        match self.locks.as_memory() {
            Some(memory) => self.begin_in_process(memory, key, max_wait).await,
            None => self.locks.begin_idempotent(key, max_wait).await,
        }
    }

    async fn begin_in_process(
        &self,
        memory: &MemoryLocks,
        key: Arc<str>,
        max_wait: Duration,
    ) -> Result<Begin, LockError> {
        let record_key = record_key(&key);
        if let Some(raw) = memory.records().get(&record_key) {
            return Ok(Begin::Found(raw));
        }
        let lease = self.locks.lock_key_within(key, max_wait).await?;
        Ok(Self::recheck(memory, lease, &record_key))
    }

    /// [`begin`](Self::begin) in process without waiting: answered at once.
    pub(crate) fn begin_now(memory: &MemoryLocks, key: Arc<str>) -> Result<Begin, LockError> {
        let record_key = record_key(&key);
        if let Some(raw) = memory.records().get(&record_key) {
            return Ok(Begin::Found(raw));
        }
        let lease = memory.acquire(key)?;
        Ok(Self::recheck(memory, lease, &record_key))
    }

    /// Looks again under the lock: a holder may have stored its record and released
    /// between the first look and the acquisition.
    fn recheck(memory: &MemoryLocks, lease: Lease, record_key: &str) -> Begin {
        match memory.records().get(record_key) {
            Some(raw) => {
                let _ = memory.unlock(lease);
                Begin::Found(raw)
            }
            None => Begin::Acquired(lease),
        }
    }

    /// [`finish`](Self::finish) in process: stores the record while the lease is valid,
    /// then releases.
    pub(crate) fn finish_now(
        memory: &MemoryLocks,
        lease: Lease,
        record: Option<Bytes>,
        ttl: Duration,
    ) {
        if let Some(raw) = record.filter(|_| lease.is_valid()) {
            memory.records().insert(record_key(lease.key()), raw, ttl);
        }
        let _ = memory.unlock(lease);
    }

    /// Stores `record` (when given) for `ttl` and releases the lease, in that order.
    ///
    /// # Errors
    ///
    /// [`LockError::NoQuorum`] when too few nodes took the record (a retry may then run
    /// the request again), [`LockError::Expired`] when the lease had run out.
    pub(crate) async fn finish(
        &self,
        lease: Lease,
        record: Option<Bytes>,
        ttl: Duration,
    ) -> Result<(), LockError> {
        if let Some(memory) = self.locks.as_memory() {
            Self::finish_now(memory, lease, record, ttl);
            return Ok(());
        }
        match record {
            Some(raw) => self.locks.finish_idempotent(lease, raw, ttl).await,
            None => self.locks.unlock(lease).await,
        }
    }
}
