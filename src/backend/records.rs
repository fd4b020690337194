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
/// Default bound on the number of records kept in process for one principal (one
/// caller's credentials, or one tenant): 1,000.
pub const DEFAULT_MAX_RECORDS_PER_PRINCIPAL: usize = 1_000;
/// Default bound on the bytes of the records kept in process (keys and stored
/// responses): 64 MiB.
pub const DEFAULT_MAX_RECORD_BYTES: usize = 64 * 1024 * 1024;

/// A fixed per-record overhead counted against the byte bound (map and index entries).
const ENTRY_OVERHEAD: usize = 96;

/// Who a record belongs to: an id of its key's principal (see
/// [`IdempotencyKey`](crate::idempotency::IdempotencyKey)), the same for every record of
/// one caller in this process.
pub(crate) type Owner = u128;

/// A response to store as an idempotency record: its stored form, whose it is, and for
/// how long.
#[derive(Debug, Clone)]
pub(crate) struct NewRecord {
    pub(crate) raw: Bytes,
    pub(crate) owner: Owner,
    pub(crate) ttl: Duration,
}

/// The [`Owner`] of a request's record, put in its extensions with its key.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecordOwner(pub(crate) Owner);

/// Records in this process's memory, bounded by a count, a count per principal and a byte
/// total.
///
/// Expired records are dropped first. A principal at its own bound gives up its oldest
/// record. When the store as a whole is full, the principal seen most recently (the one
/// whose oldest record kept is the newest) gives up its oldest record: a flood of requests
/// from many new principals (a client that changes its cookies on each request) evicts its
/// own records, never those of principals that stored theirs before it began. A record
/// evicted early lets a retry of its request run again: size the bounds for the records a
/// TTL can hold, and name principals that a client cannot mint
/// ([`IdempotencyLayer::tenant`](crate::IdempotencyLayer::tenant)).
#[derive(Debug)]
pub(crate) struct MemoryRecords {
    inner: Mutex<RecordTable>,
    max_records: usize,
    max_per_owner: usize,
    max_bytes: usize,
}

#[derive(Debug, Default)]
struct RecordTable {
    records: KeyMap<Arc<str>, StoredRecord>,
    by_expiry: BTreeSet<(Instant, Arc<str>)>,
    /// Each principal's records, in the order they were stored.
    owners: KeyMap<Owner, BTreeSet<(u64, Arc<str>)>>,
    /// The principals by their oldest record kept (its sequence number), oldest first.
    by_first: BTreeSet<(u64, Owner)>,
    /// The sequence number of the next record stored.
    next: u64,
    bytes: usize,
}

#[derive(Debug)]
struct StoredRecord {
    expires: Instant,
    owner: Owner,
    /// Its place in its principal's order.
    seq: u64,
    raw: Bytes,
}

fn cost(key: &str, raw: &Bytes) -> usize {
    key.len()
        .saturating_mul(2)
        .saturating_add(raw.len())
        .saturating_add(ENTRY_OVERHEAD)
}

