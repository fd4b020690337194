//! LockLayer and Locked<T> through a real server on 127.0.0.1 and a real HTTP client.

use crate::support;

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use support::{Logs, eventually, exists, nodes, post_to, redlock, retry_after, serve};
use tokio::sync::Notify;
use tower_redlock::{Lease, LockKey, LockLayer, Locked, Locks, MemoryLocks};

/// A handler that stays in flight until `release` is notified.
#[derive(Clone, Default)]
struct Gate {
    entered: Arc<AtomicUsize>,
    release: Arc<Notify>,
}

impl Gate {
    async fn hold(&self) -> StatusCode {
        self.entered.fetch_add(1, Ordering::SeqCst);
        self.release.notified().await;
        StatusCode::CREATED
    }

    async fn wait_entered(&self, n: usize) {
        let entered = eventually(Duration::from_secs(5), || async {
            self.entered.load(Ordering::SeqCst) >= n
        })
        .await;
        assert!(entered, "handler not entered");
    }
}

fn orders_app(locks: Locks, gate: Gate) -> Router {
    Router::new()
        .route("/orders", post(move || async move { gate.hold().await }))
        .layer(LockLayer::by_header("Idempotency-Key").backend(locks))
}

async fn assert_problem(resp: reqwest::Response, status: u16) -> serde_json::Value {
    assert_eq!(resp.status().as_u16(), status);
    assert_eq!(resp.headers()["content-type"], "application/problem+json");
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["status"], status);
    assert!(body["detail"].as_str().is_some_and(|d| !d.is_empty()));
    body
}

async fn same_key_exactly_one_201(locks: Locks) {
    let gate = Gate::default();
    let base = serve(orders_app(locks, gate.clone())).await;
    let client = reqwest::Client::new();
    let send = || {
        client
            .post(format!("{base}/orders"))
            .header("Idempotency-Key", "\"order-7\"")
            .send()
    };

    let first = tokio::spawn(send());
    gate.wait_entered(1).await;
    // While the first is held in flight, every other request with the key must be a 409.
    let others = futures_util::future::join_all((0..20).map(|_| send())).await;
    for resp in others {
        let resp = resp.unwrap();
        let retry_after = retry_after(&resp);
        assert!(retry_after >= 1);
        assert_problem(resp, 409).await;
    }
    gate.release.notify_one();
    assert_eq!(first.await.unwrap().unwrap().status(), 201);
    assert_eq!(gate.entered.load(Ordering::SeqCst), 1);
    // Completed: the key is free again.
    gate.release.notify_one();
    assert_eq!(send().await.unwrap().status(), 201);
}

#[tokio::test]
async fn same_idempotency_key_in_flight_is_409_three_nodes() {
    let nodes = nodes(3);
    same_key_exactly_one_201(redlock(&nodes, Duration::from_secs(30)).await).await;
}

#[tokio::test]
async fn same_idempotency_key_in_flight_is_409_in_process() {
    same_key_exactly_one_201(Locks::from(MemoryLocks::new())).await;
}

#[tokio::test]
async fn missing_oversized_and_malformed_keys_are_400() {
    let gate = Gate::default();
    let base = serve(orders_app(Locks::from(MemoryLocks::new()), gate.clone())).await;
    let client = reqwest::Client::new();
    let url = format!("{base}/orders");
    assert_problem(client.post(&url).send().await.unwrap(), 400).await;
    let long = "k".repeat(tower_redlock::key::MAX_KEY_LEN + 1);
    let body = assert_problem(
        client
            .post(&url)
            .header("Idempotency-Key", long)
            .send()
            .await
            .unwrap(),
        400,
    )
    .await;
    assert!(body["detail"].as_str().unwrap().contains("256"), "{body}");
    assert_problem(
        client
            .post(&url)
            .header("Idempotency-Key", "\"unterminated")
            .send()
            .await
            .unwrap(),
        400,
    )
    .await;
    assert_problem(
        client
            .post(&url)
            .header("Idempotency-Key", "\"\"")
            .send()
            .await
            .unwrap(),
        400,
    )
    .await;
    assert_eq!(
        gate.entered.load(Ordering::SeqCst),
        0,
        "the handler ran for a bad key"
    );
}

