//! A forgotten `.backend(..)` in an app that built a `Redlock`: the layers' in-process
//! fallback refuses (500, the fix logged once) rather than lock in each replica on its
//! own. Its own test binary: the default backend and the fallback are process-wide.

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
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::extract::Path;
use axum::routing::post;
use support::{Logs, nodes, serve, urls};
use tower_redlock::{
    IdempotencyLayer, LockError, LockKey, LockLayer, Locked, Locks, MemoryLocks, Redlock,
};

#[derive(serde::Deserialize)]
struct OrderId(String);

impl LockKey for OrderId {
    const SCOPE: &'static str = "order";
    fn lock_key(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

/// One replica: `/orders` behind a `LockLayer`, `/payments` behind an `IdempotencyLayer`,
/// `/orders/{id}/pay` locked by `Locked` on `Locks::default()`, none given a backend;
/// `/chosen` behind a `LockLayer` on a `MemoryLocks` chosen for it. Every handler counts
/// its runs in `ran`.
fn replica(ran: &Arc<AtomicUsize>) -> Router {
    let count = |ran: &Arc<AtomicUsize>| {
        let ran = ran.clone();
        move || async move {
            ran.fetch_add(1, Ordering::SeqCst);
            "ran"
        }
    };
    let pay = {
        let ran = ran.clone();
        move |_order: Locked<Path<OrderId>>| async move {
            ran.fetch_add(1, Ordering::SeqCst);
            "paid"
        }
    };
    Router::new()
        .route(
            "/orders",
            post(count(ran)).layer(LockLayer::by_header("Idempotency-Key")),
        )
        .route("/payments", post(count(ran)).layer(IdempotencyLayer::new()))
        .route("/orders/{order_id}/pay", post(pay))
        .route(
            "/chosen",
            post(count(ran))
                .layer(LockLayer::by_header("Idempotency-Key").backend(MemoryLocks::new())),
        )
        .with_state(Locks::default())
}

#[tokio::test]
async fn two_replicas_with_a_forgotten_backend_cannot_both_take_one_key() {
    let (logs, _guard) = Logs::capture();
    let nodes = nodes(3);
    let ran = Arc::new(AtomicUsize::new(0));

    // One replica builds its app before its Redlock, the other after: the fallback
    // refuses whichever came first.
    let first = replica(&ran);
    let _first_redlock = Redlock::builder(urls(&nodes)).build().await.unwrap();
    let _second_redlock = Redlock::builder(urls(&nodes)).build().await.unwrap();
    let second = replica(&ran);
    let bases = [serve(first).await, serve(second).await];

    let client = reqwest::Client::new();
    for path in ["/orders", "/payments", "/orders/7/pay"] {
        // The same key on both replicas at once, three times over.
        for _ in 0..3 {
            let send = |base: &String| {
                client
                    .post(format!("{base}{path}"))
                    .header("Idempotency-Key", "order-7")
                    .send()
            };
            let (a, b) = tokio::join!(send(&bases[0]), send(&bases[1]));
            for response in [a.unwrap(), b.unwrap()] {
                assert_eq!(response.status(), 500, "{path}");
                let body: serde_json::Value = response.json().await.unwrap();
                assert_eq!(
                    body["type"], "urn:tower-redlock:problem:misconfigured",
                    "{path}: {body}"
                );
            }
        }
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0, "no handler ran unlocked");
    for node in &nodes {
        let keys: i64 = redis::cmd("DBSIZE")
            .query_async(&mut node.conn().await)
            .await
            .unwrap();
        assert_eq!(keys, 0, "nothing was locked on Redis either");
    }

    // A store the app chose is not refused, nor is the handle used directly kept quiet.
    let chosen = client
        .post(format!("{}/chosen", bases[0]))
        .header("Idempotency-Key", "order-7")
        .send()
        .await
        .unwrap();
    assert_eq!(chosen.status(), 200);
    assert!(matches!(
        Locks::default().try_lock("order:7").await,
        Err(LockError::NoBackendChosen)
    ));

    // One line per kind of layer for the whole process, with the fix.
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
    ] {
        let line = format!("layer=\"{layer}\"");
        assert_eq!(
            logs.lines_with(&["ERROR", &line, "built a Redlock", fix]),
            1,
            "{layer}: {}",
            logs.text()
        );
    }
    assert_eq!(logs.lines_with(&["ERROR"]), 3, "{}", logs.text());
}
