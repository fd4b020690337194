//! IdempotencyLayer through a real server and a real HTTP client, on the in-process
//! backend and on Redlock over real Redis nodes.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::post;
use support::{RedisNode, eventually, nodes, serve, urls};
use tokio::sync::Notify;
use tower_redlock::{IdempotencyLayer, Locks, MemoryLocks, Redlock};

async fn redlock(nodes: &[RedisNode]) -> Locks {
    Locks::from(
        Redlock::builder(urls(nodes))
            .ttl(Duration::from_secs(10))
            .node_timeout(Duration::from_millis(200))
            .build()
            .await
            .unwrap(),
    )
}

/// Counts the runs of the handler; each run makes a new order id.
#[derive(Clone, Default)]
struct Orders {
    runs: Arc<AtomicUsize>,
    gate: Option<Arc<Notify>>,
}

impl Orders {
    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    fn router(&self, layer: IdempotencyLayer) -> Router {
        let orders = self.clone();
        Router::new().route(
            "/orders",
            post(move |body: Bytes| {
                let orders = orders.clone();
                async move {
                    let run = orders.runs.fetch_add(1, Ordering::SeqCst) + 1;
                    if let Some(gate) = &orders.gate {
                        gate.notified().await;
                    }
                    let text = String::from_utf8_lossy(&body).into_owned();
                    if text.contains("error") {
                        return (StatusCode::INTERNAL_SERVER_ERROR, "failed").into_response();
                    }
                    if text.contains("big") {
                        return (StatusCode::OK, vec![b'x'; 4096]).into_response();
                    }
                    (
                        StatusCode::CREATED,
                        [
                            (header::LOCATION, format!("/orders/{run}")),
                            (header::CONTENT_TYPE, "application/json".to_owned()),
                        ],
                        format!("{{\"order\":{run},\"body\":{text:?}}}"),
                    )
                        .into_response()
                }
            })
            .layer(layer),
        )
    }
}

async fn post_order(base: &str, key: Option<&str>, body: &str) -> reqwest::Response {
    let mut request = reqwest::Client::new()
        .post(format!("{base}/orders"))
        .body(body.to_owned());
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    request.send().await.unwrap()
}

async fn backends(nodes: &[RedisNode]) -> Vec<(&'static str, Locks)> {
    vec![
        ("in-process", Locks::from(MemoryLocks::new())),
        ("redlock", redlock(nodes).await),
    ]
}

#[tokio::test]
async fn a_retry_after_completion_gets_the_first_response_replayed() {
    let nodes = nodes(3);
    for (name, locks) in backends(&nodes).await {
        let orders = Orders::default();
        let base = serve(orders.router(IdempotencyLayer::new().backend(locks))).await;
        let first = post_order(&base, Some("k-1"), "{\"item\":1}").await;
        assert_eq!(first.status(), StatusCode::CREATED, "{name}");
        assert!(
            first.headers().get("idempotent-replayed").is_none(),
            "{name}"
        );
        let location = first.headers()[header::LOCATION].clone();
        let body = first.text().await.unwrap();
        for _ in 0..3 {
            let again = post_order(&base, Some("k-1"), "{\"item\":1}").await;
            assert_eq!(again.status(), StatusCode::CREATED, "{name}");
            assert_eq!(again.headers()["idempotent-replayed"], "true", "{name}");
            assert_eq!(again.headers()[header::LOCATION], location, "{name}");
            assert_eq!(
                again.headers()[header::CONTENT_TYPE],
                "application/json",
                "{name}"
            );
            assert_eq!(again.text().await.unwrap(), body, "{name}");
        }
        assert_eq!(orders.runs(), 1, "{name}: the handler ran once");
    }
}

#[tokio::test]
async fn the_same_key_with_another_body_is_422_and_a_missing_key_400() {
    let nodes = nodes(3);
    for (name, locks) in backends(&nodes).await {
        let orders = Orders::default();
        let base = serve(orders.router(IdempotencyLayer::new().backend(locks))).await;
        assert_eq!(
            post_order(&base, Some("k-2"), "{\"item\":1}")
                .await
                .status(),
            StatusCode::CREATED
        );
        let other = post_order(&base, Some("k-2"), "{\"item\":2}").await;
        assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY, "{name}");
        assert_eq!(
            other.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        let problem: serde_json::Value = other.json().await.unwrap();
        assert_eq!(
            problem["type"], "urn:tower-redlock:problem:mismatch",
            "{name}"
        );
        assert_eq!(problem["title"], "Unprocessable Content", "{name}");
        let missing = post_order(&base, None, "{\"item\":1}").await;
        assert_eq!(missing.status(), StatusCode::BAD_REQUEST, "{name}");
        assert_eq!(orders.runs(), 1, "{name}");
    }
}

