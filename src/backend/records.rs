//! The in-process store of idempotency records: bounded memory, expired records evicted.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::backend::KeyMap;
use crate::lease::Lease;

/// What a request with an idempotency key finds.
#[derive(Debug)]
pub(crate) enum Begin {
    /// A stored record (raw, as written): the first request completed.
    Found(Bytes),
    /// Nothing stored and the lock is ours: run the request.
    Acquired(Lease),
}

/// The record key of a lock key of the backend with `prefix`:
/// `<prefix>{<lock key>}:record`, as on the Redlock nodes.
pub(crate) fn record_key(prefix: &str, lock_key: &str) -> Arc<str> {
    crate::key::shared_key(|out| {
        out.push_str(prefix);
        out.push('{');
        out.push_str(lock_key);
        out.push_str("}:record");
    })
}

/// Default bound on the number of records kept in process: 10,000.
pub const DEFAULT_MAX_RECORDS: usize = 10_000;
/// Default bound on the bytes of the records kept in process (keys and stored
/// responses): 64 MiB.
pub const DEFAULT_MAX_RECORD_BYTES: usize = 64 * 1024 * 1024;

/// A fixed per-record overhead counted against the byte bound (map and index entries).
const ENTRY_OVERHEAD: usize = 96;

/// Records in this process's memory, bounded by a count and a byte total.
///
/// Expired records are dropped first; when the store is still full, the records closest
/// to their expiry go (the oldest, since they share one TTL). A record evicted early lets
/// a retry of its request run again: size the bounds for the records a TTL can hold.
#[derive(Debug)]
pub(crate) struct MemoryRecords {
    inner: Mutex<RecordTable>,
    max_records: usize,
    max_bytes: usize,
}

#[derive(Debug, Default)]
struct RecordTable {
    records: KeyMap<Arc<str>, StoredRecord>,
    by_expiry: BTreeSet<(Instant, Arc<str>)>,
    bytes: usize,
}

#[derive(Debug)]
struct StoredRecord {
    expires: Instant,
    raw: Bytes,
}

fn cost(key: &str, raw: &Bytes) -> usize {
    key.len()
        .saturating_mul(2)
        .saturating_add(raw.len())
        .saturating_add(ENTRY_OVERHEAD)
}

impl MemoryRecords {
    pub(crate) fn new(max_records: usize, max_bytes: usize) -> Self {
        Self {
            inner: Mutex::default(),
            max_records,
            max_bytes,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RecordTable> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The record stored under `key`, unless expired.
    pub(crate) fn get(&self, key: &str) -> Option<Bytes> {
        let now = Instant::now();
        let inner = self.lock();
        inner
            .records
            .get(key)
            .filter(|e| e.expires > now)
            .map(|e| e.raw.clone())
    }

    /// Stores `raw` under `key` for `ttl`; false when it alone is over the byte bound.
    pub(crate) fn insert(&self, key: Arc<str>, raw: Bytes, ttl: Duration) -> bool {
        let size = cost(&key, &raw);
        if size > self.max_bytes || self.max_records == 0 {
            return false;
        }
        let now = Instant::now();
        let expires = now
            .checked_add(ttl)
            .unwrap_or(now + Duration::from_secs(86_400 * 365));
        let mut inner = self.lock();
        inner.remove(&key);
        while inner.by_expiry.first().is_some_and(|(at, _)| *at <= now) && inner.evict_first() {}
        while inner.records.len() >= self.max_records
            || inner.bytes.saturating_add(size) > self.max_bytes
        {
            if !inner.evict_first() {
                break;
            }
        }
        inner.bytes = inner.bytes.saturating_add(size);
        inner.by_expiry.insert((expires, key.clone()));
        inner.records.insert(key, StoredRecord { expires, raw });
        true
    }

    /// How many records and bytes are kept now.
    #[cfg(test)]
    pub(crate) fn usage(&self) -> (usize, usize) {
        let inner = self.lock();
        (inner.records.len(), inner.bytes)
    }
}

impl RecordTable {
    fn remove(&mut self, key: &Arc<str>) {
        if let Some(entry) = self.records.remove(key) {
            self.by_expiry.remove(&(entry.expires, key.clone()));
            self.bytes = self.bytes.saturating_sub(cost(key, &entry.raw));
        }
    }

    fn evict_first(&mut self) -> bool {
        let Some((_, key)) = self.by_expiry.pop_first() else {
            return false;
        };
        if let Some(entry) = self.records.remove(&key) {
            self.bytes = self.bytes.saturating_sub(cost(&key, &entry.raw));
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inserts `len` zero bytes under `key` for `ttl`.
    fn put(store: &MemoryRecords, key: &str, len: usize, ttl: Duration) -> bool {
        store.insert(Arc::from(key), Bytes::from(vec![0u8; len]), ttl)
    }

    #[test]
    fn records_are_kept_until_their_ttl() {
        let store = MemoryRecords::new(10, 1 << 20);
        let v = || Bytes::from_static(b"v");
        assert!(store.insert(Arc::from("k"), v(), Duration::from_secs(60)));
        assert_eq!(store.get("k"), Some(v()));
        assert!(store.insert(Arc::from("gone"), v(), Duration::ZERO));
        assert_eq!(store.get("gone"), None);
    }

    #[test]
    fn rotating_keys_cannot_grow_the_store_past_its_bounds() {
        let hour = Duration::from_secs(3600);
        let store = MemoryRecords::new(100, 1 << 20);
        for i in 0..10_000 {
            put(&store, &format!("key-{i}"), 100, hour);
            let (count, _) = store.usage();
            assert!(count <= 100);
        }
        // The newest are kept, the oldest went first.
        assert!(store.get("key-9999").is_some());
        assert!(store.get("key-0").is_none());

        let small = MemoryRecords::new(usize::MAX, 10_000);
        for i in 0..1_000 {
            put(&small, &format!("key-{i}"), 500, hour);
            assert!(small.usage().1 <= 10_000);
        }
    }

    #[test]
    fn a_record_over_the_byte_bound_is_refused() {
        let store = MemoryRecords::new(10, 1_000);
        assert!(!put(&store, "k", 2_000, Duration::from_secs(1)));
        assert_eq!(store.usage(), (0, 0));
    }

    #[test]
    fn replacing_a_record_does_not_leak_its_bytes() {
        let store = MemoryRecords::new(10, 1 << 20);
        for _ in 0..100 {
            put(&store, "k", 100, Duration::from_secs(60));
        }
        assert_eq!(store.usage().0, 1);
        assert_eq!(store.usage().1, cost("k", &Bytes::from(vec![0u8; 100])));
    }
}
