//! IdempotencyLayer against callers who share or guess each other's keys: a record is
//! replayed only to the caller that made it, refusals are never stored, and a flood of
//! refused requests leaves nothing behind. On the in-process backend and on Redis.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use futures_util::StreamExt;
use support::{RedisNode, nodes, serve};
use tower_redlock::{IdempotencyLayer, Locks, MemoryLocks};

/// A handler that answers the status named by the request's `x-status` header (201 by
/// default), with a body that holds a secret of its run, and counts its runs.
fn app(layer: IdempotencyLayer, runs: Arc<AtomicUsize>) -> Router {
    Router::new().route(
        "/orders",
        post(move |headers: HeaderMap| {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let status = headers
                .get("x-status")
                .and_then(|v| v.to_str().ok()?.parse().ok())
                .and_then(|code| StatusCode::from_u16(code).ok())
                .unwrap_or(StatusCode::CREATED);
            async move { (status, format!("secret of run {run}")).into_response() }
        })
        .layer(layer),
    )
}

async fn send(base: &str, key: &str, headers: &[(&str, &str)]) -> (StatusCode, bool, String) {
    let mut request = reqwest::Client::new()
        .post(format!("{base}/orders"))
        .header("Idempotency-Key", key)
        .body("{\"item\":1}");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.unwrap();
    let replayed = response.headers().contains_key("idempotent-replayed");
    (response.status(), replayed, response.text().await.unwrap())
}

async fn backends(nodes: &[RedisNode]) -> Vec<(&'static str, Locks)> {
    vec![
        ("in-process", Locks::from(MemoryLocks::new())),
        (
            "redlock",
            support::redlock(nodes, Duration::from_secs(10)).await,
        ),
    ]
}

/// The record keys on `node`.
async fn record_keys(node: &RedisNode) -> Vec<String> {
    support::scan(&node.url(), "*:record").await
}

#[tokio::test]
async fn a_record_is_replayed_only_to_the_caller_that_made_it() {
    let nodes = nodes(1);
    for (name, locks) in backends(&nodes).await {
        let runs = Arc::new(AtomicUsize::new(0));
        let base = serve(app(IdempotencyLayer::new().backend(locks), runs.clone())).await;
        for (a, b) in [
            (("authorization", "Bearer a"), ("authorization", "Bearer b")),
            (("cookie", "session=a"), ("cookie", "session=b")),
        ] {
            let key = format!("k-{}", a.0);
            let (status, replayed, secret) = send(&base, &key, &[a]).await;
            assert_eq!((status, replayed), (StatusCode::CREATED, false), "{name}");
            // A's retry gets A's response back.
            let again = send(&base, &key, &[a]).await;
            assert_eq!(again, (StatusCode::CREATED, true, secret.clone()), "{name}");
            // B, and a caller without credentials, with the same key and body: their own
            // runs, never A's secret.
            for other in [&[b][..], &[]] {
                let (status, replayed, body) = send(&base, &key, other).await;
                assert_eq!((status, replayed), (StatusCode::CREATED, false), "{name}");
                assert_ne!(body, secret, "{name}: {other:?} got A's response");
            }
        }
        assert_eq!(runs.load(Ordering::SeqCst), 6, "{name}");
    }
}

#[tokio::test]
async fn a_used_key_tells_another_caller_nothing() {
    let nodes = nodes(1);
    for (name, locks) in backends(&nodes).await {
        let runs = Arc::new(AtomicUsize::new(0));
        let base = serve(app(IdempotencyLayer::new().backend(locks), runs)).await;
        let a = [("authorization", "Bearer a")];
        send(&base, "used", &a).await;
        // Another body under the used key: 422 for its owner, and for anybody else the
        // same answer as an unused key.
        let other_body = |headers: &'static [(&'static str, &'static str)]| {
            let base = base.clone();
            async move {
                let mut request = reqwest::Client::new()
                    .post(format!("{base}/orders"))
                    .body("{\"item\":2}");
                for (n, v) in headers {
                    request = request.header(*n, *v);
                }
                let used = request
                    .try_clone()
                    .unwrap()
                    .header("Idempotency-Key", "used");
                let unused = request.header("Idempotency-Key", "unused");
                let used = used.send().await.unwrap().status();
                let unused = unused.send().await.unwrap().status();
                (used, unused)
            }
        };
        let (used, _) = other_body(&[("authorization", "Bearer a")]).await;
        assert_eq!(used, StatusCode::UNPROCESSABLE_ENTITY, "{name}");
        for headers in [&[("authorization", "Bearer b")][..], &[]] {
            let (used, unused) = other_body(headers).await;
            assert_eq!(used, unused, "{name}: {headers:?}");
            assert_eq!(used, StatusCode::CREATED, "{name}: {headers:?}");
        }
    }
}

#[tokio::test]
async fn refusals_of_the_caller_are_never_stored() {
    let nodes = nodes(1);
    for (name, locks) in backends(&nodes).await {
        let runs = Arc::new(AtomicUsize::new(0));
        let base = serve(app(IdempotencyLayer::new().backend(locks), runs.clone())).await;
        let creds = ("authorization", "Bearer a");
        for status in ["401", "403", "407", "408", "429", "500", "503"] {
            let key = format!("k-{status}");
            let (got, replayed, _) = send(&base, &key, &[creds, ("x-status", status)]).await;
            assert_eq!((got.as_str(), replayed), (status, false), "{name}");
            // The retry (now authorised) runs the handler, and its result is stored.
            let (got, replayed, body) = send(&base, &key, &[creds]).await;
            assert_eq!(
                (got, replayed),
                (StatusCode::CREATED, false),
                "{name} {status}"
            );
            let again = send(&base, &key, &[creds]).await;
            assert_eq!(again, (StatusCode::CREATED, true, body), "{name} {status}");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 14, "{name}");
    }
}

