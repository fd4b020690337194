//! Metrics and spans, over real Redis nodes and real HTTP.
//!
//! Each test installs its own metrics recorder and tracing subscriber for its thread only
//! (`set_default_local_recorder`, `tracing::subscriber::set_default`): a `#[tokio::test]`
//! runtime runs the server, the client and the Redis connections on that one thread, and
//! the tests of this file, run in parallel, do not see each other's counts.

// A test stops on what it did not expect: its unwraps, indexes and panics are assertions.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::panic
)]

mod support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use support::{RedisNode, eventually, nodes, redlock, serve};
use tokio::sync::Notify;
use tower_redlock::{
    ConcurrencyLimitLayer, IdempotencyLayer, LockLayer, Locks, RateLimitLayer, RateLimiter,
    RedisConcurrencyLimiter, RedisRateLimiter, Redlock, Renewal,
};
use tracing::span;
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;

/// A key value that must never show up in a label or a span field.
const SECRET: &str = "k3y-v4lue-n0t-f0r-dashboards";

/// The counters and histograms recorded so far, by name and labels.
#[derive(Debug)]
struct Metrics {
    counters: HashMap<(String, Vec<(String, String)>), u64>,
    histograms: HashMap<String, usize>,
}

impl Metrics {
    fn of(snapshotter: &Snapshotter) -> Self {
        let mut counters = HashMap::new();
        let mut histograms = HashMap::new();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let key = key.key();
            let name = key.name().to_owned();
            let labels: Vec<(String, String)> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            for (_, value) in &labels {
                assert!(!value.contains(SECRET), "a label holds the key: {labels:?}");
            }
            match value {
                DebugValue::Counter(n) => {
                    counters.insert((name, labels), n);
                }
                DebugValue::Histogram(values) => {
                    histograms.insert(name, values.len());
                }
                DebugValue::Gauge(_) => {}
            }
        }
        Self {
            counters,
            histograms,
        }
    }

    fn counter(&self, name: &str, label: &str, value: &str) -> u64 {
        let key = (name.to_owned(), vec![(label.to_owned(), value.to_owned())]);
        self.counters.get(&key).copied().unwrap_or(0)
    }

    fn result(&self, name: &str, result: &str) -> u64 {
        self.counter(name, "result", result)
    }

    fn histogram(&self, name: &str) -> usize {
        self.histograms.get(name).copied().unwrap_or(0)
    }
}

const LOCKS: &str = "tower_redlock_lock_requests_total";
const RATE: &str = "tower_redlock_rate_limit_requests_total";
const CONCURRENCY: &str = "tower_redlock_concurrency_requests_total";
const IDEMPOTENCY: &str = "tower_redlock_idempotency_requests_total";
const NODE_ERRORS: &str = "tower_redlock_node_errors_total";
const ACQUIRE: &str = "tower_redlock_lock_acquire_duration_seconds";
const HELD: &str = "tower_redlock_lock_held_duration_seconds";

/// Holds a handler until released, so that a request can hold its key.
#[derive(Clone, Default)]
struct Gate {
    entered: Arc<Notify>,
    release: Arc<Notify>,
}

impl Gate {
    /// A handler that says it entered, then waits to be released.
    fn handler(&self) -> axum::routing::MethodRouter {
        let gate = self.clone();
        post(move || {
            let gate = gate.clone();
            async move {
                gate.entered.notify_one();
                gate.release.notified().await;
                "done"
            }
        })
    }

    /// Waits until a request is in the handler (its key held).
    async fn entered(&self) {
        tokio::time::timeout(Duration::from_secs(10), self.entered.notified())
            .await
            .expect("the first request never reached the handler");
    }

    fn open(&self) {
        self.release.notify_one();
    }
}

async fn post_with(client: &reqwest::Client, url: &str, key: Option<&str>, body: &str) -> u16 {
    let mut request = client.post(url).body(body.to_owned());
    if let Some(key) = key {
        request = request.header("Idempotency-Key", key);
    }
    request.send().await.unwrap().status().as_u16()
}

