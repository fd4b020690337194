//! The backends and the one handle over them.
//!
//! From the top down:
//! - [`handle`]: [`Locks`](crate::Locks), the cheap handle the middleware holds, and the
//!   lease guard that releases on drop;
//! - [`watchdog`]: a held lease's renewal, its live status, and the protected future that
//!   never polls work past the lease's validity;
//! - the lock backends: [`memory`] (in-process) and [`redlock`] (N Redis masters), and the
//!   rate-limit backends in [`rate_limit`];
//! - what they share: [`settings`] (TTL, retries, prefix) and [`wait`] (this process's
//!   waiters).

pub(crate) mod connection;
pub(crate) mod handle;
pub(crate) mod memory;
pub(crate) mod rate_limit;
pub(crate) mod records;
pub(crate) mod redlock;
pub(crate) mod settings;
pub(crate) mod wait;
pub(crate) mod watchdog;

/// A process-unique id for a backend instance, so that a lease can tell which one issued it.
pub(crate) fn next_backend_id() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}