impl MemoryRecords {
    pub(crate) fn new(max_records: usize, max_per_owner: usize, max_bytes: usize) -> Self {
        Self {
            inner: Mutex::default(),
            max_records,
            max_per_owner,
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

    /// Stores `raw` under `key` for `ttl`, as a record of `owner`; false when it alone is
    /// over the byte bound.
    pub(crate) fn insert(&self, key: Arc<str>, owner: Owner, raw: Bytes, ttl: Duration) -> bool {
        let size = cost(&key, &raw);
        if size > self.max_bytes || self.max_records == 0 || self.max_per_owner == 0 {
            return false;
        }
        let now = Instant::now();
        let expires = now
            .checked_add(ttl)
            .unwrap_or(now + Duration::from_secs(86_400 * 365));
        let mut inner = self.lock();
        inner.remove(&key);
        while let Some((at, key)) = inner.by_expiry.first().cloned() {
            if at > now {
                break;
            }
            inner.remove(&key);
        }
        while inner.count_of(owner) >= self.max_per_owner && inner.evict_oldest_of(owner) {}
        while inner.records.len() >= self.max_records
            || inner.bytes.saturating_add(size) > self.max_bytes
        {
            let Some(&(_, newest)) = inner.by_first.last() else {
                break;
            };
            if !inner.evict_oldest_of(newest) {
                break;
            }
        }
        let seq = inner.next;
        inner.next = seq.wrapping_add(1);
        inner.bytes = inner.bytes.saturating_add(size);
        inner.by_expiry.insert((expires, key.clone()));
        let mine = inner.owners.entry(owner).or_default();
        let first = mine.is_empty();
        mine.insert((seq, key.clone()));
        if first {
            inner.by_first.insert((seq, owner));
        }
        let record = StoredRecord {
            expires,
            owner,
            seq,
            raw,
        };
        inner.records.insert(key, record);
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
    fn count_of(&self, owner: Owner) -> usize {
        self.owners.get(&owner).map_or(0, BTreeSet::len)
    }

    /// Removes the record under `key`, from every index.
    fn remove(&mut self, key: &Arc<str>) {
        let Some(entry) = self.records.remove(key) else {
            return;
        };
        self.by_expiry.remove(&(entry.expires, key.clone()));
        self.bytes = self.bytes.saturating_sub(cost(key, &entry.raw));
        let owner = entry.owner;
        let Some(mine) = self.owners.get_mut(&owner) else {
            return;
        };
        let first = mine.first().map(|(seq, _)| *seq);
        mine.remove(&(entry.seq, key.clone()));
        let now_first = mine.first().map(|(seq, _)| *seq);
        if now_first != first {
            if let Some(first) = first {
                self.by_first.remove(&(first, owner));
            }
            match now_first {
                Some(seq) => {
                    self.by_first.insert((seq, owner));
                }
                None => {
                    self.owners.remove(&owner);
                }
            }
        }
    }

    /// Removes `owner`'s oldest record; false when it has none.
    fn evict_oldest_of(&mut self, owner: Owner) -> bool {
        let oldest = self
            .owners
            .get(&owner)
            .and_then(|mine| mine.first().cloned());
        let Some((_, key)) = oldest else {
            return false;
        };
        self.remove(&key);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inserts `len` zero bytes under `key` for `ttl`.
    fn put(store: &MemoryRecords, key: &str, len: usize, ttl: Duration) -> bool {
        store.insert(Arc::from(key), 0, Bytes::from(vec![0u8; len]), ttl)
    }

    #[test]
    fn records_are_kept_until_their_ttl() {
        let store = MemoryRecords::new(10, 10, 1 << 20);
        let v = || Bytes::from_static(b"v");
        assert!(store.insert(Arc::from("k"), 0, v(), Duration::from_secs(60)));
        assert_eq!(store.get("k"), Some(v()));
        assert!(store.insert(Arc::from("gone"), 0, v(), Duration::ZERO));
        assert_eq!(store.get("gone"), None);
    }

    #[test]
    fn rotating_keys_cannot_grow_the_store_past_its_bounds() {
        let hour = Duration::from_secs(3600);
        let store = MemoryRecords::new(100, 100, 1 << 20);
        for i in 0..10_000 {
            put(&store, &format!("key-{i}"), 100, hour);
            let (count, _) = store.usage();
            assert!(count <= 100);
        }
        // The newest are kept, the oldest went first.
        assert!(store.get("key-9999").is_some());
        assert!(store.get("key-0").is_none());

        let small = MemoryRecords::new(usize::MAX, usize::MAX, 10_000);
        for i in 0..1_000 {
            put(&small, &format!("key-{i}"), 500, hour);
            assert!(small.usage().1 <= 10_000);
        }
    }

    #[test]
    fn a_record_over_the_byte_bound_is_refused() {
        let store = MemoryRecords::new(10, 10, 1_000);
        assert!(!put(&store, "k", 2_000, Duration::from_secs(1)));
        assert_eq!(store.usage(), (0, 0));
    }

    #[test]
    fn replacing_a_record_does_not_leak_its_bytes() {
        let store = MemoryRecords::new(10, 10, 1 << 20);
        for _ in 0..100 {
            put(&store, "k", 100, Duration::from_secs(60));
        }
        assert_eq!(store.usage().0, 1);
        assert_eq!(store.usage().1, cost("k", &Bytes::from(vec![0u8; 100])));
    }

    #[test]
    fn one_principal_evicts_only_its_own_records() {
        let hour = Duration::from_secs(3600);
        let store = MemoryRecords::new(100, 10, 1 << 20);
        let v = || Bytes::from_static(b"v");
        // A caller's one record, then a flood of another caller's, past every bound.
        assert!(store.insert(Arc::from("victim"), 1, v(), hour));
        for i in 0..10_000 {
            assert!(store.insert(Arc::from(format!("flood-{i}")), 2, v(), hour));
        }
        assert_eq!(store.get("victim"), Some(v()));
        // The flooder keeps its newest records, up to its own bound.
        assert_eq!(store.usage().0, 11);
        assert!(store.get("flood-9999").is_some());
        assert!(store.get("flood-9989").is_none());
    }

    #[test]
    fn a_full_store_evicts_the_principal_seen_last() {
        let hour = Duration::from_secs(3600);
        let store = MemoryRecords::new(10, 8, 1 << 20);
        let v = || Bytes::from_static(b"v");
        for i in 0..5 {
            store.insert(Arc::from(format!("a-{i}")), 1, v(), hour);
        }
        store.insert(Arc::from("b-0"), 2, v(), hour);
        // A flood from new principals, one record each: they evict each other, never the
        // records of the principals seen before them, whichever holds more.
        for i in 0..10_000u128 {
            store.insert(Arc::from(format!("flood-{i}")), 100 + i, v(), hour);
        }
        assert_eq!(store.usage().0, 10);
        assert!((0..5).all(|i| store.get(&format!("a-{i}")).is_some()));
        assert!(store.get("b-0").is_some());
        assert!(store.get("flood-9999").is_some());
        assert!(store.get("flood-9990").is_none());
    }
}
