//! [`RateLimitLayer`]: a fixed-window or GCRA rate limit per key, shared by every replica
//! that uses the same Redis.
//!
//! For each request the layer (a [`KeyedLayer`](crate::keyed::KeyedLayer) with the
//! [`RateLimitPolicy`])
//! 1. takes the key value from the request with its [`KeyExtractor`](crate::key::KeyExtractor)
//!    (the peer IP, a header, a path parameter, your function, a header else the peer IP,
//!    or one global key) and checks it ([`validate_value`](crate::key::validate_value));
//! 2. counts `{scope}:{value}` on its store ([`RateLimiter`]) in one step, by the
//!    [`Quota`]'s algorithm: a [fixed window](#fixed-window) or [GCRA](#gcra);
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
//! When the store cannot count (Redis down or slower than its timeout),
//! [`RateLimitLayer::fail_open`]`(true)`, the default, runs the inner service uncounted
//! (`RateLimit-Policy` but no `RateLimit` header, no [`Usage`] on the request); `false`
//! answers **503** with `Retry-After: 1`. Either way the request is counted
//! (`tower_redlock_store_unavailable_total`) and a warning logged, at most once per 10 s
//! per kind of layer. A rate limit protects capacity, not correctness: failing closed
//! would turn an outage of its Redis into one of every limited route. Choose `false`
//! where the limit is a security control, such as login attempts or a paid quota.
//!
//! # Headers
//!
//! `RateLimit-Policy` and `RateLimit` from the IETF draft "RateLimit header fields for
//! HTTP" (<https://datatracker.ietf.org/doc/draft-ietf-httpapi-ratelimit-headers/>), and
//! `Retry-After` (RFC 9110, section 10.2.3) on 429; [`RateLimitLayer::legacy_headers`] adds
//! the `X-RateLimit-*` ones. The guide's [rate-limit chapter](crate::guide::rate_limit)
//! gives their values for each algorithm.
//!
//! # Fixed window
//!
//! [`Quota::new`]: a key's window starts with its first request; on Redis one Lua script
//! `INCR`s the key and sets its expiry on the window's first hit (the "Pattern: Rate
//! limiter" of <https://redis.io/docs/latest/commands/incr/>, without its race). The price:
//! `limit` requests at the end of one window and `limit` more at the start of the next.
//!
//! # GCRA
//!
//! [`Quota::gcra`]: a steady rate with bounded bursts (the generic cell rate algorithm,
//! as in redis-cell and tower_governor): in any interval of length `t`, at most
//! `burst + t × limit / window` requests pass. On Redis the script reads the server's
//! clock (`TIME`), so every replica shares one limit, whatever their clocks.
//!
//! # Example
//!
//! ```no_run
//! use std::net::SocketAddr;
//! use axum::{Router, routing::post};
//! use tower_redlock::{Quota, RateLimitLayer, RedisRateLimiter};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let redis = RedisRateLimiter::builder("redis://127.0.0.1:6379").build().await?;
//! let quota: Quota = std::env::var("RATE_LIMIT").as_deref().unwrap_or("100/60").parse()?;
//!
//! let app = Router::new()
//!     .route("/items/{item_id}/buy", post(|| async { "bought" }))
//!     .route_layer(
//!         RateLimitLayer::by_header_or_peer_ip("X-Client-Id", quota)
//!             .scope("buy")
//!             .backend(redis),
//!     );
//!
//! let listener = tokio::net::TcpListener::bind("0.0.0.0:3000").await?;
//! // The peer IP comes from ConnectInfo.
//! axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>()).await?;
//! # Ok(()) }
//! ```

mod key;
mod layer;
mod policy;
#[cfg(all(test, feature = "axum"))]
mod tests;

pub use crate::backend::rate_limit::quota::{Quota, QuotaError, Usage};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use crate::backend::rate_limit::{
    DEFAULT_RATE_PREFIX, DEFAULT_RATE_TIMEOUT, RedisRateLimiter, RedisRateLimiterBuilder,
};
pub use crate::backend::rate_limit::{MemoryRateLimiter, RateLimitError, RateLimiter};
pub use key::{HeaderOrPeerIp, PeerIpKey};
pub use layer::{RateLimit, RateLimitLayer};
pub use policy::RateLimitPolicy;
