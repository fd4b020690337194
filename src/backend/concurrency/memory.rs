//! [`MemoryConcurrencyLimiter`]: in-flight counts in this process's memory.

use std::fmt;
use std::hash::BuildHasher;
use std::sync::{Arc, PoisonError};

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

use super::{ConcurrencyError, PermitSlot};
use crate::backend::settings::check_resource;
use crate::backend::wait::Waiters;
use crate::sync::{Mutex, MutexGuard};

/// In-flight counts in this process's memory, with the contract of
/// [`RedisConcurrencyLimiter`](super::RedisConcurrencyLimiter): at most `limit` permits
/// per key at once, each released when its request is done.
///
/// It is the embedded default ([`ConcurrencyLimiter::default`](super::ConcurrencyLimiter::default)),
/// for examples, single-replica services and tests: it does not share permits across
/// processes, and its permits never expire (a holder that dies takes the store with it).
/// Chosen (`ConcurrencyLimiter::from(MemoryConcurrencyLimiter::new())`), it works in any
/// process; the default one is refused in a process that built a `RedisConcurrencyLimiter`.
/// A permit is a short mutex, no `.await`. Cloning is cheap and shares the counts.
///
/// # Bounded memory
///
/// A key costs memory only while it has permits, and at most
/// [`max_keys`](Self::with_max_keys) keys (default
/// [`DEFAULT_MAX_KEYS`](Self::DEFAULT_MAX_KEYS)) have permits at once. Past that, a request
/// on another key gets [`ConcurrencyError::StoreFull`], which the
/// [`ConcurrencyLimitLayer`](crate::ConcurrencyLimitLayer) treats as an unavailable store.
///
/// ```
/// use tower_redlock::MemoryConcurrencyLimiter;
///
/// let limiter = MemoryConcurrencyLimiter::with_max_keys(1000);
/// assert_eq!(limiter.in_flight("tenant:acme"), 0);
/// assert!(limiter.is_empty());
/// ```
#[derive(Clone)]
pub struct MemoryConcurrencyLimiter {
    inner: Arc<MemoryPermits>,
}

struct MemoryPermits {
    counts: Mutex<Counts>,
    /// The requests of this process waiting for a permit, woken by a release.
    waiters: Waiters,
}

/// The permits held per key. A key is hashed once per permit: the permit keeps the hash
/// and the table's `Arc` of its key, and its release finds the entry by both, without
/// hashing or comparing the key again.
struct Counts {
    in_flight: HashTable<(Arc<str>, u32)>,
    hasher: foldhash::fast::RandomState,
    max_keys: usize,
}

impl fmt::Debug for MemoryConcurrencyLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryConcurrencyLimiter")
            .field("keys", &self.len())
            .field("max_keys", &self.max_keys())
            .finish()
    }
}

impl Default for MemoryConcurrencyLimiter {
    fn default() -> Self {
        Self::with_max_keys(Self::DEFAULT_MAX_KEYS)
    }
}

impl MemoryConcurrencyLimiter {
    /// The default bound on keys with permits: 100,000.
    pub const DEFAULT_MAX_KEYS: usize = 100_000;

    /// New, empty counts, at most [`DEFAULT_MAX_KEYS`](Self::DEFAULT_MAX_KEYS) keys with
    /// permits.
    pub fn new() -> Self {
        Self::default()
    }

    /// New, empty counts, at most `max_keys` keys with permits at once (at least 1; 0 is
    /// raised to 1). See [Bounded memory](Self#bounded-memory).
    pub fn with_max_keys(max_keys: usize) -> Self {
        Self {
            inner: Arc::new(MemoryPermits {
                counts: Mutex::new(Counts {
                    in_flight: HashTable::new(),
                    hasher: foldhash::fast::RandomState::default(),
                    max_keys: max_keys.max(1),
                }),
                waiters: Waiters::default(),
            }),
        }
    }

    /// The bound on keys with permits.
    pub fn max_keys(&self) -> usize {
        self.counts().max_keys
    }

    /// The permits held on `key` now: the whole key the layer builds, `{scope}:{value}`.
    pub fn in_flight(&self, key: &str) -> u32 {
        let counts = self.counts();
        let hash = counts.hasher.hash_one(key);
        counts
            .in_flight
            .find(hash, |(held, _)| **held == *key)
            .map_or(0, |(_, count)| *count)
    }

    /// The number of keys with permits.
    pub fn len(&self) -> usize {
        self.counts().in_flight.len()
    }

    /// Whether no permit is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn counts(&self) -> MutexGuard<'_, Counts> {
        // No code panics while holding the lock; recover the map if a panic ever did.
        self.inner
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes a permit on `resource` if fewer than `limit` are held.
    pub(crate) fn acquire_slot(
        &self,
        resource: &str,
        limit: u32,
    ) -> Result<PermitSlot, ConcurrencyError> {
        check_resource(resource)?;
        self.acquire_key(resource, limit)
    }