#[tokio::test]
async fn lock_requests_are_counted_by_result_and_node_errors_by_host_and_port() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _recorder = metrics::set_default_local_recorder(&recorder);

    let mut nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(10)).await;
    let gate = Gate::default();
    let app = Router::new().route(
        "/pay",
        gate.handler()
            .layer(LockLayer::by_header("Idempotency-Key").backend(locks.clone())),
    );
    let base = serve(app).await;
    let url = format!("{base}/pay");
    let client = reqwest::Client::new();

    // Held by the first request: the second one is taken (409).
    let first = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move { post_with(&client, &url, Some(SECRET), "").await }
    });
    gate.entered().await;
    assert_eq!(post_with(&client, &url, Some(SECRET), "").await, 409);
    // Without the header: 400.
    assert_eq!(post_with(&client, &url, None, "").await, 400);
    gate.open();
    assert_eq!(first.await.unwrap(), 200);

    // Two nodes of three gone: no quorum, 503.
    nodes[1].kill();
    nodes[2].kill();
    assert_eq!(post_with(&client, &url, Some("other"), "").await, 503);

    let m = Metrics::of(&snapshotter);
    assert_eq!(m.result(LOCKS, "acquired"), 1, "{m:?}");
    assert_eq!(m.result(LOCKS, "taken"), 1, "{m:?}");
    assert_eq!(m.result(LOCKS, "invalid"), 1, "{m:?}");
    assert_eq!(m.result(LOCKS, "unavailable"), 1, "{m:?}");
    assert_eq!(m.result(LOCKS, "lost"), 0, "{m:?}");
    // Every acquisition that reached the backend was timed; the 400 never did.
    assert_eq!(m.histogram(ACQUIRE), 3, "{m:?}");
    assert_eq!(m.histogram(HELD), 1, "{m:?}");
    // The dead nodes, by host:port; none for the live one.
    for node in &nodes[1..] {
        let label = format!("127.0.0.1:{}", node.port());
        assert!(
            m.counter(NODE_ERRORS, "node", &label) >= 1,
            "no error counted for {label}: {m:?}"
        );
    }
    let live = format!("127.0.0.1:{}", nodes[0].port());
    assert_eq!(m.counter(NODE_ERRORS, "node", &live), 0, "{m:?}");
}

#[tokio::test]
async fn a_lost_lease_is_counted_and_its_hold_timed() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _recorder = metrics::set_default_local_recorder(&recorder);

    let nodes = nodes(1);
    // Not renewed: the lease runs out while the handler waits, and the layer answers 503.
    let locks = redlock(&nodes, Duration::from_millis(300)).await;
    let gate = Gate::default();
    let app = Router::new().route(
        "/job",
        gate.handler().layer(
            LockLayer::by_header("Idempotency-Key")
                .backend(locks)
                .renewal(Renewal::disabled()),
        ),
    );
    let url = format!("{}/job", serve(app).await);
    let status = post_with(&reqwest::Client::new(), &url, Some(SECRET), "").await;
    assert_eq!(status, 503);

    let m = Metrics::of(&snapshotter);
    assert_eq!(m.result(LOCKS, "acquired"), 1, "{m:?}");
    assert_eq!(m.result(LOCKS, "lost"), 1, "{m:?}");
    assert_eq!(m.histogram(HELD), 1, "{m:?}");
}

#[tokio::test]
async fn rate_limit_requests_are_counted_by_result() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _recorder = metrics::set_default_local_recorder(&recorder);

    let mut node = RedisNode::start();
    let limiter = RedisRateLimiter::builder(node.url()).build().await.unwrap();
    let layer = RateLimitLayer::by_header("Idempotency-Key", "2/60".parse().unwrap())
        .backend(RateLimiter::from(limiter));
    let app = Router::new().route("/buy", post(|| async { "ok" }).layer(layer));
    let url = format!("{}/buy", serve(app).await);
    let client = reqwest::Client::new();

    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(post_with(&client, &url, Some(SECRET), "").await);
    }
    assert_eq!(seen, [200, 200, 429]);
    assert_eq!(post_with(&client, &url, None, "").await, 400);
    // Redis gone: the layer fails open, the request runs uncounted.
    node.kill();
    assert_eq!(post_with(&client, &url, Some(SECRET), "").await, 200);

    let m = Metrics::of(&snapshotter);
    assert_eq!(m.result(RATE, "allowed"), 2, "{m:?}");
    assert_eq!(m.result(RATE, "limited"), 1, "{m:?}");
    assert_eq!(m.result(RATE, "invalid"), 1, "{m:?}");
    assert_eq!(m.result(RATE, "unavailable"), 1, "{m:?}");
    let label = format!("127.0.0.1:{}", node.port());
    assert_eq!(m.counter(NODE_ERRORS, "node", &label), 1, "{m:?}");
}

