//! [`ConcurrencyLimitLayer`]: at most N requests in flight per key (a tenant, a route, a
//! downstream), across every replica that shares one Redis: the distributed form of
//! tower's `ConcurrencyLimitLayer`.
//!
//! For each request the layer (the [keyed core](crate::keyed) with the
//! [`ConcurrencyPolicy`])
//! 1. takes the key value with its [`KeyExtractor`](crate::key::KeyExtractor) (a header,
//!    a path parameter, the client IP, your function, or one global key) and checks it;
//! 2. takes a permit on `{scope}:{value}` from its store ([`ConcurrencyLimiter`]): on
//!    Redis one Lua script over a sorted set of expiring permit tokens; in process, a
//!    count under a short mutex;
//! 3. runs the inner service, renewing a Redis permit ([`Renewal`](crate::Renewal));
//! 4. releases the permit when the response body has ended or the inner service failed,
//!    and in the background when the future or body is dropped. A replica that dies
//!    frees its permits as they expire ([`RedisConcurrencyLimiterBuilder::permit_ttl`]).
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
//! Over the limit is a 503, not a 429: requests in flight are the server's load, shared by
//! every client on the key. Permits need no quorum (one Redis node, or a replicated
//! primary). The guide's [concurrency chapter](crate::guide::concurrency) gives the why of
//! both, the Redis keys and scripts, when to use [`RateLimitLayer`] instead, and an
//! example on Redis.
//!
//! # Failing open
//!
//! When the store cannot answer (Redis down, or slower than its timeout), the layer runs
//! the request unguarded by default, as the rate limiter does
//! ([failing open](crate::rate_limit#failing-open));
//! [`fail_open(false)`](ConcurrencyLimitLayer::fail_open) answers **503** with
//! `Retry-After: 1`, for a hard bound a downstream relies on.
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
pub use layer::{ConcurrencyLimitLayer, ConcurrencyLimitService};
pub use policy::ConcurrencyPolicy;
