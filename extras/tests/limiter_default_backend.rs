//! The limiters' default stores, chosen once: `RateLimiter::set_default` and
//! `ConcurrencyLimiter::set_default` are what the layers built without `.backend(..)` use,
//! so that replicas share one limit on Redis. Its own test binary: the defaults are
//! process-wide.

// A test stops on what it did not expect: its unwraps, indexes and panics are assertions.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::sync::Arc;

use axum::Router;
use axum::routing::post;
use support::{RedisNode, serve};
use tokio::sync::Semaphore;
use tower_redlock::{
    ConcurrencyLimitLayer, ConcurrencyLimiter, ConfigError, MemoryConcurrencyLimiter,
    MemoryRateLimiter, Quota, RateLimitLayer, RateLimiter, RedisConcurrencyLimiter,
    RedisRateLimiter,
};

/// One replica: `/search` limited to 3 per minute per client, `/report` to 1 in flight
/// (its handler waits for a permit of `gate`), neither given a backend.
fn replica(gate: &Arc<Semaphore>) -> Router {
    let gate = gate.clone();
    let quota: Quota = "3/60".parse().unwrap();
    Router::new()
        .route(
            "/search",
            post(|| async { "results" }).layer(RateLimitLayer::by_header("x-client", quota)),
        )
        .route(
            "/report",
            post(move || {
                let gate = gate.clone();
                async move {
                    gate.acquire().await.unwrap().forget();
                    "report"
                }
            })
            .layer(ConcurrencyLimitLayer::global(1).scope("report")),
        )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_limiters_set_defaults_are_used_by_layers_without_a_backend() {
    let node = RedisNode::start();
    let rate = RedisRateLimiter::builder(node.url()).build().await.unwrap();
    let permits = RedisConcurrencyLimiter::builder(node.url())
        .build()
        .await
        .unwrap();
    RateLimiter::set_default(rate).unwrap();
    ConcurrencyLimiter::set_default(permits).unwrap();
    // Chosen once: a second choice is refused, whatever it is.
    assert!(matches!(
        RateLimiter::set_default(MemoryRateLimiter::new()),
        Err(ConfigError::DefaultAlreadyChosen {
            handle: "RateLimiter"
        })
    ));
    assert!(matches!(
        ConcurrencyLimiter::set_default(MemoryConcurrencyLimiter::new()),
        Err(ConfigError::DefaultAlreadyChosen {
            handle: "ConcurrencyLimiter"
        })
    ));
    assert!(!RateLimiter::default().is_in_process());
    assert!(!ConcurrencyLimiter::default().is_in_process());

    let gate = Arc::new(Semaphore::new(0));
    let bases = [serve(replica(&gate)).await, serve(replica(&gate)).await];
    let client = reqwest::Client::new();
    let post = |base: &str, path: &str| {
        client
            .post(format!("{base}{path}"))
            .header("x-client", "acme")
            .send()
    };

    // One limit for both replicas: 3 of 8 pass, and the count is on Redis.
    let mut statuses = Vec::new();
    for i in 0..8 {
        statuses.push(
            post(&bases[i % 2], "/search")
                .await
                .unwrap()
                .status()
                .as_u16(),
        );
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429, 429, 429]);
    let count = support::get(&node, "tower-redlock-rate:x-client:acme").await;
    assert_eq!(count.as_deref(), Some("8"));

    // One permit for both replicas: while the first replica runs a report, the second
    // refuses one, and the permit is on Redis.
    let running = tokio::spawn(post(&bases[0], "/report"));
    let key = "tower-redlock-concurrency:{report:all}";
    assert!(
        support::eventually(std::time::Duration::from_secs(5), || async {
            redis::cmd("ZCARD")
                .arg(key)
                .query_async::<i64>(&mut node.conn().await)
                .await
                .unwrap()
                == 1
        })
        .await,
        "the first report's permit is on Redis"
    );
    assert_eq!(post(&bases[1], "/report").await.unwrap().status(), 503);
    gate.add_permits(1);
    assert_eq!(running.await.unwrap().unwrap().status(), 200);
}