    /// [`acquire_slot`](Self::acquire_slot) on a key a layer built: its value checked
    /// already, its prefix and scope the server's.
    pub(crate) fn acquire_key(
        &self,
        key: &str,
        limit: u32,
    ) -> Result<PermitSlot, ConcurrencyError> {
        let mut counts = self.counts();
        let Counts {
            in_flight,
            hasher,
            max_keys,
        } = &mut *counts;
        let hash = hasher.hash_one(key);
        let len = in_flight.len();
        let entry = in_flight.entry(
            hash,
            |(held, _)| **held == *key,
            |(held, _)| hasher.hash_one(&**held),
        );
        let key = match entry {
            Entry::Occupied(mut held) => {
                let (key, count) = held.get_mut();
                if *count >= limit {
                    return Err(ConcurrencyError::LimitReached { limit });
                }
                *count += 1;
                key.clone()
            }
            Entry::Vacant(_) if limit == 0 => return Err(ConcurrencyError::LimitReached { limit }),
            Entry::Vacant(_) if len >= *max_keys => {
                return Err(ConcurrencyError::StoreFull {
                    max_keys: *max_keys,
                });
            }
            Entry::Vacant(vacant) => {
                let key = Arc::<str>::from(key);
                vacant.insert((key.clone(), 1));
                key
            }
        };
        drop(counts);
        Ok(PermitSlot::memory(self.clone(), key, hash))
    }

    /// Gives back a permit on `key` (the table's own `Arc`, hashed to `hash`), and wakes
    /// the requests waiting for one; the key is forgotten with its last permit.
    pub(crate) fn release(&self, key: &Arc<str>, hash: u64) {
        let mut counts = self.counts();
        if let Ok(mut held) = counts
            .in_flight
            .find_entry(hash, |(held, _)| Arc::ptr_eq(held, key))
        {
            let count = &mut held.get_mut().1;
            *count = count.saturating_sub(1);
            if *count == 0 {
                held.remove();
                let Counts {
                    in_flight, hasher, ..
                } = &mut *counts;
                if in_flight.is_empty() && in_flight.capacity() > 1024 {
                    in_flight.shrink_to(1024, |(held, _)| hasher.hash_one(&**held));
                }
            }
        }
        drop(counts);
        self.inner.waiters.wake(key);
    }

    /// The requests of this process waiting for a permit.
    pub(crate) fn waiters(&self) -> &Waiters {
        &self.inner.waiters
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    /// A waiter whose fallback timer is at 50 to 100 ms gets the permit within moments of
    /// its release (woken, not polling): the median delay of 7 rounds is under 10 ms.
    #[tokio::test]
    async fn a_waiter_is_woken_by_the_release() {
        let store = MemoryConcurrencyLimiter::new();
        let limiter = super::super::ConcurrencyLimiter::from(store.clone());
        let mut delays = Vec::new();
        for _ in 0..7 {
            let holder = store.acquire_slot("k", 1).unwrap();
            let waiter = tokio::spawn({
                let limiter = limiter.clone();
                async move {
                    let slot = limiter.acquire_within("k", 1, Duration::from_secs(5)).await;
                    (slot, Instant::now())
                }
            });
            // Long enough for the waiter's timer to reach its longest steps.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let released = Instant::now();
            drop(holder);
            let (slot, acquired) = waiter.await.unwrap();
            assert!(slot.is_ok());
            delays.push(acquired - released);
        }
        delays.sort();
        assert!(delays[3] < Duration::from_millis(10), "{delays:?}");
    }

    #[test]
    fn at_most_limit_permits_and_release_frees_one() {
        let store = MemoryConcurrencyLimiter::new();
        let a = store.acquire_slot("k", 2).unwrap();
        let _b = store.acquire_slot("k", 2).unwrap();
        let third = store.acquire_slot("k", 2);
        assert!(matches!(
            third,
            Err(ConcurrencyError::LimitReached { limit: 2 })
        ));
        assert_eq!(store.in_flight("k"), 2);
        drop(a);
        assert_eq!(store.in_flight("k"), 1);
        assert!(store.acquire_slot("k", 2).is_ok());
    }

    #[test]
    fn keys_are_forgotten_with_their_last_permit_and_bounded() {
        let store = MemoryConcurrencyLimiter::with_max_keys(1);
        let a = store.acquire_slot("a", 5).unwrap();
        let b = store.acquire_slot("b", 5);
        assert!(matches!(
            b,
            Err(ConcurrencyError::StoreFull { max_keys: 1 })
        ));
        assert!(a.release().is_none());
        assert!(store.is_empty());
        assert!(store.acquire_slot("b", 5).is_ok());
    }

    #[test]
    fn permits_are_released_after_the_table_grew_under_them() {
        let store = MemoryConcurrencyLimiter::new();
        // Held while the table grows (and rehashes) many times over.
        let permits: Vec<_> = (0..5000)
            .flat_map(|i| {
                let key = format!("tenant:{i}");
                [
                    store.acquire_slot(&key, 2).unwrap(),
                    store.acquire_slot(&key, 2).unwrap(),
                ]
            })
            .collect();
        assert_eq!(store.len(), 5000);
        assert_eq!(store.in_flight("tenant:4321"), 2);
        assert!(store.acquire_slot("tenant:4321", 2).is_err());
        let (first, second): (Vec<_>, Vec<_>) = permits
            .into_iter()
            .enumerate()
            .partition(|(i, _)| i % 2 == 0);
        drop(first);
        assert_eq!(store.len(), 5000);
        assert_eq!(store.in_flight("tenant:4321"), 1);
        drop(second);
        assert!(store.is_empty());
        assert_eq!(store.in_flight("tenant:4321"), 0);
    }

    #[test]
    fn a_limit_of_zero_admits_nothing_and_bad_keys_are_refused() {
        let store = MemoryConcurrencyLimiter::new();
        let zero = store.acquire_slot("k", 0);
        assert!(matches!(
            zero,
            Err(ConcurrencyError::LimitReached { limit: 0 })
        ));
        let empty = store.acquire_slot("", 1);
        assert!(matches!(empty, Err(ConcurrencyError::InvalidKey(_))));
        assert!(store.is_empty());
    }
}
