//! Shadow (dry-run) mode and path exemptions, over real HTTP (and Redis where named).
//!
//! Each test counts with a metrics recorder of its own thread (`set_default_local_recorder`):
//! a `#[tokio::test]` runtime runs the server and the client on that one thread.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::http::HeaderMap;
use axum::routing::{get, post};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use tokio::sync::Notify;
use tower_redlock::{
    ConcurrencyLimitLayer, IdempotencyLayer, LockLayer, Locks, MemoryConcurrencyLimiter,
    MemoryLocks, RateLimitLayer, RateLimiter, RedisRateLimiter, Shadow,
};

use crate::support::{RedisNode, nodes, redlock, serve};

const SHADOW: &str = "tower_redlock_shadow_refusals_total";

/// The shadow counts seen so far: a snapshot of the debugging recorder hands over what was
/// counted since the one before, so the counts add up here.
struct Shadowed {
    snapshotter: Snapshotter,
    seen: std::collections::HashMap<(String, String), u64>,
}

impl Shadowed {
    fn new(recorder: &DebuggingRecorder) -> Self {
        Self {
            snapshotter: recorder.snapshotter(),
            seen: Default::default(),
        }
    }

    /// What `layer` would have refused as `kind`, counted so far.
    fn count(&mut self, layer: &str, kind: &str) -> u64 {
        for (key, _, _, value) in self.snapshotter.snapshot().into_vec() {
            let key = key.key();
            let label = |name: &str| {
                key.labels()
                    .find(|l| l.key() == name)
                    .map(|l| l.value().to_owned())
            };
            if let (SHADOW, Some(layer), Some(kind), DebugValue::Counter(n)) =
                (key.name(), label("layer"), label("kind"), value)
            {
                *self.seen.entry((layer, kind)).or_default() += n;
            }
        }
        self.seen
            .get(&(layer.to_owned(), kind.to_owned()))
            .copied()
            .unwrap_or(0)
    }
}

/// A handler that holds its request until released when it carries `x-hold`, and answers
/// at once otherwise.
fn holding_handler(entered: Arc<Notify>, release: Arc<Notify>) -> axum::routing::MethodRouter {
    post(move |headers: HeaderMap| {
        let (entered, release) = (entered.clone(), release.clone());
        async move {
            if headers.contains_key("x-hold") {
                entered.notify_one();
                release.notified().await;
            }
            "done"
        }
    })
}

async fn send(client: &reqwest::Client, url: &str, headers: &[(&str, &str)]) -> u16 {
    let mut request = client.post(url);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.unwrap().status().as_u16()
}

#[tokio::test]
async fn a_shadowed_lock_layer_never_refuses_counts_what_it_would_have_and_switches_at_run_time() {
    let recorder = DebuggingRecorder::new();
    let mut counts = Shadowed::new(&recorder);
    let _recorder = metrics::set_default_local_recorder(&recorder);

    let (entered, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let shadow = Shadow::new(true);
    let layer = LockLayer::by_header("x-order-id")
        .backend(Locks::from(MemoryLocks::new()))
        .shadow(shadow.clone());
    let app = Router::new().route(
        "/orders",
        holding_handler(entered.clone(), release.clone()).layer(layer),
    );
    let url = format!("{}/orders", serve(app).await);
    let client = reqwest::Client::new();

    // The first request holds order 7 in its handler.
    let first = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move { send(&client, &url, &[("x-order-id", "7"), ("x-hold", "1")]).await }
    });
    tokio::time::timeout(Duration::from_secs(10), entered.notified())
        .await
        .unwrap();

    // Held, and without a key: both would be refused, and both run.
    assert_eq!(send(&client, &url, &[("x-order-id", "7")]).await, 200);
    assert_eq!(send(&client, &url, &[]).await, 200);
    assert_eq!(counts.count("LockLayer", "taken"), 1);
    assert_eq!(counts.count("LockLayer", "missing_key"), 1);

    // Switched off at run time: the layer refuses again, and counts nothing more.
    shadow.set(false);
    assert_eq!(send(&client, &url, &[("x-order-id", "7")]).await, 409);
    assert_eq!(send(&client, &url, &[]).await, 400);
    assert_eq!(counts.count("LockLayer", "taken"), 1);

    release.notify_one();
    assert_eq!(first.await.unwrap(), 200);
    // The lock was taken as usual: once released, the key is free.
    assert_eq!(send(&client, &url, &[("x-order-id", "7")]).await, 200);
}

