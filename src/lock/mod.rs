//! [`LockLayer`]: take a lock per request before the inner service runs, and hold it until
//! the response is done.
//!
//! For each request the layer (a [`KeyedLayer`](crate::keyed::KeyedLayer) with the
//! [`LockPolicy`]):
//! 1. takes the key value from the request with its [`KeyExtractor`](crate::key::KeyExtractor)
//!    and checks it ([`validate_value`](crate::key::validate_value));
//! 2. acquires `{scope}:{value}` on its backend ([`Locks`]), one attempt
//!    (or waits up to [`LockLayer::max_wait`]); with [`LockLayer::by_fn_all`], every
//!    key the request names, with one lease, all or none;
//! 3. runs the inner service with the lease's live [`LeaseStatus`] in
//!    the request extensions (read it, or the [`Lease`], with their
//!    extractors), renewing the lease while it runs ([`LockLayer::renewal`]) and never
//!    polling it past the lease's validity ([`LockLayer::on_lock_loss`]);
//! 4. keeps the lease while the response body streams, and releases it as the last frame
//!    is handed on, before the client can see the end of the response
//!    ([`LockLayer::release_at_head`] releases once the response head is ready instead);
//!    when the future or the body is dropped early (the client went away), it releases in
//!    the background, and the TTL is the backstop.
//!
//! When the lock is not granted it answers itself, with `application/problem+json`
//! (RFC 9457):
//!
//! | situation | status |
//! | --- | --- |
//! | the lock is held by another request | 409 for `by_header`, 423 otherwise ([`LockLayer::taken_status`]); `Retry-After` |
//! | the key is missing (when required) or invalid | 400 |
//! | the server is misconfigured (a path parameter the route lacks, the layer outside the `Router`, a bad header name) | 500, the fix logged once |
//! | the backend has no quorum | 503 with `Retry-After: 1` (see [Failing open](#failing-open)) |
//! | the lease was lost while the inner service ran | 503 with `Retry-After: 1` ([`OnLockLoss::Continue`](crate::OnLockLoss) runs on instead) |
//! | the lease was lost while the body streamed | the body ends with an error |
//!
//! The service's error type stays the inner service's: no `HandleErrorLayer` is needed.
//!
//! # Modes
//!
//! A layer takes a plain lock by default. [`LockLayer::shared`] lets requests hold a key
//! together (readers), and [`LockLayer::exclusive`] makes a request wait for the readers
//! and exclude them (a writer that keeps new readers out while it waits).
//! [`LockLayer::fair`] makes waiters ([`LockLayer::max_wait`]) acquire in arrival order
//! across replicas. The README's sections "Shared and exclusive" and "Fair waiting" give
//! their guarantees and their costs in round trips.
//!
//! # Failing open
//!
//! [`LockLayer::fail_open`]`(true)` runs the inner service without a lock when the
//! backend has no quorum (Redis down), instead of answering 503. The default is `false`,
//! fail closed, because a lock that is silently skipped protects nothing. The handler can
//! tell: it has no lease (take `Option<Lease>` or `Option<LeaseStatus>`).

mod layer;
pub(crate) mod policy;
#[cfg(test)]
mod tests;

use crate::keyed;
pub use layer::{Lock, LockLayer};
pub use policy::LockPolicy;

pub use crate::backend::handle::Locks;
pub use crate::backend::memory::{MemoryLocks, MemoryLocksBuilder};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use crate::backend::redlock::{Redlock, RedlockBuilder};
pub use crate::backend::status::LeaseStatus;
pub use crate::backend::watchdog::{OnLockLoss, Renewal};
pub use crate::lease::{Lease, Token};

/// The response future of [`Lock`].
pub type ResponseFuture<S, ReqB> = keyed::ResponseFuture<S, ReqB, LockPolicy>;

/// The response body of [`Lock`]: the inner body, holding the lease until it ends.
pub type ResponseBody<B> = keyed::ResponseBody<B, LockPolicy>;
