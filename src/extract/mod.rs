//! axum extractors: [`Locked<T>`], which holds a lock on a value taken from the request,
//! and the extractors for what a layer put on the request: the [`Lease`](crate::Lease)
//! and its [`LeaseStatus`](crate::LeaseStatus) (from a [`LockLayer`](crate::LockLayer)),
//! the [`Usage`](crate::Usage) (from a [`RateLimitLayer`](crate::RateLimitLayer)).
//!
//! ```
//! # #[cfg(all(feature = "lock", feature = "rate-limit"))] {
//! use axum::{Router, routing::post};
//! use tower_redlock::{Lease, LeaseStatus, LockLayer, Usage};
//!
//! // Behind a LockLayer that fails closed, a handler always has its lease.
//! async fn pay(lease: Lease, status: LeaseStatus) -> String {
//!     format!("{} fenced by {:?}, {:?} left", lease.key(), lease.fencing_token(), status.remaining())
//! }
//!
//! // Behind a layer that may let a request through unguarded (fail open, an optional
//! // key), take an `Option`: `None` is that case.
//! async fn buy(lease: Option<Lease>, usage: Option<Usage>) -> &'static str {
//!     if lease.is_some() { "locked" } else { "unlocked" }
//! }
//!
//! let app: Router = Router::new()
//!     .route("/pay", post(pay).layer(LockLayer::by_header("Idempotency-Key")))
//!     .route("/buy", post(buy).layer(LockLayer::by_header("Idempotency-Key").fail_open(true)));
//! # }
//! ```

#[cfg(any(feature = "lock", feature = "rate-limit"))]
mod held;
#[cfg(feature = "lock")]
mod lock_keys;
#[cfg(feature = "lock")]
mod locked;

#[cfg(any(feature = "lock", feature = "rate-limit"))]
pub use held::NotGuarded;
#[cfg(feature = "lock")]
#[cfg_attr(docsrs, doc(cfg(feature = "lock")))]
pub use lock_keys::LockKeys;
#[cfg(feature = "lock")]
#[cfg_attr(docsrs, doc(cfg(feature = "lock")))]
pub use locked::{LockKey, Locked, LockedRejection};
