//! Storage only: the backends (in process; Redlock's rounds, tally and scripts; the
//! limiters' stores), their connections, and the private contract the lock domain runs
//! them through (`contract`); each submodule's docs open with what it holds. Nothing here
//! imports from the lock domain, the keyed core or the middlewares (scripts/layering).

/// The hash map of the per-key tables: foldhash's fast hasher, seeded at random per map
/// (keys come from clients, so a fixed seed would let them aim collisions).
pub(crate) type KeyMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

#[cfg(feature = "concurrency-limit")]
pub(crate) mod concurrency;
#[cfg(feature = "redis")]
pub(crate) mod connection;
#[cfg(feature = "lock")]
pub(crate) mod contract;
pub(crate) mod fallback;
#[cfg(feature = "lock")]
pub(crate) mod hold;
#[cfg(feature = "lock")]
pub(crate) mod inspect;
#[cfg(feature = "redis")]
pub(crate) mod lua;
#[cfg(feature = "lock")]
pub(crate) mod memory;
#[cfg(feature = "redis")]
pub(crate) mod node;
#[cfg(all(
    feature = "redis",
    any(feature = "lock", feature = "concurrency-limit")
))]
pub(crate) mod notify;
#[cfg(feature = "rate-limit")]
pub(crate) mod rate_limit;
#[cfg(feature = "idempotency")]
pub(crate) mod records;
#[cfg(all(feature = "lock", feature = "redis"))]
pub(crate) mod redlock;
pub(crate) mod settings;
#[cfg(all(
    feature = "redis",
    any(feature = "rate-limit", feature = "concurrency-limit")
))]
pub(crate) mod store;
#[cfg(any(feature = "lock", feature = "concurrency-limit"))]
pub(crate) mod wait;

/// A process-unique id for a backend instance, so that a lease can tell which one issued it.
#[cfg(feature = "lock")]
pub(crate) fn next_backend_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}
