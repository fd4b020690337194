//! [`ConcurrencyLimitLayer`]: at most N requests in flight per key (a tenant, a route, a
//! downstream), across every replica that shares one Redis: the distributed form of
//! tower's `ConcurrencyLimitLayer`.
//!
//! For each request the layer (a [`KeyedLayer`](crate::keyed::KeyedLayer) with the
//! [`ConcurrencyPolicy`])
//! 1. takes the key value with its [`KeyExtractor`](crate::key::KeyExtractor) (a header,
//!    a path parameter, your function, or one global key) and checks it;
//! 2. takes a permit on `{scope}:{value}` from its store ([`ConcurrencyLimiter`]): on
//!    Redis one Lua script over a sorted set of permit tokens scored by their expiry (drop
//!    the expired, count, add ours under the limit), as Redisson's
//!    `RPermitExpirableSemaphore`; in process, a count under a short mutex;
//! 3. runs the inner service, renewing a Redis permit (every TTL/3 by default, see
//!    [`Renewal`](crate::Renewal));
//! 4. releases the permit when the response body has ended or the inner service failed
//!    (one `ZREM` on Redis), and in the background when the future or body is dropped. A
//!    replica that dies frees its permits as they expire
//!    ([`RedisConcurrencyLimiterBuilder::permit_ttl`], default 10 s).
//!
//! | situation | status | headers |
//! | --- | --- | --- |
//! | under the limit | the inner service's | |
//! | over the limit (after [`max_wait`](ConcurrencyLimitLayer::max_wait), if set) | 503 Service Unavailable | `Retry-After` (default 1 s) |
//! | key missing (when required) or invalid | 400 | |
//! | the server is misconfigured (a path parameter the route lacks) | 500, the fix logged once | |
//! | store unavailable, fail open (default) | the inner service's, unguarded | |
//! | store unavailable, [`fail_open(false)`](ConcurrencyLimitLayer::fail_open) | 503 | `Retry-After: 1` |
//!
//! The layer's own answers have an `application/problem+json` body (RFC 9457); the
//! service's error type stays the inner service's (no `HandleErrorLayer` needed).
//!
//! # Why 503 and not 429
//!
//! 429 (RFC 6585, section 4) says that *this client* sent too many requests in a given
//! time: a rate limit ([`RateLimitLayer`]). Requests in flight are the server's load,
//! shared by every client on the key. 503 (RFC 9110, section 15.6.4) is for a server
//! "currently unable to handle the request due to a temporary overload", with
//! `Retry-After` (section 10.2.3); clients and proxies retry it elsewhere or later.
//!
//! # When to use it, and when [`RateLimitLayer`]
//!
//! A rate limit bounds requests per time window (fair use, quotas); a concurrency limit
//! bounds work at once (a downstream that takes N calls in parallel). They compose: rate
//! limit the client outside, the costly route's concurrency inside.
//!
//! # One node, no quorum
//!
//! Permits need no quorum: a concurrency limit protects capacity, not correctness. One
//! Redis node (or a replicated primary) holds them; a failover that loses the set lets up
//! to `limit` more requests in until the old ones end. Each key's set is one key inside a
//! Redis Cluster hash tag (`{prefix}{<key>}`), so the scripts touch one slot.
//!
//! # Failing open
//!
//! When the store cannot answer (Redis down, or slower than its timeout), the layer runs
//! the request unguarded by default, for the reason the rate limiter does
//! ([failing open](crate::rate_limit#failing-open)).
//! [`fail_open(false)`](ConcurrencyLimitLayer::fail_open) answers **503** with
//! `Retry-After: 1` instead, where the limit is a hard bound a downstream relies on. Either
//! way `tower_redlock_store_unavailable_total` counts the request, and a warning is logged
//! at most once per 10 s per kind of layer.
//!
//! # Example
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use tower_redlock::{ConcurrencyLimitLayer, RedisConcurrencyLimiter};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let redis = RedisConcurrencyLimiter::builder("redis://127.0.0.1:6379").build().await?;
//!
//! // At most 5 payments in flight across every replica.
//! let app: Router = Router::new()
//!     .route("/pay", post(|| async { "paid" }))
//!     .route_layer(ConcurrencyLimitLayer::global(5).scope("pay").backend(redis));
//! # Ok(()) }
//! ```
//!
//! [`RateLimitLayer`]: crate::RateLimitLayer

mod layer;
mod policy;
#[cfg(test)]
mod tests;

pub use crate::backend::concurrency::{
    ConcurrencyError, ConcurrencyLimiter, MemoryConcurrencyLimiter,
};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use crate::backend::concurrency::{
    DEFAULT_CONCURRENCY_PREFIX, DEFAULT_CONCURRENCY_TIMEOUT, DEFAULT_PERMIT_TTL,
    RedisConcurrencyLimiter, RedisConcurrencyLimiterBuilder,
};
pub use layer::{ConcurrencyLimit, ConcurrencyLimitLayer};
pub use policy::ConcurrencyPolicy;
