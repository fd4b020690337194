//! A limit given no backend in an app that built a `Redlock` but no Redis store of the
//! limit's kind: it runs in process, and says so once as a warning, since the app uses
//! Redis. Its own test binary: the defaults and what they have said are process-wide.

// A test stops on what it did not expect: its unwraps, indexes and panics are assertions.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use axum::Router;
use axum::routing::post;
use support::{Logs, nodes, serve, urls};
use tower_redlock::{Quota, RateLimitLayer, Redlock};

#[tokio::test]
async fn a_limit_without_a_store_of_its_kind_beside_redis_warns_once() {
    let (logs, _guard) = Logs::capture();
    let nodes = nodes(1);
    let _redlock = Redlock::builder(urls(&nodes)).build().await.unwrap();
    let quota: Quota = "3/60".parse().unwrap();
    let app = Router::new().route(
        "/search",
        post(|| async { "results" }).layer(RateLimitLayer::by_header("x-client", quota)),
    );
    let base = serve(app).await;
    let client = reqwest::Client::new();
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let response = client
            .post(format!("{base}/search"))
            .header("x-client", "acme")
            .send()
            .await
            .unwrap();
        statuses.push(response.status().as_u16());
    }
    // Counted in process.
    assert_eq!(statuses, [200, 200, 200, 429, 429]);
    let fix = "give it .backend(..), or call RateLimiter::set_default(..)";
    assert_eq!(
        logs.lines_with(&["WARN", "layer=\"RateLimitLayer\"", "uses Redis", fix]),
        1,
        "{}",
        logs.text()
    );
    assert_eq!(logs.lines_with(&["RateLimitLayer"]), 1, "{}", logs.text());
}
