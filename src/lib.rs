#![doc = include_str!("docs/crate.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod backend;
pub mod error;
#[cfg(feature = "axum")]
pub mod extract;
pub mod key;
pub mod keyed;
mod lease;
pub mod lock;
pub mod problem;
mod protect;
pub mod rate_limit;

pub use backend::handle::Locks;
pub use backend::memory::{MemoryLocks, MemoryLocksBuilder};
pub use backend::redlock::{Redlock, RedlockBuilder};
pub use backend::watchdog::{LeaseStatus, OnLockLoss, Renewal};
pub use error::{ConfigError, LockError, NodeFailure, NodeFailureReason};
#[cfg(feature = "axum")]
pub use extract::{LockKey, Locked, LockedRejection};
pub use lease::{Lease, Token};
pub use lock::LockLayer;
pub use problem::Problem;
pub use rate_limit::{
    MemoryRateLimiter, Quota, RateLimitError, RateLimitLayer, RateLimiter, RedisRateLimiter, Usage,
};
pub mod idempotency;
pub use idempotency::IdempotencyLayer;

// The README's Rust examples run as doc tests too (the crate docs are src/docs/crate.md).
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
