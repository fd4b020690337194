//! An app that chose no backend and built no Redis store: the layers run in process, and
//! each kind says so once in the log, with the fix for several replicas. Its own test
//! binary: the defaults and what they have said are process-wide.

// A test stops on what it did not expect: its unwraps, indexes and panics are assertions.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::borrow::Cow;
use std::sync::Arc;

use axum::Router;
use axum::extract::Path;
use axum::routing::post;
use support::{Logs, serve};
use tokio::sync::Semaphore;
use tower_redlock::{
    ConcurrencyLimitLayer, IdempotencyLayer, LockKey, LockLayer, Locked, Locks, Quota,
    RateLimitLayer,
};

#[derive(serde::Deserialize)]
struct OrderId(String);

impl LockKey for OrderId {
    const SCOPE: &'static str = "order";
    fn lock_key(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

#[tokio::test]
async fn the_in_process_default_runs_and_says_so_once_per_kind_of_layer() {
    let (logs, _guard) = Logs::capture();
    // `/orders` holds its lock until `gate` lets it go.
    let gate = Arc::new(Semaphore::new(0));
    let held = gate.clone();
    let quota: Quota = "100/60".parse().unwrap();
    let app = Router::new()
        .route(
            "/orders",
            post(move || {
                let held = held.clone();
                async move {
                    held.acquire().await.unwrap().forget();
                    "created"
                }
            })
            .layer(LockLayer::by_header("Idempotency-Key")),
        )
        .route(
            "/payments",
            post(|| async { "paid" }).layer(IdempotencyLayer::new()),
        )
        .route(
            "/orders/{order_id}/pay",
            post(|_order: Locked<Path<OrderId>>| async { "paid" }),
        )
        .route(
            "/search",
            post(|| async { "results" }).layer(RateLimitLayer::by_header("x-client", quota)),
        )
        .route(
            "/report",
            post(|| async { "report" }).layer(ConcurrencyLimitLayer::global(5)),
        )
        .with_state(Locks::default());
    let base = serve(app).await;
    let client = reqwest::Client::new();
    let send = |path: &str, key: &str| {
        client
            .post(format!("{base}{path}"))
            .header("Idempotency-Key", key)
            .header("x-client", "acme")
            .send()
    };

    // In process, locks still exclude: a second request on a held key is refused.
    let holder = tokio::spawn(send("/orders", "order-1"));
    let refused = support::eventually(std::time::Duration::from_secs(5), || async {
        send("/orders", "order-1").await.unwrap().status() == 409
    })
    .await;
    assert!(refused, "the held key is refused");
    gate.add_permits(1);
    assert_eq!(holder.await.unwrap().unwrap().status(), 200);
    for i in 0..3 {
        for path in ["/payments", "/orders/7/pay", "/search", "/report"] {
            let key = format!("k-{i}");
            let response = send(path, &key).await.unwrap();
            assert_eq!(response.status(), 200, "{path}");
        }
    }

    // One line per kind of layer, not per request, with the fix for several replicas.
    for (layer, fix) in [
        (
            "LockLayer",
            "give it .backend(..), or call Locks::set_default(..)",
        ),
        (
            "IdempotencyLayer",
            "give it .backend(..), or call Locks::set_default(..)",
        ),
        (
            "Locked",
            "put Locks::from(redlock) in the state, or call Locks::set_default(..)",
        ),
        (
            "RateLimitLayer",
            "give it .backend(..), or call RateLimiter::set_default(..)",
        ),
        (
            "ConcurrencyLimitLayer",
            "give it .backend(..), or call ConcurrencyLimiter::set_default(..)",
        ),
    ] {
        let field = format!("layer=\"{layer}\"");
        assert_eq!(
            logs.lines_with(&["INFO", &field, "each replica on its own", fix]),
            1,
            "{layer}: {}",
            logs.text()
        );
    }
    assert_eq!(logs.lines_with(&["INFO"]), 5, "{}", logs.text());
    assert_eq!(logs.lines_with(&["ERROR"]), 0, "{}", logs.text());
}
