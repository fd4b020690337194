//! Idempotency records in process, beside the locks.

use std::sync::Arc;
use std::time::Duration;

use super::MemoryLocks;
use crate::backend::contract::LockBackend as _;
use crate::backend::records::{Begin, NewRecord, record_key};
use crate::error::LockError;
use crate::holder::{Holder, HolderRef};
use crate::lease::Lease;

impl MemoryLocks {
    /// The record of `key`, or the lock on `key` when there is none (its lease recording
    /// `holder`); at once.
    pub(crate) fn begin_idempotent_now(
        &self,
        key: Arc<str>,
        holder: HolderRef<'_>,
    ) -> Result<Begin, LockError> {
        let record_key = record_key(self.prefix(), &key);
        if let Some(raw) = self.records().get(&record_key) {
            return Ok(Begin::Found(raw));
        }
        let lease = self.acquire_from(key, std::time::Instant::now(), holder)?;
        Ok(self.recheck(lease, &record_key))
    }

    /// [`begin_idempotent`](Self::begin_idempotent), waiting up to `max_wait` for a holder
    /// to finish.
    pub(crate) async fn begin_idempotent_within(
        &self,
        key: Arc<str>,
        max_wait: Duration,
        holder: &Holder,
    ) -> Result<Begin, LockError> {
        let record_key = record_key(self.prefix(), &key);
        if let Some(raw) = self.records().get(&record_key) {
            return Ok(Begin::Found(raw));
        }
        let lease = self.lock_within(key, None, max_wait, holder).await?;
        Ok(self.recheck(lease, &record_key))
    }

    /// Looks again under the lock: a holder may have stored its record and released
    /// between the first look and the acquisition.
    fn recheck(&self, lease: Lease, record_key: &str) -> Begin {
        match self.records().get(record_key) {
            Some(raw) => {
                let _ = self.release(&lease);
                Begin::Found(raw)
            }
            None => Begin::Acquired(lease),
        }
    }

    /// Stores `record` for `ttl` as one of `owner`'s while the lease is valid, then
    /// releases the lease.
    pub(crate) fn store_and_release(&self, lease: Lease, record: Option<NewRecord>) {
        if let Some(NewRecord { raw, owner, ttl }) = record.filter(|_| lease.is_valid()) {
            self.records()
                .insert(record_key(self.prefix(), lease.key()), owner, raw, ttl);
        }
        let _ = self.release(&lease);
    }
}
