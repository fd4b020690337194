//! The outage rule: with its Redis node down, a limiter lets requests through by default
//! (a lock layer answers 503), and the log carries one line per interval for each kind of
//! layer, not one per request. Alone in its test binary, so that no other test's outage
//! shares the interval.

// A test stops on what it did not expect: its unwraps, indexes and panics are assertions.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::time::Duration;

use axum::Router;
use axum::routing::post;
use support::{Logs, RedisNode, serve};
use tower_redlock::{
    ConcurrencyLimitLayer, LockLayer, Quota, RateLimitLayer, RateLimiter, RedisConcurrencyLimiter,
    RedisRateLimiter, Redlock,
};

#[tokio::test]
async fn limiters_fail_open_locks_fail_closed_and_the_log_has_one_line_per_layer() {
    let (logs, _guard) = Logs::capture();

    let mut node = RedisNode::start();
    let timeout = Duration::from_millis(200);
    let rate = RedisRateLimiter::builder(node.url())
        .timeout(timeout)
        .build()
        .await
        .unwrap();
    let concurrency = RedisConcurrencyLimiter::builder(node.url())
        .timeout(timeout)
        .build()
        .await
        .unwrap();
    let redlock = Redlock::builder([node.url()])
        .node_timeout(timeout)
        .retry_count(0)
        .build()
        .await
        .unwrap();
    let limited = Router::new()
        .route("/limited", post(|| async { "ran" }))
        .route_layer(ConcurrencyLimitLayer::global(5).backend(concurrency))
        .route_layer(
            RateLimitLayer::global(Quota::new(1000, Duration::from_secs(60)).unwrap())
                .backend(RateLimiter::from(rate)),
        );
    let app = Router::new()
        .route("/locked", post(|| async { "ran" }))
        .route_layer(LockLayer::by_header("x-order-id").backend(redlock))
        .merge(limited);
    let base = serve(app).await;
    let client = reqwest::Client::new();
    let post = |path: &'static str, order: usize| {
        client
            .post(format!("{base}/{path}"))
            .header("x-order-id", order.to_string())
            .send()
    };
    assert_eq!(post("limited", 0).await.unwrap().status(), 200);
    node.kill();
    for order in 1..=20 {
        assert_eq!(
            post("limited", order).await.unwrap().status(),
            200,
            "fail open"
        );
        assert_eq!(
            post("locked", order).await.unwrap().status(),
            503,
            "fail closed"
        );
    }
    for (layer, outcome) in [
        ("RateLimitLayer", "fail open"),
        ("ConcurrencyLimitLayer", "fail open"),
        ("LockLayer", "fail closed"),
    ] {
        let lines = logs.lines_with(&["store unavailable", layer, outcome]);
        assert_eq!(lines, 1, "{layer}: {lines} lines for 20 requests");
    }
}