#[tokio::test]
async fn all_nodes_down_is_503_with_retry_after() {
    let mut nodes = nodes(3);
    let gate = Gate::default();
    let base = serve(orders_app(
        redlock(&nodes, Duration::from_secs(10)).await,
        gate.clone(),
    ))
    .await;
    for node in &mut nodes {
        node.kill();
    }
    let start = Instant::now();
    let resp = reqwest::Client::new()
        .post(format!("{base}/orders"))
        .header("Idempotency-Key", "k")
        .send()
        .await
        .unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
    assert_eq!(resp.headers()["retry-after"], "1");
    let body = assert_problem(resp, 503).await;
    assert!(
        !body.to_string().contains("127.0.0.1"),
        "internal details leaked: {body}"
    );
    assert_eq!(gate.entered.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn fail_open_runs_unlocked_when_nodes_are_down() {
    let mut nodes = nodes(1);
    let locks = redlock(&nodes, Duration::from_secs(10)).await;
    let app = Router::new()
        .route(
            "/orders",
            post(|lease: Option<Lease>| async move {
                if lease.is_some() {
                    "locked"
                } else {
                    "unlocked"
                }
            }),
        )
        .layer(
            LockLayer::by_header("Idempotency-Key")
                .backend(locks)
                .fail_open(true),
        );
    let base = serve(app).await;
    let client = reqwest::Client::new();
    let send = || {
        client
            .post(format!("{base}/orders"))
            .header("Idempotency-Key", "k")
            .send()
    };
    assert_eq!(send().await.unwrap().text().await.unwrap(), "locked");
    nodes[0].kill();
    let resp = send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.unwrap(), "unlocked");
}

#[tokio::test]
async fn client_disconnect_frees_the_lock_long_before_ttl() {
    let nodes = nodes(3);
    let ttl = Duration::from_secs(60);
    let locks = redlock(&nodes, ttl).await;
    let gate = Gate::default();
    let base = serve(orders_app(locks, gate.clone())).await;
    let key = "tower-redlock:idempotency-key POST /orders:gone";

    // The client gives up while the handler is still running.
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    let url = format!("{base}/orders");
    let abandoned = tokio::spawn({
        let client = client.clone();
        let url = url.clone();
        async move {
            client
                .post(url)
                .header("Idempotency-Key", "gone")
                .send()
                .await
        }
    });
    gate.wait_entered(1).await;
    assert!(exists(&nodes[0], key).await, "lock not taken on {key}");
    assert!(
        abandoned.await.unwrap().is_err(),
        "the request should have timed out"
    );

    let start = Instant::now();
    let freed = eventually(Duration::from_secs(5), || async {
        let mut n = 0;
        for node in &nodes {
            n += usize::from(exists(node, key).await);
        }
        n == 0
    })
    .await;
    assert!(freed, "lock still held after the client went away");
    assert!(start.elapsed() < ttl / 10);
    // And a new request with the key goes through.
    gate.release.notify_one();
    let again = reqwest::Client::new()
        .post(&url)
        .header("Idempotency-Key", "gone")
        .send();
    let waiter = tokio::spawn(again);
    gate.wait_entered(2).await;
    gate.release.notify_one();
    assert_eq!(waiter.await.unwrap().unwrap().status(), 201);
}

#[tokio::test]
async fn path_param_scopes_keep_items_and_users_apart() {
    let gate = Gate::default();
    let locks = Locks::from(MemoryLocks::new());
    let held = gate.clone();
    let app = Router::new()
        .route(
            "/items/{id}",
            post(move || async move { held.hold().await }),
        )
        .route("/items/{id}/buy", post(|| async { StatusCode::OK }))
        .route("/users/{id}", post(|| async { StatusCode::OK }))
        .route_layer(LockLayer::by_path_param("id").backend(locks));
    let base = serve(app).await;
    let client = reqwest::Client::new();
    let holder = tokio::spawn(client.post(format!("{base}/items/1")).send());
    gate.wait_entered(1).await;
    // Same id, other resource: not locked.
    assert_eq!(
        post_to(&client, format!("{base}/users/1")).await.status(),
        200
    );
    // Other item: not locked.
    assert_eq!(
        post_to(&client, format!("{base}/items/2/buy"))
            .await
            .status(),
        200
    );
    // Same item through a sub-route: locked, 423 with Retry-After.
    let resp = post_to(&client, format!("{base}/items/1/buy")).await;
    assert!(resp.headers().contains_key("retry-after"));
    assert_problem(resp, 423).await;
    gate.release.notify_one();
    assert_eq!(holder.await.unwrap().unwrap().status(), 201);
}

#[tokio::test]
async fn handler_reads_its_lease_from_extensions() {
    let nodes = nodes(1);
    let app = Router::new()
        .route(
            "/jobs/{job}",
            post(|lease: Lease| async move {
                format!("{} {} {}", lease.key(), lease.token(), lease.is_valid())
            }),
        )
        .layer(
            LockLayer::by_path_param("job").backend(redlock(&nodes, Duration::from_secs(10)).await),
        );
    let base = serve(app).await;
    let text = reqwest::Client::new()
        .post(format!("{base}/jobs/nightly"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let parts: Vec<&str> = text.split(' ').collect();
    // The route template's braces are escaped: no accidental Redis Cluster hash tag.
    assert_eq!(parts[0], "tower-redlock:/jobs/%7Bjob%7D:nightly");
    assert_eq!(parts[1].len(), 32);
    assert_eq!(parts[2], "true");
    // Released once the response is out.
    assert!(!exists(&nodes[0], parts[0]).await);
}

#[tokio::test]
async fn by_fn_and_optional_key() {
    let gate = Gate::default();
    let held = gate.clone();
    let app = Router::new()
        .route("/report", post(move || async move { held.hold().await }))
        .layer(
            LockLayer::by_fn(|parts| {
                parts
                    .headers
                    .get("x-tenant")?
                    .to_str()
                    .ok()
                    .map(str::to_owned)
            })
            .scope("report")
            .backend(MemoryLocks::new())
            .optional(true),
        );
    let base = serve(app).await;
    let client = reqwest::Client::new();
    let holder = tokio::spawn(
        client
            .post(format!("{base}/report"))
            .header("x-tenant", "acme")
            .send(),
    );
    gate.wait_entered(1).await;
    let resp = client
        .post(format!("{base}/report"))
        .header("x-tenant", "acme")
        .send()
        .await
        .unwrap();
    assert_problem(resp, 423).await;
    // Without a key the request passes, unlocked.
    let unkeyed = tokio::spawn(client.post(format!("{base}/report")).send());
    gate.wait_entered(2).await;
    gate.release.notify_waiters();
    assert_eq!(holder.await.unwrap().unwrap().status(), 201);
    assert_eq!(unkeyed.await.unwrap().unwrap().status(), 201);
}

#[derive(serde::Deserialize)]
struct OrderId(String);

impl LockKey for OrderId {
    const SCOPE: &'static str = "order";
    fn lock_key(&self) -> Cow<'_, str> {
        Cow::Borrowed(&self.0)
    }
}

#[tokio::test]
async fn locked_extractor_423_and_release_on_drop() {
    let nodes = nodes(3);
    let locks = redlock(&nodes, Duration::from_secs(30)).await;
    let gate = Gate::default();
    // The backend comes from the state through FromRef.
    #[derive(Clone)]
    struct AppState {
        locks: Locks,
        gate: Gate,
    }
    impl axum::extract::FromRef<AppState> for Locks {
        fn from_ref(s: &AppState) -> Locks {
            s.locks.clone()
        }
    }
    impl axum::extract::FromRef<AppState> for Gate {
        fn from_ref(s: &AppState) -> Gate {
            s.gate.clone()
        }
    }
    let app = Router::new()
        .route(
            "/orders/{id}/pay",
            post(
                |State(gate): State<Gate>, order: Locked<Path<OrderId>>| async move {
                    assert_eq!(
                        order.lease().key(),
                        format!("tower-redlock:order:{}", order.0.0)
                    );
                    gate.hold().await
                },
            ),
        )
        .with_state(AppState {
            locks,
            gate: gate.clone(),
        });
    let base = serve(app).await;
    let client = reqwest::Client::new();
    let first = tokio::spawn(client.post(format!("{base}/orders/9/pay")).send());
    gate.wait_entered(1).await;
    assert!(exists(&nodes[1], "tower-redlock:order:9").await);
    let resp = post_to(&client, format!("{base}/orders/9/pay")).await;
    assert!(resp.headers().contains_key("retry-after"));
    assert_problem(resp, 423).await;
    gate.release.notify_one();
    assert_eq!(first.await.unwrap().unwrap().status(), 201);
    let released = eventually(Duration::from_secs(5), || async {
        !exists(&nodes[1], "tower-redlock:order:9").await
    })
    .await;
    assert!(released, "Locked did not release on drop");
}

#[tokio::test]
async fn locked_extractor_reuses_the_layer_lease() {
    let locks = Locks::from(MemoryLocks::new());
    let app = Router::new()
        .route(
            "/orders/{order_id}/pay",
            post(
                |layer_lease: Lease, order: Locked<Path<OrderId>>| async move {
                    assert_eq!(order.lease(), &layer_lease);
                    "paid"
                },
            ),
        )
        .route_layer(
            LockLayer::by_path_param("order_id")
                .scope("order")
                .backend(locks.clone()),
        )
        .with_state(locks.clone());
    let base = serve(app).await;
    let resp = reqwest::Client::new()
        .post(format!("{base}/orders/5/pay"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
    // Released by the layer afterwards.
    locks
        .unlock(
            locks
                .try_lock("order:5")
                .await
                .expect("free after the request"),
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn route_layer_leaves_unmatched_requests_alone() {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route_layer(LockLayer::by_header("Idempotency-Key").backend(MemoryLocks::new()));
    let base = serve(app).await;
    // route_layer does not run for unmatched routes.
    assert_eq!(
        reqwest::get(format!("{base}/nope")).await.unwrap().status(),
        404
    );
}

#[tokio::test]
async fn client_cannot_forge_the_fencing_header() {
    let nodes = nodes(1);
    // No fencing tokens on this backend, and the key is optional: nothing may put a
    // client-chosen value in the header the inner service trusts.
    let app = Router::new()
        .route(
            "/write",
            post(|headers: axum::http::HeaderMap| async move {
                format!("{:?}", headers.get("fencing-token"))
            }),
        )
        .layer(
            LockLayer::by_header("Idempotency-Key")
                .backend(redlock(&nodes, Duration::from_secs(10)).await)
                .fencing_header("Fencing-Token")
                .optional(true),
        );
    let base = serve(app).await;
    let client = reqwest::Client::new();
    for with_key in [true, false] {
        let mut req = client
            .post(format!("{base}/write"))
            .header("Fencing-Token", "999999999");
        if with_key {
            req = req.header("Idempotency-Key", "k");
        }
        assert_eq!(req.send().await.unwrap().text().await.unwrap(), "None");
    }
}

#[tokio::test]
async fn locked_extractor_does_not_reuse_a_lease_of_another_backend() {
    let layer_locks = Locks::from(MemoryLocks::new());
    let state_locks = Locks::from(MemoryLocks::new());
    let check = state_locks.clone();
    let app = Router::new()
        .route(
            "/orders/{order_id}/pay",
            post(
                move |layer_lease: Lease, order: Locked<Path<OrderId>>| async move {
                    assert_ne!(order.lease(), &layer_lease);
                    // The extractor locked its own backend.
                    assert!(check.try_lock("order:5").await.is_err());
                    "paid"
                },
            ),
        )
        .route_layer(
            LockLayer::by_path_param("order_id")
                .scope("order")
                .backend(layer_locks),
        )
        .with_state(state_locks);
    let base = serve(app).await;
    let resp = reqwest::Client::new()
        .post(format!("{base}/orders/5/pay"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{}", resp.text().await.unwrap());
}

/// Serves any service, without the peer address (no `ConnectInfo`).
async fn serve_service<S>(service: S) -> String
where
    S: tower::Service<
            axum::extract::Request,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    use axum::ServiceExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, service.into_make_service())
            .await
            .unwrap();
    });
    format!("http://{addr}")
}

type AppService = tower::util::BoxCloneSyncService<
    axum::extract::Request,
    axum::response::Response,
    std::convert::Infallible,
>;

/// `layer` around the whole `Router`, from outside, as a plain tower stack.
fn around<L>(layer: L, router: Router) -> AppService
where
    L: tower::Layer<Router>,
    L::Service: tower::Service<axum::extract::Request, Error = std::convert::Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    <L::Service as tower::Service<axum::extract::Request>>::Response: axum::response::IntoResponse,
    <L::Service as tower::Service<axum::extract::Request>>::Future: Send,
{
    use axum::response::IntoResponse;
    AppService::new(
        tower::ServiceBuilder::new()
            .map_response(IntoResponse::into_response)
            .layer(layer)
            .service(router),
    )
}

async fn assert_misconfigured(resp: reqwest::Response, leak: &str) {
    let body = assert_problem(resp, 500).await;
    assert!(
        !body.to_string().contains(leak),
        "internal details leaked: {body}"
    );
}

#[tokio::test]
async fn path_param_the_route_lacks_is_a_500_logged_once() {
    let (logs, _guard) = Logs::capture();
    let gate = Gate::default();
    let held = gate.clone();
    let app = Router::new()
        .route(
            "/items/{id}",
            post(move || async move { held.hold().await }),
        )
        .route_layer(LockLayer::by_path_param("item_id").backend(MemoryLocks::new()));
    let base = serve(app).await;
    let client = reqwest::Client::new();
    for _ in 0..3 {
        let resp = client.post(format!("{base}/items/1")).send().await.unwrap();
        assert_misconfigured(resp, "item_id").await;
    }
    assert_eq!(gate.entered.load(Ordering::SeqCst), 0);
    assert_eq!(logs.errors_with("item_id"), 1, "one log line per layer");
}

#[tokio::test]
async fn path_param_layer_around_the_router_is_a_500_logged_once() {
    let (logs, _guard) = Logs::capture();
    let router = Router::new().route("/items/{id}", post(|| async { "ran" }));
    let layer = LockLayer::by_path_param("id").backend(MemoryLocks::new());
    let base = serve_service(around(layer, router)).await;
    let client = reqwest::Client::new();
    for _ in 0..3 {
        let resp = client.post(format!("{base}/items/1")).send().await.unwrap();
        assert_misconfigured(resp, "route_layer").await;
    }
    assert_eq!(logs.errors_with("route_layer"), 1, "one log line per layer");
}

#[tokio::test]
async fn peer_ip_without_connect_info_is_a_500_logged_once() {
    let (logs, _guard) = Logs::capture();
    let quota: tower_redlock::Quota = "10/60".parse().unwrap();
    let app = Router::new()
        .route("/search", post(|| async { "results" }))
        .route_layer(
            tower_redlock::RateLimitLayer::by_peer_ip(quota)
                .backend(tower_redlock::MemoryRateLimiter::new()),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = reqwest::Client::new();
    for _ in 0..3 {
        let resp = post_to(&client, format!("http://{addr}/search")).await;
        assert_misconfigured(resp, "connect_info").await;
    }
    assert_eq!(
        logs.errors_with("connect_info"),
        1,
        "one log line per layer"
    );
}

#[tokio::test]
async fn unmatched_requests_under_router_layer_reach_the_fallback() {
    let app = Router::new()
        .route("/items/{id}", post(|| async { "ran" }))
        .layer(LockLayer::by_path_param("id").backend(MemoryLocks::new()));
    let base = serve(app).await;
    let client = reqwest::Client::new();
    assert_eq!(post_to(&client, format!("{base}/nope")).await.status(), 404);
    assert_eq!(
        post_to(&client, format!("{base}/items/1")).await.status(),
        200
    );
}

#[tokio::test]
async fn without_a_route_the_client_cannot_choose_the_scope() {
    // Outside the Router no route has matched: the request's path must not make a new
    // lock, or a client could mint one per path.
    let gate = Gate::default();
    let held = gate.clone();
    let router = Router::new()
        .route("/a", post(move || async move { held.hold().await }))
        .route("/b", post(|| async { StatusCode::CREATED }));
    let layer = LockLayer::by_header("Idempotency-Key").backend(MemoryLocks::new());
    let base = serve_service(around(layer, router)).await;
    let client = reqwest::Client::new();
    let send = |path: &str| {
        client
            .post(format!("{base}{path}"))
            .header("Idempotency-Key", "k")
            .send()
    };
    let holder = tokio::spawn(send("/a"));
    gate.wait_entered(1).await;
    for path in ["/b", "/a/../b", "/anything"] {
        assert_problem(send(path).await.unwrap(), 409).await;
    }
    gate.release.notify_one();
    assert_eq!(holder.await.unwrap().unwrap().status(), 201);
}

#[tokio::test]
async fn lease_extractor_without_a_lock_layer_is_a_500() {
    let app = Router::new()
        .route("/strict", post(|_lease: Lease| async { "ran" }))
        .route(
            "/maybe",
            post(|lease: Option<Lease>| async move {
                if lease.is_some() {
                    "locked"
                } else {
                    "unlocked"
                }
            }),
        );
    let base = serve(app).await;
    let client = reqwest::Client::new();
    assert_problem(
        client.post(format!("{base}/strict")).send().await.unwrap(),
        500,
    )
    .await;
    let maybe = client.post(format!("{base}/maybe")).send().await.unwrap();
    assert_eq!(maybe.text().await.unwrap(), "unlocked");
}

#[tokio::test]
async fn usage_extractor_reads_the_count() {
    let quota: tower_redlock::Quota = "5/60".parse().unwrap();
    let app = Router::new()
        .route(
            "/search",
            post(|usage: tower_redlock::Usage| async move { usage.remaining().to_string() }),
        )
        .route_layer(
            tower_redlock::RateLimitLayer::global(quota)
                .backend(tower_redlock::MemoryRateLimiter::new()),
        );
    let base = serve(app).await;
    let client = reqwest::Client::new();
    for left in ["4", "3"] {
        let resp = client.post(format!("{base}/search")).send().await.unwrap();
        assert_eq!(resp.text().await.unwrap(), left);
    }
}

#[tokio::test]
async fn locked_path_of_an_integer_or_a_string() {
    let locks = Locks::from(MemoryLocks::new());
    let app = Router::new()
        .route(
            "/jobs/{id}",
            post(|job: Locked<Path<u64>>| async move { job.lease().key().to_owned() }),
        )
        .route(
            "/names/{name}",
            post(|name: Locked<Path<String>>| async move { name.lease().key().to_owned() }),
        )
        .with_state(locks);
    let base = serve(app).await;
    let client = reqwest::Client::new();
    let text = |path: &'static str| {
        let client = client.clone();
        let base = base.clone();
        async move {
            post_to(&client, format!("{base}{path}"))
                .await
                .text()
                .await
                .unwrap()
        }
    };
    assert_eq!(text("/jobs/42").await, "tower-redlock::42");
    assert_eq!(text("/names/ada").await, "tower-redlock::ada");
}