#[tokio::test]
async fn a_retry_while_the_first_runs_is_409_or_waits_with_max_wait() {
    let nodes = nodes(3);
    for (name, locks) in backends(&nodes).await {
        let gate = Arc::new(Notify::new());
        let orders = Orders {
            gate: Some(gate.clone()),
            ..Orders::default()
        };
        let base = serve(orders.router(IdempotencyLayer::new().backend(locks.clone()))).await;
        let waiting_base = serve(
            orders.router(
                IdempotencyLayer::new()
                    .backend(locks)
                    .max_wait(Duration::from_secs(5)),
            ),
        )
        .await;
        let first = tokio::spawn({
            let base = base.clone();
            async move { post_order(&base, Some("k-3"), "{}").await }
        });
        assert!(eventually(Duration::from_secs(5), || async { orders.runs() == 1 }).await);
        let conflict = post_order(&base, Some("k-3"), "{}").await;
        assert_eq!(conflict.status(), StatusCode::CONFLICT, "{name}");
        assert!(
            conflict.headers().contains_key(header::RETRY_AFTER),
            "{name}"
        );
        let waiter = tokio::spawn({
            let base = waiting_base.clone();
            async move { post_order(&base, Some("k-3"), "{}").await }
        });
        gate.notify_one();
        let first = first.await.unwrap();
        assert_eq!(first.status(), StatusCode::CREATED);
        let first_body = first.text().await.unwrap();
        let waited = waiter.await.unwrap();
        assert_eq!(waited.status(), StatusCode::CREATED, "{name}");
        assert_eq!(waited.headers()["idempotent-replayed"], "true", "{name}");
        assert_eq!(waited.text().await.unwrap(), first_body, "{name}");
        assert_eq!(orders.runs(), 1, "{name}");
    }
}

#[tokio::test]
async fn a_server_error_is_not_stored_and_a_retry_runs_again() {
    let nodes = nodes(3);
    for (name, locks) in backends(&nodes).await {
        let orders = Orders::default();
        let base = serve(orders.router(IdempotencyLayer::new().backend(locks))).await;
        for run in 1..=2 {
            let answer = post_order(&base, Some("k-4"), "error").await;
            assert_eq!(answer.status(), StatusCode::INTERNAL_SERVER_ERROR, "{name}");
            assert!(answer.headers().get("idempotent-replayed").is_none());
            assert_eq!(orders.runs(), run, "{name}");
        }
    }
}

#[tokio::test]
async fn body_caps_413_for_requests_and_no_replay_but_no_second_run_for_responses() {
    let nodes = nodes(3);
    for (name, locks) in backends(&nodes).await {
        let orders = Orders::default();
        let layer = IdempotencyLayer::new()
            .backend(locks)
            .max_request_body(64)
            .max_response_body(1024);
        let base = serve(orders.router(layer)).await;
        let large = post_order(&base, Some("k-5"), &"y".repeat(65)).await;
        assert_eq!(large.status(), StatusCode::PAYLOAD_TOO_LARGE, "{name}");
        let problem: serde_json::Value = large.json().await.unwrap();
        assert_eq!(
            problem["type"], "urn:tower-redlock:problem:too-large",
            "{name}"
        );
        assert_eq!(problem["title"], "Content Too Large", "{name}");
        assert_eq!(orders.runs(), 0);
        // The handler sees the body unchanged.
        let exact = post_order(&base, Some("k-6"), &"z".repeat(64)).await;
        assert_eq!(exact.status(), StatusCode::CREATED);
        assert!(exact.text().await.unwrap().contains(&"z".repeat(64)));
        // A response over the cap is sent whole, but cannot be replayed.
        let big = post_order(&base, Some("k-7"), "big").await;
        assert_eq!(big.status(), StatusCode::OK, "{name}");
        assert_eq!(big.bytes().await.unwrap().len(), 4096, "{name}");
        let retry = post_order(&base, Some("k-7"), "big").await;
        assert_eq!(retry.status(), StatusCode::CONFLICT, "{name}");
        assert!(retry.text().await.unwrap().contains("cannot be replayed"));
        assert_eq!(orders.runs(), 2, "{name}: the big one ran once");
    }
}

#[tokio::test]
async fn a_record_expires_after_its_ttl() {
    let nodes = nodes(3);
    for (name, locks) in backends(&nodes).await {
        let orders = Orders::default();
        let layer = IdempotencyLayer::new()
            .backend(locks)
            .record_ttl(Duration::from_millis(300));
        let base = serve(orders.router(layer)).await;
        assert_eq!(
            post_order(&base, Some("k-8"), "{}").await.status(),
            StatusCode::CREATED
        );
        let replayed = post_order(&base, Some("k-8"), "{}").await;
        assert_eq!(replayed.headers()["idempotent-replayed"], "true", "{name}");
        assert!(
            eventually(Duration::from_secs(5), || async {
                let again = post_order(&base, Some("k-8"), "{}").await;
                again.headers().get("idempotent-replayed").is_none()
            })
            .await,
            "{name}: the record outlived its TTL"
        );
        assert_eq!(orders.runs(), 2, "{name}");
    }
}