#[tokio::test]
async fn concurrency_requests_are_counted_by_result_and_outages_by_layer() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _recorder = metrics::set_default_local_recorder(&recorder);

    let mut node = RedisNode::start();
    let limiter = RedisConcurrencyLimiter::builder(node.url())
        .build()
        .await
        .unwrap();
    let gate = Gate::default();
    let layer = ConcurrencyLimitLayer::by_header("Idempotency-Key", 1).backend(limiter);
    let app = Router::new().route("/export", gate.handler().layer(layer));
    let url = format!("{}/export", serve(app).await);
    let client = reqwest::Client::new();

    let entered = gate.entered.notified();
    let first = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move { post_with(&client, &url, Some(SECRET), "").await }
    });
    entered.await;
    assert_eq!(post_with(&client, &url, Some(SECRET), "").await, 503);
    assert_eq!(post_with(&client, &url, None, "").await, 400);
    gate.release.notify_one();
    assert_eq!(first.await.unwrap(), 200);
    // Redis gone: the limiter fails open, the request runs unguarded.
    node.kill();
    let ran = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move { post_with(&client, &url, Some(SECRET), "").await }
    });
    gate.entered.notified().await;
    gate.release.notify_one();
    assert_eq!(ran.await.unwrap(), 200);

    let m = Metrics::of(&snapshotter);
    assert_eq!(m.result(CONCURRENCY, "admitted"), 1, "{m:?}");
    assert_eq!(m.result(CONCURRENCY, "limited"), 1, "{m:?}");
    assert_eq!(m.result(CONCURRENCY, "invalid"), 1, "{m:?}");
    assert_eq!(m.result(CONCURRENCY, "unavailable"), 1, "{m:?}");
    let outage = (
        "tower_redlock_store_unavailable_total".to_owned(),
        vec![
            ("layer".to_owned(), "ConcurrencyLimitLayer".to_owned()),
            ("outcome".to_owned(), "fail_open".to_owned()),
        ],
    );
    assert_eq!(m.counters.get(&outage).copied(), Some(1), "{m:?}");
}

#[tokio::test]
async fn idempotency_requests_are_counted_by_result() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _recorder = metrics::set_default_local_recorder(&recorder);

    let nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(10)).await;
    let gate = Gate::default();
    let app = Router::new().route(
        "/orders",
        gate.handler()
            .layer(IdempotencyLayer::new().backend(locks.clone())),
    );
    let url = format!("{}/orders", serve(app).await);
    let client = reqwest::Client::new();

    let first = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move { post_with(&client, &url, Some(SECRET), "{\"n\":1}").await }
    });
    gate.entered().await;
    assert_eq!(
        post_with(&client, &url, Some(SECRET), "{\"n\":1}").await,
        409
    );
    gate.open();
    assert_eq!(first.await.unwrap(), 200);
    assert_eq!(
        post_with(&client, &url, Some(SECRET), "{\"n\":1}").await,
        200
    );
    assert_eq!(
        post_with(&client, &url, Some(SECRET), "{\"n\":2}").await,
        422
    );
    assert_eq!(post_with(&client, &url, None, "{\"n\":1}").await, 400);

    let m = Metrics::of(&snapshotter);
    assert_eq!(m.result(IDEMPOTENCY, "new"), 1, "{m:?}");
    assert_eq!(m.result(IDEMPOTENCY, "in_flight"), 1, "{m:?}");
    assert_eq!(m.result(IDEMPOTENCY, "replayed"), 1, "{m:?}");
    assert_eq!(m.result(IDEMPOTENCY, "mismatch"), 1, "{m:?}");
    assert_eq!(m.result(IDEMPOTENCY, "missing"), 1, "{m:?}");
}

/// One span as the capture saw it: its name, its parent's name and its fields.
#[derive(Debug, Clone, Default)]
struct SpanRecord {
    name: String,
    parent: Option<String>,
    fields: HashMap<String, String>,
}

#[derive(Default)]
struct Fields<'a>(Option<&'a mut HashMap<String, String>>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if let Some(fields) = self.0.as_mut() {
            fields.insert(field.name().to_owned(), format!("{value:?}"));
        }
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if let Some(fields) = self.0.as_mut() {
            fields.insert(field.name().to_owned(), value.to_owned());
        }
    }
}

/// Keeps every closed span.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<SpanRecord>>>);