#[tokio::test]
async fn a_shadowed_rate_limit_on_redis_lets_every_request_through_and_counts_the_excess() {
    let recorder = DebuggingRecorder::new();
    let mut counts = Shadowed::new(&recorder);
    let _recorder = metrics::set_default_local_recorder(&recorder);

    let node = RedisNode::start();
    let limiter = RedisRateLimiter::builder(node.url()).build().await.unwrap();
    let layer = RateLimitLayer::by_header("x-tenant", "2/60".parse().unwrap())
        .backend(RateLimiter::from(limiter))
        .shadow(true);
    let app = Router::new().route("/search", post(|| async { "ok" }).layer(layer));
    let url = format!("{}/search", serve(app).await);
    let client = reqwest::Client::new();

    let mut seen = Vec::new();
    for _ in 0..5 {
        seen.push(send(&client, &url, &[("x-tenant", "acme")]).await);
    }
    assert_eq!(seen, [200; 5]);
    assert_eq!(counts.count("RateLimitLayer", "limited"), 3);
}

#[tokio::test]
async fn a_shadowed_layer_runs_the_request_when_its_store_is_down_even_failing_closed() {
    let recorder = DebuggingRecorder::new();
    let mut counts = Shadowed::new(&recorder);
    let _recorder = metrics::set_default_local_recorder(&recorder);

    let mut nodes = nodes(1);
    let locks = redlock(&nodes, Duration::from_secs(10)).await;
    let layer = LockLayer::by_header("x-order-id")
        .backend(locks)
        .shadow(true);
    let app = Router::new().route("/orders", post(|| async { "ok" }).layer(layer));
    let url = format!("{}/orders", serve(app).await);
    let client = reqwest::Client::new();

    nodes[0].kill();
    assert_eq!(send(&client, &url, &[("x-order-id", "7")]).await, 200);
    assert_eq!(counts.count("LockLayer", "unavailable"), 1);
}

#[tokio::test]
async fn shadowed_idempotency_and_concurrency_layers_run_what_they_would_have_answered() {
    let recorder = DebuggingRecorder::new();
    let mut counts = Shadowed::new(&recorder);
    let _recorder = metrics::set_default_local_recorder(&recorder);

    let runs = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let counted = runs.clone();
    let handler = post(move || {
        let runs = counted.clone();
        async move {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                .to_string()
        }
    });
    let idempotent = IdempotencyLayer::new()
        .backend(Locks::from(MemoryLocks::new()))
        .shadow(true);
    let (entered, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let limited = ConcurrencyLimitLayer::global(1)
        .backend(MemoryConcurrencyLimiter::new())
        .shadow(true);
    let app = Router::new()
        .route("/pay", handler.layer(idempotent))
        .route(
            "/export",
            holding_handler(entered.clone(), release.clone()).layer(limited),
        );
    let base = serve(app).await;
    let client = reqwest::Client::new();

    // The same key twice: the second would be a replay, and runs the handler again.
    let pay = format!("{base}/pay");
    assert_eq!(send(&client, &pay, &[("idempotency-key", "k1")]).await, 200);
    assert_eq!(send(&client, &pay, &[("idempotency-key", "k1")]).await, 200);
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 2);
    assert_eq!(counts.count("IdempotencyLayer", "replay"), 1);

    // A second export while one runs would be a 503.
    let export = format!("{base}/export");
    let first = tokio::spawn({
        let (client, export) = (client.clone(), export.clone());
        async move { send(&client, &export, &[("x-hold", "1")]).await }
    });
    tokio::time::timeout(Duration::from_secs(10), entered.notified())
        .await
        .unwrap();
    assert_eq!(send(&client, &export, &[]).await, 200);
    assert_eq!(counts.count("ConcurrencyLimitLayer", "limited"), 1);
    release.notify_one();
    assert_eq!(first.await.unwrap(), 200);
}

#[tokio::test]
async fn exempt_paths_and_requests_pass_a_layer_unguarded() {
    let layer = LockLayer::by_header("x-order-id")
        .backend(Locks::from(MemoryLocks::new()))
        .exempt_paths(["/health", "/grpc.health.v1.Health/"])
        .exempt_if(|parts| parts.headers.contains_key("x-internal"));
    let app = Router::new()
        .route("/health", get(|| async { "ok" }).post(|| async { "ok" }))
        .route("/healthz", post(|| async { "ok" }))
        .route("/grpc.health.v1.Health/Check", post(|| async { "ok" }))
        .route("/orders", post(|| async { "ok" }))
        .layer(layer);
    let base = serve(app).await;
    let client = reqwest::Client::new();

    // No key: refused (400) where the layer guards, run where it does not.
    assert_eq!(send(&client, &format!("{base}/health"), &[]).await, 200);
    assert_eq!(
        send(&client, &format!("{base}/grpc.health.v1.Health/Check"), &[]).await,
        200
    );
    assert_eq!(
        send(&client, &format!("{base}/orders"), &[("x-internal", "1")]).await,
        200
    );
    assert_eq!(send(&client, &format!("{base}/orders"), &[]).await, 400);
    assert_eq!(
        send(&client, &format!("{base}/healthz"), &[]).await,
        400,
        "an exact path"
    );
}