#[tokio::test]
async fn tenants_with_the_same_key_do_not_share_it() {
    let orders = Orders::default();
    let layer = IdempotencyLayer::new()
        .backend(MemoryLocks::new())
        .tenant(|parts| {
            parts
                .headers
                .get("x-account")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        });
    let base = serve(orders.router(layer)).await;
    let client = reqwest::Client::new();
    for account in ["a", "b", "a"] {
        let answer = client
            .post(format!("{base}/orders"))
            .header("Idempotency-Key", "same")
            .header("x-account", account)
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::CREATED);
    }
    assert_eq!(orders.runs(), 2);
    let anonymous = post_order(&base, Some("same"), "{}").await;
    assert_eq!(anonymous.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn two_routers_on_three_nodes_run_a_key_exactly_once() {
    let nodes = nodes(3);
    let orders = Orders::default();
    let one = serve(orders.router(IdempotencyLayer::new().backend(redlock(&nodes).await))).await;
    let two = serve(orders.router(IdempotencyLayer::new().backend(redlock(&nodes).await))).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(50));
    let mut tasks = Vec::new();
    for i in 0..50 {
        let base = if i % 2 == 0 { one.clone() } else { two.clone() };
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            post_order(&base, Some("k-9"), "{\"item\":9}")
                .await
                .status()
        }));
    }
    for task in tasks {
        let status = task.await.unwrap();
        assert!(
            status == StatusCode::CREATED || status == StatusCode::CONFLICT,
            "{status}"
        );
    }
    for i in 0..10 {
        let base = if i % 2 == 0 { &one } else { &two };
        let answer = post_order(base, Some("k-9"), "{\"item\":9}").await;
        assert_eq!(answer.status(), StatusCode::CREATED);
        assert_eq!(answer.headers()["idempotent-replayed"], "true");
    }
    assert_eq!(orders.runs(), 1, "the handler ran once over both routers");
}

#[tokio::test]
async fn a_node_down_between_write_and_replay_still_replays() {
    let mut nodes = nodes(3);
    let orders = Orders::default();
    let base = serve(orders.router(IdempotencyLayer::new().backend(redlock(&nodes).await))).await;
    let first = post_order(&base, Some("k-10"), "{}").await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let body = first.text().await.unwrap();
    // A node down: the record is still read from a quorum.
    nodes[1].kill();
    let again = post_order(&base, Some("k-10"), "{}").await;
    assert_eq!(again.status(), StatusCode::CREATED, "a node down");
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(again.text().await.unwrap(), body);
    assert_eq!(orders.runs(), 1);
}

#[tokio::test]
async fn without_a_quorum_the_answer_is_503() {
    let mut nodes = nodes(3);
    let orders = Orders::default();
    let base = serve(orders.router(IdempotencyLayer::new().backend(redlock(&nodes).await))).await;
    nodes[0].kill();
    nodes[1].kill();
    let answer = post_order(&base, Some("k-11"), "{}").await;
    assert_eq!(answer.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(answer.headers().contains_key(header::RETRY_AFTER));
    assert_eq!(orders.runs(), 0);
}

#[tokio::test]
async fn retry_after_is_estimated_per_route_whatever_the_tenant() {
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let entered = Arc::new(Notify::new());
    let handler = {
        let (gate, entered) = (gate.clone(), entered.clone());
        move |headers: axum::http::HeaderMap| {
            let (gate, entered) = (gate.clone(), entered.clone());
            async move {
                if headers.contains_key("x-slow") {
                    entered.notify_one();
                    gate.acquire().await.unwrap().forget();
                }
                (StatusCode::CREATED, "created")
            }
        }
    };
    let layer = IdempotencyLayer::new()
        .backend(MemoryLocks::new())
        .tenant(|parts| Some(parts.headers.get("x-account")?.to_str().ok()?.to_owned()));
    let base = serve(Router::new().route("/orders", post(handler).layer(layer))).await;
    let client = reqwest::Client::new();
    let order = |account: &'static str, key: &'static str, slow: bool| {
        let mut request = client
            .post(format!("{base}/orders"))
            .header("Idempotency-Key", key)
            .header("x-account", account);
        if slow {
            request = request.header("x-slow", "1");
        }
        request.send()
    };
    // Tenant "a" completes an order at once: the route's hold time is observed.
    assert_eq!(order("a", "k-1", false).await.unwrap().status(), 201);
    // Tenant "b", never seen before, has an order in flight...
    let slow = tokio::spawn(order("b", "k-2", true));
    entered.notified().await;
    let conflict = order("b", "k-2", false).await.unwrap();
    assert_eq!(conflict.status(), StatusCode::CONFLICT);
    // ... and its retry waits for the route's hold time (under a second), not for the
    // 10 s left on the holder's lease.
    assert_eq!(conflict.headers()[header::RETRY_AFTER], "1");
    gate.add_permits(1);
    assert_eq!(slow.await.unwrap().unwrap().status(), 201);
}