impl<S> tracing_subscriber::Layer<S> for Capture
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        let span = ctx.span(id).unwrap();
        let mut record = SpanRecord {
            name: attrs.metadata().name().to_owned(),
            parent: span.parent().map(|p| p.name().to_owned()),
            fields: HashMap::new(),
        };
        attrs.record(&mut Fields(Some(&mut record.fields)));
        span.extensions_mut().insert(record);
    }

    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).unwrap();
        let mut extensions = span.extensions_mut();
        let record = extensions.get_mut::<SpanRecord>().unwrap();
        values.record(&mut Fields(Some(&mut record.fields)));
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        let span = ctx.span(&id).unwrap();
        if let Some(record) = span.extensions_mut().remove::<SpanRecord>() {
            self.0.lock().unwrap().push(record);
        }
    }
}

/// The capture, installed as the global subscriber the first time. Global rather than
/// for this thread: tracing caches whether a span is wanted per call site, and a call site
/// first met on another test's thread could be cached as unwanted before a thread's own
/// subscriber is counted. The other tests' spans land here too (and are checked for the
/// key as well); this test picks its own by their route.
fn capture() -> Capture {
    static CAPTURE: std::sync::OnceLock<Capture> = std::sync::OnceLock::new();
    CAPTURE
        .get_or_init(|| {
            let capture = Capture::default();
            let subscriber =
                tracing_subscriber::registry().with(tracing_subscriber::Layer::with_filter(
                    capture.clone(),
                    tracing_subscriber::filter::LevelFilter::DEBUG,
                ));
            tracing::subscriber::set_global_default(subscriber).unwrap();
            capture
        })
        .clone()
}

impl Capture {
    /// The closed spans named `name` whose scope names `route`.
    fn spans(&self, name: &str, route: &str) -> Vec<SpanRecord> {
        let spans = self.0.lock().unwrap();
        for span in spans.iter() {
            for value in span.fields.values() {
                assert!(!value.contains(SECRET), "a span holds the key: {span:?}");
            }
        }
        spans
            .iter()
            .filter(|s| s.name == name && s.fields.get("scope").is_some_and(|v| v.ends_with(route)))
            .cloned()
            .collect()
    }
}

#[tokio::test]
async fn backend_spans_sit_under_the_request_span_with_scope_quorum_and_verdict() {
    let capture = capture();

    let nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(10)).await;
    let gate = Gate::default();
    let app = Router::new()
        .route(
            "/traced",
            gate.handler()
                .layer(LockLayer::by_header("Idempotency-Key").backend(locks.clone())),
        )
        .layer(tower_http::trace::TraceLayer::new_for_http());
    let url = format!("{}/traced", serve(app).await);
    let client = reqwest::Client::new();

    let first = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move { post_with(&client, &url, Some(SECRET), "").await }
    });
    gate.entered().await;
    assert_eq!(post_with(&client, &url, Some(SECRET), "").await, 409);
    gate.open();
    assert_eq!(first.await.unwrap(), StatusCode::OK.as_u16());

    let released = eventually(Duration::from_secs(5), || async {
        capture
            .spans("tower_redlock.release", "/traced")
            .iter()
            .any(|s| s.parent.as_deref() == Some("request"))
    })
    .await;
    assert!(released, "no release span under the request span");
    let acquires: Vec<_> = capture
        .spans("tower_redlock.acquire", "/traced")
        .into_iter()
        .filter(|s| s.parent.as_deref() == Some("request"))
        .collect();
    assert_eq!(acquires.len(), 2, "{acquires:?}");
    let verdicts: Vec<_> = acquires
        .iter()
        .map(|s| s.fields["verdict"].as_str())
        .collect();
    assert!(
        verdicts.contains(&"ok") && verdicts.contains(&"taken"),
        "{acquires:?}"
    );
    for span in &acquires {
        assert_eq!(
            span.fields["scope"], "idempotency-key POST /traced",
            "{span:?}"
        );
        assert_eq!(span.fields["quorum"], "2", "{span:?}");
        let answered: usize = span.fields["nodes_answered"].parse().unwrap();
        // A request refused while this process holds the key is answered in process,
        // without asking a node.
        if span.fields["verdict"] == "taken" {
            assert!(answered == 0 || answered >= 2, "{span:?}");
        } else {
            assert!(answered >= 2, "{span:?}");
        }
        let elapsed: f64 = span.fields["elapsed_ms"].parse().unwrap();
        assert!(elapsed > 0.0, "{span:?}");
    }
}