#[tokio::test]
async fn a_flood_of_refused_requests_evicts_nothing_and_adds_no_record() {
    const FLOOD: usize = 10_000;
    let nodes = nodes(1);
    // In process, a store far smaller than the flood: any record it left would evict.
    let small = MemoryLocks::builder().max_records(100, 1 << 20).build();
    let backends = [
        ("in-process", Locks::from(small.unwrap())),
        (
            "redlock",
            support::redlock(&nodes, Duration::from_secs(10)).await,
        ),
    ];
    for (name, locks) in backends {
        let redis = !locks.is_in_process();
        let runs = Arc::new(AtomicUsize::new(0));
        let base = serve(app(IdempotencyLayer::new().backend(locks), runs.clone())).await;
        let victim = [("authorization", "Bearer victim")];
        let (_, _, secret) = send(&base, "victim-key", &victim).await;

        // Anonymous requests the handler refuses, each with a key of its own.
        let client = reqwest::Client::new();
        let refused = futures_util::stream::iter(0..FLOOD)
            .map(|i| {
                let request = client
                    .post(format!("{base}/orders"))
                    .header("Idempotency-Key", format!("flood-{i}"))
                    .header("x-status", "401");
                async move { request.send().await.unwrap().status() }
            })
            .buffer_unordered(32)
            .filter(|status| std::future::ready(*status == StatusCode::UNAUTHORIZED))
            .count()
            .await;
        assert_eq!(refused, FLOOD, "{name}");

        // The victim's record is still replayed; a flooded key holds no record (the
        // handler runs for it again).
        let again = send(&base, "victim-key", &victim).await;
        assert_eq!(again, (StatusCode::CREATED, true, secret), "{name}");
        let (status, replayed, _) = send(&base, "flood-7", &[]).await;
        assert_eq!((status, replayed), (StatusCode::CREATED, false), "{name}");
        assert_eq!(runs.load(Ordering::SeqCst), FLOOD + 2, "{name}");
        if redis {
            assert_eq!(record_keys(&nodes[0]).await.len(), 2, "{name}");
        }
    }
}

#[tokio::test]
async fn one_callers_stored_records_cannot_evict_anothers_in_process() {
    let store = MemoryLocks::builder()
        .max_records(100, 1 << 20)
        .max_records_per_principal(10)
        .build()
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let base = serve(app(IdempotencyLayer::new().backend(store), runs.clone())).await;
    let victim = [("authorization", "Bearer victim")];
    let (_, _, secret) = send(&base, "victim-key", &victim).await;
    // Another caller whose requests all succeed, ten times the store's bound.
    let flooder = [("authorization", "Bearer flooder")];
    for i in 0..1_000 {
        let (status, replayed, _) = send(&base, &format!("flood-{i}"), &flooder).await;
        assert_eq!((status, replayed), (StatusCode::CREATED, false));
    }
    let again = send(&base, "victim-key", &victim).await;
    assert_eq!(again, (StatusCode::CREATED, true, secret.clone()));
    // The flooder's newest records are kept, up to its own bound.
    assert!(send(&base, "flood-999", &flooder).await.1);
    assert!(!send(&base, "flood-900", &flooder).await.1);

    // The same token with another junk cookie on each request: a new principal each time,
    // 1,000 of them in a store of 100.
    for i in 0..1_000 {
        let cookie = format!("junk={i}");
        let headers = [flooder[0], ("cookie", cookie.as_str())];
        let (status, replayed, _) = send(&base, &format!("minted-{i}"), &headers).await;
        assert_eq!((status, replayed), (StatusCode::CREATED, false));
    }
    let again = send(&base, "victim-key", &victim).await;
    assert_eq!(again, (StatusCode::CREATED, true, secret));
}

#[tokio::test]
async fn a_key_reused_for_another_resource_is_422_not_its_response() {
    let nodes = nodes(1);
    for (name, locks) in backends(&nodes).await {
        let app = Router::new().route(
            "/accounts/{id}/withdraw",
            post(
                |axum::extract::Path(id): axum::extract::Path<u32>, body: String| async move {
                    (
                        StatusCode::CREATED,
                        format!("withdrew {body} from account {id}"),
                    )
                },
            )
            .layer(IdempotencyLayer::new().backend(locks)),
        );
        let base = serve(app).await;
        let withdraw = |path: &str| {
            reqwest::Client::new()
                .post(format!("{base}{path}"))
                .header("Idempotency-Key", "w-1")
                .header("authorization", "Bearer a")
                .body("100")
                .send()
        };
        let first = withdraw("/accounts/1/withdraw").await.unwrap();
        assert_eq!(first.status(), StatusCode::CREATED, "{name}");
        for other in ["/accounts/2/withdraw", "/accounts/1/withdraw?to=mallory"] {
            let response = withdraw(other).await.unwrap();
            assert_eq!(response.status(), 422, "{name}: {other}");
            assert!(!response.headers().contains_key("idempotent-replayed"));
        }
        let again = withdraw("/accounts/1/withdraw").await.unwrap();
        assert_eq!(again.headers()["idempotent-replayed"], "true", "{name}");
    }
}
