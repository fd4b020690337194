#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod error;
#[cfg(feature = "axum")]
pub mod extract;
pub mod key;
mod lease;
pub mod lock;
mod locks;
mod memory;
pub mod policy;
pub mod problem;
pub mod rate_limit;
mod redlock;
mod wait;
mod watchdog;

pub use error::{ConfigError, LockError, NodeFailure, NodeFailureReason};
#[cfg(feature = "axum")]
pub use extract::{LockKey, Locked, LockedRejection};
pub use lease::{Lease, Token};
pub use lock::LockLayer;
pub use locks::Locks;
pub use memory::{MemoryLocks, MemoryLocksBuilder};
pub use problem::Problem;
pub use rate_limit::{
    MemoryRateLimiter, Quota, RateLimitError, RateLimitLayer, RateLimiter, RedisRateLimiter, Usage,
};
pub use redlock::{Redlock, RedlockBuilder};
pub use watchdog::{LeaseStatus, OnLockLoss, Renewal};