#[tokio::test]
async fn a_node_that_stops_answering_is_counted_once_its_deadline_passes() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _recorder = metrics::set_default_local_recorder(&recorder);

    let nodes = nodes(3);
    let proxy = support::Proxy::start(nodes[2].addr()).await;
    let redlock = Locks::from(
        Redlock::builder([nodes[0].url(), nodes[1].url(), proxy.url()])
            .node_timeout(Duration::from_millis(200))
            .build()
            .await
            .unwrap(),
    );
    // Connected through the proxy, then silent: no error, no answer.
    redlock
        .unlock(redlock.try_lock("warm").await.unwrap())
        .await
        .unwrap();
    proxy.black_hole();
    // The two other nodes decide both rounds; the silent one is given up at its deadline
    // (the release's stragglers are finished in the background until then).
    let lease = redlock.try_lock(SECRET).await.unwrap();
    redlock.unlock(lease).await.unwrap();

    let label = format!("127.0.0.1:{}", proxy.url().rsplit(':').next().unwrap());
    let counted = eventually(Duration::from_secs(5), || async {
        Metrics::of(&snapshotter).counter(NODE_ERRORS, "node", &label) >= 1
    })
    .await;
    let m = Metrics::of(&snapshotter);
    assert!(counted, "the silent node was never counted: {m:?}");
    for node in &nodes[..2] {
        let live = format!("127.0.0.1:{}", node.port());
        assert_eq!(m.counter(NODE_ERRORS, "node", &live), 0, "{m:?}");
    }
}

/// The gauges' values: the debugging recorder's snapshot hands out what changed since the
/// last one (it swaps each value for 0), so the values are the sums of the snapshots.
#[derive(Default)]
struct Gauges(std::cell::RefCell<HashMap<String, f64>>);

impl Gauges {
    fn now(&self, snapshotter: &Snapshotter, name: &str) -> f64 {
        let mut totals = self.0.borrow_mut();
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            if let DebugValue::Gauge(change) = value {
                *totals.entry(key.key().name().to_owned()).or_default() += change.into_inner();
            }
        }
        totals.get(name).copied().unwrap_or(0.0)
    }
}

#[tokio::test]
async fn gauges_show_the_leases_permits_and_waiters_of_this_process_now() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _recorder = metrics::set_default_local_recorder(&recorder);

    let nodes = nodes(1);
    let locks = redlock(&nodes, Duration::from_secs(10)).await;
    let limiter = RedisConcurrencyLimiter::builder(nodes[0].url())
        .build()
        .await
        .unwrap();
    let gate = Gate::default();
    // A permit first, then the lock, waiting for it up to 5 s.
    let route = gate.handler().layer(
        tower::ServiceBuilder::new()
            .layer(ConcurrencyLimitLayer::by_header("Idempotency-Key", 5).backend(limiter))
            .layer(
                LockLayer::by_header("Idempotency-Key")
                    .backend(locks)
                    .max_wait(Duration::from_secs(5)),
            ),
    );
    let url = format!(
        "{}/export",
        serve(Router::new().route("/export", route)).await
    );
    let client = reqwest::Client::new();
    let send = || {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { post_with(&client, &url, Some(SECRET), "").await })
    };
    let gauges = Gauges::default();
    let now = |name| gauges.now(&snapshotter, name);

    let first = send();
    gate.entered().await;
    let second = send();
    assert!(
        eventually(Duration::from_secs(5), || async {
            now("tower_redlock_waiters") == 1.0
        })
        .await,
        "the second request waits for the lock"
    );
    assert_eq!(now("tower_redlock_leases_held"), 1.0);
    assert_eq!(now("tower_redlock_concurrency_permits_held"), 2.0);

    gate.open();
    assert_eq!(first.await.unwrap(), 200);
    gate.entered().await;
    assert_eq!(now("tower_redlock_waiters"), 0.0);
    assert_eq!(now("tower_redlock_leases_held"), 1.0);
    gate.open();
    assert_eq!(second.await.unwrap(), 200);
    assert!(
        eventually(Duration::from_secs(5), || async {
            now("tower_redlock_leases_held") == 0.0
                && now("tower_redlock_concurrency_permits_held") == 0.0
        })
        .await,
        "leases {} and permits {} left after the requests",
        now("tower_redlock_leases_held"),
        now("tower_redlock_concurrency_permits_held")
    );
}
