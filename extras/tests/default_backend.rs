//! The app's default backend, chosen once: a layer built without `.backend(..)` in an app
//! that chose Redis locks on Redis, never per process. Its own test binary, since the
//! default is process-wide.

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
use redis::AsyncCommands;
use tower_redlock::{ConfigError, IdempotencyLayer, Lease, LockLayer, Locks, MemoryLocks, Redlock};

use support::{nodes, serve, urls};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layer_without_a_backend_locks_on_the_redis_the_app_chose() {
    let nodes = nodes(1);
    let redlock = Redlock::builder(urls(&nodes))
        .ttl(Duration::from_secs(10))
        .build()
        .await
        .unwrap();
    Locks::set_default(redlock).unwrap();
    // Chosen once: a second choice is refused, whatever it is.
    assert!(matches!(
        Locks::set_default(MemoryLocks::new()),
        Err(ConfigError::DefaultAlreadyChosen { handle: "Locks" })
    ));
    assert!(!Locks::default().is_in_process());

    // The handler answers whether its lease's key holds its token on the Redis node.
    let url = nodes[0].url();
    let on_redis = move |lease: Lease| {
        let url = url.clone();
        async move {
            let client = redis::Client::open(url).unwrap();
            let mut conn = client.get_multiplexed_async_connection().await.unwrap();
            let value: Option<String> = conn.get(lease.key()).await.unwrap();
            if value.as_deref() == Some(lease.token().as_str()) {
                "on redis"
            } else {
                "in process"
            }
        }
    };
    // Neither layer is given a backend.
    let app = Router::new()
        .route(
            "/orders",
            post(on_redis.clone()).layer(LockLayer::by_header("Idempotency-Key")),
        )
        .route("/payments", post(on_redis).layer(IdempotencyLayer::new()));
    let base = serve(app).await;
    let http = reqwest::Client::new();
    for path in ["orders", "payments"] {
        let response = http
            .post(format!("{base}/{path}"))
            .header("Idempotency-Key", "k-1")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{path}");
        assert_eq!(response.text().await.unwrap(), "on redis", "{path}");
    }
}
