#![doc = include_str!("docs/crate.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

// The layout, from the top down (no module imports from one above it; scripts/layering
// checks it, and holds the order):
// - the middlewares: `lock` (LockLayer: lock/{layer,policy,body}.rs), `idempotency`
//   (IdempotencyLayer), `rate_limit` (RateLimitLayer), `concurrency`
//   (ConcurrencyLimitLayer), `extract` (axum extractors);
// - `keyed`: the core every keyed middleware is a policy of;
// - the lock domain, in `lock/`: `handle` (`Locks`), `request` (`LockRequest` and the one
//   acquisition path), `status` (`LeaseStatus`), `watchdog` (renewal, `OnLockLoss`),
//   `reentry`;
// - `backend`: storage only: the backends (in process; Redlock; the limiters' stores, with
//   their handles `RateLimiter`, `ConcurrencyLimiter`), connections, scripts, and the
//   private contract the lock domain runs them through (`contract`: `LockBackend`, `Claim`,
//   `LockMode`);
// - the primitives: `key`, `lease` (`Lease`, `Token`), `renewal` (the schedule a lease and
//   a concurrency permit share), `future` (boxed futures and errors, work finished once
//   started, and the lock-loss guarantee: `poll_guarded`), `rejection` and `problem`
//   (refusals and their answers), `error`, `redact`, `observe`
//   (metric names and spans), `holder` (who holds a lease: `LockHolder`, and what a
//   lease records of its request), `sync` (the in-process stores' locks and
//   notifications: std's and tokio's, or the schedule explorer's with `--cfg shuttle`).
//
// The crate root re-exports what a user names to build and use the layers: the layers,
// the backends with their builders, the extractors and their rejections, the errors,
// `Rejection` and `Problem`. Services, futures, bodies, policies and key extractors stay in their modules.

#[cfg(any(
    feature = "lock",
    feature = "rate-limit",
    feature = "concurrency-limit"
))]
mod backend;
#[cfg(feature = "concurrency-limit")]
#[cfg_attr(docsrs, doc(cfg(feature = "concurrency-limit")))]
pub mod concurrency;
pub mod error;
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub mod extract;
#[cfg(any(
    feature = "lock",
    feature = "rate-limit",
    feature = "concurrency-limit"
))]
mod future;
#[cfg(feature = "lock")]
mod holder;
pub mod key;
#[cfg(any(
    feature = "lock",
    feature = "rate-limit",
    feature = "concurrency-limit"
))]
pub mod keyed;
#[cfg(feature = "lock")]
mod lease;
#[cfg(feature = "lock")]
#[cfg_attr(docsrs, doc(cfg(feature = "lock")))]
pub mod lock;
#[cfg(any(
    feature = "lock",
    feature = "rate-limit",
    feature = "concurrency-limit"
))]
mod observe;
pub mod problem;
#[cfg(feature = "rate-limit")]
#[cfg_attr(docsrs, doc(cfg(feature = "rate-limit")))]
pub mod rate_limit;
mod redact;
pub mod rejection;
#[cfg(any(feature = "lock", feature = "concurrency-limit"))]
mod renewal;
#[cfg(all(shuttle, feature = "concurrency-limit"))]
#[doc(hidden)]
pub mod shuttle_hooks;
#[cfg(any(feature = "lock", feature = "concurrency-limit"))]
mod sync;

#[cfg(all(feature = "redis", any(feature = "lock", feature = "rate-limit")))]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use backend::node::Node;
#[cfg(feature = "concurrency-limit")]
#[cfg_attr(docsrs, doc(cfg(feature = "concurrency-limit")))]
pub use concurrency::{
    ConcurrencyError, ConcurrencyLimitLayer, ConcurrencyLimiter, MemoryConcurrencyLimiter,
};
#[cfg(all(feature = "concurrency-limit", feature = "redis"))]
#[cfg_attr(
    docsrs,
    doc(cfg(all(feature = "concurrency-limit", feature = "redis")))
)]
pub use concurrency::{RedisConcurrencyLimiter, RedisConcurrencyLimiterBuilder};
pub use error::{ConfigError, LockError, LockOperation, NodeFailure, NodeFailureReason};
#[cfg(all(feature = "axum", any(feature = "lock", feature = "rate-limit")))]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use extract::NotGuarded;
#[cfg(all(feature = "axum", feature = "lock"))]
#[cfg_attr(docsrs, doc(cfg(all(feature = "axum", feature = "lock"))))]
pub use extract::{LockKey, LockKeys, Locked, LockedRejection};
#[cfg(feature = "lock")]
#[cfg_attr(docsrs, doc(cfg(feature = "lock")))]
pub use lock::{
    Lease, LeaseStatus, LockAllLayer, LockAllRequest, LockHolder, LockInspection, LockLayer,
    LockMode, LockRequest, Locks, MemoryLocks, MemoryLocksBuilder, OnLockLoss, Token,
};
#[cfg(all(feature = "lock", feature = "redis"))]
#[cfg_attr(docsrs, doc(cfg(all(feature = "lock", feature = "redis"))))]
pub use lock::{Redlock, RedlockBuilder};
pub use problem::Problem;
#[cfg(feature = "rate-limit")]
#[cfg_attr(docsrs, doc(cfg(feature = "rate-limit")))]
pub use rate_limit::{
    MemoryRateLimiter, Quota, QuotaError, RateLimitError, RateLimitLayer, RateLimiter, Usage,
};
#[cfg(all(feature = "rate-limit", feature = "redis"))]
#[cfg_attr(docsrs, doc(cfg(all(feature = "rate-limit", feature = "redis"))))]
pub use rate_limit::{RedisRateLimiter, RedisRateLimiterBuilder};
pub use redact::log_full_keys;
pub use rejection::{RejectedBy, Rejection, RejectionKind};
#[cfg(any(feature = "lock", feature = "concurrency-limit"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "lock", feature = "concurrency-limit"))))]
pub use renewal::Renewal;
#[cfg(feature = "idempotency")]
#[cfg_attr(docsrs, doc(cfg(feature = "idempotency")))]
pub mod idempotency;
#[cfg(feature = "idempotency")]
#[cfg_attr(docsrs, doc(cfg(feature = "idempotency")))]
pub use idempotency::IdempotencyLayer;
#[cfg(any(
    feature = "lock",
    feature = "rate-limit",
    feature = "concurrency-limit"
))]
pub use keyed::Shadow;

// The guide: documentation only, one module per chapter (src/docs/guide*.md). Compiled for
// rustdoc and for doc tests, so that its examples run with the others; never in a build.
#[cfg(all(
    any(doc, doctest),
    feature = "axum",
    feature = "idempotency",
    feature = "rate-limit",
    feature = "concurrency-limit",
    feature = "redis",
    feature = "client-ip"
))]
pub mod guide {
    #![doc = include_str!("docs/guide.md")]
    // Chapter `name` is src/docs/guide_name.md.
    macro_rules! chapters {
        ($($name:ident)*) => {$(
            pub mod $name {
                #![doc = include_str!(concat!("docs/guide_", stringify!($name), ".md"))]
            }
        )*};
    }
    chapters!(configuration lifecycle shared_exclusive fair several_keys http_answers
        idempotency rate_limit concurrency observability topologies performance algorithm);
}

// The README's Rust examples run as doc tests too (the crate docs are src/docs/crate.md).
#[cfg(all(doctest, feature = "idempotency", feature = "client-ip"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
