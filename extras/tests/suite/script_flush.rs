//! Every layer on Redis serves the next request after the node forgot its scripts
//! (`SCRIPT FLUSH`, as after a restart): each script is loaded again on `NOSCRIPT`.

use crate::support;

use std::time::Duration;

use axum::Router;
use axum::routing::post;
use support::{RedisNode, serve};
use tower_redlock::{
    ConcurrencyLimitLayer, ConcurrencyLimiter, IdempotencyLayer, LockLayer, Locks, Quota,
    RateLimitLayer, RateLimiter, RedisConcurrencyLimiter, RedisRateLimiter, Redlock,
};

async fn flush_scripts(node: &RedisNode) {
    let mut conn = node.conn().await;
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut conn)
        .await
        .unwrap();
}

#[tokio::test]
async fn every_layer_serves_the_next_request_after_a_script_flush() {
    let nodes = support::nodes(1);
    let locks = support::redlock(&nodes, Duration::from_secs(10)).await;
    let fenced = Locks::from(
        Redlock::builder(support::urls(&nodes))
            .fencing_tokens(true)
            .build()
            .await
            .unwrap(),
    );
    let rate = RateLimiter::from(
        RedisRateLimiter::builder(nodes[0].url())
            .build()
            .await
            .unwrap(),
    );
    let concurrency = ConcurrencyLimiter::from(
        RedisConcurrencyLimiter::builder(nodes[0].url())
            .build()
            .await
            .unwrap(),
    );
    let fixed: Quota = "1000/60".parse().unwrap();
    let gcra = Quota::gcra(1000, Duration::from_secs(60), 100).unwrap();
    let ok = || async { "ok" };
    let app = Router::new()
        .route(
            "/lock",
            post(ok).layer(LockLayer::by_header("x-key").backend(locks.clone())),
        )
        .route(
            "/fenced",
            post(ok).layer(LockLayer::by_header("x-key").backend(fenced)),
        )
        .route(
            "/idempotent",
            post(ok).layer(IdempotencyLayer::with_header("x-key".parse().unwrap()).backend(locks)),
        )
        .route(
            "/fixed",
            post(ok).layer(RateLimitLayer::by_header("x-key", fixed).backend(rate.clone())),
        )
        .route(
            "/gcra",
            post(ok).layer(RateLimitLayer::by_header("x-key", gcra).backend(rate)),
        )
        .route(
            "/concurrency",
            post(ok).layer(ConcurrencyLimitLayer::by_header("x-key", 4).backend(concurrency)),
        );
    let base = serve(app).await;
    let http = reqwest::Client::new();
    for path in [
        "lock",
        "fenced",
        "idempotent",
        "fixed",
        "gcra",
        "concurrency",
    ] {
        for round in 0..3 {
            // A new key each round, so that the idempotent route runs (and stores) again.
            let response = http
                .post(format!("{base}/{path}"))
                .header("x-key", format!("k-{round}"))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200, "{path}, round {round}");
            flush_scripts(&nodes[0]).await;
        }
    }
}
