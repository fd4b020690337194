//! [`LockLayer`]: take a lock per request before the inner service runs.
//!
//! For each request the layer
//! 1. takes the key value from the request with its [`KeyExtractor`](crate::key::KeyExtractor)
//!    and checks it ([`validate_value`](crate::key::validate_value));
//! 2. acquires `{scope}:{value}` on its backend ([`Locks`](crate::Locks)), one attempt;
//! 3. runs the inner service with a clone of the [`Lease`](crate::Lease) and a live
//!    [`LeaseStatus`](crate::LeaseStatus) in the request extensions, renewing the lease
//!    while it runs ([`LockLayer::renewal`]) and never polling it past the lease's
//!    validity ([`LockLayer::on_lock_loss`]);
//! 4. releases the lease when the inner future completes, before the response is returned,
//!    or in the background when the future is dropped (the client went away); the TTL is
//!    the backstop.
//!
//! When the lock is not granted it answers itself, with `application/problem+json`
//! (RFC 9457):
//!
//! | situation | status |
//! | --- | --- |
//! | the lock is held by another request | 409 for `by_header`, 423 otherwise ([`LockLayer::taken_status`]); `Retry-After` |
//! | the key is missing (when required) or invalid | 400 |
//! | the backend has no quorum | 503 with `Retry-After: 1` ([`LockLayer::fail_open`] lets it through instead) |
//! | the lease was lost while the inner service ran | 503 with `Retry-After: 1` ([`OnLockLoss::Continue`](crate::OnLockLoss) runs on instead) |
//!
//! The service's error type stays the inner service's: no `HandleErrorLayer` is needed.

mod future;
mod layer;
mod service;

pub use future::ResponseFuture;
pub use layer::LockLayer;
pub use service::Lock;
