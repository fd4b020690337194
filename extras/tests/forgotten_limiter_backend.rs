//! A forgotten `.backend(..)` on a limit in an app that built the limiter's Redis store:
//! the in-process fallback refuses (500, the fix logged once) rather than let each
//! replica allow the whole limit. Its own test binary: the defaults and the fallbacks are
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
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::routing::post;
use support::{Logs, RedisNode, serve};
use tower_redlock::{
    ConcurrencyLimitLayer, Quota, RateLimitError, RateLimitLayer, RateLimiter,
    RedisConcurrencyLimiter, RedisRateLimiter,
};

/// One replica: `/search` limited to 3 per minute per client, `/report` to 1 in flight,
/// neither given a backend. Every handler counts its runs in `ran`.
fn replica(ran: &Arc<AtomicUsize>) -> Router {
    let count = || {
        let ran = ran.clone();
        move || async move {
            ran.fetch_add(1, Ordering::SeqCst);
            "ran"
        }
    };
    let quota: Quota = "3/60".parse().unwrap();
    Router::new()
        .route(
            "/search",
            post(count()).layer(RateLimitLayer::by_header("x-client", quota)),
        )
        .route(
            "/report",
            post(count()).layer(ConcurrencyLimitLayer::global(1).scope("report")),
        )
}

#[tokio::test]
async fn a_forgotten_limiter_backend_cannot_multiply_a_limit() {
    let (logs, _guard) = Logs::capture();
    let node = RedisNode::start();
    let ran = Arc::new(AtomicUsize::new(0));

    // One replica builds its app before its Redis stores, the other after.
    let first = replica(&ran);
    let stores = || async {
        let rate = RedisRateLimiter::builder(node.url()).build().await.unwrap();
        let permits = RedisConcurrencyLimiter::builder(node.url())
            .build()
            .await
            .unwrap();
        (rate, permits)
    };
    let _first_stores = stores().await;
    let _second_stores = stores().await;
    let second = replica(&ran);
    let bases = [serve(first).await, serve(second).await];

    let client = reqwest::Client::new();
    for path in ["/search", "/report"] {
        // 8 requests of one client over the two replicas: a 3-per-minute limit counted
        // per replica would have let 6 through.
        for i in 0..8 {
            let response = client
                .post(format!("{}{path}", bases[i % 2]))
                .header("x-client", "acme")
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 500, "{path}");
            let body: serde_json::Value = response.json().await.unwrap();
            assert_eq!(
                body["type"], "urn:tower-redlock:problem:misconfigured",
                "{path}: {body}"
            );
        }
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0, "no request ran unlimited");
    assert!(matches!(
        RateLimiter::default()
            .hit("acme", "3/60".parse().unwrap())
            .await,
        Err(RateLimitError::NoBackendChosen)
    ));

    // One line per kind of layer for the whole process, with the fix.
    for (layer, redis, fix) in [
        (
            "RateLimitLayer",
            "RedisRateLimiter",
            "give it .backend(..), or call RateLimiter::set_default(..)",
        ),
        (
            "ConcurrencyLimitLayer",
            "RedisConcurrencyLimiter",
            "give it .backend(..), or call ConcurrencyLimiter::set_default(..)",
        ),
    ] {
        let field = format!("layer=\"{layer}\"");
        let built = format!("built a {redis}:");
        assert_eq!(
            logs.lines_with(&["ERROR", &field, &built, fix]),
            1,
            "{layer}: {}",
            logs.text()
        );
    }
    assert_eq!(logs.lines_with(&["ERROR"]), 2, "{}", logs.text());
}
