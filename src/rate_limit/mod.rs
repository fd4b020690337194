//! [`RateLimitLayer`]: a fixed-window or GCRA rate limit per key, shared by every replica
//! that uses the same Redis.
//!
//! For each request the layer (the [keyed core](crate::keyed) with the
//! [`RateLimitPolicy`])
//! 1. takes the key value from the request with its [`KeyExtractor`](crate::key::KeyExtractor)
//!    (the peer IP, the client IP behind trusted proxies, a header, a path parameter, your
//!    function, a header else the peer IP, or one global key) and checks it ([`validate_value`](crate::key::validate_value));
//! 2. counts `{scope}:{value}` on its store ([`RateLimiter`]) in one step, by the
//!    [`Quota`]'s algorithm: a fixed window ([`Quota::new`]) or GCRA ([`Quota::gcra`]);
//! 3. runs the inner service with the [`Usage`] in its extensions, or answers itself.
//!
//! | situation | status | headers |
//! | --- | --- | --- |
//! | within the limit | the inner service's | `RateLimit-Policy`, `RateLimit` |
//! | over the limit | 429 Too Many Requests (RFC 6585, section 4) | `Retry-After`, `RateLimit-Policy`, `RateLimit` |
//! | key missing (when required) or invalid | 400 | |
//! | the server is misconfigured (no peer address, a path parameter the route lacks) | 500, the fix logged once | |
//! | store unavailable, fail open (default) | the inner service's | `RateLimit-Policy` |
//! | store unavailable, fail closed | 503 | `Retry-After: 1`, `RateLimit-Policy` |
//!
//! The layer's own answers have an `application/problem+json` body (RFC 9457); the
//! service's error type stays the inner service's (no `HandleErrorLayer` needed).
//!
//! # Failing open
//!
//! When the store cannot count (Redis down or slower than its timeout), the default
//! [`RateLimitLayer::fail_open`]`(true)` runs the inner service counted by this replica
//! alone, in process, against the quota divided by
//! [`outage_replicas`](RateLimitLayer::outage_replicas) (default 1: the whole quota per
//! replica): an outage degrades the limit instead of removing it, and past that count the
//! layer answers 429 as usual. `outage_replicas(0)` runs the requests uncounted
//! (`RateLimit-Policy` but no `RateLimit` header, no [`Usage`] on the request). `false`
//! answers **503** with `Retry-After: 1` within that count, for a limit that is a security
//! control (login attempts, a paid quota). A rate limit protects capacity, not
//! correctness.
//!
//! A store whose nodes keep failing is not waited for: after 3 failures in a row a node's
//! outage breaker opens, and its commands fail at once for 500 ms, after which one probes
//! (`tower_redlock_breaker_transitions_total`, one log line per change); the same holds for
//! the lock and concurrency stores.
//!
//! # Headers and algorithms
//!
//! `RateLimit-Policy` and `RateLimit` (IETF draft "RateLimit header fields for HTTP",
//! <https://datatracker.ietf.org/doc/draft-ietf-httpapi-ratelimit-headers/>), and
//! `Retry-After` (RFC 9110, section 10.2.3) on 429; [`RateLimitLayer::legacy_headers`] adds
//! the `X-RateLimit-*` ones. [`Quota::new`] counts in a fixed window that starts with a
//! key's first request (up to twice the limit across a window's edge); [`Quota::gcra`]
//! allows a steady rate with bounded bursts. The guide's
//! [rate-limit chapter](crate::guide::rate_limit) gives the headers' values, the Redis
//! scripts and each algorithm's bound, with an example on Redis.

mod key;
mod layer;
mod policy;
#[cfg(test)]
#[cfg(feature = "axum")]
mod tests;

pub use crate::backend::rate_limit::quota::{Quota, QuotaError, Usage};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use crate::backend::rate_limit::{
    DEFAULT_RATE_PREFIX, DEFAULT_RATE_TIMEOUT, RedisRateLimiter, RedisRateLimiterBuilder,
};
pub use crate::backend::rate_limit::{MemoryRateLimiter, RateLimitError, RateLimiter};
pub use key::{HeaderOrPeerIp, PeerIpKey};
pub use layer::{RateLimitLayer, RateLimitService};
pub use policy::RateLimitPolicy;
